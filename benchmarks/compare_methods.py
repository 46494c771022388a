"""Paired comparison of one refresh method against the others, from a fidelity run.

Every method of ``benchmarks/fidelity.py`` answered the same test prompts, so two
methods compare per prompt: the ratio of their accuracies with a 95 % paired
bootstrap interval (prompts resampled together, ``paired_intervals``). An interval
that excludes 1 is a difference outside the noise of these prompts.

    python benchmarks/compare_methods.py benchmarks/results/fidelity-next/fidelity.json \
        --method conduit --budgets 0.05,0.1

``--gap-ceiling oracle`` also writes, for every method at each budget, the share of
the gap between plain reuse and the ceiling method at that budget that it closes
(``gap_oracle.md``). ``--with`` adds the records of other runs over the same test
prompts (a method measured later), paired by prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

from harness.bootstrap import gap_share, paired_intervals

FLOOR = "reuse@0.0"


def outcomes(records: list[dict], scenario: str) -> dict[str, float]:
    """uid -> 1.0 if the probe answered right, for one scenario's records."""
    return {r["uid"]: float(r["probe_correct"]) for r in records if r["scenario"] == scenario}


def compare(records: dict[str, list[dict]], method: str, budget: float) -> list[dict]:
    """``method@budget`` against every other method at ``budget`` and against plain reuse."""
    mine = records[f"{method}@{budget}"]
    others = [k for k in records if k.endswith(f"@{budget}") and not k.startswith(method + "@")]
    rows = []
    for scenario in sorted({r["scenario"] for r in mine}):
        a = outcomes(mine, scenario)
        for other in [*others, "reuse@0.0"]:
            if other not in records:
                continue
            b = outcomes(records[other], scenario)
            uids = sorted(a.keys() & b.keys())
            if not uids:  # ``other`` was not measured on this scenario
                continue
            ci = paired_intervals([b[u] for u in uids], [a[u] for u in uids])
            rows.append(
                {
                    "scenario": scenario,
                    "method": f"{method}@{budget}",
                    "against": other,
                    "n": len(uids),
                    "accuracy": round(sum(a[u] for u in uids) / len(uids), 4),
                    "against_accuracy": round(sum(b[u] for u in uids) / len(uids), 4),
                    "ratio_95ci": ci["relative_accuracy"],
                }
            )
    return rows


def gap_rows(records: dict[str, list[dict]], ceiling: str, budget: float) -> list[dict]:
    """Every method at ``budget``: the share of the gap from plain reuse to
    ``ceiling@budget`` it closes, with its paired 95 % interval."""
    top = records[f"{ceiling}@{budget}"]
    methods = [k for k in records if k.endswith(f"@{budget}") and k != f"{ceiling}@{budget}"]
    rows = []
    for scenario in sorted({r["scenario"] for r in top}):
        high, low = outcomes(top, scenario), outcomes(records[FLOOR], scenario)
        for method in methods:
            mid = outcomes(records[method], scenario)
            uids = sorted(high.keys() & low.keys() & mid.keys())
            share, ci = gap_share(
                [low[u] for u in uids], [mid[u] for u in uids], [high[u] for u in uids]
            )
            rows.append(
                {
                    "scenario": scenario,
                    "method": method,
                    "ceiling": f"{ceiling}@{budget}",
                    "n": len(uids),
                    "floor_accuracy": round(sum(low[u] for u in uids) / len(uids), 4),
                    "accuracy": round(sum(mid[u] for u in uids) / len(uids), 4),
                    "ceiling_accuracy": round(sum(high[u] for u in uids) / len(uids), 4),
                    "gap_share": round(share, 4),
                    "gap_share_95ci": ci,
                }
            )
    return rows


def gap_table(rows: list[dict]) -> str:
    lines = [
        "| scenario | method | n | reuse | accuracy | ceiling | gap closed (95 % CI) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["gap_share_95ci"]
        lines.append(
            f"| {r['scenario']} | {r['method']} | {r['n']} | {r['floor_accuracy']:.3f} | "
            f"{r['accuracy']:.3f} | {r['ceiling_accuracy']:.3f} ({r['ceiling']}) | "
            f"{r['gap_share']:.2f} [{lo:.2f}, {hi:.2f}] |"
        )
    return "\n".join(lines)


def load_records(paths: list[Path]) -> dict[str, list[dict]]:
    """The records of every run, method by method; a method measured in two runs
    is refused (which one would count?)."""
    records: dict[str, list[dict]] = {}
    for path in paths:
        for label, rs in json.loads(path.read_text())["records"].items():
            if label in records and label != FLOOR:
                raise SystemExit(f"{label} is in more than one of {', '.join(map(str, paths))}")
            records.setdefault(label, rs)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fidelity_json", type=Path)
    parser.add_argument("--method", default="conduit")
    parser.add_argument("--budgets", default="0.05,0.1")
    parser.add_argument("--gap-ceiling", default="", help="e.g. oracle: the gap-share table")
    parser.add_argument(
        "--with",
        dest="others",
        type=Path,
        action="append",
        default=[],
        help="another fidelity.json over the same prompts (its plain reuse is not used)",
    )
    args = parser.parse_args(argv)
    records = load_records([args.fidelity_json, *args.others])
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = [r for b in budgets for r in compare(records, args.method, b)]
    lines = [
        "| scenario | method | against | n | accuracy | against | ratio 95 % CI | outside |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["ratio_95ci"]
        outside = "higher" if lo > 1 else "lower" if hi < 1 else "no"
        lines.append(
            f"| {r['scenario']} | {r['method']} | {r['against']} | {r['n']} | "
            f"{r['accuracy']:.3f} | {r['against_accuracy']:.3f} | "
            f"[{lo:.3f}, {hi:.3f}] | {outside} |"
        )
    table = "\n".join(lines)
    print(table)
    out = args.fidelity_json.parent
    (out / f"compare_{args.method}.md").write_text(table + "\n")
    (out / f"compare_{args.method}.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.gap_ceiling:
        gaps = [r for b in budgets for r in gap_rows(records, args.gap_ceiling, b)]
        table = gap_table(gaps)
        print(table)
        (out / f"gap_{args.gap_ceiling}.md").write_text(table + "\n")
        (out / f"gap_{args.gap_ceiling}.json").write_text(json.dumps(gaps, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

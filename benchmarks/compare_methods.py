"""Paired comparison of one refresh method against the others, from a fidelity run.

Every method of ``benchmarks/fidelity.py`` answered the same test prompts, so two
methods compare per prompt: the ratio of their accuracies with a 95 % paired
bootstrap interval (prompts resampled together, ``paired_intervals``). An interval
that excludes 1 is a difference outside the noise of these prompts.

    python benchmarks/compare_methods.py benchmarks/results/fidelity-next/fidelity.json \
        --method conduit --budgets 0.05,0.1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

from harness.bootstrap import paired_intervals


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fidelity_json", type=Path)
    parser.add_argument("--method", default="conduit")
    parser.add_argument("--budgets", default="0.05,0.1")
    args = parser.parse_args(argv)
    records = json.loads(args.fidelity_json.read_text())["records"]
    rows = [r for b in args.budgets.split(",") for r in compare(records, args.method, float(b))]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

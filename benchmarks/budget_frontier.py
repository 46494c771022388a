"""Accuracy against refresh cost, every method's budgets and the adaptive budget.

Reads fidelity runs of one model over the same test prompts (``benchmarks/fidelity.py``,
``--budgets auto`` among them) and, per scenario, draws relative accuracy (95 %
paired interval) against the share of reused image tokens refreshed: one line per
method through its budgets, plain reuse and full prefill at the ends, each ``auto``
run as one point. The table gives each ``auto`` run's accuracy and cost, and for
every fixed-budget method the cheapest budget measured that reaches the target.

    python benchmarks/budget_frontier.py benchmarks/results/fidelity-next/fidelity.json \
        benchmarks/results/fidelity-auto-next-f0.5/fidelity.json --target 0.95 \
        --out-dir benchmarks/results/budget-frontier-next
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

AUTO = "auto"
ENDS = ("reuse", "full")


def refreshed_share(summary: dict) -> float:
    """The share of reused image tokens a summary's probes refreshed (0 without reuse)."""
    reused = summary["mean_reused_tokens"]
    return summary["mean_refreshed_tokens"] / reused if reused > 0 else 0.0


def load_summaries(paths: list[Path]) -> list[dict]:
    """Every summary of every run; ``reuse`` and ``full`` once per scenario."""
    seen, summaries = set(), []
    for path in paths:
        for s in json.loads(path.read_text())["summaries"]:
            key = (s["mode"], s["budget"], s["scenario"])
            if key not in seen:
                seen.add(key)
                summaries.append(s)
    return summaries


def cheapest_meeting(summaries: list[dict], target: float) -> dict | None:
    """The fixed-budget summary of lowest refreshed share whose relative accuracy
    reaches ``target`` (None if none does)."""
    meeting = [s for s in summaries if s["relative_accuracy"] >= target]
    return min(meeting, key=refreshed_share, default=None)


def frontier_rows(summaries: list[dict], target: float) -> list[dict]:
    """Per scenario: each ``auto`` run, and each fixed-budget method's cheapest budget
    reaching ``target`` (or its best, flagged)."""
    rows = []
    for scenario in dict.fromkeys(s["scenario"] for s in summaries):
        mine = [s for s in summaries if s["scenario"] == scenario]
        for s in mine:
            if s["budget"] == AUTO or s["mode"] in ENDS:
                rows.append(_row(scenario, s, s["mode"], target))
        budgeted = [s for s in mine if s["budget"] not in (AUTO, None) and s["mode"] not in ENDS]
        for mode in dict.fromkeys(s["mode"] for s in budgeted):
            runs = [s for s in budgeted if s["mode"] == mode]
            best = cheapest_meeting(runs, target)
            if best is None:
                best = max(runs, key=lambda s: s["relative_accuracy"])
            rows.append(_row(scenario, best, mode, target))
    return rows


def _row(scenario: str, s: dict, mode: str, target: float) -> dict:
    low, high = s["relative_accuracy_ci"]
    return {
        "scenario": scenario,
        "method": mode,
        "budget": s["budget"],
        "n": s["n"],
        "relative_accuracy": s["relative_accuracy"],
        "relative_accuracy_95ci": [low, high],
        "meets_target": s["relative_accuracy"] >= target,
        "refreshed_share": refreshed_share(s),
        "flops_fraction": s.get("mean_flops_fraction"),
    }


def markdown(rows: list[dict], target: float) -> str:
    lines = [
        f"| scenario | method | budget | n | rel. accuracy [95 % CI] | >= {target:g} | "
        "refreshed share | FLOPs fraction |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["relative_accuracy_95ci"]
        flops = r["flops_fraction"]
        lines.append(
            f"| {r['scenario']} | {r['method']} | {r['budget'] if r['budget'] is not None else '-'}"
            f" | {r['n']} | {r['relative_accuracy']:.3f} [{low:.3f}, {high:.3f}] | "
            f"{'yes' if r['meets_target'] else 'no'} | {r['refreshed_share']:.3f} | "
            f"{'-' if flops is None or math.isnan(flops) else f'{flops:.3f}'} |"
        )
    return "\n".join(lines)


def plot(summaries: list[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(s["scenario"] for s in summaries))
    modes = list(dict.fromkeys(s["mode"] for s in summaries if s["mode"] not in ENDS))
    colour = {mode: f"C{i % 10}" for i, mode in enumerate(modes)}
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.6), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        mine = [s for s in summaries if s["scenario"] == scenario]
        ends = [s for s in mine if s["mode"] in ENDS]
        for mode in dict.fromkeys(s["mode"] for s in mine if s["mode"] not in ENDS):
            runs = [s for s in mine if s["mode"] == mode]
            fixed = sorted(
                [s for s in runs if s["budget"] != AUTO] + ends, key=lambda s: refreshed_share(s)
            )
            if len(fixed) > len(ends):
                style = dict(marker="o", linestyle="-", color=colour[mode], label=mode)
                _errorbar(ax, fixed, style)
            autos = [s for s in runs if s["budget"] == AUTO]
            if autos:
                style = dict(marker="*", markersize=12, linestyle="", color=colour[mode])
                _errorbar(ax, autos, {**style, "label": f"{mode} (auto)"})
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target:g}")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_title(scenario)
        ax.set_xlabel("share of reused image tokens refreshed")
        ax.set_ylabel("accuracy / full prefill (95 % CI)")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(0, 1.1)
    labelled = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    fig.legend(labelled.values(), labelled.keys(), fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=120)


def _errorbar(ax, summaries: list[dict], style: dict) -> None:
    xs = [refreshed_share(s) for s in summaries]
    ys = [s["relative_accuracy"] for s in summaries]
    spread = [
        [max(0.0, y - s["relative_accuracy_ci"][0]) for y, s in zip(ys, summaries, strict=True)],
        [max(0.0, s["relative_accuracy_ci"][1] - y) for y, s in zip(ys, summaries, strict=True)],
    ]
    ax.errorbar(xs, ys, yerr=spread, capsize=2, **style)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fidelity_json", type=Path, nargs="+")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    summaries = load_summaries(args.fidelity_json)
    rows = frontier_rows(summaries, args.target)
    table = markdown(rows, args.target)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python benchmarks/budget_frontier.py " + " ".join(argv or sys.argv[1:]),
        "target": args.target,
        "runs": [str(p) for p in args.fidelity_json],
        "rows": rows,
    }
    (args.out_dir / "frontier.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "frontier.md").write_text(table + "\n")
    plot(summaries, args.target, args.out_dir / "frontier.png")
    print(f"[frontier] wrote {args.out_dir}/frontier.json, frontier.md, frontier.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

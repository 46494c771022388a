"""Accuracy against a full prefill's FLOPs, every method, one panel per scenario.

Joins two kinds of measurement of one model over the same test prompts:

- server runs (``benchmarks/fidelity.py`` JSON): each method and budget at the
  server counters' FLOPs fraction (``mean_flops_fraction``);
- offline runs (``training/repair_study.py``'s ``repair_study.json``): the repairs
  no server runs yet (stalepatch, the Kamera- and VLCache-style baselines) at their
  counted FLOPs; the oracles have no FLOPs and are left out of the plot.

Per scenario it lists every point, marks the accuracy-FLOPs frontier (no other point
of the scenario at most as costly and at least as accurate, one of them strictly)
and whether the point meets a bar (relative accuracy at least ``--target`` at
FLOPs at most ``--max-flops``); the plot shades the bar's corner.

    python benchmarks/flops_frontier.py \
        --server benchmarks/results/fidelity-page/fidelity.json ... \
        --offline training/results/repair-study/repair_study.json \
        --out-dir benchmarks/results/flops-frontier-page
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SERVER, OFFLINE = "server", "offline"
DECIMALS = 4
OFFLINE_LABELS = {"staleprobe": "staleprobe@auto"}  # repair_study's name of the server's


def server_points(paths: list[Path]) -> list[dict]:
    """One point per (mode, budget, scenario) of the fidelity runs: where two runs
    measured the same cell, the one given first."""
    seen, points = set(), []
    for path in paths:
        for s in json.loads(path.read_text())["summaries"]:
            key = (s["mode"], s["budget"], s["scenario"])
            flops = s.get("mean_flops_fraction")
            if key in seen or flops is None:
                continue
            seen.add(key)
            label = s["mode"] if s["mode"] in ("reuse", "full") else f"{s['mode']}@{s['budget']}"
            points.append(
                _point(s["scenario"], label, SERVER, s["relative_accuracy"], s, flops, path)
            )
    return points


def offline_points(path: Path) -> list[dict]:
    """One point per method cell of a ``repair_study.json``'s test table (cells
    without FLOPs, the oracles, are skipped)."""
    report = json.loads(path.read_text())
    points = []
    for scenario, cells in report["test"].items():
        for label, cell in cells.items():
            if label.startswith("_") or not math.isfinite(cell.get("flops", math.nan)):
                continue
            ci = {"relative_accuracy_ci": cell["relative_ci"]}
            label = OFFLINE_LABELS.get(label, label)
            points.append(
                _point(scenario, label, OFFLINE, cell["relative"], ci, cell["flops"], path)
            )
            points[-1]["flops_incl_fill"] = cell.get("flops_incl_fill", cell["flops"])
    return points


def _point(scenario, label, source, rel, ci_of: dict, flops, path) -> dict:
    """One point, as measured (:func:`on_frontier` compares at 4 decimals)."""
    return {
        "scenario": scenario,
        "label": label,
        "source": source,
        "relative": float(rel),
        "relative_ci": [float(x) for x in ci_of["relative_accuracy_ci"]],
        "flops": float(flops),
        "from": str(path),
    }


def on_frontier(point: dict, others: list[dict]) -> bool:
    """No other point is at most as costly and at least as accurate, one strictly;
    compared at 4 decimals, as the offline runs write them, so that a server and an
    offline measurement of the same cell do not dominate each other by rounding."""
    flops, rel = round(point["flops"], DECIMALS), round(point["relative"], DECIMALS)
    for o in others:
        if o is point:
            continue
        o_flops, o_rel = round(o["flops"], DECIMALS), round(o["relative"], DECIMALS)
        if o_flops <= flops and o_rel >= rel and (o_flops < flops or o_rel > rel):
            return False
    return True


def mark(points: list[dict], target: float, max_flops: float) -> list[dict]:
    """``points`` with ``frontier`` and ``meets_bar`` set, per scenario, by FLOPs."""
    out = []
    for scenario in dict.fromkeys(p["scenario"] for p in points):
        mine = [p for p in points if p["scenario"] == scenario]
        for p in sorted(mine, key=lambda p: (p["flops"], -p["relative"])):
            meets = p["relative"] >= target and p["flops"] <= max_flops
            out.append({**p, "frontier": on_frontier(p, mine), "meets_bar": meets})
    return out


def markdown(points: list[dict], target: float, max_flops: float) -> str:
    lines = [
        f"Bar: relative accuracy >= {target:g} at <= {max_flops:g} of a full prefill's FLOPs. "
        "`*` on the accuracy-FLOPs frontier.",
        "",
        "| scenario | method | source | relative [95 %] | FLOPs | frontier | meets bar |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lo, hi = p["relative_ci"]
        lines.append(
            f"| {p['scenario']} | {p['label']} | {p['source']} | {p['relative']:.3f} "
            f"[{lo:.3f}, {hi:.3f}] | {p['flops']:.3f} | {'*' if p['frontier'] else ''} | "
            f"{'yes' if p['meets_bar'] else ''} |"
        )
    return "\n".join(lines)


def family(label: str) -> str:
    """The method a label belongs to (its budget or configuration stripped)."""
    return label.split("@")[0].split("[")[0]


def plot(points: list[dict], target: float, max_flops: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(p["scenario"] for p in points))
    families = list(dict.fromkeys(family(p["label"]) for p in points))
    palette = plt.get_cmap("tab20").colors
    colour = {f: palette[i % len(palette)] for i, f in enumerate(families)}
    cols = min(2, len(scenarios))
    rows = math.ceil(len(scenarios) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    for ax in axes.flat[len(scenarios) :]:
        ax.set_visible(False)
    for ax, scenario in zip(axes.flat, scenarios, strict=False):
        mine = [p for p in points if p["scenario"] == scenario]
        ax.fill_between([0, max_flops], target, 1.1, color="green", alpha=0.08, label="bar")
        front = sorted((p for p in mine if p["frontier"]), key=lambda p: p["flops"])
        ax.step(
            [p["flops"] for p in front],
            [p["relative"] for p in front],
            where="post",
            color="grey",
            linewidth=0.8,
            label="frontier",
        )
        for p in mine:
            lo, hi = p["relative_ci"]
            ax.errorbar(
                [p["flops"]],
                [p["relative"]],
                yerr=[[max(0.0, p["relative"] - lo)], [max(0.0, hi - p["relative"])]],
                marker="o" if p["source"] == SERVER else "s",
                mfc=colour[family(p["label"])] if p["source"] == SERVER else "none",
                color=colour[family(p["label"])],
                capsize=2,
                linestyle="",
                label=f"{family(p['label'])} ({p['source']})",
            )
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_title(scenario)
        ax.set_xlabel("FLOPs / full prefill")
        ax.set_ylabel("accuracy / full prefill (95 % CI)")
        ax.set_xlim(0, max(1.05, max(p["flops"] for p in mine) + 0.05))
        ax.set_ylim(0, 1.1)
    labelled: dict = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    fig.legend(labelled.values(), labelled.keys(), fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", type=Path, nargs="*", default=[])
    parser.add_argument("--offline", type=Path, nargs="*", default=[])
    parser.add_argument(
        "--scenarios",
        default="reordered,image_prefix,turn_reordered,changed_prefix",
        help="the scenarios to list and draw, in this order",
    )
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--max-flops", type=float, default=0.25)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    points = server_points(args.server)
    for path in args.offline:
        points += offline_points(path)
    order = [s for s in args.scenarios.split(",") if s]
    points = sorted(
        (p for p in points if p["scenario"] in order), key=lambda p: order.index(p["scenario"])
    )
    if not points:
        parser.error("no point with a FLOPs fraction in the given runs")
    points = mark(points, args.target, args.max_flops)
    table = markdown(points, args.target, args.max_flops)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python benchmarks/flops_frontier.py " + " ".join(argv or sys.argv[1:]),
        "target": args.target,
        "max_flops": args.max_flops,
        "points": points,
    }
    (args.out_dir / "frontier.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "frontier.md").write_text(table + "\n")
    plot(points, args.target, args.max_flops, args.out_dir / "frontier.png")
    print(f"[frontier] wrote {args.out_dir}/frontier.json, frontier.md, frontier.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

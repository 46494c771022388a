"""benchmarks/budget_frontier.py: the cheapest budget reaching a target, the auto rows,
the table and the plot (from summaries as benchmarks/fidelity.py writes them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import budget_frontier  # noqa: E402


def _summary(mode, budget, rel, refreshed, scenario="reordered", flops=None) -> dict:
    s = {
        "mode": mode,
        "budget": budget,
        "scenario": scenario,
        "n": 200,
        "relative_accuracy": rel,
        "relative_accuracy_ci": [rel - 0.05, min(1.0, rel + 0.05)],
        "mean_reused_tokens": 40.0,
        "mean_refreshed_tokens": refreshed,
    }
    if flops is not None:
        s["mean_flops_fraction"] = flops
    return s


SUMMARIES = [
    _summary("reuse", 0.0, 0.30, 0.0),
    _summary("full", 1.0, 1.00, 40.0),
    _summary("prophetkv", 0.1, 0.60, 4.0),
    _summary("prophetkv", 0.3, 0.96, 12.0),
    _summary("prophetkv", 0.5, 0.97, 20.0),
    _summary("random", 0.1, 0.50, 4.0),
    _summary("random", 0.3, 0.80, 12.0),
    _summary("staleprobe-f0.5", "auto", 0.98, 10.0, flops=0.31),
]


def test_the_cheapest_budget_reaching_the_target_and_the_best_of_those_that_do_not():
    rows = {r["method"]: r for r in budget_frontier.frontier_rows(SUMMARIES, 0.95)}
    assert rows["prophetkv"]["budget"] == 0.3 and rows["prophetkv"]["meets_target"]
    assert rows["prophetkv"]["refreshed_share"] == 12.0 / 40.0
    assert rows["random"]["budget"] == 0.3 and not rows["random"]["meets_target"]
    auto = rows["staleprobe-f0.5"]
    assert auto["budget"] == "auto" and auto["refreshed_share"] == 0.25
    assert auto["flops_fraction"] == 0.31
    assert auto["relative_accuracy_95ci"] == pytest.approx([0.93, 1.0])
    assert rows["reuse"]["refreshed_share"] == 0.0 and rows["full"]["flops_fraction"] is None


def test_the_run_writes_the_table_json_and_plot_and_counts_each_end_once(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"summaries": SUMMARIES[:6]}))
    second.write_text(json.dumps({"summaries": [SUMMARIES[0], *SUMMARIES[6:]]}))
    out = tmp_path / "out"
    assert budget_frontier.main([str(first), str(second), "--out-dir", str(out)]) == 0
    result = json.loads((out / "frontier.json").read_text())
    assert [r["method"] for r in result["rows"]] == [
        "reuse", "full", "staleprobe-f0.5", "prophetkv", "random",
    ]  # fmt: skip
    table = (out / "frontier.md").read_text()
    assert "| reordered | staleprobe-f0.5 | auto | 200 | 0.980 [0.930, 1.000] | yes |" in table
    assert (out / "frontier.png").stat().st_size > 10_000

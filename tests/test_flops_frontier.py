"""benchmarks/flops_frontier.py: server and offline points on one FLOPs axis, the
frontier, the bar, the table and the plot."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import flops_frontier  # noqa: E402


def _summary(mode, budget, rel, flops, scenario="reordered") -> dict:
    return {
        "mode": mode,
        "budget": budget,
        "scenario": scenario,
        "relative_accuracy": rel,
        "relative_accuracy_ci": [rel - 0.05, rel + 0.05],
        "mean_flops_fraction": flops,
    }


def _server(tmp_path: Path, summaries: list[dict], name="fidelity.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"summaries": summaries}))
    return path


def _offline(tmp_path: Path) -> Path:
    def cell(rel, flops, method):
        return {
            "relative": rel,
            "relative_ci": [rel - 0.1, rel + 0.1],
            "flops": flops,
            "flops_incl_fill": flops + 0.5,
            "method": method,
            "outcomes": [1, 0],
        }

    report = {
        "test": {
            "reordered": {
                "_full_accuracy": 0.9,
                "staleprobe": cell(1.0, 0.64, "staleprobe"),
                "stalepatch[P=4,kernel,tau=0]": cell(0.86, 0.21, "stalepatch"),
                "oracle-rank2": cell(0.94, math.nan, "oracle-rank"),
            }
        }
    }
    path = tmp_path / "repair_study.json"
    path.write_text(json.dumps(report))
    return path


def test_points_from_both_sources(tmp_path):
    server = _server(
        tmp_path,
        [
            _summary("reuse", 0.0, 0.16, 0.15),
            _summary("staleprobe", "auto", 1.0, 0.60),
            _summary("staleprobe", "auto", 0.5, 0.9),  # the same key again: first run wins
            {**_summary("conduit", 0.1, 0.4, 0.3), "mean_flops_fraction": None},
        ],
    )
    points = flops_frontier.server_points([server])
    assert [(p["label"], p["flops"]) for p in points] == [
        ("reuse", 0.15),
        ("staleprobe@auto", 0.60),
    ]
    offline = flops_frontier.offline_points(_offline(tmp_path))
    # the oracle has no FLOPs: left out; staleprobe is named as the server names it
    assert [p["label"] for p in offline] == ["staleprobe@auto", "stalepatch[P=4,kernel,tau=0]"]
    assert offline[1]["flops_incl_fill"] == 0.71 and offline[1]["source"] == "offline"


def test_frontier_and_bar():
    def p(label, rel, flops):
        return {
            "scenario": "s",
            "label": label,
            "source": "server",
            "relative": rel,
            "relative_ci": [rel, rel],
            "flops": flops,
        }

    points = [
        p("a", 0.2, 0.1),
        p("b", 0.9, 0.2),
        p("c", 0.8, 0.3),
        p("d", 0.99, 0.24),
        p("e", 1.0, 0.6),
        p("f", 0.99, 0.24),
    ]
    marked = {q["label"]: q for q in flops_frontier.mark(points, 0.98, 0.25)}
    assert [q["label"] for q in flops_frontier.mark(points, 0.98, 0.25)] == list("abdfce")
    assert {k for k, q in marked.items() if q["frontier"]} == {"a", "b", "d", "f", "e"}
    assert not marked["c"]["frontier"]  # b is cheaper and more accurate
    assert {k for k, q in marked.items() if q["meets_bar"]} == {"d", "f"}
    table = flops_frontier.markdown(flops_frontier.mark(points, 0.98, 0.25), 0.98, 0.25)
    assert table.count("| yes |") == 2 and "| s | c | server | 0.800" in table


def test_main_writes_table_json_and_plot(tmp_path):
    server = _server(
        tmp_path,
        [_summary("reuse", 0.0, 0.16, 0.15), _summary("reuse", 0.0, 0.5, 0.2, "other")],
    )
    out = tmp_path / "out"
    assert (
        flops_frontier.main(
            [
                "--server",
                str(server),
                "--offline",
                str(_offline(tmp_path)),
                "--out-dir",
                str(out),
                "--scenarios",
                "reordered",
            ]
        )
        == 0
    )
    result = json.loads((out / "frontier.json").read_text())
    assert {p["scenario"] for p in result["points"]} == {"reordered"}  # "other" not asked for
    assert len(result["points"]) == 3
    assert (out / "frontier.png").stat().st_size > 10_000


def test_server_and_offline_cells_compare_at_four_decimals(tmp_path):
    """A server summary (full float) and an offline cell (4 decimals) of the same
    measurement: neither dominates the other on a rounding artefact."""
    server = _server(tmp_path, [_summary("staleprobe", "auto", 62 / 61, 0.473)])
    points = flops_frontier.server_points([server])
    assert points[0]["relative"] == 62 / 61  # kept as measured
    offline = {**points[0], "source": "offline", "relative": 1.0164, "flops": 0.529}
    marked = flops_frontier.mark([points[0], offline], 0.98, 0.25)
    assert [q["frontier"] for q in marked] == [True, False]  # the dearer one is dominated

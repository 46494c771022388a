"""training/retrieval_probes.py end to end on a few steps (slow: `make test-slow`), and its
chance baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.fidelity_task import make_example
from training.retrieval_probes import no_retrieval_chance

ROOT = Path(__file__).resolve().parent.parent


def test_no_retrieval_chance_counts_distinct_candidates():
    one = [make_example("validation", i, num_images=1) for i in range(10)]
    assert no_retrieval_chance(one) == 1.0
    four = [make_example("validation", i, num_images=4, qtype="colour") for i in range(10)]
    assert abs(no_retrieval_chance(four) - 0.25) < 1e-9  # shape colours are distinct
    kinds = [make_example("validation", i, num_images=8, qtype="kind") for i in range(30)]
    expected = sum(1 / len({im.kind for im in e.images}) for e in kinds) / 30
    assert abs(no_retrieval_chance(kinds) - expected) < 1e-9
    assert 1 / 3 <= no_retrieval_chance(kinds) < 0.5


@pytest.mark.slow
def test_runs_end_to_end(tmp_path):
    out = tmp_path / "probes"
    command = [
        sys.executable,
        "-m",
        "training.retrieval_probes",
        "--variants", "keyed-text,marked",
        "--steps", "4",
        "--eval-every", "2",
        "--num-validation", "4",
        "--jobs", "1",
        "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "retrieval_probes.json").read_text())
    assert record["config"]["steps"] == 4 and record["config"]["max_images"] == 2
    results = {r["variant"]: r for r in record["results"]}
    assert set(results) == {"keyed-text", "marked"}
    for result in results.values():
        assert [p["step"] for p in result["curve"]] == [2, 4]
        assert all(0.0 <= p["val_acc"] <= 1.0 for p in result["curve"])
        assert 0.0 < result["no_retrieval_chance"] <= 1.0
    assert results["keyed-text"]["as_text"] and not results["marked"]["as_text"]
    table = (out / "retrieval_probes.md").read_text()
    assert "| keyed-text |" in table and "| marked |" in table
    assert (out / "retrieval_probes.png").stat().st_size > 0

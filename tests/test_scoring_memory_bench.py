"""benchmarks/scoring_memory.py runs on a tiny shape: each path and each phase of a
reusing request measures a peak and selects the same tokens (no server)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import scoring_memory  # noqa: E402

TINY = scoring_memory.Shape("tiny", layers=2, heads=4, kv_heads=2, head_dim=16, row=256, text=8)


def test_every_path_measures_and_the_streamed_and_copied_selections_agree():
    rows = {
        path: scoring_memory.measure(TINY, path, torch.float32, "cpu", budget=0.1)
        for path in scoring_memory.PATHS
    }
    assert rows["pass only"]["selected"] is None
    streamed, copied = rows["streamed"]["selected"], rows["copies"]["selected"]
    visual = rows["streamed"]["visual_tokens"]
    # 10 % of each of the two images' tokens, rounded up per image
    assert visual > 0 and len(streamed) == 2 * math.ceil(0.1 * visual / 2)
    assert streamed == copied  # the same CONDUIT scores, computed two ways
    assert all(r["peak_extra_mib"] >= 0 for r in rows.values())
    assert rows["copies"]["row_copy_mib"] == rows["streamed"]["row_copy_mib"] > 0


def test_a_reusing_requests_phases_each_have_a_peak():
    row = scoring_memory.measure_request(TINY, torch.float32, "cpu", budget=0.1)
    assert row["image_tokens"] > 0
    assert row["refreshed"] == 2 * math.ceil(0.1 * row["image_tokens"] / 2)
    assert row["peak_extra_mib"] == max(row[f"{p}_mib"] for p in scoring_memory.PHASES)

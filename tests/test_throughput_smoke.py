"""The throughput runner end to end on the tiny VLM: stock and conduit side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_mmkv.refresh.flops import DecoderShape

ROOT = Path(__file__).resolve().parent.parent
# The throughput benchmark end to end (two servers, every cell): `make test-slow`.
pytestmark = pytest.mark.slow

IMAGE_TOKENS = 16  # a 112 x 112 image on the tiny model


@pytest.fixture(scope="module")
def bench(tiny_vlm, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("throughput")
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "throughput.py"),
        "--model-path", str(tiny_vlm),
        "--modes", "conduit",
        "--images", "2",
        "--concurrency", "1,2",
        "--requests-per-cell", "2",
        "--pool-size", "3",
        "--image-size", "112",
        "--turns", "2",
        "--max-tokens", "4",
        "--rounds", "2",
        "--max-control-overhead", "100",  # tiny-model timings are noise; bound checked in units
        "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Serving Benchmark Result" in done.stdout
    assert (out / "throughput.png").stat().st_size > 0
    report = json.loads((out / "throughput.json").read_text())
    report["stdout"] = done.stdout
    return report


def _row(report: dict, cell: str, side: str) -> dict:
    (row,) = [r for r in report["cells"] if r["cell"] == cell and r["side"] == side]
    return row


def test_every_cell_ran_on_both_sides_without_failures(bench):
    assert bench["sides"] == ["stock", "conduit"]
    # stock at its defaults, the overlap scheduler on; the refresh mode keeps it on
    assert "disable_overlap_schedule" not in bench["settings_differences"]
    assert "--disable-overlap-schedule" not in bench["meta"]["command_lines"]["stock"]
    cells = {r["cell"] for r in bench["cells"]}
    assert len(cells) == 4 * 2  # 4 workloads x 2 concurrencies
    for cell in cells:
        for side in bench["sides"]:
            row = _row(bench, cell, side)
            requests = bench["requests"][f"{side}/{cell}"]
            assert row["failed"] == 0 and row["completed"] == len(requests) >= 4
            assert {r["round"] for r in requests} == {0, 1}
            assert all(r["completion_tokens"] == 4 for r in requests)


def test_doc_qa_pages_are_reused_by_conduit_and_recomputed_by_stock(bench):
    for cell in ("doc_qa/2img/c1", "doc_qa/2img/c2"):
        stock, conduit = _row(bench, cell, "stock"), _row(bench, cell, "conduit")
        for r in bench["requests"][f"stock/{cell}"]:  # a shared system-prompt head at most
            assert r["cached_tokens"] < r["prompt_tokens"] - 2 * IMAGE_TOKENS
        assert stock["reused_tokens_per_req"] == 0
        assert conduit["reused_tokens_per_req"] == 2 * IMAGE_TOKENS
        assert conduit["refreshed_tokens_per_req"] == 4  # ceil(0.1 * 32) per request
    new = _row(bench, "no_reuse/2img/c1", "conduit")
    assert new["reused_tokens_per_req"] == 0 and new["refreshed_tokens_per_req"] == 0
    # The cost gate: where reuse would compute more than a full prefill (a two-turn
    # chat of tiny images), the request runs as stock does, so no cell costs more.
    for row in bench["cells"]:
        if row["side"] == "conduit":
            assert row["flops_fraction"] <= 1.0, row["cell"]


def test_flops_are_counted_by_the_server_exactly_as_the_usage_implies(bench, tiny_vlm):
    shape = DecoderShape.from_config(json.loads((tiny_vlm / "config.json").read_text()))
    for row in bench["cells"]:
        requests = bench["requests"][f"{row['side']}/{row['cell']}"]
        full = sum(shape.extend_flops(r["cached_tokens"], r["prompt_tokens"]) for r in requests)
        assert row["full_prefill_tflops"] * 1e12 == pytest.approx(full, rel=1e-12)
        if row["side"] == "stock":
            assert row["flops_fraction"] == 1.0
        if row["workload"] == "no_reuse":  # nothing reused: conduit computes what stock does
            assert row["prefill_tflops"] == pytest.approx(row["full_prefill_tflops"], rel=1e-12)


def test_same_prefix_is_served_from_the_radix_tree_on_both_sides(bench):
    for side in ("stock", "conduit"):
        requests = bench["requests"][f"{side}/same_prefix/2img/c1"]
        assert requests[1]["cached_tokens"] > 2 * IMAGE_TOKENS

"""SGLang's own client against stock and sgl_mmkv: traces it reads, and the runner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sglang.benchmark.datasets.openai_dataset import sample_openai_requests
from transformers import AutoTokenizer

from harness import workloads as wl
from harness.traces import doc_qa_traces

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_serving  # noqa: E402


def test_sglangs_openai_dataset_reads_the_traces_as_written(tiny_vlm, tmp_path):
    paths = doc_qa_traces(tmp_path, 3, 4, pool_size=5, rounds=2, image_size=112, max_tokens=6)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)
    warm = sample_openai_requests(str(paths["warmup"]), 0, tokenizer)
    assert len(warm) == 5
    expected = wl.doc_qa(4, 3, 5, 112, seed=1000)
    rows = sample_openai_requests(str(paths["round-1"]), 0, tokenizer)
    assert [row.prompt for row in rows] == [r.messages for r in expected]
    assert {row.output_len for row in rows} == {6}
    assert rows[0].extra_request_body == {"temperature": 0.0, "ignore_eos": True}
    # every request carries 3 pool pages; rounds differ in prompts and page orders
    first = sample_openai_requests(str(paths["round-0"]), 0, tokenizer)
    assert all(sum(p["type"] == "image_url" for p in r.prompt[1]["content"]) == 3 for r in rows)
    assert [r.prompt for r in first] != [r.prompt for r in rows]


def _record(side: str, r: int, ttft: float, tput: float) -> dict:
    result = {"mean_ttft_ms": ttft, "output_throughput": tput}
    return {"side": side, "round": r, "label": "doc", "concurrency": 1, "result": result}


def test_the_summary_is_the_ratio_of_means_with_the_range_of_paired_rounds():
    records = [
        _record("stock", 0, 900.0, 10.0),
        _record("conduit", 0, 300.0, 10.0),
        _record("stock", 1, 1100.0, 12.0),
        _record("conduit", 1, 200.0, 9.0),
    ]
    (row,) = bench_serving.summarise(records, ["conduit"])
    ttft = row["mean_ttft_ms"]
    assert ttft["stock"] == 1000.0 and ttft["conduit"] == 250.0 and ttft["ratio"] == 4.0
    assert ttft["range"] == [3.0, 5.5]
    tput = row["output_throughput"]
    assert tput["ratio"] == round(9.5 / 11.0, 3) and tput["range"] == [0.75, 1.0]


@pytest.fixture(scope="module")
def run(tiny_vlm, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench-serving")
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"),
        "--model-path", str(tiny_vlm),
        "--modes", "conduit",
        "--images", "2",
        "--no-reuse-images", "1",
        "--num-prompts", "3",
        "--pool-size", "3",
        "--image-size", "112",
        "--max-tokens", "4",
        "--text-concurrency", "2",
        "--text-prompts", "2",
        "--text-input-len", "64",
        "--text-output-len", "8",
        "--rounds", "1",
        "--out-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "bench_serving.json").read_text())


def test_the_client_ran_every_cell_on_both_sides_and_conduit_reused(run):
    assert run["failed"] == []
    cells = {(x["side"], x["label"], x["concurrency"]) for x in run["records"]}
    measured = [("doc_qa-2img", 1), ("no_reuse-1img", 1), ("text", 2)]
    assert cells == {(s, c, n) for s in ("stock", "conduit") for c, n in measured}
    for record in run["records"]:
        assert record["result"]["completed"] > 0 and record["result"]["mean_ttft_ms"] > 0
    # stock at its defaults; the refresh mode keeps the overlap scheduler on too
    assert "disable_overlap_schedule" not in run["meta"]["settings_differences"]
    assert "--disable-overlap-schedule" not in run["meta"]["command_lines"]["stock"]
    # pages of the pool came back under new system prompts: conduit reused them
    refresh = run["counters"]["conduit-r0"]["refresh"]
    assert refresh["reused_tokens"] > 0 and run["counters"]["stock-r0"] == {}

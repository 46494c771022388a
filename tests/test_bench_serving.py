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


MIXED = [
    "--modes", "conduit",
    "--pool-size", "3",
    "--image-size", "112",
    "--mixes", "50/25/25",
    "--concurrency", "2",
    "--mix-prompts", "4",
    "--mix-doc-pages", "2",
    "--mix-new-pages", "1",
    "--mix-text-words", "20",
    "--mix-max-tokens", "4",
]  # fmt: skip


def _bench(model: Path, out: Path, args: list[str]) -> tuple[dict, str]:
    """``bench_serving.py`` run to the end: ``(its JSON, its stdout)``."""
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_serving.py")]
    command += ["--model-path", str(model), *args, "--out-dir", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "bench_serving.png").read_bytes()[:4] == b"\x89PNG"
    return json.loads((out / "bench_serving.json").read_text()), done.stdout


@pytest.fixture(scope="module")
def mixed(tiny_vlm, tmp_path_factory) -> tuple[dict, str]:
    """The mixed cell alone (closed loop at 2), stock then conduit, one round."""
    out = tmp_path_factory.mktemp("bench-mixed")
    cells = ["--images", "", "--no-reuse-images", "", "--text-concurrency", ""]
    return _bench(tiny_vlm, out, [*MIXED, *cells, "--rounds", "1"])


@pytest.mark.slow  # two servers and the benchmark end to end
def test_both_sides_ran_the_same_mixed_trace_one_server_at_a_time(mixed):
    run, stdout = mixed
    assert run["failed"] == [] and run["rows"] == []
    records = run["records"]
    assert [(x["side"], x["label"], x["concurrency"]) for x in records] == [
        ("stock", "mix-50-25-25-c2", 2),
        ("conduit", "mix-50-25-25-c2", 2),
    ]
    stock, ours = records
    assert stock["trace"] == ours["trace"] and stock["trace_sha256"] == ours["trace_sha256"]
    # stock first, stopped before conduit started
    servers = run["servers"]
    assert [x["side"] for x in servers] == ["stock", "conduit"]
    assert servers[0]["up"] < servers[0]["down"] <= servers[1]["up"] < servers[1]["down"]
    # both command lines printed; stock's has no sgl_mmkv flag
    lines = run["meta"]["command_lines"]
    assert f"stock: {lines['stock']}" in stdout and f"conduit: {lines['conduit']}" in stdout
    assert (
        lines["stock"].startswith("python -m sglang.launch_server")
        and "--mm-" not in lines["stock"]
    )
    assert lines["conduit"].startswith("python -m sgl_mmkv.launch_server --model-path")
    assert "--mm-reuse conduit" in lines["conduit"]
    assert "--output-details" in run["meta"]["client_command_examples"][-1]
    assert f"client: {run['meta']['client_command_examples'][-1]}" in stdout
    assert run["meta"]["commit"] and len(run["meta"]["load_average"]["start"]) == 3
    # the doc-QA requests came back under new system prompts: conduit reused their pages
    assert run["counters"]["conduit-r0"]["refresh"]["reused_tokens"] > 0
    assert run["counters"]["stock-r0"] == {}


@pytest.mark.slow  # two servers and the benchmark end to end
def test_the_mixed_cell_split_by_kind_against_stock_with_its_flops_bound(mixed):
    run, _ = mixed
    records = run["records"]
    labels = json.loads(Path(records[0]["trace"]).with_suffix(".labels.json").read_text())
    in_trace = {k: [x["kind"] for x in labels].count(k) for k in ("doc_qa", "new_images", "text")}
    assert in_trace == {"doc_qa": 2, "new_images": 1, "text": 1}
    for record in records:
        assert [q["kind"] for q in record["requests"]] == [x["kind"] for x in labels]
        assert all(q["error"] == "" and q["ttft_ms"] > 0 for q in record["requests"])
        assert all(q["output_len"] == 4 and 1 <= len(q["itl_ms"]) <= 3 for q in record["requests"])
        assert record["result"]["completed"] == 4 and len(record["load_average"]) == 3
    stock, ours = run["mixed_rows"]
    assert (stock["side"], ours["side"], ours["load"]) == ("stock", "conduit", "c2")
    for row in (stock, ours):
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["count_by_kind"] == in_trace
        for key in ("request_throughput", "output_throughput", "ttft_p50_ms", "ttft_p99_ms"):
            assert row[key] > 0
        assert row["itl_p99_ms"] >= row["itl_p50_ms"] > 0
        assert all(v > 0 for v in row["ttft_p50_by_kind_ms"].values())
    # the bound from conduit's own counters over the trace: stock's FLOPs over ours
    flops = records[1]["flops"]
    assert flops["full"] > flops["executed"] > 0 and records[0]["flops"] == {}
    assert ours["flops_bound"] == flops["full"] / flops["executed"]
    assert ours["share_of_bound"] == ours["throughput_ratio"] / ours["flops_bound"]
    assert ours["throughput_ratio"] == ours["request_throughput"] / stock["request_throughput"]
    assert ours["throughput_ratio_range"] == [ours["throughput_ratio"]] * 2  # one round


@pytest.fixture(scope="module")
def run(tiny_vlm, tmp_path_factory) -> dict:
    """Every kind of cell, the mixed one closed loop and at a request rate."""
    out = tmp_path_factory.mktemp("bench-serving")
    cells = [
        "--images", "2",
        "--no-reuse-images", "1",
        "--num-prompts", "3",
        "--max-tokens", "4",
        "--text-concurrency", "2",
        "--text-prompts", "2",
        "--text-input-len", "64",
        "--text-output-len", "8",
        "--request-rate", "4",
        "--rate-concurrency", "8",
    ]  # fmt: skip
    return _bench(tiny_vlm, out, [*MIXED, *cells, "--rounds", "1"])[0]


@pytest.mark.slow
def test_the_client_ran_every_cell_on_both_sides_and_conduit_reused(run):
    assert run["failed"] == []
    cells = {(x["side"], x["label"], x["concurrency"]) for x in run["records"]}
    measured = [("doc_qa-2img", 1), ("no_reuse-1img", 1), ("text", 2)]
    measured += [("mix-50-25-25-c2", 2), ("mix-50-25-25-rate4", 8)]
    assert cells == {(s, c, n) for s in ("stock", "conduit") for c, n in measured}
    for record in run["records"]:
        assert record["result"]["completed"] > 0 and record["result"]["mean_ttft_ms"] > 0
    # stock at its defaults; the refresh mode keeps the overlap scheduler on too
    assert "disable_overlap_schedule" not in run["meta"]["settings_differences"]
    assert "--disable-overlap-schedule" not in run["meta"]["command_lines"]["stock"]
    # pages of the pool came back under new system prompts: conduit reused them
    refresh = run["counters"]["conduit-r0"]["refresh"]
    assert refresh["reused_tokens"] > 0 and run["counters"]["stock-r0"] == {}
    rate = [x for x in run["records"] if x.get("load") == "rate4"]
    assert [x["request_rate"] for x in rate] == [4.0, 4.0]
    closed = [x for x in run["records"] if x.get("load") == "c2"]
    assert len({x["trace_sha256"] for x in rate}) == len({x["trace_sha256"] for x in closed}) == 1
    assert rate[0]["trace_sha256"] != closed[0]["trace_sha256"]  # other requests, other seed
    (row,) = [x for x in run["rows"] if x["cell"] == "doc_qa-2img/c1"]
    assert row["mean_ttft_ms"]["stock"] > 0 and row["mean_ttft_ms"]["conduit"] > 0

"""Mixed traffic for SGLang's client: the traces, the per-kind split, the summary
against stock and the FLOPs bound, the plot (no server; the end-to-end run is in
tests/test_bench_serving.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sglang.benchmark.datasets.openai_dataset import sample_openai_requests
from transformers import AutoTokenizer

from harness.mixed_traces import (
    Mix,
    kind_of,
    mixed_requests,
    read_labels,
    text_chat,
    write_mixed_trace,
)
from harness.serving_report import (
    flops_delta,
    format_mixed,
    per_request,
    plot,
    summarise_mixed,
    throughput_by_concurrency,
    ttft_by_pages,
)
from harness.sglang_client import ClientRun, client_command

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_serving  # noqa: E402

POOL = 10_000  # harness.workloads' pool image seeds start here


def _images(request) -> list[str]:
    return [
        part["image_url"]["url"]
        for message in request.messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image_url"
    ]


def test_a_mix_splits_n_requests_into_counts_that_add_up():
    mix = Mix.parse("70/15/15")
    assert mix.label == "70-15-15"
    assert mix.counts(24) == {"doc_qa": 17, "new_images": 4, "text": 3}
    assert mix.counts(100) == {"doc_qa": 70, "new_images": 15, "text": 15}
    assert Mix.parse("2/1/1").counts(8) == {"doc_qa": 4, "new_images": 2, "text": 2}
    for n in range(1, 40):
        assert sum(Mix.parse("50/25/25").counts(n).values()) == n
    for bad in ("70/30", "a/b/c", "-1/1/1", "0/0/0"):
        with pytest.raises(ValueError):
            Mix.parse(bad)


def _mixed(seed: int, n: int = 20, mix: str = "50/25/25"):
    return mixed_requests(
        Mix.parse(mix),
        n,
        doc_pages=3,
        new_pages=2,
        pool_size=5,
        image_size=112,
        text_words=12,
        seed=seed,
    )


def test_the_kinds_carry_pool_pages_new_pages_and_no_pages():
    from harness.workloads import _image_url, pool_warmup

    pool = {url for r in pool_warmup(5, 112) for url in _images(r)}
    requests = _mixed(seed=100)
    kinds = [kind_of(r) for r in requests]
    assert {k: kinds.count(k) for k in set(kinds)} == {"doc_qa": 10, "new_images": 5, "text": 5}
    assert kinds != sorted(kinds)  # interleaved
    new_pages = []
    for request, kind in zip(requests, kinds, strict=True):
        urls = _images(request)
        if kind == "doc_qa":
            assert len(urls) == 3 and set(urls) <= pool
        elif kind == "new_images":
            assert len(urls) == 2 and not set(urls) & pool
            new_pages += urls
        else:
            assert urls == [] and len(request.messages[1]["content"].split()) == 3 + 12
    assert len(set(new_pages)) == len(new_pages) == 10  # nobody sent them before
    # same seed, same trace; another cell's seed, other new pages and other text
    assert [r.messages for r in _mixed(seed=100)] == [r.messages for r in requests]
    other = _mixed(seed=101)
    other_new = {u for r in other if kind_of(r) == "new_images" for u in _images(r)}
    assert not other_new & set(new_pages)
    assert _image_url(POOL, 112) in pool
    assert text_chat(2, 5, 1)[0].messages != text_chat(2, 5, 2)[0].messages


def test_sglangs_client_reads_the_mixed_trace_in_the_order_of_its_labels(tiny_vlm, tmp_path):
    requests = _mixed(seed=7, n=8, mix="2/1/1")
    path = write_mixed_trace(requests, tmp_path / "mix.jsonl", max_tokens=5)
    rows = sample_openai_requests(str(path), 0, AutoTokenizer.from_pretrained(tiny_vlm))
    labels = read_labels(path)
    assert [row.prompt for row in rows] == [r.messages for r in requests]
    assert [label["kind"] for label in labels] == [kind_of(r) for r in requests]
    assert [label["images"] for label in labels] == [len(_images(r)) for r in requests]
    assert {row.output_len for row in rows} == {5}
    assert rows[0].extra_request_body == {"temperature": 0.0, "ignore_eos": True}


def _trace_images(path: Path) -> list[list[str]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        [
            part["image_url"]["url"]
            for message in line["messages"]
            if isinstance(message["content"], list)
            for part in message["content"]
            if part["type"] == "image_url"
        ]
        for line in lines
    ]


def test_the_benchmarks_mixed_traces_are_the_same_files_for_the_same_arguments(tmp_path):
    from harness.workloads import no_reuse, pool_warmup

    args = ["--mixes", "70/15/15,50/25/25", "--concurrency", "2,4", "--request-rate", "0.5"]
    args += ["--mix-prompts", "7", "--mix-doc-pages", "2", "--mix-new-pages", "2"]
    args += ["--mix-text-words", "6", "--pool-size", "4", "--image-size", "56", "--rounds", "2"]
    first = bench_serving.mixed_traces(
        bench_serving.parse_args([*args, "--out-dir", str(tmp_path / "a")])
    )
    second = bench_serving.mixed_traces(
        bench_serving.parse_args([*args, "--out-dir", str(tmp_path / "b")])
    )
    assert len(first) == 2 * 2 * 3  # rounds x mixes x loads
    pool = {url for r in pool_warmup(4, 56) for url in _images(r)}
    controls = {u for s in (0, 1000) for r in no_reuse(7, 2, 56, s) for u in _images(r)}
    new_pages = []
    for key, path in first.items():
        assert path.read_bytes() == second[key].read_bytes()  # same seed, same bytes
        labels = read_labels(path)
        mix = Mix.parse(key[0].replace("-", "/"))
        assert {k: [x["kind"] for x in labels].count(k) for k in mix.counts(7)} == mix.counts(7)
        for label, urls in zip(labels, _trace_images(path), strict=True):
            assert len(urls) == {"doc_qa": 2, "new_images": 2, "text": 0}[label["kind"]]
            assert (set(urls) <= pool) == (label["kind"] != "new_images")
            new_pages += urls if label["kind"] == "new_images" else []
    # a page nobody sent stays new: in no other cell, round or the no-reuse control
    # 2 rounds x 3 loads x (1 + 2) requests with new pages x 2 pages
    assert len(new_pages) == len(set(new_pages)) == 2 * 3 * (1 + 2) * 2
    assert not set(new_pages) & controls


def test_the_client_command_asks_for_poisson_arrivals_and_per_request_details():
    closed = ClientRun("mix", 4, 24, Path("t.jsonl"), details=True)
    command = client_command("http://h:1", Path("m"), closed, Path("o.jsonl"))
    assert "--output-details" in command and "--request-rate" not in command
    assert command[command.index("--max-concurrency") + 1] == "4"
    poisson = ClientRun("mix", 64, 24, Path("t.jsonl"), request_rate=0.25)
    command = client_command("http://h:1", Path("m"), poisson, Path("o.jsonl"))
    assert command[command.index("--request-rate") + 1] == "0.25"
    assert "--output-details" not in command


def test_per_request_pairs_the_clients_lists_with_the_labels():
    result = {
        "completed": 2,
        "ttfts": [0.5, 1.5],
        "itls": [[0.01, 0.03], [0.02]],
        "input_lens": [300, 40],
        "output_lens": [3, 2],
        "errors": ["", ""],
    }
    labels = [{"uid": "doc-0", "kind": "doc_qa", "images": 8}, {"uid": "t", "kind": "text"}]
    labels[1]["images"] = 0
    rows = per_request(dict(result), labels)
    assert [r["kind"] for r in rows] == ["doc_qa", "text"]
    assert rows[0]["ttft_ms"] == 500.0 and rows[0]["itl_ms"] == [10.0, 30.0]
    assert rows[1]["input_len"] == 40 and rows[1]["output_len"] == 2
    with pytest.raises(ValueError):
        per_request(dict(result), labels[:1])


def test_flops_delta_reads_the_refresh_counters_and_is_empty_for_stock():
    before = {"refresh": {"full_prefill_flops": 100, "executed_flops": 40}}
    after = {"refresh": {"full_prefill_flops": 1100, "executed_flops": 240}}
    assert flops_delta(before, after) == {"full": 1000, "executed": 200}
    assert flops_delta({}, {}) == {}


def _request(kind: str, ttft_s: float, itl_ms: float) -> dict:
    return {"kind": kind, "ttft_ms": 1e3 * ttft_s, "itl_ms": [itl_ms] * 3, "error": ""}


def _record(side: str, r: int, tput: float, ttfts: list[float], itl: float, flops=None) -> dict:
    kinds = ["doc_qa", "doc_qa", "new_images", "text"]
    return {
        "side": side,
        "round": r,
        "label": "mix-70-15-15-c4",
        "concurrency": 4,
        "mix": "70-15-15",
        "load": "c4",
        "result": {"completed": 4, "request_throughput": tput, "output_throughput": 16 * tput},
        "requests": [_request(k, t, itl) for k, t in zip(kinds, ttfts, strict=True)],
        "flops": flops or {},
    }


def test_the_mixed_summary_against_stock_and_the_flops_bound():
    records = [
        _record("stock", 0, 0.10, [10, 12, 6, 1], 50.0),
        _record("conduit", 0, 0.30, [2, 3, 6, 1], 51.0, {"full": 1000, "executed": 250}),
        _record("stock", 1, 0.12, [11, 13, 7, 2], 50.0),
        _record("conduit", 1, 0.30, [2, 4, 7, 2], 51.0, {"full": 1000, "executed": 250}),
    ]
    stock, ours = summarise_mixed(records, ["conduit"])
    assert (stock["side"], ours["side"]) == ("stock", "conduit")
    assert stock["completed"] == ours["completed"] == 8 and ours["failed"] == 0
    assert ours["count_by_kind"] == {"doc_qa": 4, "new_images": 2, "text": 2}
    assert stock["request_throughput"] == pytest.approx(0.11)
    assert ours["throughput_ratio"] == pytest.approx(0.30 / 0.11)
    assert ours["throughput_ratio_range"] == pytest.approx([2.5, 3.0])
    assert ours["flops_bound"] == 4.0 and "flops_bound" not in stock
    assert ours["share_of_bound"] == pytest.approx(0.30 / 0.11 / 4)
    # TTFT percentiles over every request of every round; p50 per kind
    assert stock["ttft_p50_ms"] == pytest.approx(8500.0)
    assert ours["ttft_p50_by_kind_ms"] == {"doc_qa": 2500.0, "new_images": 6500.0, "text": 1500.0}
    assert ours["p99_ttft_speedup"] == pytest.approx(stock["ttft_p99_ms"] / ours["ttft_p99_ms"])
    assert ours["itl_p50_vs_stock"] == pytest.approx(51 / 50)
    (point,) = throughput_by_concurrency([stock, ours])["conduit bound, 70-15-15"]
    assert point == (4, pytest.approx(0.44))
    table = format_mixed([stock, ours]).splitlines()
    assert (
        len(table) == 4 and "| 2.73x (2.50-3.00) | " in table[3] and "| 4.00x | 0.68 |" in table[3]
    )


def test_a_kind_the_mix_leaves_out_has_no_median_and_a_round_without_stock_no_pair():
    records = [
        _record("stock", 0, 0.10, [10, 12, 6, 1], 50.0),
        _record("conduit", 0, 0.30, [2, 3, 6, 1], 51.0, {"full": 1000, "executed": 250}),
        _record("conduit", 1, 0.20, [2, 4, 7, 2], 51.0, {"full": 1000, "executed": 250}),
    ]
    for record in records:
        for request in record["requests"]:
            request["kind"] = "doc_qa" if request["kind"] != "text" else "text"
    stock, ours = summarise_mixed(records, ["conduit"])
    assert ours["count_by_kind"] == {"doc_qa": 6, "new_images": 0, "text": 2}
    assert ours["ttft_p50_by_kind_ms"]["new_images"] is None
    assert ours["throughput_ratio_range"] == pytest.approx([3.0, 3.0])  # round 1: no stock
    assert " / - / " in format_mixed([stock, ours]).splitlines()[3]
    json.dumps([stock, ours], allow_nan=False)


def test_ttft_against_pages_with_the_bound_and_the_plot_file(tmp_path):
    def doc(side, pages, ttft, flops=None):
        result = {"mean_ttft_ms": ttft}
        label = f"doc_qa-{pages}img"
        return {"side": side, "label": label, "concurrency": 1, "result": result, "flops": flops}

    records = [
        doc("stock", 1, 1000.0),
        doc("stock", 8, 8000.0),
        doc("conduit", 1, 900.0, {"full": 10, "executed": 10}),
        doc("conduit", 8, 2000.0, {"full": 100, "executed": 20}),
    ]
    series = ttft_by_pages(records, ["conduit"])
    assert series["stock"] == [(1, 1000.0), (8, 8000.0)]
    assert series["conduit bound"] == [(1, 1000.0), (8, 1600.0)]
    path = plot(series, {}, "test", tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    json.dumps(series)  # what the report stores is plain JSON

"""Throughput benchmark pieces without a server: workloads, FLOPs, settings check,
summaries and the exit verdict."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from harness import workloads as wl
from harness.client import RequestResult, run_requests
from harness.report import (
    control_overhead,
    failures,
    percentile,
    summarise,
)
from harness.runner import BenchConfig, BenchRun, CellRun, CellSpec, plan_cells
from harness.servers import compare_settings
from sgl_mmkv.refresh.flops import DecoderShape
from sgl_mmkv.testing.make_tiny_model import TinyModelSpec, build_untrained
from sgl_mmkv.testing.server import free_port


def _image_urls(message: dict) -> list[str]:
    content = message["content"]
    if isinstance(content, str):
        return []
    return [p["image_url"]["url"] for p in content if p["type"] == "image_url"]


def _all_urls(request: wl.BenchRequest) -> list[str]:
    return [url for m in request.messages for url in _image_urls(m)]


def test_doc_qa_is_seeded_and_changes_order_and_prefix():
    a = wl.doc_qa(6, 4, pool_size=10, image_size=28, seed=3)
    b = wl.doc_qa(6, 4, pool_size=10, image_size=28, seed=3)
    assert [r.messages for r in a] == [r.messages for r in b]
    assert all(len(set(_all_urls(r))) == 4 == r.num_images for r in a)
    assert len({r.messages[0]["content"] for r in a}) == 6  # a new system prompt each time
    assert len({tuple(_all_urls(r)) for r in a}) == 6  # a new page order each time
    pool = {u for r in wl.pool_warmup(10, 28) for u in _all_urls(r)}
    assert {u for r in a for u in _all_urls(r)} <= pool  # every page was warmed up
    with pytest.raises(ValueError, match="pool of 10"):
        wl.doc_qa(1, 11, pool_size=10, image_size=28, seed=0)


def test_no_reuse_images_are_all_new_and_same_prefix_shares_everything_but_the_question():
    new = wl.no_reuse(5, 3, image_size=28, seed=1)
    urls = [u for r in new for u in _all_urls(r)]
    assert len(urls) == 15 == len(set(urls))
    pool = {u for r in wl.pool_warmup(24, 28) for u in _all_urls(r)}
    assert not set(urls) & pool

    same = wl.same_prefix(4, 3, pool_size=8, image_size=28, seed=1)
    assert len({(r.messages[0]["content"], tuple(_all_urls(r))) for r in same}) == 1
    assert len({r.messages[-1]["content"][-1]["text"] for r in same}) == 4


def test_multi_turn_adds_one_image_per_turn_under_a_changed_system_prompt():
    reqs = wl.multi_turn(num_sessions=2, turns=3, image_size=28, seed=0)
    assert [r.uid for r in reqs] == [f"chat-{s}-{t}" for t in (1, 2, 3) for s in (0, 1)]
    session0 = [r for r in reqs if r.uid.startswith("chat-0-")]
    urls = [_all_urls(r) for r in session0]
    assert [len(u) for u in urls] == [1, 2, 3]
    assert urls[1][:1] == urls[0] and urls[2][:2] == urls[1]  # earlier images come back
    assert len({r.messages[0]["content"] for r in session0}) == 3


def test_plan_cells_covers_every_workload_images_and_concurrency():
    config = BenchConfig(images=(2, 4), concurrency=(1, 3), requests_per_cell=2, pool_size=6)
    keys = [c.key for c in plan_cells(config)]
    assert len(keys) == len(set(keys)) == 3 * 2 * 2 + 2
    cell = next(c for c in plan_cells(config) if c.key == "doc_qa/4img/c3")
    assert len(cell.requests) == 3  # at least one request per concurrent slot
    with pytest.raises(ValueError, match="unknown workload"):
        plan_cells(BenchConfig(workloads=("nope",)))


def test_decoder_flops_match_torch_flop_counter():
    """Linear layers and LM head exactly as torch counts them; eager attention computes
    the full square, so its share is swapped for the causal count."""
    spec = TinyModelSpec(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4)
    model, _ = build_untrained("qwen2", spec, seed=0)
    model.config._attn_implementation = "eager"
    n = 23
    with FlopCounterMode(display=False) as counter:
        model(torch.arange(n)[None], logits_to_keep=1)
    shape = DecoderShape.from_config(model.config)
    causal_keys = n * (n + 1) // 2
    want = shape.pass_flops(range(n)) - shape.attention_flops(causal_keys)
    want += shape.attention_flops(n * n)
    assert counter.get_total_flops() == want
    assert shape.extend_flops(4, 4 + n) == shape.pass_flops(range(4, 4 + n))


def test_scattered_pass_flops_count_keys_by_position():
    shape = DecoderShape(1, 8, 16, 2, 1, 4, 10)
    linear = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16)
    assert shape.linear_flops_per_token == linear
    keys = (5 + 1) + (9 + 1)
    assert shape.pass_flops([5, 9]) == 2 * linear + 4 * 2 * 4 * keys + 2 * 8 * 10
    assert shape.pass_flops([]) == 0


def test_compare_settings_rejects_a_differing_setting_and_reports_the_rest():
    base = {"page_size": 1, "attention_backend": "torch_native", "radix_cache_backend": "radix"}
    same = dict(base, radix_cache_backend="sgl_mmkv", log_level="debug")
    differences = compare_settings({"stock": base, "conduit": same})
    assert differences == {"log_level": {"stock": None, "conduit": "debug"}}
    other = dict(base, attention_backend="flashinfer")
    with pytest.raises(RuntimeError, match="attention_backend"):
        compare_settings({"stock": base, "conduit": other})


def test_the_overlap_scheduler_is_an_intended_difference():
    # reported, not compared: were one side to run without it, the report shows it
    base = {"disable_overlap_schedule": False, "attention_backend": "torch_native"}
    ours = dict(base, disable_overlap_schedule=True)
    differences = compare_settings({"stock": base, "conduit": ours})
    assert differences == {"disable_overlap_schedule": {"stock": False, "conduit": True}}


def test_each_round_sends_new_requests():
    config = BenchConfig(workloads=("doc_qa",), images=(2,), concurrency=(1,), pool_size=6)
    first, second = plan_cells(config, 0), plan_cells(config, 1)
    assert [c.key for c in first] == [c.key for c in second]
    assert first[0].requests[0].messages != second[0].requests[0].messages
    assert plan_cells(config, 0)[0].requests[0].messages == first[0].requests[0].messages


def _cell_run(side: str, workload: str, ttfts: list[float], failed: int = 0) -> CellRun:
    cell = CellSpec(workload, 2, 1, ())
    results = [
        RequestResult("u", workload, 2, ttft_s=t, latency_s=2 * t, prompt_tokens=100) for t in ttfts
    ]
    results += [RequestResult("x", workload, 2, error="HTTP 400: bad") for _ in range(failed)]
    return CellRun(side, cell, results, 10.0, 0.5, {})


def test_summaries_speedup_overhead_and_verdict():
    shape = DecoderShape(1, 8, 16, 2, 1, 4, 10)
    runs = [
        _cell_run("stock", "doc_qa", [1.0, 3.0]),
        _cell_run("conduit", "doc_qa", [0.5, 0.5]),
        _cell_run("stock", "no_reuse", [1.0]),
        _cell_run("conduit", "no_reuse", [1.1], failed=1),
    ]
    run = BenchRun(["stock", "conduit"], {}, {}, runs, 1.0)
    rows = summarise(run, shape)
    doc = rows[1]
    assert doc.ttft_mean_ms == pytest.approx(500) and doc.ttft_speedup == pytest.approx(4.0)
    assert doc.flops_fraction == pytest.approx(1.0)  # same usage, no refresh counters
    assert rows[0].e2e_p50_ms == pytest.approx(4000)
    assert rows[3].completed == 1 and rows[3].failed == 1
    assert control_overhead(rows) == pytest.approx(0.1)
    problems = failures(run, rows, max_control_overhead=0.05)
    assert len(problems) == 2 and "1 request(s) failed" in problems[0]
    assert "HTTP 400" in problems[0] and "+10.0%" in problems[1]
    assert failures(run, rows[:2], max_control_overhead=0.05) == []


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))


def test_client_records_a_refused_connection_as_a_failed_request():
    request = wl.no_reuse(1, 1, image_size=28, seed=0)[0]
    (result,) = run_requests(f"http://127.0.0.1:{free_port()}", [request], 1, max_tokens=2)
    assert not result.ok and "Connect" in result.error
    with pytest.raises(ValueError, match="concurrency"):
        run_requests("http://127.0.0.1:1", [request], 0, max_tokens=2)


def test_mode_names_map_to_reuse_and_eviction_flags():
    from harness.servers import mode_flags

    assert mode_flags("conduit", 0.1, 0.5) == [
        "--mm-reuse",
        "conduit",
        "--mm-refresh-budget",
        "0.1",
        "--mm-report-reuse",
    ]
    assert mode_flags("conduit+aircache", 0.2, 0.25) == [
        *("--mm-reuse", "conduit", "--mm-refresh-budget", "0.2", "--mm-report-reuse"),
        *("--mm-evict", "aircache", "--mm-kv-budget", "0.25"),
    ]

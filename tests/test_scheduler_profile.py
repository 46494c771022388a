"""harness/scheduler_profile.py puts each sampled scheduler stack in one part, and
harness/serving_report.py turns the parts into the trace's time bound (no server)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.scheduler_profile import PARTS, busy_seconds, part_of, scheduler_split
from harness.serving_report import format_time_split, summarise_mixed, time_bound

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_serving  # noqa: E402

LOOP = "Scheduler.event_loop_overlap (s.py:1);Scheduler.run_batch (s.py:2)"
RUNNER = f"{LOOP};ModelRunner._forward_raw (m.py:3)"
RAW = "\n".join(
    [
        f"{RUNNER};EagerRunner._execute_decode (e.py:1);Qwen2Model.forward (q.py:1) 30",
        f"{RUNNER};EagerRunner._execute_extend (e.py:2);Qwen2Model.forward (q.py:1) 50",
        # the vision encoder runs inside an extend: it is its own part
        f"{RUNNER};EagerRunner._execute_extend (e.py:2);embed_mm_inputs (u.py:1);"
        "Qwen2VLForConditionalGeneration.get_image_feature (v.py:1) 10",
        f"{RUNNER};EagerRunner._execute_extend (e.py:2);RefreshExecutor.execute_extend "
        "(x.py:1);TokenSelector.select (t.py:1) 20",
        "Scheduler.event_loop_overlap (s.py:1);Scheduler.process_batch_result (s.py:4) 8",
        "Scheduler.event_loop_overlap (s.py:1);Scheduler.get_next_batch_to_run (s.py:5) 2",
        "a line py-spy never writes",
        "",
    ]
)


def test_each_scheduler_stack_lands_in_one_part(tmp_path):
    raw = tmp_path / "scheduler.spy"
    raw.write_text(RAW)
    assert scheduler_split(raw, rate=10) == {
        "decode": 3.0,
        "vision": 1.0,
        "extend": 7.0,
        "scheduler": 1.0,
    }
    assert busy_seconds(raw, rate=10) == 12.0
    assert part_of("Scheduler.recv_requests (s.py:9)") == "scheduler"
    # a sampler that wrote nothing (py-spy could not attach) reads as no samples
    assert scheduler_split(tmp_path / "absent.spy", rate=10) == dict.fromkeys(PARTS, 0.0)


def test_the_time_bound_shrinks_only_stocks_extend():
    stock = {"wall": 2.0, "decode": 0.5, "vision": 0.1, "extend": 1.2, "scheduler": 0.1}
    # a quarter of the prefill FLOPs: 2.0 / (2.0 - 1.2 * 0.75) = 2.0 / 1.1
    assert time_bound(stock, 0.25) == pytest.approx(2.0 / 1.1)
    assert time_bound(stock, 1.0) == pytest.approx(1.0)


def _record(
    side: str, r: int, duration: float, split: dict, flops: dict | None, window: float = 0.0
) -> dict:
    return {
        "side": side,
        "round": r,
        "mix": "70-15-15",
        "load": "c4",
        "result": {
            "completed": 4,
            "duration": duration,
            "request_throughput": 4 / duration,
            "output_throughput": 64 / duration,
        },
        "requests": [
            {"kind": "doc_qa", "ttft_ms": 1e3, "itl_ms": [50.0], "error": ""} for _ in range(4)
        ],
        "flops": flops or {},
        "profile": {
            "rate": 100,
            "wall_s": duration + window,
            "scheduler_s": split,
            "http_busy_s": 0.4,
        },
    }


def test_a_profiled_mix_has_its_time_bound_share_and_extend_over_its_flops_share():
    # the sampler's window outlasts the client's duration by 2 s (stock) and 3 s
    stock_split = {"decode": 1.0, "vision": 0.2, "extend": 5.6, "scheduler": 0.4}
    ours_split = {"decode": 1.0, "vision": 0.2, "extend": 2.8, "scheduler": 0.6}
    records = [
        _record("stock", 0, 8.0, stock_split, None, window=2.0),
        _record("conduit", 0, 5.0, ours_split, {"full": 1000, "executed": 250}, window=3.0),
    ]
    stock, ours = summarise_mixed(records, ["conduit"])
    assert stock["seconds_per_request"] == {
        "wall": 2.0,
        "window": 2.5,
        "decode": 0.25,
        "vision": 0.05,
        "extend": 1.4,
        "scheduler": 0.1,
        "http": 0.1,
    }
    # stock 2.0 s a request; its extend 1.4 s shrunk to a quarter: 2.0 - 1.05 = 0.95 s
    assert ours["time_bound"] == pytest.approx(2.0 / 0.95)
    assert ours["share_of_time_bound"] == pytest.approx((8.0 / 5.0) / (2.0 / 0.95))
    # conduit's extend, 0.7 s a request, against a quarter of stock's 1.4 s
    assert ours["extend_over_flops_share"] == pytest.approx(2.0)
    table = format_time_split([stock, ours]).splitlines()
    assert len(table) == 4
    assert ours["seconds_per_request"]["scheduler"] == pytest.approx(0.15)
    assert table[3].startswith(
        "| 70-15-15 | c4 | conduit | 1.250 | 2.000 | 0.250 | 0.050 | 0.700 | 0.150 |"
    )
    assert table[3].endswith("| 2.11x | 0.76 | 2.00 |")


def test_an_unprofiled_run_has_no_time_split_table():
    records = [
        _record("stock", 0, 8.0, {}, None),
        _record("conduit", 0, 5.0, {}, {"full": 1000, "executed": 250}),
    ]
    for record in records:
        del record["profile"]
    stock, ours = summarise_mixed(records, ["conduit"])
    assert "time_bound" not in ours and "seconds_per_request" not in stock
    assert format_time_split([stock, ours]) == ""


def test_replot_summarises_a_result_files_records_again(tmp_path):
    split = {"decode": 1.0, "vision": 0.2, "extend": 5.6, "scheduler": 0.4}
    records = [
        _record("stock", 0, 8.0, split, None),
        _record("conduit", 0, 5.0, split | {"extend": 2.8}, {"full": 1000, "executed": 250}),
    ]
    for record in records:
        record |= {"label": "mix-70-15-15-c4", "concurrency": 4}
    meta = {"commit": "abc", "machine": "m", "modes": ["conduit"], "load_average": {}}
    path = tmp_path / "bench_serving.json"
    path.write_text(json.dumps({"meta": meta, "rows": [], "mixed_rows": [], "records": records}))
    assert bench_serving.replot(path) == 0
    report = json.loads(path.read_text())
    assert report["mixed_rows"][1]["time_bound"] == pytest.approx(2.0 / 0.95)
    md = (tmp_path / "bench_serving.md").read_text()
    assert md.startswith("commit abc; m;") and "| 2.11x | 0.76 | 2.00 |" in md
    assert (tmp_path / "bench_serving.png").stat().st_size > 0


def test_at_a_request_rate_there_is_no_share_of_a_bound():
    split = {"decode": 1.0, "vision": 0.2, "extend": 5.6, "scheduler": 0.4}
    records = [
        _record("stock", 0, 8.0, split, None),
        _record("conduit", 0, 8.0, split | {"extend": 2.8}, {"full": 1000, "executed": 250}),
    ]
    for record in records:
        record["load"] = "rate0.5"
    _, ours = summarise_mixed(records, ["conduit"])
    assert ours["throughput_ratio"] == pytest.approx(1.0) and ours["flops_bound"] == 4.0
    assert not {"share_of_bound", "time_bound", "share_of_time_bound"} & set(ours)

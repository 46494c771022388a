"""ReuseReporter: the per-request facts of a chunked request are summed over its
chunks (SGLang keeps only the last chunk's ``customized_info``); a prefill that does
not continue the last chunk starts anew (no server)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_mmkv.refresh.report import META_INFO_KEY, RefreshCounters, ReuseReporter


def _plan(prefix: int, seq: int, reused: int, segments: list[str]):
    spans = [SimpleNamespace(segment=SimpleNamespace(key=key)) for key in segments]
    return SimpleNamespace(
        prefix_len=prefix,
        seq_len=seq,
        extend_len=seq - prefix,
        reused_tokens=reused,
        spans=spans,
        hole_mask=lambda: torch.zeros(seq - prefix, dtype=torch.bool),
    )


def _forward(reporter: ReuseReporter, rids: list[str], plans: list, refreshed: list[int]):
    ctx = SimpleNamespace(plans=plans, forward_batch=SimpleNamespace(rids=rids))
    selected = [torch.arange(k) for k in refreshed]
    out = SimpleNamespace(customized_info=None)
    reporter.report(ctx, selected, out, seconds=0.0)
    return out.customized_info[META_INFO_KEY]


def test_a_chunked_requests_facts_are_summed_and_a_cut_segment_counted_once():
    counters = RefreshCounters()
    reporter = ReuseReporter("conduit", counters, per_request=True)
    # chunk 1: image a whole and b's first part; chunk 2: b's rest and c
    (first,) = _forward(reporter, ["r"], [_plan(0, 40, 30, ["a", "b"])], [3])
    (second,) = _forward(reporter, ["r"], [_plan(40, 80, 25, ["b", "c"])], [2])
    assert first["reused_segments"] == 2 and first["reused_tokens"] == 30
    assert second == {
        "method": "conduit",
        "reused_segments": 3,
        "reused_tokens": 55,
        "hole_tokens": 0,
        "refreshed_tokens": 5,
        "recomputed_tokens": (40 - 30 + 3) + (40 - 25 + 2),
    }
    assert counters.reused_tokens == 55 and counters.refreshed_tokens == 5


def test_another_request_or_a_prefill_that_does_not_continue_starts_anew():
    reporter = ReuseReporter("conduit", RefreshCounters(), per_request=True)
    _forward(reporter, ["r"], [_plan(0, 40, 30, ["a"])], [3])
    # a new request in the next forward, and r prefilled again from 10 (a retraction)
    other, again = _forward(
        reporter, ["s", "r"], [_plan(0, 20, 16, ["a"]), _plan(10, 50, 30, ["a"])], [1, 3]
    )
    assert other["reused_tokens"] == 16 and other["reused_segments"] == 1
    assert again["reused_tokens"] == 30 and again["refreshed_tokens"] == 3
    # a forward without r forgets it: its next extend starts anew
    _forward(reporter, ["s"], [_plan(20, 30, 0, [])], [0])
    (later,) = _forward(reporter, ["r"], [_plan(50, 60, 0, [])], [0])
    assert later["reused_tokens"] == 0 and later["reused_segments"] == 0


def test_without_the_flag_nothing_is_carried_or_attached():
    reporter = ReuseReporter("conduit", RefreshCounters(), per_request=False)
    batch = SimpleNamespace(rids=["r"])
    ctx = SimpleNamespace(plans=[_plan(0, 40, 30, ["a"])], forward_batch=batch)
    out = SimpleNamespace(customized_info=None)
    reporter.report(ctx, [torch.arange(3)], out, seconds=0.0)
    assert out.customized_info is None and reporter._carried == {}

"""The refresh pass's skip of unchanged leading tokens and the reuse cost estimate."""

from __future__ import annotations

import pytest
import torch

from sgl_mmkv.refresh.cost import reuse_flops, scoring_rows, unchanged_prefix
from sgl_mmkv.refresh.flops import DecoderShape
from sgl_mmkv.refresh.plan import RequestPlan, ReuseSpan
from sgl_mmkv.refresh.planning import ExtendPlanner
from sgl_mmkv.refresh.report import RefreshCounters
from sgl_mmkv.scoring import make_refresh_scorer
from sgl_mmkv.segments.store import Segment

SHAPE = DecoderShape(
    num_layers=8,
    hidden_size=1024,
    intermediate_size=2816,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    vocab_size=1024,
)


def _plan(prefix: int, seq_len: int, spans: list[tuple[int, int]], kept=None) -> RequestPlan:
    visual = torch.zeros(seq_len - prefix, dtype=torch.bool)
    reused = []
    for start, end in spans:
        n = end - start
        keep = None if kept is None else torch.arange(0, n, 2)
        segment = Segment(
            key=(start, n),
            slots=torch.arange(n if keep is None else keep.numel()),
            positions=torch.arange(n)[None],
            kept=keep,
        )
        reused.append(ReuseSpan(start, end, segment, delta=0))
        visual[start - prefix : end - prefix] = True
    return RequestPlan(0, prefix, seq_len, tuple(reused), visual=visual)


def test_unchanged_prefix_ends_at_the_first_refreshed_token():
    plan = _plan(10, 100, [(30, 46), (60, 76)])
    assert unchanged_prefix(plan, torch.tensor([33, 62]), deviation_pass=False) == 23
    assert unchanged_prefix(plan, torch.empty(0, dtype=torch.long), deviation_pass=False) == 90


def test_unchanged_prefix_after_a_deviation_pass_ends_at_the_first_reused_token():
    plan = _plan(10, 100, [(30, 46), (60, 76)])
    assert unchanged_prefix(plan, torch.tensor([62]), deviation_pass=True) == 20


def test_little_reuse_among_much_fresh_work_costs_more_than_full_prefill():
    # One 256-token stored image, then 15 new ones: scoring + refresh pass both
    # compute the new images.
    plan = _plan(20, 20 + 16 * 256 + 40, [(20, 276)])
    full = SHAPE.extend_flops(plan.prefix_len, plan.seq_len)
    assert reuse_flops(SHAPE, plan, make_refresh_scorer("conduit"), 0.1) > full
    # A position-only method runs one pass: always cheaper than full prefill.
    assert reuse_flops(SHAPE, plan, make_refresh_scorer("reuse"), 0.0) < full


def test_much_reuse_costs_a_fraction_of_full_prefill():
    spans = [(20 + 256 * i, 20 + 256 * (i + 1)) for i in range(16)]
    plan = _plan(20, 20 + 16 * 256 + 40, spans)
    full = SHAPE.extend_flops(plan.prefix_len, plan.seq_len)
    cost = reuse_flops(SHAPE, plan, make_refresh_scorer("conduit"), 0.1)
    assert 0.1 * full < cost < 0.2 * full
    # CacheBlend recomputes the whole extend for its signal: never cheaper.
    assert reuse_flops(SHAPE, plan, make_refresh_scorer("cacheblend"), 0.1) > full


@pytest.mark.parametrize("budget", [0.0, 0.1, 0.5, 1.0])
def test_estimate_counts_scoring_pass_and_bounded_refresh_pass(budget):
    plan = _plan(0, 120, [(20, 52)])
    positions = torch.arange(120)
    reused = plan.reused_mask()
    scoring = SHAPE.pass_flops(positions[~reused])
    k = int(torch.tensor(budget * 32).ceil())
    refresh = ~reused
    refresh[:20] = False
    refresh[52 - k : 52] = True
    expected = scoring + SHAPE.pass_flops(positions[refresh])
    assert reuse_flops(SHAPE, plan, make_refresh_scorer("conduit"), budget) == expected


def test_estimate_counts_the_tokens_staleprobe_probes_in_its_scoring_pass():
    # Three spans, the last two shifted alike: staleprobe probes the first two, each
    # at its middle reused token, over the rows conduit's scoring pass runs.
    visual = torch.zeros(200, dtype=torch.bool)
    spans = []
    for (start, end), delta in zip([(20, 52), (60, 92), (100, 132)], [5, -3, -3], strict=True):
        segment = Segment(key=(start,), slots=torch.arange(32), positions=torch.arange(32)[None])
        spans.append(ReuseSpan(start, end, segment, delta=delta))
        visual[start:end] = True
    plan = RequestPlan(0, 0, 200, tuple(spans), visual=visual)
    positions = torch.arange(200)
    scoring = scoring_rows(plan.fresh_mask())
    probed = scoring.clone()
    probed[[36, 76]] = True
    extra = SHAPE.pass_flops(positions[probed]) - SHAPE.pass_flops(positions[scoring])
    assert extra > 0
    conduit = reuse_flops(SHAPE, plan, make_refresh_scorer("conduit"), 0.1)
    assert reuse_flops(SHAPE, plan, make_refresh_scorer("staleprobe"), 0.1) == conduit + extra


def test_estimate_skips_a_compressed_segments_dropped_tokens_in_the_refresh_pass():
    whole = _plan(0, 120, [(20, 52)])
    compressed = _plan(0, 120, [(20, 52)], kept="even")
    scorer = make_refresh_scorer("conduit")
    dropped = compressed.dropped_mask()
    assert int(dropped.sum()) == 16
    # Dropped tokens run in the scoring pass only: more than the whole segment's
    # scoring pass, less than computing them twice.
    extra_scoring = SHAPE.pass_flops(torch.arange(120)[dropped])
    cost_whole = reuse_flops(SHAPE, whole, scorer, 0.1)
    cost_compressed = reuse_flops(SHAPE, compressed, scorer, 0.1)
    assert cost_whole < cost_compressed < cost_whole + 2 * extra_scoring


def _spans_with_deltas(deltas: list[int]) -> RequestPlan:
    """110 tokens, three 32-token images at 4, 38 and 72 shifted by ``deltas``: 14 text."""
    visual = torch.zeros(110, dtype=torch.bool)
    spans = []
    for start, delta in zip((4, 38, 72), deltas, strict=True):
        segment = Segment(key=(start,), slots=torch.arange(32), positions=torch.arange(32)[None])
        spans.append(ReuseSpan(start, start + 32, segment, delta=delta))
        visual[start : start + 32] = True
    return RequestPlan(0, 0, 110, tuple(spans), visual=visual)


def test_the_cost_gate_bounds_an_auto_budget_by_the_images_it_may_find_stale():
    """At ``auto`` the gate counts ``auto_fraction`` of the probed images' tokens: images
    moved together (one probe) are reused, reordered ones (every image probed, all of
    them possibly refreshed) cost more than the full prefill and are served as stock."""
    scorer = make_refresh_scorer("staleprobe")
    planner = ExtendPlanner(None, scorer, "auto", "cost", RefreshCounters())
    planner._shape = SHAPE
    full = SHAPE.extend_flops(0, 110)
    together, reordered = _spans_with_deltas([4, 4, 4]), _spans_with_deltas([5, -3, 9])
    assert (
        reuse_flops(SHAPE, together, scorer, 32 / 96)
        < full
        <= reuse_flops(SHAPE, reordered, scorer, 1.0)
    )
    assert not planner._too_costly(together)
    assert planner._too_costly(reordered)
    fixed = ExtendPlanner(None, scorer, 0.1, "cost", RefreshCounters())
    fixed._shape = SHAPE
    assert not fixed._too_costly(reordered)  # a fixed 10 % is cheap whatever went stale


def test_a_span_that_reuses_no_token_in_its_chunk_is_costed():
    """A compressed segment cut by a chunk boundary with none of its kept tokens in
    this chunk: its span reuses nothing, and the estimate is the fresh work."""
    n = 32
    segment = Segment(
        key=(0, n),
        slots=torch.arange(16),
        positions=torch.arange(n)[None],
        kept=torch.arange(0, n, 2),
    )
    span = ReuseSpan(41, 42, segment, delta=0, image_start=40)  # image token 1: dropped
    visual = torch.zeros(2, dtype=torch.bool)
    visual[0] = True
    plan = RequestPlan(0, 41, 43, (span,), visual=visual)
    assert int(plan.reused_mask().sum()) == 0
    for name in ("conduit", "staleprobe", "cacheblend"):
        cost = reuse_flops(SHAPE, plan, make_refresh_scorer(name), 0.1)
        assert cost >= SHAPE.pass_flops(torch.arange(41, 43))

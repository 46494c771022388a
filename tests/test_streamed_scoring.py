"""Scores reduced layer by layer inside the pass equal the whole-row reference.

The refresh selector runs its real scoring pass (``run_pass``, the refresh attention
backend, ``active_sub_batch``) over SGLang-shaped pools; a fake model plays the
layers, each token's q / k / v a fixed function of its slot, so every run of the
pass writes the same KV. Each attention scorer is run twice from the same pool:
streamed (its per-layer statistics, nothing of the row kept) and as the reference
(the same scorer without a reduction: every layer's queries kept and the row copied
after the pass, ``score()`` on whole rows). Scores agree within float tolerance and
selections are equal; the batch has GQA, a compressed segment computed fresh and
one left as holes (a ``RowView``). CacheBlend's one-layer copies and the eviction
ranker's streamed rankings are held to their whole-row references the same way.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sgl_mmkv.refresh.attention_backend import RefreshAttentionBackend  # noqa: E402
from sgl_mmkv.refresh.cost import scoring_rows  # noqa: E402
from sgl_mmkv.refresh.observer import ObservingBackend, PrefillObserver  # noqa: E402
from sgl_mmkv.refresh.ranker import VisualRanker  # noqa: E402
from sgl_mmkv.refresh.row_kv import row_kv  # noqa: E402
from sgl_mmkv.refresh.selection import TokenSelector  # noqa: E402
from sgl_mmkv.refresh.sub_batch import active_sub_batch  # noqa: E402
from sgl_mmkv.scoring import (  # noqa: E402
    EVICTION_SCORERS,
    ScoringInputs,
    budget_count,
    make_eviction_scorer,
    make_refresh_scorer,
)
from tests.fake_extend import (  # noqa: E402
    BUDGET,
    H_KV,
    H_Q,
    HIDDEN,
    LAYERS,
    POOL_ROWS,
    D,
)
from tests.fake_extend import plans as _plans  # noqa: E402
from tests.fake_extend import setup as _setup  # noqa: E402


def _recording(scorer):
    """``scorer`` with its ``select`` inputs recorded."""
    seen = []
    select = scorer.select

    def recorded(inputs, budget):
        seen.append(inputs)
        return select(inputs, budget)

    scorer.select = recorded
    return scorer, seen


def _select(scorer, whole_row: bool):
    ctx, _ = _setup()
    scorer, seen = _recording(scorer)
    if whole_row:
        scorer.layer_reduction = lambda: None  # the copy-every-layer reference path
    counters = SimpleNamespace(executed_flops=0)
    selected = TokenSelector(scorer, BUDGET, None, counters).select(ctx).tokens
    return selected, seen, ctx


ATTENTION_SCORERS = [
    ("conduit", {}),
    ("conduit", {"query_span": "last_text"}),
    ("conduit", {"layers": [0, 2]}),
    ("conduit", {"use_value_norm": False, "amplification": 0.5}),
    ("prophetkv", {}),
    ("prophetkv", {"layers": [1], "query_span": "last_text"}),
]


@pytest.mark.parametrize(
    ("name", "knobs"), ATTENTION_SCORERS, ids=[f"{n}-{k}" for n, k in ATTENTION_SCORERS]
)
def test_streamed_scores_equal_the_whole_row_reference(name, knobs):
    streamed, seen, ctx = _select(make_refresh_scorer(name, **knobs), whole_row=False)
    reference, whole, _ = _select(make_refresh_scorer(name, **knobs), whole_row=True)
    scorer = make_refresh_scorer(name, **knobs)
    layers = tuple(knobs.get("layers", range(LAYERS)))
    assert len(seen) == len(whole) == 2
    for plan, got, want, chosen, expected in zip(
        ctx.plans, seen, whole, streamed, reference, strict=True
    ):
        # nothing of the row or the queries reached the streamed scorer
        assert got.queries == got.keys == got.values == ()
        assert got.layer_ids == layers
        assert got.layer_statistics.shape == (len(layers), want.num_visual)
        assert len(want.keys) == LAYERS and want.keys[0].shape[0] == plan.seq_len - int(
            plan.hole_mask().sum()
        )
        torch.testing.assert_close(scorer.score(got), scorer.score(want), rtol=1e-5, atol=1e-7)
        assert torch.equal(chosen, expected)
        assert chosen.numel() == budget_count(BUDGET, want.num_visual)
    assert all(bool(torch.isfinite(s.layer_statistics).all()) for s in seen)  # no hole read


def test_last_text_reduces_the_last_query_alone():
    _, seen, ctx = _select(make_refresh_scorer("conduit", query_span="last_text"), False)
    for plan, inputs in zip(ctx.plans, seen, strict=True):
        last = plan.seq_len - 1
        view = ctx.views[plan.index]
        expected = last if view is None else int(view.index[last])
        assert inputs.query_positions.tolist() == [expected]


@pytest.mark.parametrize(("name", "layers"), [("cacheblend", (1,)), ("oracle", (0, 1, 2))])
def test_deviation_scorers_copy_their_layers_of_the_reused_tokens_and_equal_whole_rows(
    name, layers
):
    """The stale and fresh K/V of the scorer's layers (CacheBlend: layer 1; the
    oracle: every layer) at the reused tokens, against the whole rows of every layer
    before and after the recompute."""
    ctx, _ = _setup(seed=3)
    runner, batch = ctx.model_runner, ctx.forward_batch

    def rows():
        out = []
        for plan, view in zip(ctx.plans, ctx.views, strict=True):
            keys, values = row_kv(runner, batch, plan.index)
            if view is not None:
                keys, values = view.rows(keys), view.rows(values)
            out.append((keys, values))
        return out

    stale = rows()
    pool = runner.token_to_kv_pool
    saved = ([k.clone() for k in pool.k], [v.clone() for v in pool.v])
    fresh = []

    class Restore:
        def copy(self, model_runner, forward_batch, plans):
            fresh.extend(rows())
            pool.k, pool.v = saved

    scorer, seen = _recording(make_refresh_scorer(name))
    counters = SimpleNamespace(executed_flops=0)
    chosen = TokenSelector(scorer, BUDGET, Restore(), counters).select(ctx).tokens
    reference = make_refresh_scorer(name)
    for i, inputs in enumerate(seen):
        whole = ScoringInputs(
            (),
            stale[i][0],
            stale[i][1],
            torch.empty(0, dtype=torch.long),
            inputs.image_spans,
            fresh_keys=fresh[i][0],
            fresh_values=fresh[i][1],
        )
        assert inputs.layer_ids == layers and inputs.keys == ()
        assert inputs.layer_statistics.shape == (len(layers), whole.num_visual)
        torch.testing.assert_close(reference.score(inputs), reference.score(whole))
        assert bool((reference.score(whole) > 0).all())  # the recompute changed every token
        view = ctx.views[i]
        want = reference.select(whole, BUDGET)
        assert torch.equal(chosen[i], want if view is None else view.expand(want))


PROBES = ([12, 23], [10, 22])  # the middle reused token of each span (request 1: holes)


@pytest.mark.parametrize("same_shift", [False, True])
def test_staleprobe_probes_in_the_scoring_pass_and_keeps_the_probes(same_shift):
    """The probes (the middle reused token of each span shifted unlike its predecessor)
    run in the scoring pass: their stale K/V of every layer is compared with what the
    pass wrote (the oracle's deviation, by hand here), they keep the new K/V, the FLOPs
    count them, and the refresh selection holds the probes of stale images (counted in
    the budget; they run again over the refreshed row) and none of fresh ones."""
    ctx, model = _setup(seed=4)
    probes = PROBES
    if same_shift:  # request 0's second image moved with its first: one probe there
        plan0 = ctx.plans[0]
        spans = (plan0.spans[0], dataclasses.replace(plan0.spans[1], delta=plan0.spans[0].delta))
        ctx = dataclasses.replace(
            ctx, plans=(dataclasses.replace(plan0, spans=spans), ctx.plans[1])
        )
        probes = ([12], PROBES[1])
    pool = ctx.model_runner.token_to_kv_pool
    req_to_token = ctx.model_runner.req_to_token_pool.req_to_token
    stale_k, stale_v = [k.clone() for k in pool.k], [v.clone() for v in pool.v]
    scorer, seen = _recording(make_refresh_scorer("staleprobe"))
    counters = SimpleNamespace(executed_flops=0)
    chosen = TokenSelector(scorer, BUDGET, None, counters).select(ctx).tokens
    active = []
    for plan, inputs, picked, rows in zip(ctx.plans, seen, chosen, probes, strict=True):
        rows_t = torch.tensor(rows)
        slots = req_to_token[POOL_ROWS[plan.index], rows_t].long()
        want = []
        for layer in range(LAYERS):
            new_k = model.k[layer][slots].view(-1, H_KV, D)
            new_v = model.v[layer][slots].view(-1, H_KV, D)
            assert torch.equal(pool.k[layer][slots], new_k)  # kept, not restored
            assert torch.equal(pool.v[layer][slots], new_v)
            scale_k = new_k.flatten(1).norm(dim=-1).mean()
            scale_v = new_v.flatten(1).norm(dim=-1).mean()
            dk = (new_k - stale_k[layer][slots]).flatten(1).norm(dim=-1) / scale_k
            dv = (new_v - stale_v[layer][slots]).flatten(1).norm(dim=-1) / scale_v
            want.append(dk + dv)
        torch.testing.assert_close(inputs.probe_deviation, torch.stack(want))
        view = ctx.views[plan.index]
        compact = rows_t if view is None else view.compact(rows_t)
        assert torch.equal(inputs.probe_positions, compact)
        z = inputs.probe_deviation.sum(0)
        stale = z >= 0.5 * z.max()
        assert torch.isin(rows_t, picked).tolist() == stale.tolist()
        assert picked.numel() == budget_count(BUDGET, inputs.num_visual)
        mask = scoring_rows(plan.fresh_mask())
        mask[rows_t - plan.prefix_len] = True
        active.append(mask)
    assert counters.executed_flops == ctx.pass_flops(active)


def _observed_pass(observer: PrefillObserver, seed: int, active):
    """The refresh pass of both plans over ``active`` tokens, observed."""
    ctx, model = _setup(seed)
    sub, _ = active_sub_batch(ctx.forward_batch, active)
    runner = ctx.model_runner
    backend = RefreshAttentionBackend(
        runner.req_to_token_pool,
        runner.token_to_kv_pool,
        ctx.pass_positions(active),
        None,
        list(ctx.views),
    )
    model.run(sub, ObservingBackend(backend, observer), observer)
    return ctx


class Projector:
    """MM-ShiftKV's ``project_queries``: a per-layer ``q_proj`` (RoPE left out)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.weights = [torch.randn(HIDDEN, H_Q * D, generator=g) for _ in range(LAYERS)]

    def __call__(self, layer, x, positions):
        return (x @ self.weights[layer]).view(x.shape[0], H_Q, D)


def _active(plans) -> list[torch.Tensor]:
    """A refresh pass: the fresh tokens and a few selected reused ones."""
    out = []
    for plan in plans:
        rows = plan.fresh_mask().clone()
        rows[plan.reused_mask().nonzero().flatten()[::3]] = True
        out.append(rows)
    return out


@pytest.mark.parametrize("name", sorted(set(EVICTION_SCORERS) - {"random_keep"}))
def test_streamed_eviction_rankings_equal_the_whole_row_reference(name):
    knobs = {"num_samples": 64, "samples_per_group": 8} if name == "mmshiftkv" else {}
    plans = _plans()
    active = _active(plans)
    spans_of = lambda p: list(p.images)  # noqa: E731

    ranker = VisualRanker(make_eviction_scorer(name, **knobs), 0.5, spans_of)
    ranker._projector = Projector()
    observer = ranker.observer_for(list(plans), active)
    assert observer.statistics is not None
    ctx = _observed_pass(observer, 5, active)
    assert observer.queries == {}  # only the statistics were kept
    runner, batch = ctx.model_runner, ctx.forward_batch
    streamed = ranker.rank_batch(observer, runner, batch, list(plans), active, list(ctx.views))

    reference = VisualRanker(make_eviction_scorer(name, **knobs), 0.5, spans_of)
    reference._projector = ranker._projector
    kept = PrefillObserver(observer.rows)
    ctx = _observed_pass(kept, 5, active)
    for plan, view in zip(plans, ctx.views, strict=True):
        want = reference.rankings(
            kept,
            ctx.model_runner,
            ctx.forward_batch,
            plan,
            list(plan.images),
            active[plan.index],
            view,
        )
        got = [streamed[plan.index][span] for span in plan.images]
        for g_, w_ in zip(got, want, strict=True):
            torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-6)
        assert [r.numel() for r in got] == [
            e - s - int(plan.hole_mask()[s - plan.prefix_len : e - plan.prefix_len].sum())
            for s, e in plan.images
        ]


def test_a_scorer_without_a_reduction_still_gets_every_layer():
    """A scorer outside the reduction (a method reading whole rows) keeps today's path."""
    _, seen, _ = _select(make_refresh_scorer("conduit"), whole_row=True)
    assert all(s.layer_statistics is None and len(s.queries) == LAYERS for s in seen)


def test_layer_reductions_name_what_the_pass_reads():
    conduit = make_refresh_scorer("conduit", layers=[2, 0], query_span="last_text")
    assert dataclasses.astuple(conduit.layer_reduction()) == ((0, 2), True, True)
    assert not make_refresh_scorer("prophetkv").layer_reduction().needs_values
    for name in ("first", "random", "full", "reuse", "cacheblend", "oracle"):
        assert make_refresh_scorer(name).layer_reduction() is None

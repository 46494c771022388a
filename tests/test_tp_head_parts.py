"""Scorer statistics at ``--tp-size`` 2 equal TP 1's: parts over each rank's heads,
summed (the all-reduce), then finished (``scoring/head_parts.py``).

For every statistic of a refresh mode (CONDUIT's mass x value norm, ProphetKV's and
staleprobe's mass, CacheBlend's, the oracle's and staleprobe's K/V deviations) the
statistic over all H heads is computed as TP 1 does, and again from two halves of
the heads, as two ranks hold them: their parts summed and finished equal it within
1e-6 relative, while the ranks' mean of their own statistics (what the ranks agreed
on before) does not, for a norm. Then the selector's TP > 1 path (parts in the
pass, one sum, the scorer's finish) runs over the fake extend of
``tests/fake_extend.py`` and picks what TP 1 picks.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from sgl_mmkv.refresh.rank_agreement import RankAgreement
from sgl_mmkv.scoring import ScoringInputs, make_eviction_scorer, make_refresh_scorer
from sgl_mmkv.scoring.base import LayerInputs

torch.set_num_threads(1)

H_Q, H_KV, D, N = 8, 4, 16, 40
EVERY = slice(0, H_KV)
HALVES = (slice(0, H_KV // 2), slice(H_KV // 2, H_KV))  # rank 0's and rank 1's KV heads
VISUAL = torch.arange(4, 30)
HEAD_SCALE = torch.tensor([0.5, 1.0, 2.0, 4.0])[None, :, None]  # heads unlike each other


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


def _far(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` differs from ``want`` somewhere by more than 1e-3 relative."""
    assert not torch.allclose(got, want, rtol=1e-3, atol=0.0)


def _heads(x: torch.Tensor, kv_heads: slice, group: int = 1) -> torch.Tensor:
    """``x`` ``(n, H, d)`` at the heads of ``kv_heads`` (``group`` heads per KV head)."""
    return x[:, kv_heads.start * group : kv_heads.stop * group]


def _layer(seed: int, kv_heads: slice) -> LayerInputs:
    """One layer of a row of ``N`` tokens, its visual tokens ``VISUAL``, the queries
    at the last ten positions, held at the KV heads ``kv_heads`` (and their query
    heads): what a rank holding them computes over."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(N - 10, N)
    queries = torch.randn(10, H_Q, D, generator=g)
    keys = torch.randn(N, H_KV, D, generator=g)
    values = torch.randn(N, H_KV, D, generator=g) * HEAD_SCALE
    return LayerInputs(
        layer=0,
        queries=_heads(queries, kv_heads, H_Q // H_KV),
        keys=_heads(keys, kv_heads),
        query_positions=positions,
        visual_positions=VISUAL,
        visual_values=_heads(values, kv_heads)[VISUAL],
    )


def _kv(seed: int, kv_heads: slice) -> tuple[torch.Tensor, ...]:
    """``(K, V, K~, V~)``, each ``(N_v, H, d)`` at ``kv_heads``: stale and fresh K/V
    of the visual tokens, each head and token deviating by its own amount."""
    g = torch.Generator().manual_seed(seed)
    n_v = VISUAL.numel()
    keys, values = (torch.randn(n_v, H_KV, D, generator=g) * HEAD_SCALE for _ in range(2))
    drift = torch.rand(n_v, H_KV, 1, generator=g) * HEAD_SCALE.flip(1)
    fresh_keys = keys + drift * torch.randn(n_v, H_KV, D, generator=g)
    fresh_values = values + 0.3 * drift * torch.randn(n_v, H_KV, D, generator=g)
    return tuple(_heads(x, kv_heads) for x in (keys, values, fresh_keys, fresh_values))


LAYER_MODES = [
    ("conduit", {}),
    ("conduit", {"use_value_norm": False}),
    ("prophetkv", {}),
    ("staleprobe", {}),
]


@pytest.mark.parametrize(("name", "knobs"), LAYER_MODES, ids=[f"{n}-{k}" for n, k in LAYER_MODES])
def test_layer_parts_of_two_ranks_finish_into_the_statistic_of_every_head(name, knobs):
    scorer = make_refresh_scorer(name, **knobs)
    seeds = (0, 1, 2)  # three layers, stacked as the pass stacks them
    want = torch.stack([scorer.layer_statistic(_layer(s, EVERY)) for s in seeds])
    ranks = [torch.stack([scorer.layer_parts(_layer(s, h)) for s in seeds]) for h in HALVES]
    _close(scorer.finish_layers(ranks[0] + ranks[1]), want)  # the all-reduce: a sum
    every = torch.stack([scorer.layer_parts(_layer(s, EVERY)) for s in seeds])
    _close(scorer.finish_layers(every), want)  # one rank holding every head
    rank_mean = sum(
        torch.stack([scorer.layer_statistic(_layer(s, h)) for s in seeds]) for h in HALVES
    ) / len(HALVES)
    if scorer.use_value_norm:
        _far(rank_mean, want)  # the mean of the ranks' norms is not the norm
    else:
        torch.testing.assert_close(rank_mean, want, rtol=1e-5, atol=0.0)  # a mean: it was


@pytest.mark.parametrize("name", ["cacheblend", "oracle", "staleprobe"])
def test_deviation_parts_of_two_ranks_finish_into_the_deviation_of_every_head(name):
    scorer = make_refresh_scorer(name)
    seeds = (3, 4)
    want = torch.stack([scorer.deviation(*_kv(s, EVERY)) for s in seeds])
    ranks = [torch.stack([scorer.deviation_parts(*_kv(s, h)) for s in seeds]) for h in HALVES]
    _close(scorer.finish_deviation(ranks[0] + ranks[1]), want)
    every = torch.stack([scorer.deviation_parts(*_kv(s, EVERY)) for s in seeds])
    _close(scorer.finish_deviation(every), want)
    rank_mean = sum(
        torch.stack([scorer.deviation(*_kv(s, h)) for s in seeds]) for h in HALVES
    ) / len(HALVES)
    _far(rank_mean, want)


def test_a_scorer_without_deviation_has_no_parts_of_one():
    with pytest.raises(NotImplementedError, match="compares no fresh K/V"):
        make_refresh_scorer("conduit").deviation_parts(*_kv(0, EVERY))


class AllHeads(RankAgreement):
    """A TP group whose one rank holds every head, run as TP > 1 runs: the pass
    keeps parts, :meth:`sum` returns them as the all-reduce would (float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.world_size, self.sums = 2, 0

    def check(self, error, stage) -> None:
        if error is not None:
            raise error

    def sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.sums += 1
        return [t.float() for t in tensors]


class Restore:
    """The selector's copier after a deviation pass: the stale pool put back."""

    def __init__(self, pool) -> None:
        self.pool, self.saved = pool, ([k.clone() for k in pool.k], [v.clone() for v in pool.v])

    def copy(self, model_runner, forward_batch, plans) -> None:
        self.pool.k, self.pool.v = self.saved


def _selected(name: str, agreement: RankAgreement | None):
    """The picks of ``name`` over the fake extend, and the inputs its ``select`` saw."""
    from sgl_mmkv.refresh.selection import TokenSelector
    from tests.fake_extend import BUDGET, setup

    ctx, _ = setup(seed=5)
    scorer, seen = make_refresh_scorer(name), []
    select = scorer.select
    scorer.select = lambda inputs, budget: seen.append(inputs) or select(inputs, budget)
    copier = Restore(ctx.model_runner.token_to_kv_pool)
    counters = SimpleNamespace(executed_flops=0)
    selector = TokenSelector(scorer, BUDGET, copier, counters, agreement)
    return selector.select(ctx).tokens, seen


@pytest.mark.parametrize("name", ["conduit", "prophetkv", "staleprobe", "cacheblend", "oracle"])
def test_the_selector_s_tp_path_picks_what_tp1_picks(name):
    """Parts kept in the pass (layer statistics, probes) or after CacheBlend's and the
    oracle's recompute, one sum, the scorer's finish: TP 1's statistics and picks."""
    pytest.importorskip("sglang")
    agreement = AllHeads()
    tp1, tp1_seen = _selected(name, None)
    tp, tp_seen = _selected(name, agreement)
    assert agreement.sums == 1
    for a, b in zip(tp, tp1, strict=True):
        assert torch.equal(a, b)
    for got, want in zip(tp_seen, tp1_seen, strict=True):
        assert got.layer_statistics.shape == want.layer_statistics.shape
        torch.testing.assert_close(got.layer_statistics, want.layer_statistics, rtol=1e-5, atol=0)
        if want.probe_deviation is not None:
            torch.testing.assert_close(got.probe_deviation, want.probe_deviation, rtol=1e-5, atol=0)
    assert (name == "staleprobe") == (tp_seen[0].probe_deviation is not None)


# --- eviction rankings at TP 2 -----------------------------------------------------
#
# ``--mm-evict`` ranks a new segment's tokens from the prefill; at TP 2 each rank
# reduces its own heads' parts, the ranker sums them (one all-reduce) and every rank
# ranks from the same statistics, so both keep the same tokens of every segment.

HIDDEN = 24
EVICT_BUDGET = 0.5


def _evict_layer(seed: int, kv_heads: slice) -> LayerInputs:
    """:func:`_layer` with what MM-ShiftKV reads too: the attention input's statistics
    and a ``q_proj`` whose output is the rank's query heads."""
    layer = _layer(seed, kv_heads)
    weight = torch.randn(HIDDEN, H_Q * D, generator=torch.Generator().manual_seed(seed + 50))
    group = H_Q // H_KV

    def project(_layer_id: int, x: torch.Tensor, _positions: torch.Tensor) -> torch.Tensor:
        return _heads((x @ weight).view(-1, H_Q, D), kv_heads, group)

    stats = (torch.tensor(0.1), torch.tensor(1.3), HIDDEN)
    # ``layer``: MM-ShiftKV's noise seed, the same on both ranks
    return replace(layer, layer=seed, hidden_stats=stats, project_queries=project)


def _ranking(scorer, statistics: torch.Tensor) -> torch.Tensor:
    inputs = ScoringInputs(
        queries=(),
        keys=(),
        values=(),
        query_positions=torch.arange(N - 10, N),
        image_spans=((int(VISUAL[0]), int(VISUAL[-1]) + 1),),
        layer_ids=tuple(range(statistics.shape[0])),
        layer_statistics=statistics,
    )
    return scorer.ranking(inputs, EVICT_BUDGET)


def _kept(ranking: torch.Tensor) -> set[int]:
    return set(torch.topk(ranking, ranking.numel() // 2).indices.tolist())


def _evict_scorer(name: str):
    knobs = {"num_samples": 64, "samples_per_group": 8} if name == "mmshiftkv" else {}
    return make_eviction_scorer(name, **knobs)


@pytest.mark.parametrize("name", ["snapkv", "mmshiftkv"])
def test_eviction_parts_of_two_ranks_rank_as_every_head(name):
    """SnapKV's and MM-ShiftKV's statistics are sums and means over heads: summed
    parts rank the visual tokens exactly as one rank holding every head."""
    scorer = _evict_scorer(name)
    seeds = (0, 1, 2)
    want = _ranking(
        scorer, torch.stack([scorer.layer_statistic(_evict_layer(s, EVERY)) for s in seeds])
    )
    ranks = [torch.stack([scorer.layer_parts(_evict_layer(s, h)) for s in seeds]) for h in HALVES]
    got = _ranking(scorer, scorer.finish_layers(ranks[0] + ranks[1]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert _kept(got) == _kept(want)


def test_aircache_ranks_of_two_ranks_agree_and_keep_most_of_tp1_s_tokens():
    """AirCache's elite set is each rank's own heads' at TP 2 (no collective inside a
    layer). Ranked alone, the two ranks would keep different tokens; from the summed
    parts both keep one set, most of what TP 1 keeps at budget 0.5 (0.69 here, on
    random heads that share no pattern: the printed overlap)."""
    scorer = _evict_scorer("aircache")
    seeds = (0, 1, 2)
    want = _ranking(
        scorer, torch.stack([scorer.layer_statistic(_evict_layer(s, EVERY)) for s in seeds])
    )
    ranks = [torch.stack([scorer.layer_parts(_evict_layer(s, h)) for s in seeds]) for h in HALVES]
    alone = [_kept(_ranking(scorer, scorer.finish_layers(parts))) for parts in ranks]
    assert alone[0] != alone[1]
    got = _ranking(scorer, scorer.finish_layers(ranks[0] + ranks[1]))
    overlap = len(_kept(got) & _kept(want)) / len(_kept(want))
    print(f"aircache TP-2 keep set overlap with TP 1: {overlap:.3f}")
    assert overlap >= 0.6

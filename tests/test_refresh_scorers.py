"""Each refresh method's own defining property (the shared invariants of every scorer
are in test_scorers.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from sgl_mmkv.scoring import ScoringInputs, budget_count, make_refresh_scorer
from sgl_mmkv.scoring.attention import attention_mass
from sgl_mmkv.scoring.conduit import image_amplification


def make_inputs(
    seed: int = 0,
    spans=((5, 21), (24, 40), (43, 59)),
    n: int = 70,
    layers: int = 3,
    h_q: int = 4,
    h_kv: int = 2,
    d: int = 16,
) -> ScoringInputs:
    g = torch.Generator().manual_seed(seed)
    query_positions = torch.arange(spans[-1][1] + 1, n)
    keys = tuple(torch.randn(n, h_kv, d, generator=g) for _ in range(layers))
    values = tuple(torch.randn(n, h_kv, d, generator=g) for _ in range(layers))
    return ScoringInputs(
        queries=tuple(
            torch.randn(len(query_positions), h_q, d, generator=g) for _ in range(layers)
        ),
        keys=keys,
        values=values,
        query_positions=query_positions,
        image_spans=tuple(spans),
        fresh_keys=tuple(k + 0.1 * torch.randn(k.shape, generator=g) for k in keys),
        fresh_values=tuple(v + 0.1 * torch.randn(v.shape, generator=g) for v in values),
    )


def test_budget_count_is_ceil_and_validated():
    assert budget_count(0.1, 48) == math.ceil(4.8) == 5
    assert budget_count(0.1, 40) == 4
    assert budget_count(1.0, 7) == 7
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        budget_count(1.5, 10)


def test_unknown_scorer_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown refresh scorer 'magic'"):
        make_refresh_scorer("magic")


def test_attention_mass_matches_a_loop_over_queries_and_heads():
    inputs = make_inputs(seed=5, h_q=4, h_kv=2)
    q, k = inputs.queries[0], inputs.keys[0]
    got = attention_mass(q, k, inputs.query_positions)
    want = torch.zeros(k.shape[0])
    for i, p in enumerate(inputs.query_positions.tolist()):
        for h in range(q.shape[1]):
            logits = (k[: p + 1, h // 2] @ q[i, h]) / math.sqrt(q.shape[-1])
            want[: p + 1] += torch.softmax(logits, dim=0)
    want /= q.shape[0] * q.shape[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_attention_mass_is_causal_by_position():
    inputs = make_inputs(seed=6)
    early = torch.tensor([30])  # a query in the middle of the row sees keys <= 30 only
    mass = attention_mass(inputs.queries[0][:1], inputs.keys[0], early)
    assert mass[31:].abs().max() == 0 and mass[:31].sum() == pytest.approx(1.0, abs=1e-5)


def test_conduit_is_prophetkv_times_value_norm_times_image_factor():
    inputs = make_inputs(seed=7)
    pos = inputs.visual_positions
    alpha = torch.stack(
        [
            attention_mass(q, k, inputs.query_positions)[pos]
            for q, k in zip(inputs.queries, inputs.keys, strict=True)
        ]
    )
    vnorm = torch.stack([v[pos].flatten(1).norm(dim=-1) for v in inputs.values])
    s = (alpha * vnorm).mean(0)
    m = torch.stack([s[inputs.image_ids() == j].clamp(min=0).mean() for j in range(3)])
    want = s * (m / m.mean())[inputs.image_ids()]  # lambda = 1: c_j = m_j / mean m
    torch.testing.assert_close(
        make_refresh_scorer("conduit").score(inputs), want, rtol=1e-5, atol=1e-8
    )
    torch.testing.assert_close(make_refresh_scorer("prophetkv").score(inputs), alpha.mean(0))


def _alpha(inputs, layers=None, last_only=False):
    """``(L', N_v)`` attention mass per layer of the visual tokens, by hand."""
    pos, qpos = inputs.visual_positions, inputs.query_positions
    out = []
    for i, (q, k) in enumerate(zip(inputs.queries, inputs.keys, strict=True)):
        if layers is None or i in layers:
            q_, p_ = (q[-1:], qpos[-1:]) if last_only else (q, qpos)
            out.append(attention_mass(q_, k, p_)[pos])
    return torch.stack(out)


def test_each_conduit_knob_switches_off_one_part():
    """The ablations' parts, each against its formula: value norm, amplification, the
    query span and the layer set are independent knobs of one score."""
    inputs = make_inputs(seed=9, layers=4)
    pos, ids = inputs.visual_positions, inputs.image_ids()
    vnorm = torch.stack([v[pos].flatten(1).norm(dim=-1) for v in inputs.values])

    def amplified(s):
        return s * image_amplification(s, ids, 1.0)

    def conduit(**knobs):
        return make_refresh_scorer("conduit", **knobs).score(inputs)

    close = dict(rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(conduit(use_value_norm=False), amplified(_alpha(inputs).mean(0)))
    torch.testing.assert_close(conduit(amplification=0.0), (_alpha(inputs) * vnorm).mean(0))
    torch.testing.assert_close(
        conduit(query_span="last_text"),
        amplified((_alpha(inputs, last_only=True) * vnorm).mean(0)),
        **close,
    )
    torch.testing.assert_close(
        conduit(layers=[3, 1]),
        amplified((_alpha(inputs, layers={1, 3}) * vnorm[[1, 3]]).mean(0)),
        **close,
    )
    both_off = conduit(use_value_norm=False, amplification=0.0)
    assert torch.equal(both_off, make_refresh_scorer("prophetkv").score(inputs))
    # the parts matter here: each knob changes the 10 % selection or the scores
    default = make_refresh_scorer("conduit").select(inputs, 0.1)
    for knobs in ({"use_value_norm": False}, {"query_span": "last_text"}, {"layers": [0]}):
        assert not torch.equal(make_refresh_scorer("conduit", **knobs).select(inputs, 0.1), default)


def test_conduit_layers_name_model_layers_not_list_indices():
    """With ``layer_ids`` the scored entries are layers 4..7; ``layers=[5]`` is the
    second entry, and a layer that was not scored is an error, not a silent mean."""
    inputs = make_inputs(seed=10, layers=4)
    shifted = ScoringInputs(
        inputs.queries,
        inputs.keys,
        inputs.values,
        inputs.query_positions,
        inputs.image_spans,
        layer_ids=(4, 5, 6, 7),
    )
    one = make_refresh_scorer("conduit", layers=[5], amplification=0.0, use_value_norm=False)
    torch.testing.assert_close(one.score(shifted), _alpha(inputs, layers={1})[0])
    with pytest.raises(ValueError, match=r"layers \[2\] were not scored \(\(4, 5, 6, 7\)\)"):
        make_refresh_scorer("conduit", layers=[2]).score(shifted)


def test_image_amplification_is_one_for_a_single_image_and_averages_to_one():
    scores = torch.rand(16)
    assert torch.equal(
        image_amplification(scores, torch.zeros(16, dtype=torch.long), 1.0), torch.ones(16)
    )
    ids = torch.arange(3).repeat_interleave(5)
    factor = image_amplification(torch.rand(15), ids, 1.0)
    assert factor[::5].mean().item() == pytest.approx(1.0, abs=1e-6)


def test_conduit_prefers_the_image_the_queries_attend_to():
    """Queries aligned with image 2's keys: CONDUIT's top 10 % all come from image 2."""
    inputs = make_inputs(seed=8)
    s, e = inputs.image_spans[1]
    u = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))  # one per KV head
    queries = tuple(u.repeat_interleave(2, 0).expand_as(q).clone() for q in inputs.queries)
    boosted = tuple(k.clone() for k in inputs.keys)
    for k in boosted:
        k[s:e] = 0.5 * u + 0.1 * k[s:e]
    steered = ScoringInputs(
        queries, boosted, inputs.values, inputs.query_positions, inputs.image_spans
    )
    chosen = make_refresh_scorer("conduit").select(steered, 0.1)
    assert ((chosen >= s) & (chosen < e)).all()


def test_first_takes_the_leading_tokens_of_each_image():
    inputs = make_inputs()
    chosen = make_refresh_scorer("first").select(inputs, 0.1)
    assert chosen.tolist() == [5, 6, 24, 25, 43, 44]


def test_cacheblend_needs_fresh_kv_and_ranks_by_deviation():
    inputs = make_inputs(seed=9)
    plain = ScoringInputs(
        inputs.queries, inputs.keys, inputs.values, inputs.query_positions, inputs.image_spans
    )
    with pytest.raises(ValueError, match="fresh K/V"):
        make_refresh_scorer("cacheblend").score(plain)
    fresh_k = tuple(k.clone() for k in inputs.keys)
    fresh_k[1][30] += 100.0  # one token deviates a lot at layer 1 (layer 0 cannot)
    marked = ScoringInputs(
        inputs.queries,
        inputs.keys,
        inputs.values,
        inputs.query_positions,
        inputs.image_spans,
        fresh_keys=fresh_k,
        fresh_values=inputs.values,
    )
    assert make_refresh_scorer("cacheblend").select(marked, 0.02).tolist() == [30]


def test_oracle_sums_the_scale_free_deviation_of_every_layer():
    """The oracle's formula by hand, token by token; a deviation at the last layer
    alone is found; multiplying one layer's K/V by 1000 (stale and fresh alike)
    changes no score: each layer weighs by its relative deviation, not its scale."""
    inputs = make_inputs(seed=11, layers=4)
    pos = inputs.visual_positions
    want = torch.zeros(pos.numel())
    for layer in range(4):
        for stale, fresh in (
            (inputs.keys[layer], inputs.fresh_keys[layer]),
            (inputs.values[layer], inputs.fresh_values[layer]),
        ):
            scale = sum(fresh[p].flatten().norm() for p in pos.tolist()) / pos.numel()
            for i, p in enumerate(pos.tolist()):
                want[i] += (fresh[p] - stale[p]).flatten().norm() / scale
    oracle = make_refresh_scorer("oracle")
    torch.testing.assert_close(oracle.score(inputs), want, rtol=1e-5, atol=1e-6)
    assert oracle.deviation_layers(4) == (0, 1, 2, 3) and oracle.needs_fresh_kv

    def rebuilt(keys, values, fresh_keys, fresh_values):
        return ScoringInputs(
            inputs.queries,
            keys,
            values,
            inputs.query_positions,
            inputs.image_spans,
            fresh_keys=fresh_keys,
            fresh_values=fresh_values,
        )

    scaled = rebuilt(
        (1000 * inputs.keys[0], *inputs.keys[1:]),
        (1000 * inputs.values[0], *inputs.values[1:]),
        (1000 * inputs.fresh_keys[0], *inputs.fresh_keys[1:]),
        (1000 * inputs.fresh_values[0], *inputs.fresh_values[1:]),
    )
    torch.testing.assert_close(oracle.score(scaled), want, rtol=1e-4, atol=1e-5)

    exact = rebuilt(inputs.keys, inputs.values, inputs.keys, inputs.values)
    assert oracle.score(exact).abs().max() == 0  # nothing stale: every score 0
    deep = tuple(v.clone() for v in inputs.values)
    deep[3][30] += 5.0  # token 30 is stale at the last layer alone
    marked = rebuilt(inputs.keys, inputs.values, inputs.keys, deep)
    assert oracle.select(marked, 0.02).tolist() == [30]
    with pytest.raises(ValueError, match="fresh K/V"):
        oracle.score(rebuilt(inputs.keys, inputs.values, None, None))
    statistics = torch.rand(4, pos.numel())  # the selector's per-layer deviations
    reduced = ScoringInputs(
        (),
        (),
        (),
        torch.empty(0, dtype=torch.long),
        inputs.image_spans,
        layer_ids=(0, 1, 2, 3),
        layer_statistics=statistics,
    )
    torch.testing.assert_close(oracle.score(reduced), statistics.sum(0))


def test_staleprobe_probes_moved_images_and_ranks_attention_by_staleness():
    """Probes: the first span and each span shifted unlike its predecessor. Scores:
    ProphetKV's mass times the probe's summed deviation of the token's image (0 for an
    image without a probe); the ranking puts stale images' probes first and fresh
    images' probes last; without probes it is ProphetKV."""
    scorer = make_refresh_scorer("staleprobe")
    assert scorer.probe_spans((4, 4, 9, 9, 4)) == (0, 2, 4)
    assert scorer.probe_spans(()) == ()
    inputs = make_inputs(seed=12)  # images (5, 21), (24, 40), (43, 59)
    alpha = make_refresh_scorer("prophetkv").score(inputs)
    assert torch.equal(scorer.score(inputs), alpha)
    assert torch.equal(
        scorer.select(inputs, 0.1), make_refresh_scorer("prophetkv").select(inputs, 0.1)
    )
    deviation = torch.tensor([[0.1, 2.0], [0.2, 1.0]])  # (L, m): image 0 sums 0.3, image 1 3.0
    probed = replace(inputs, probe_positions=torch.tensor([13, 32]), probe_deviation=deviation)
    z = torch.tensor([0.3, 3.0, 0.0])[inputs.image_ids()]
    torch.testing.assert_close(scorer.score(probed), alpha * z)
    ranking = scorer.ranking(probed, 0.1)
    assert ranking[32 - 24 + 16] == float("inf") and ranking[13 - 5] == float("-inf")
    chosen = scorer.select(probed, 0.1)  # 5 tokens: the stale probe and 4 of image 1
    assert chosen.numel() == 5 and 32 in chosen.tolist() and 13 not in chosen.tolist()
    assert ((chosen >= 24) & (chosen < 40)).all()
    lenient = make_refresh_scorer("staleprobe", stale_fraction=0.05)
    assert 13 in lenient.select(probed, 0.1).tolist()  # 0.3 >= 0.05 * 3.0: stale too
    with pytest.raises(ValueError, match="stale_fraction"):
        make_refresh_scorer("staleprobe", stale_fraction=1.5)


def _adaptive_reference(scorer, inputs) -> list[int]:
    """``select_adaptive`` by a loop over images: ``ceil(fraction * n_j)`` tokens of each
    image whose per-layer mean probe deviation reaches the threshold, its probe first,
    then by ``alpha * z``."""
    layers = inputs.probe_deviation.shape[0]
    z = [0.0] * len(inputs.image_spans)
    for position, column in zip(
        inputs.probe_positions.tolist(), inputs.probe_deviation.T, strict=True
    ):
        image = next(i for i, (s, e) in enumerate(inputs.image_spans) if s <= position < e)
        z[image] += float(column.sum())
    scores = scorer.score(inputs).tolist()
    chosen, offset = [], 0
    for (start, end), z_j in zip(inputs.image_spans, z, strict=True):
        probed = any(start <= p < end for p in inputs.probe_positions.tolist())
        if probed and z_j / layers >= scorer.auto_threshold:
            quota = math.ceil(scorer.auto_fraction * (end - start) - 1e-9)
            probes = [p for p in inputs.probe_positions.tolist() if start <= p < end]
            rest = sorted(
                (p for p in range(start, end) if p not in probes),
                key=lambda p: -scores[offset + p - start],
            )
            chosen += (probes + rest)[:quota]
        offset += end - start
    return sorted(chosen)


def test_staleprobe_auto_refreshes_a_share_of_each_image_its_probe_finds_stale():
    """At ``auto``: an image is stale when its probe's deviation averaged over layers
    reaches ``auto_threshold``; ``ceil(auto_fraction * n_j)`` of a stale image's tokens
    are refreshed (its probe, then the highest scores), none of a fresh or unprobed
    image; the count is the request's own. Matches a loop over images."""
    inputs = make_inputs(seed=13)  # images (5, 21), (24, 40), (43, 59): 16 tokens each
    deviation = torch.tensor([[0.1, 0.9, 0.5], [0.1, 0.7, 0.3]])  # per-layer means .1 .8 .4
    probed = replace(inputs, probe_positions=torch.tensor([13, 32, 51]), probe_deviation=deviation)
    scorer = make_refresh_scorer("staleprobe", auto_threshold=0.3, auto_fraction=0.25)
    assert scorer.adapts_budget and scorer.budget_bound(0.1, (3, 4), (16, 16)) == 0.1
    # the cost gate's bound: a quarter of each image it would probe (the first, and
    # each shifted unlike its predecessor), none of the others
    assert scorer.budget_bound("auto", (3, 3, 7), (16, 16, 16)) == 8 / 48
    assert scorer.budget_bound("auto", (3, 4, 5), (16, 16, 16)) == 12 / 48
    assert scorer.budget_bound("auto") == 0.25
    chosen = scorer.select(probed, "auto")
    assert chosen.tolist() == _adaptive_reference(scorer, probed)
    assert chosen.numel() == 8  # 4 of image 1, 4 of image 2; image 0 is fresh
    assert {32, 51} <= set(chosen.tolist()) and not ((chosen >= 5) & (chosen < 21)).any()
    strict = make_refresh_scorer("staleprobe", auto_threshold=0.5, auto_fraction=0.5)
    assert strict.select(probed, "auto").tolist() == _adaptive_reference(strict, probed)
    assert strict.select(probed, "auto").numel() == 8  # image 1 alone, half of it
    everything = make_refresh_scorer("staleprobe", auto_threshold=0.0, auto_fraction=1.0)
    assert everything.select(probed, "auto").tolist() == list(range(5, 21)) + list(
        range(24, 40)
    ) + list(range(43, 59))
    first_only = replace(
        probed, probe_positions=torch.tensor([13]), probe_deviation=deviation[:, :1]
    )
    assert everything.select(first_only, "auto").tolist() == list(range(5, 21))  # unprobed: kept
    fresh = make_refresh_scorer("staleprobe", auto_threshold=0.9)
    assert fresh.select(probed, "auto").numel() == 0  # every probe came back fresh
    assert fresh.select(inputs, "auto").numel() == 0  # no probes: nothing known stale
    long = replace(
        make_inputs(seed=14, spans=((5, 55),)),
        probe_positions=torch.tensor([30]),
        probe_deviation=torch.tensor([[1.0], [1.0]]),
    )
    thirty = make_refresh_scorer("staleprobe", auto_fraction=0.3)
    assert thirty.select(long, "auto").numel() == 15 == math.ceil(0.3 * 50 - 1e-9)
    assert thirty.budget_bound("auto", (4,), (50,)) == 15 / 50
    with pytest.raises(ValueError, match="auto_fraction"):
        make_refresh_scorer("staleprobe", auto_fraction=1.5)
    with pytest.raises(ValueError, match="auto_threshold"):
        make_refresh_scorer("staleprobe", auto_threshold=-1.0)
    with pytest.raises(ValueError, match="does not size its budget"):
        make_refresh_scorer("conduit").select(inputs, "auto")


def test_random_depends_on_its_seed_only():
    inputs = make_inputs()
    a = make_refresh_scorer("random", seed=1).select(inputs, 0.2)
    assert torch.equal(a, make_refresh_scorer("random", seed=1).select(make_inputs(seed=4), 0.2))
    assert not torch.equal(a, make_refresh_scorer("random", seed=2).select(inputs, 0.2))

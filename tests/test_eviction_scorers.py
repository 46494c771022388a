"""Each eviction method against a loop-by-loop torch reference (the shared invariants
of every scorer are in test_scorers.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_mmkv.scoring import ScoringInputs, make_eviction_scorer
from sgl_mmkv.scoring.aircache import AirCacheScorer, layer_keep_counts
from sgl_mmkv.scoring.mmshiftkv import MMShiftKVScorer, top_p_mask

BUDGETS = (0.05, 0.1, 0.2, 0.5, 1.0)
HIDDEN = 12


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of ``(S, H, d)`` at ``(S,)`` positions."""
    d = x.shape[-1]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def make_inputs(seed=0, spans=((3, 19), (22, 38)), n=50, layers=3, h_q=4, h_kv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    visual = torch.zeros(n, dtype=torch.bool)
    for s, e in spans:
        visual[s:e] = True
    query_positions = (~visual).nonzero().flatten()  # the prompt's text tokens
    weights = [torch.randn(HIDDEN, h_q * d, generator=g) for _ in range(layers)]

    def project(layer, x, positions):
        return rope((x @ weights[layer]).view(-1, h_q, d), positions)

    return ScoringInputs(
        queries=tuple(
            torch.randn(len(query_positions), h_q, d, generator=g) for _ in range(layers)
        ),
        keys=tuple(torch.randn(n, h_kv, d, generator=g) for _ in range(layers)),
        values=tuple(torch.randn(n, h_kv, d, generator=g) for _ in range(layers)),
        query_positions=query_positions,
        image_spans=tuple(spans),
        hidden_stats=tuple((0.1 * i, 1.0 + 0.2 * i, HIDDEN) for i in range(layers)),
        project_queries=project,
    )


def scorer(name: str):
    knobs = {"num_samples": 64, "samples_per_group": 8} if name == "mmshiftkv" else {}
    return make_eviction_scorer(name, **knobs)


def test_unknown_scorer_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown eviction scorer 'h2o'"):
        make_eviction_scorer("h2o")


def causal_softmax_row(q, keys, qpos, kpos, scale):
    logits = torch.tensor([float(q @ k) * scale for k in keys])
    logits[kpos > qpos] = float("-inf")
    return torch.softmax(logits, dim=0)


def test_snapkv_matches_loop_reference():
    inputs = make_inputs(seed=1)
    s = make_eviction_scorer("snapkv", window=5, pool_kernel=3)
    n = inputs.keys[0].shape[0]
    per_layer = []
    for q, k in zip(inputs.queries, inputs.keys, strict=True):
        h_q, h_kv, d = q.shape[1], k.shape[1], q.shape[2]
        votes = torch.zeros(h_kv, n)
        for i in range(q.shape[0] - 5, q.shape[0]):
            for h in range(h_q):
                kh = h // (h_q // h_kv)
                row = causal_softmax_row(
                    q[i, h], k[:, kh], int(inputs.query_positions[i]), torch.arange(n), d**-0.5
                )
                votes[kh] += row / (h_q // h_kv)
        padded = torch.nn.functional.pad(votes, (1, 1))
        pooled = torch.stack([padded[:, j : j + 3].sum(dim=1) / 3 for j in range(n)], dim=1)
        per_layer.append(pooled[:, inputs.visual_positions])
    expected = torch.stack(per_layer).mean(dim=(0, 1))
    torch.testing.assert_close(s.score(inputs), expected, rtol=1e-5, atol=1e-6)


def test_aircache_importance_matches_loop_reference():
    inputs = make_inputs(seed=2)
    s = AirCacheScorer(alpha=0.5)
    visual = inputs.visual_positions
    expected = []
    for q, k in zip(inputs.queries, inputs.keys, strict=True):
        h_q, h_kv, d = q.shape[1], k.shape[1], q.shape[2]
        group = h_q // h_kv
        text = inputs.query_positions
        last = torch.zeros(len(text))
        for h in range(h_q):
            last += causal_softmax_row(q[-1, h], k[text, h // group], 10**9, text, d**-0.5) / h_q
        elite = (last >= 0.5 * last.max()).nonzero().flatten()
        key_pos = torch.cat([visual, text[elite]])
        importance = torch.zeros(len(visual))
        for i in elite.tolist():
            for h in range(h_q):
                row = causal_softmax_row(
                    q[i, h], k[key_pos, h // group], int(text[i]), key_pos, d**-0.5
                )
                importance += row[: len(visual)] / (len(elite) * h_q)
        expected.append(importance)
    torch.testing.assert_close(
        s.layer_importance(inputs), torch.stack(expected), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("budget", BUDGETS)
def test_aircache_layer_budgets_average_to_the_global_budget(budget):
    importance = torch.rand(6, 40, generator=torch.Generator().manual_seed(4)) ** 3
    budgets = AirCacheScorer.layer_budgets(importance, budget)
    assert budgets.shape == (6,)
    assert math.isclose(float(budgets.mean()), budget, abs_tol=1e-6)
    assert float(budgets.min()) >= 0.0 and float(budgets.max()) <= 1.0
    counts = layer_keep_counts(budgets, 40)
    assert int(counts.sum()) == round(budget * 6 * 40)
    assert bool((counts <= 40).all())


def test_aircache_layer_budgets_follow_the_layers_strength():
    importance = torch.full((2, 30), 0.01)
    importance[1, :3] = 0.5  # layer 1: strong and skewed
    budgets = AirCacheScorer.layer_budgets(importance, 0.2)
    assert float(budgets[1]) > float(budgets[0])


def test_top_p_mask_is_the_smallest_set_reaching_the_mass():
    scores = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.25, 0.25, 0.25, 0.25]])
    mask = top_p_mask(scores, 0.9)
    assert mask.tolist() == [[True, False, True, True], [True, True, True, True]]
    assert top_p_mask(scores, 0.5).tolist()[0] == [True, False, False, False]


def test_mmshiftkv_votes_match_loop_reference():
    inputs = make_inputs(seed=5)
    s = MMShiftKVScorer(num_samples=16, samples_per_group=4, group_stride=32, top_p=0.8)
    layer = 1
    votes, last_attention = s.layer_votes(inputs, layer)
    q, k = inputs.queries[layer], inputs.keys[layer]
    mean, std, hidden = inputs.hidden_stats[layer]
    last = int(inputs.query_positions[-1])
    x = mean + 10.0 * std * torch.randn(16, hidden, generator=torch.Generator().manual_seed(layer))
    positions = torch.tensor([last + 32 * (j + 1) for _ in range(4) for j in range(4)])
    proxies = inputs.project_queries(layer, x, positions)
    h_q, h_kv, d = q.shape[1], k.shape[1], q.shape[2]
    group = h_q // h_kv
    expected_votes = torch.zeros(h_kv, last)
    expected_last = torch.zeros(h_kv, last)
    for kh in range(h_kv):
        heads = range(kh * group, (kh + 1) * group)
        real = (
            sum(
                causal_softmax_row(q[-1, h], k[:last, kh], last, torch.arange(last), d**-0.5)
                for h in heads
            )
            / group
        )
        expected_last[kh] = real
        for g in range(4):
            total = real.clone()
            for sample in range(g * 4, (g + 1) * 4):
                total += (
                    sum(
                        causal_softmax_row(
                            proxies[sample, h], k[:last, kh], 10**9, torch.arange(last), d**-0.5
                        )
                        for h in heads
                    )
                    / group
                )
            total /= 5
            order = torch.argsort(total, descending=True)
            mass = 0.0
            for j in order.tolist():
                if mass >= 0.8 * float(total.sum()):
                    break
                expected_votes[kh, j] += 1
                mass += float(total[j])
    visual = inputs.visual_positions
    torch.testing.assert_close(votes, expected_votes[:, visual])
    torch.testing.assert_close(last_attention, expected_last[:, visual], rtol=1e-5, atol=1e-6)


def test_mmshiftkv_needs_hidden_statistics():
    inputs = make_inputs()
    bare = ScoringInputs(
        inputs.queries, inputs.keys, inputs.values, inputs.query_positions, inputs.image_spans
    )
    with pytest.raises(ValueError, match="mmshiftkv needs"):
        MMShiftKVScorer().score(bare)

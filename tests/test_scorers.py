"""One test matrix for every scorer of both registries (kvpress ``default_presses``
style): a new method gets these invariants by being registered. Each method's own
defining property is tested beside it (test_refresh_scorers, test_eviction_scorers)."""

from __future__ import annotations

import pytest
import torch

from sgl_mmkv.scoring import (
    EVICTION_SCORERS,
    REFRESH_SCORERS,
    ScoringInputs,
    TokenScorer,
    budget_count,
    make_eviction_scorer,
    make_refresh_scorer,
)

BUDGETS = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)
HIDDEN = 12
ALL = sorted(REFRESH_SCORERS) + sorted(EVICTION_SCORERS)


def make_inputs(seed=0, spans=((3, 19), (22, 38)), n=50, layers=3, h_q=4, h_kv=2, d=8):
    """A row with two images between text tokens; the queries are the text tokens, and
    every optional input a scorer may need is present."""
    g = torch.Generator().manual_seed(seed)
    visual = torch.zeros(n, dtype=torch.bool)
    for s, e in spans:
        visual[s:e] = True
    query_positions = (~visual).nonzero().flatten()
    weights = [torch.randn(HIDDEN, h_q * d, generator=g) for _ in range(layers)]
    keys = tuple(torch.randn(n, h_kv, d, generator=g) for _ in range(layers))
    values = tuple(torch.randn(n, h_kv, d, generator=g) for _ in range(layers))

    def project(layer, x, positions):
        return (x @ weights[layer]).view(-1, h_q, d)

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
        hidden_stats=tuple((0.1 * i, 1.0 + 0.2 * i, HIDDEN) for i in range(layers)),
        project_queries=project,
    )


def make(name: str) -> TokenScorer:
    if name in EVICTION_SCORERS:
        knobs = {"num_samples": 64, "samples_per_group": 8} if name == "mmshiftkv" else {}
        return make_eviction_scorer(name, **knobs)
    return make_refresh_scorer(name)


def expected_count(name: str, budget: float, inputs: ScoringInputs) -> int:
    if name == "full":
        return inputs.num_visual
    if name == "reuse":
        return 0
    if name == "first":
        return sum(budget_count(budget, e - s) for s, e in inputs.image_spans)
    return budget_count(budget, inputs.num_visual)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("budget", BUDGETS)
def test_selection_invariants(name, budget):
    inputs = make_inputs()
    scorer = make(name)
    chosen = scorer.select(inputs, budget)
    visual = set(inputs.visual_positions.tolist())

    assert chosen.numel() == expected_count(name, budget, inputs)
    assert set(chosen.tolist()) <= visual  # only image tokens are chosen
    assert chosen.unique().numel() == chosen.numel()  # no token twice
    assert torch.equal(chosen, chosen.sort().values)
    assert torch.equal(scorer.select(inputs, budget), chosen)  # deterministic


@pytest.mark.parametrize("name", ALL)
def test_scores_cover_every_visual_token(name):
    inputs = make_inputs(seed=3)
    scores = make(name).score(inputs)
    assert scores.shape == (inputs.num_visual,)
    assert bool(torch.isfinite(scores).all())


SHARED_SELECT = [n for n in ALL if type(make(n)).select is TokenScorer.select]


@pytest.mark.parametrize("name", SHARED_SELECT)
@pytest.mark.parametrize("budget", (0.05, 0.1, 0.2, 0.5))
def test_chosen_tokens_are_exactly_the_top_ranked(name, budget):
    inputs = make_inputs(seed=3)
    scorer = make(name)
    ranking = scorer.ranking(inputs, budget)
    chosen = torch.isin(inputs.visual_positions, scorer.select(inputs, budget))
    assert float(ranking[chosen].min()) >= float(ranking[~chosen].max())


def test_the_shared_selection_covers_the_attention_methods():
    # the controls with a rule of their own are the only ones outside the top-k check
    assert set(ALL) - set(SHARED_SELECT) == {"first", "full", "reuse"}


@pytest.mark.parametrize("name", ALL)
def test_every_scorer_says_what_it_ranks_by(name):
    # the summary is the scorer's line in the launcher's --help
    summary = type(make(name)).summary
    assert summary and "\n" not in summary and len(summary) < 100

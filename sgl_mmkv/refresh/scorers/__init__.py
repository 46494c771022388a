"""Refresh scorers: one class per method; ``SCORERS`` names are the ``--mm-reuse`` choices."""

from __future__ import annotations

from sgl_mmkv.refresh.scorers.base import RefreshScorer, ScoringInputs, budget_count, build_scorer
from sgl_mmkv.refresh.scorers.baselines import (
    CacheBlendScorer,
    FirstTokensScorer,
    FullRecomputeScorer,
    NoRefreshScorer,
    ProphetKVScorer,
    RandomScorer,
)
from sgl_mmkv.refresh.scorers.conduit import ConduitScorer

SCORERS: dict[str, type[RefreshScorer]] = {
    cls.name: cls
    for cls in (
        ConduitScorer,
        FullRecomputeScorer,
        NoRefreshScorer,
        FirstTokensScorer,
        CacheBlendScorer,
        ProphetKVScorer,
        RandomScorer,
    )
}


def make_scorer(name: str, **knobs) -> RefreshScorer:
    return build_scorer(SCORERS, "refresh", name, **knobs)


__all__ = ["SCORERS", "RefreshScorer", "ScoringInputs", "budget_count", "make_scorer"]

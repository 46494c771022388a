"""Token scorers, one small class per method, and the two registries whose names are
the CLI choices.

- :data:`REFRESH_SCORERS`: the scorer modes of ``--mm-reuse``; ``select`` is the set of
  reused image tokens to *recompute*.
- :data:`EVICTION_SCORERS`: the scored ``--mm-evict`` policies (``lru`` is the
  unscored one); ``select`` is the set of cached image tokens to *keep*.

Both kinds are :class:`TokenScorer` s: higher scores mean more important.
"""

from __future__ import annotations

from sgl_mmkv.scoring.aircache import AirCacheScorer
from sgl_mmkv.scoring.base import (
    AUTO_BUDGET,
    RefreshBudget,
    ScoringInputs,
    TokenScorer,
    budget_count,
    top_tokens,
)
from sgl_mmkv.scoring.cacheblend import CacheBlendScorer
from sgl_mmkv.scoring.conduit import ConduitScorer
from sgl_mmkv.scoring.controls import (
    FirstTokensScorer,
    FullRecomputeScorer,
    NoRefreshScorer,
    RandomKeepScorer,
    RandomScorer,
)
from sgl_mmkv.scoring.mmshiftkv import MMShiftKVScorer
from sgl_mmkv.scoring.oracle import OracleScorer
from sgl_mmkv.scoring.prophetkv import ProphetKVScorer
from sgl_mmkv.scoring.snapkv import SnapKVScorer
from sgl_mmkv.scoring.staleprobe import StaleProbeScorer

REFRESH_SCORERS: dict[str, type[TokenScorer]] = {
    cls.name: cls
    for cls in (
        ConduitScorer,
        FullRecomputeScorer,
        NoRefreshScorer,
        FirstTokensScorer,
        CacheBlendScorer,
        ProphetKVScorer,
        RandomScorer,
        OracleScorer,
        StaleProbeScorer,
    )
}
EVICTION_SCORERS: dict[str, type[TokenScorer]] = {
    cls.name: cls for cls in (AirCacheScorer, MMShiftKVScorer, SnapKVScorer, RandomKeepScorer)
}


def _build(registry: dict[str, type[TokenScorer]], kind: str, name: str, **knobs) -> TokenScorer:
    if name not in registry:
        raise ValueError(f"unknown {kind} scorer {name!r}; choose one of {', '.join(registry)}")
    return registry[name](**knobs)


def make_refresh_scorer(name: str, **knobs) -> TokenScorer:
    """``REFRESH_SCORERS[name](**knobs)``; an unknown name raises with the choices."""
    return _build(REFRESH_SCORERS, "refresh", name, **knobs)


def make_eviction_scorer(name: str, **knobs) -> TokenScorer:
    """``EVICTION_SCORERS[name](**knobs)``; an unknown name raises with the choices."""
    return _build(EVICTION_SCORERS, "eviction", name, **knobs)


__all__ = [
    "AUTO_BUDGET",
    "EVICTION_SCORERS",
    "REFRESH_SCORERS",
    "RefreshBudget",
    "ScoringInputs",
    "TokenScorer",
    "budget_count",
    "make_eviction_scorer",
    "make_refresh_scorer",
    "top_tokens",
]

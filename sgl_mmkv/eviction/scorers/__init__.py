"""Eviction scorers: one class per method; ``EVICTION_SCORERS`` names plus ``lru``
are the ``--mm-evict`` choices. They share the refresh scorers' interface
(:class:`~sgl_mmkv.refresh.scorers.RefreshScorer`): ``select(inputs, budget)`` is
the set of visual tokens *kept*."""

from __future__ import annotations

from sgl_mmkv.eviction.scorers.aircache import AirCacheScorer
from sgl_mmkv.eviction.scorers.mmshiftkv import MMShiftKVScorer
from sgl_mmkv.eviction.scorers.snapkv import SnapKVScorer
from sgl_mmkv.refresh.scorers.base import RefreshScorer, build_scorer

EVICTION_SCORERS: dict[str, type[RefreshScorer]] = {
    cls.name: cls for cls in (AirCacheScorer, MMShiftKVScorer, SnapKVScorer)
}


def make_eviction_scorer(name: str, **knobs) -> RefreshScorer:
    return build_scorer(EVICTION_SCORERS, "eviction", name, **knobs)


__all__ = ["EVICTION_SCORERS", "make_eviction_scorer"]

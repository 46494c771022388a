"""Which image segments of a request stock prefix matching reuses, and which it misses.

For every request the cache sees, each image item is classed once:

- ``prefix``:   inside the exact-prefix match, so stock SGLang reuses its KV;
- ``reusable``: outside the match but its content was seen in an earlier request,
  i.e. KV that position-independent segment reuse could serve;
- ``new``:      content not seen before.

Two images are the same when their segment keys are (:func:`~sgl_mmkv.segments.key.item_key`:
namespace, content identity, modality, grid and length), the definition the segment
store uses; never the 30-bit pad value. The index remembers the last ``capacity``
keys (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sgl_mmkv.counters import Counters
from sgl_mmkv.segments.key import SegmentKey, item_key, item_span, request_namespace


@dataclass(slots=True)
class SegmentCounters(Counters):
    """Server-wide counts since start (items and their visual tokens)."""

    requests: int = 0
    image_items: int = 0
    prefix_items: int = 0
    reusable_items: int = 0
    new_items: int = 0
    image_tokens: int = 0
    prefix_tokens: int = 0
    reusable_tokens: int = 0
    new_tokens: int = 0


def _items(req: Any) -> list[Any]:
    mm_inputs = getattr(req, "multimodal_inputs", None)
    return list(getattr(mm_inputs, "mm_items", None) or [])


class SegmentIndex:
    """Classifies the image items of each request against its prefix match."""

    def __init__(self, capacity: int = 4096, max_tracked_requests: int = 65536) -> None:
        self.capacity = capacity
        self.counters = SegmentCounters()
        self._seen: OrderedDict[SegmentKey, None] = OrderedDict()
        self._observed_rids: OrderedDict[str, None] = OrderedDict()
        self._max_rids = max_tracked_requests

    def observe(self, req: Any, matched_len: int) -> dict[str, int] | None:
        """Class the request's image items once (its first match); None if already seen
        or text-only. ``matched_len`` is the exact-prefix match length in tokens."""
        rid = getattr(req, "rid", None)
        items = _items(req)
        if rid is None or not items or rid in self._observed_rids:
            return None
        self._remember(self._observed_rids, rid, self._max_rids)
        counts = {"prefix": 0, "reusable": 0, "new": 0}
        namespace = request_namespace(req)
        c = self.counters
        c.requests += 1
        for item in items:
            offsets = item.offsets or []
            tokens = sum(end - start + 1 for start, end in offsets)
            last = max((end for _, end in offsets), default=-1)
            span = item_span(item)
            key = None if span is None else item_key(item, namespace, span[1] - span[0])
            if last < matched_len:
                kind = "prefix"
            elif key is not None and key in self._seen:
                kind = "reusable"
            else:
                kind = "new"
            counts[kind] += 1
            c.image_items += 1
            c.image_tokens += tokens
            setattr(c, f"{kind}_items", getattr(c, f"{kind}_items") + 1)
            setattr(c, f"{kind}_tokens", getattr(c, f"{kind}_tokens") + tokens)
            if key is not None:
                self._remember(self._seen, key, self.capacity)
        return counts

    def forget_contents(self) -> None:
        """Forget every content seen (the store was flushed); counters stay."""
        self._seen.clear()

    @staticmethod
    def _remember(table: OrderedDict, key: Any, capacity: int) -> None:
        table[key] = None
        table.move_to_end(key)
        while len(table) > capacity:
            table.popitem(last=False)

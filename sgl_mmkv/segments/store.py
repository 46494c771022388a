"""Position-independent image segments: per-layer KV of one image, in slots the store owns.

A segment is keyed by the image's full content key (SGLang's sha256-derived item
hash plus its token count, never the 30-bit pad value). Its KV slots come from
SGLang's token allocator and belong to the store alone: requests never point at
them, they get rotated *copies* (``sgl_mmkv.refresh.executor``). So a segment can
be evicted at any time, also while a request that copied it is still decoding.

The store's tokens count as evictable in SGLang's admission accounting (the radix
cache adds :attr:`SegmentStore.num_tokens` to ``evictable_size``) and are freed
by :meth:`SegmentStore.evict_lru` when the allocator runs short.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger(__name__)

SegmentKey = tuple[int, int]  # (item hash, number of image tokens)


@dataclass(slots=True)
class Segment:
    """One cached image.

    Attributes:
        key: content key.
        slots: ``(n,)`` int64 KV slots owned by the store.
        positions: ``(P, n)`` int64 rotary positions the KV was computed at
            (``P = 3`` for M-RoPE: t, h, w; ``P = 1`` for 1-D RoPE).
        alive: False once evicted; a plan holding it falls back to recompute.
    """

    key: SegmentKey
    slots: torch.Tensor
    positions: torch.Tensor
    alive: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.slots.numel())


@dataclass(slots=True)
class StoreCounters:
    """Server-wide segment counts since start."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    fills: int = 0
    fill_skipped: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    flushed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SegmentStore:
    """LRU map content key -> :class:`Segment`, backed by SGLang's KV pool.

    Args:
        allocator: SGLang's token-to-KV allocator (``alloc(n)``, ``free(idx)``,
            ``available_size()``).
        kv_pool: SGLang's KV pool (``get_key_buffer(l)``, ``get_value_buffer(l)``,
            ``layer_num``).
    """

    def __init__(self, allocator, kv_pool) -> None:
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.counters = StoreCounters()
        self._segments: OrderedDict[SegmentKey, Segment] = OrderedDict()
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """KV slots held by the store (all evictable)."""
        return self._num_tokens

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self._segments

    def lookup(self, key: SegmentKey) -> Segment | None:
        """The live segment for ``key`` (marked most recently used), or None."""
        self.counters.lookups += 1
        segment = self._segments.get(key)
        if segment is None:
            self.counters.misses += 1
            return None
        self._segments.move_to_end(key)
        self.counters.hits += 1
        return segment

    def fill(self, key: SegmentKey, src_slots: torch.Tensor, positions: torch.Tensor) -> bool:
        """Copy every layer's KV at ``src_slots`` into fresh store slots.

        Args:
            src_slots: ``(n,)`` int64 slots of a request row holding the image's KV.
            positions: ``(P, n)`` positions that KV was computed at.
        Returns:
            True if stored; False if already present or the pool had no free slots
            (filling never evicts: it runs inside a forward).
        """
        segment = self.reserve(key, int(src_slots.numel()), positions)
        if segment is None:
            return False
        slots = segment.slots
        src = src_slots.to(slots.device)
        for layer in range(self.kv_pool.layer_num):
            k = self.kv_pool.get_key_buffer(layer)
            v = self.kv_pool.get_value_buffer(layer)
            k[slots] = k[src]
            v[slots] = v[src]
        return True

    def reserve(self, key: SegmentKey, n: int, positions: torch.Tensor) -> Segment | None:
        """A new segment of ``n`` fresh slots whose KV the caller writes (canonical fill).

        Returns None if ``key`` is present or the pool has no ``n`` free slots.
        """
        if key in self._segments:
            return None
        if n == 0 or self.allocator.available_size() < n:
            self.counters.fill_skipped += 1
            return None
        slots = self.allocator.alloc(n)
        if slots is None:
            self.counters.fill_skipped += 1
            return None
        segment = Segment(key, slots, positions.to("cpu", torch.long).clone())
        self._segments[key] = segment
        self._num_tokens += n
        self.counters.fills += 1
        return segment

    def discard(self, key: SegmentKey) -> None:
        """Drop ``key`` and free its slots (a fill whose KV could not be written)."""
        segment = self._segments.pop(key, None)
        if segment is not None:
            self._release(segment, free_slots=True)
            self.counters.fills -= 1

    def evict_lru(self, num_tokens: int) -> int:
        """Free least recently used segments until ``num_tokens`` slots are freed
        (or the store is empty). Returns the number of slots freed."""
        freed = 0
        while freed < num_tokens and self._segments:
            _, segment = self._segments.popitem(last=False)
            freed += self._release(segment, free_slots=True)
            self.counters.evictions += 1
            self.counters.evicted_tokens += segment.num_tokens
        return freed

    def clear(self, free_slots: bool) -> None:
        """Drop every segment; ``free_slots=False`` when the allocator is being
        cleared anyway (SGLang's ``flush_cache`` resets the pool after the cache)."""
        while self._segments:
            _, segment = self._segments.popitem(last=False)
            self._release(segment, free_slots=free_slots)
            self.counters.flushed += 1

    def _release(self, segment: Segment, free_slots: bool) -> int:
        segment.alive = False
        if free_slots:
            self.allocator.free(segment.slots)
        self._num_tokens -= segment.num_tokens
        return segment.num_tokens

    def stats(self) -> dict:
        return {"segments": len(self), "tokens": self.num_tokens, **self.counters.as_dict()}

"""Position-independent image segments: per-layer KV of one image, in slots the store owns.

A segment is keyed by its request's namespace (salt, extra key, adapter) and the
image's full content identity (:mod:`sgl_mmkv.segments.key`). Its KV slots come from
SGLang's token allocator and belong to the store alone: requests never point at
them, they get rotated *copies* (``sgl_mmkv.refresh.executor``). So a segment can
be evicted at any time, also while a request that copied it is still decoding.

The store's tokens count as evictable in SGLang's admission accounting (the radix
cache adds :attr:`SegmentStore.num_tokens` to ``evictable_size``) and are freed
by :meth:`SegmentStore.evict_lru` when the allocator runs short. With an
eviction scorer (``--mm-evict``) segments are first *compressed*
(:meth:`SegmentStore.compress_lru`): each keeps its top ``--mm-kv-budget`` tokens
by the ranking computed when it was filled, and frees the rest.

With SGLang's paged allocator (``--page-size`` above 1: ``alloc(n)`` hands out
whole pages and ``free`` releases every page an index touches) a segment owns
whole pages: ``ceil(n / page) * page`` slots, its tokens in the first ``n``. The
store counts the slots it holds (what SGLang's ledger sees), frees whole pages
only, and a compressed segment moves its kept tokens' KV down into its first
pages and frees the pages behind them (keeping the top tokens that fill its last
kept page).

With an L3 tier (:mod:`sgl_mmkv.segments.storage`, ``--mm-segment-storage``) every
new segment is queued to be written through to SGLang's storage backend (the
forward never waits for a write), and a lookup that misses in memory loads the
segment from there into fresh store slots, waiting at most the storage deadline.

A segment may also hold its image's vision-encoder output (host memory, at most
``embeddings_max_bytes`` over the store, least recently used dropped first), written
through and loaded with its KV: a request that reuses it builds its input embeddings
without the vision tower (``refresh/segment_embeddings.py``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sgl_mmkv.counters import Counters
from sgl_mmkv.kernels.kv_dtype import put_rows
from sgl_mmkv.scoring.base import budget_count, top_tokens
from sgl_mmkv.segments.key import SegmentKey
from sgl_mmkv.segments.poison import poison_slots
from sgl_mmkv.segments.storage import KVFingerprint, SegmentStorage, StoredSegment

logger = logging.getLogger(__name__)

EMBEDDINGS_MAX_BYTES = 2**30


@dataclass(slots=True)
class Segment:
    """One cached image.

    Attributes:
        key: namespace and content key.
        slots: ``(m,)`` int64 KV slots owned by the store, one per kept token.
        positions: ``(P, n)`` int64 rotary positions the KV was computed at
            (``P = 3`` for M-RoPE: t, h, w; ``P = 1`` for 1-D RoPE), every token.
        alive: False once evicted; a plan holding it falls back to recompute.
        ranking: optional ``(n,)`` float32 eviction-scorer ranking (higher: keep).
        kept: ``(m,)`` int64 sorted indices of the image tokens whose KV is held;
            ``None`` while the segment is whole (``m = n``).
        pinned: True while its KV is still being written (canonical fill): never
            evicted or compressed then.
        persisted: True once its KV is queued for the L3 storage, or loaded from it.
        stored_embeddings: True once its L3 entry holds its embeddings too (written or
            loaded with them): embeddings dropped by the host cap and computed again do
            not write the entry again.
        embeddings: ``(n_e, W)`` the vision encoder's output for the image, on the CPU
            (the rows of its placeholder tokens; DeepStack features included), or None.
        pages: with a paged allocator, ``(k * page,)`` int64 slots of the whole pages
            the segment owns (``slots`` is their first ``m``); None at page size 1,
            where the segment owns ``slots`` alone.
    """

    key: SegmentKey
    slots: torch.Tensor
    positions: torch.Tensor
    alive: bool = True
    ranking: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    pinned: bool = False
    persisted: bool = False
    embeddings: torch.Tensor | None = None
    stored_embeddings: bool = False
    pages: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Slots held (whole pages with a paged allocator)."""
        return int(self.owned_slots.numel())

    @property
    def owned_slots(self) -> torch.Tensor:
        """Every slot the segment owns: its pages, or at page size 1 its ``slots``."""
        return self.slots if self.pages is None else self.pages

    @property
    def image_tokens(self) -> int:
        return int(self.positions.shape[1])

    @property
    def compressed(self) -> bool:
        return self.kept is not None

    def kept_indices(self) -> torch.Tensor:
        """``(m,)`` int64 indices of the image tokens whose KV the segment holds."""
        return torch.arange(self.image_tokens) if self.kept is None else self.kept


@dataclass(slots=True)
class StoreCounters(Counters):
    """Server-wide segment counts since start."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    fills: int = 0
    ranked_fills: int = 0
    fill_skipped: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    compressions: int = 0
    compressed_tokens: int = 0
    flushed: int = 0
    loaded: int = 0  # segments loaded from the L3 storage (also counted in misses)
    # canonical fill: images that could not be computed alone in their extend (the
    # token before them, or part of them, in the prefix or an earlier chunk): not stored
    canonical_skipped: int = 0
    embeddings_loaded: int = 0  # segments loaded from L3 with their image embeddings
    embeddings_dropped: int = 0  # embeddings let go to keep embeddings_max_bytes
    # attached to a segment that had none (its entry written again, unless compressed since)
    embeddings_gained: int = 0
    # images of extend forwards whose embeddings came from a segment (vision tower
    # skipped), and images the vision tower encoded (refresh/segment_embeddings.py)
    vision_skipped: int = 0
    vision_encoded: int = 0
    weight_updates: int = 0  # every segment dropped: the weights changed


def valid_kept(kept: torch.Tensor, m: int, n: int) -> bool:
    """Whether ``kept`` is ``m`` strictly increasing int64 indices in ``[0, n)`` (a
    stored compressed segment's, read from shared storage)."""
    if kept.dtype != torch.int64 or kept.dim() != 1 or kept.numel() != m:
        return False
    if m == 0:
        return True
    return bool(kept[0] >= 0) and bool(kept[-1] < n) and bool((kept[1:] > kept[:-1]).all())


class SegmentStore:
    """LRU map content key -> :class:`Segment`, backed by SGLang's KV pool.

    Args:
        allocator: SGLang's token-to-KV allocator (``alloc(n)``, ``free(idx)``,
            ``available_size()``, ``page_size``: 1 when it has none).
        kv_pool: SGLang's KV pool (``get_key_buffer(l)``, ``get_value_buffer(l)``,
            ``layer_num``).
        compress_budget: ``--mm-kv-budget`` when segments are ranked for scored
            eviction; None for whole-segment LRU.
        storage: the L3 tier below the store, or None (``--mm-segment-storage none``).
        embeddings_max_bytes: host bytes of image embeddings the segments hold at most.
    """

    def __init__(
        self,
        allocator,
        kv_pool,
        compress_budget: float | None = None,
        storage: SegmentStorage | None = None,
        embeddings_max_bytes: int = EMBEDDINGS_MAX_BYTES,
    ) -> None:
        self.allocator = allocator
        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        self.kv_pool = kv_pool
        self.compress_budget = compress_budget
        self.storage = storage
        self.embeddings_max_bytes = embeddings_max_bytes
        self.counters = StoreCounters()
        self._segments: OrderedDict[SegmentKey, Segment] = OrderedDict()
        self._num_tokens = 0
        self._embedded: OrderedDict[SegmentKey, int] = OrderedDict()  # key -> bytes, LRU
        self._embedding_bytes = 0

    @property
    def num_tokens(self) -> int:
        """KV slots held by the store (all evictable)."""
        return self._num_tokens

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self._segments

    def lookup(self, key: SegmentKey) -> Segment | None:
        """The live segment for ``key`` (marked most recently used), or None. A miss
        in memory is looked up in the L3 storage, if any, and loaded from there."""
        self.counters.lookups += 1
        segment = self._segments.get(key)
        if segment is None:
            self.counters.misses += 1
            return self._load(key) if self.storage is not None else None
        self._touch(key)
        self.counters.hits += 1
        return segment

    def lookup_many(self, keys: list[SegmentKey]) -> list[Segment | None]:
        """:meth:`lookup` of each of ``keys`` (one request's images), the keys missed in
        memory looked up in the L3 storage together: one deadline for all, and with
        Mooncake one round trip for their headers
        (:meth:`~sgl_mmkv.segments.storage.SegmentStorage.fetch_many`)."""
        missed = [key for key in dict.fromkeys(keys) if key not in self._segments]
        fetched: dict[SegmentKey, StoredSegment | None] = {}
        if self.storage is not None and missed:
            fetched = dict(zip(missed, self.storage.fetch_many(missed), strict=True))
        out = []
        for key in keys:  # counted as lookup() counts them
            self.counters.lookups += 1
            if key in fetched:
                self.counters.misses += 1
                out.append(self._install(key, fetched.pop(key)))
                continue
            segment = self._segments.get(key)
            if segment is None:
                self.counters.misses += 1
            else:
                self._touch(key)
                self.counters.hits += 1
            out.append(segment)
        return out

    def _touch(self, key: SegmentKey) -> None:
        self._segments.move_to_end(key)
        if key in self._embedded:
            self._embedded.move_to_end(key)

    def peek(self, key: SegmentKey) -> Segment | None:
        """The segment for ``key`` without counting a lookup or touching the LRU order."""
        return self._segments.get(key)

    def fill(
        self,
        key: SegmentKey,
        src_slots: torch.Tensor,
        positions: torch.Tensor,
        ranking: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> Segment | None:
        """Copy every layer's KV at ``src_slots`` into fresh store slots.

        Args:
            src_slots: ``(n,)`` int64 slots of a request row holding the image's KV.
            positions: ``(P, n)`` positions that KV was computed at.
            ranking: optional ``(n,)`` eviction ranking of the tokens.
            embeddings: optional ``(n_e, W)`` vision-encoder output of the image.
        Returns:
            The new segment; None if already present or the pool had no free slots
            (filling never evicts: it runs inside a forward).
        """
        segment = self.reserve(key, int(src_slots.numel()), positions, ranking)
        if segment is None:
            return None
        if embeddings is not None:
            self.attach_embeddings(segment, embeddings)
        slots = segment.slots
        src = src_slots.to(slots.device)
        for layer in range(self.kv_pool.layer_num):
            k = self.kv_pool.get_key_buffer(layer)
            v = self.kv_pool.get_value_buffer(layer)
            put_rows(k, slots, k[src])
            put_rows(v, slots, v[src])
        self.write_through(segment)
        return segment

    def write_through(self, segment: Segment) -> None:
        """Queue ``segment`` (its KV complete) for the L3 storage; a no-op without one,
        or once persisted. Its KV is copied to the CPU here (on the forward's stream);
        the write itself runs on the storage's writer thread. A failed or dropped
        write is counted by the storage, never raised."""
        if self.storage is None or segment.persisted or not segment.alive:
            return
        layers = range(self.kv_pool.layer_num)
        try:
            keys = torch.stack([self.kv_pool.get_key_buffer(i)[segment.slots] for i in layers])
            values = torch.stack([self.kv_pool.get_value_buffer(i)[segment.slots] for i in layers])
            stored = StoredSegment(
                segment.positions.clone(),
                None if segment.kept is None else segment.kept.clone(),
                None if segment.ranking is None else segment.ranking.clone(),
                keys.to("cpu"),
                values.to("cpu"),
                segment.embeddings,  # immutable once attached: shared, not copied
            )
        except Exception as error:  # never fail the forward over the L3 copy
            logger.warning("sgl_mmkv: reading a segment for L3 failed (%r)", error)
            self.storage.count({"write_failed": 1})
            return
        segment.persisted = self.storage.put(segment.key, stored)
        segment.stored_embeddings = segment.persisted and stored.embeddings is not None

    def _load(self, key: SegmentKey) -> Segment | None:
        """``key``'s segment from the L3 storage, in fresh store slots, or None."""
        return self._install(key, self.storage.fetch(key))

    def _install(self, key: SegmentKey, stored: StoredSegment | None) -> Segment | None:
        """``stored`` (read from the L3 storage for ``key``) in fresh store slots, or
        None (nothing read, shapes that do not fit, no free slots; counted)."""
        if stored is None:
            return None
        k0 = self.kv_pool.get_key_buffer(0)
        v0 = self.kv_pool.get_value_buffer(0)
        m = int(stored.keys.shape[1])
        expected_k = (self.kv_pool.layer_num, m, *k0.shape[1:])
        expected_v = (self.kv_pool.layer_num, m, *v0.shape[1:])
        n = int(stored.positions.shape[-1])
        kept_ok = m == n if stored.kept is None else valid_kept(stored.kept, m, n)
        if (
            tuple(stored.keys.shape) != expected_k
            or tuple(stored.values.shape) != expected_v
            or stored.keys.dtype != k0.dtype
            or not kept_ok
            or n != key.num_tokens
        ):
            self.storage.count({"mismatched": 1})
            return None
        segment = self.reserve(key, m, stored.positions, stored.ranking)
        if segment is None:
            self.storage.count({"load_skipped": 1})
            return None
        self.counters.fills -= 1  # loaded, not filled
        self.counters.ranked_fills -= stored.ranking is not None
        self.counters.loaded += 1
        slots = segment.slots
        for layer in range(self.kv_pool.layer_num):
            k, v = self.kv_pool.get_key_buffer(layer), self.kv_pool.get_value_buffer(layer)
            put_rows(k, slots, stored.keys[layer].to(k0.device))
            put_rows(v, slots, stored.values[layer].to(v0.device))
        segment.kept = None if stored.kept is None else stored.kept.clone()
        segment.persisted = True
        segment.stored_embeddings = stored.embeddings is not None
        if stored.embeddings is not None and self.attach_embeddings(segment, stored.embeddings):
            self.counters.embeddings_loaded += 1
        return segment

    def gain_embeddings(self, segment: Segment, embeddings: torch.Tensor) -> None:
        """Attach ``embeddings`` ``(n_e, W)`` the vision tower computed for a segment that
        had none (loaded from an entry written without them, or filled without them),
        and write its entry again with them, so other instances skip the vision tower
        too. A segment compressed since it was stored is not written again (its entry
        keeps more tokens)."""
        if not self.attach_embeddings(segment, embeddings):
            return
        self.counters.embeddings_gained += 1
        stale = segment.persisted and not segment.stored_embeddings
        if self.storage is not None and stale and segment.kept is None:
            segment.persisted = False
            self.write_through(segment)

    def attach_embeddings(self, segment: Segment, embeddings: torch.Tensor) -> bool:
        """Keep ``embeddings`` ``(n_e, W)`` (a copy on the CPU) with ``segment``, unless it
        has some or they alone exceed ``embeddings_max_bytes``; the least recently used
        segments' embeddings are let go to stay under it. True if attached."""
        size = int(embeddings.numel() * embeddings.element_size())
        if segment.embeddings is not None or not segment.alive or embeddings.dim() != 2:
            return False
        if size > self.embeddings_max_bytes:
            return False
        while self._embedded and self._embedding_bytes + size > self.embeddings_max_bytes:
            oldest = next(iter(self._embedded))
            self._drop_embeddings(self._segments[oldest])
            self.counters.embeddings_dropped += 1
        segment.embeddings = embeddings.detach().to("cpu", copy=True).contiguous()
        self._embedded[segment.key] = size
        self._embedding_bytes += size
        return True

    def _drop_embeddings(self, segment: Segment) -> None:
        self._embedding_bytes -= self._embedded.pop(segment.key, 0)
        segment.embeddings = None

    @property
    def embedding_bytes(self) -> int:
        """Host bytes of the embeddings the segments hold."""
        return self._embedding_bytes

    def reserve(
        self,
        key: SegmentKey,
        n: int,
        positions: torch.Tensor,
        ranking: torch.Tensor | None = None,
    ) -> Segment | None:
        """A new segment of ``n`` fresh slots whose KV the caller writes (canonical fill).
        With a paged allocator it owns ``ceil(n / page)`` whole pages, ``n`` slots used.

        Returns None if ``key`` is present or the pool has no ``n`` free slots.
        """
        if key in self._segments:
            return None
        size = self.paged_size(n)
        if size > 0:
            self._make_room(size)
        if size == 0 or self.allocator.available_size() < size:
            self.counters.fill_skipped += 1
            return None
        slots = self.allocator.alloc(size)
        if slots is None or int(slots.numel()) != size:
            if slots is not None and slots.numel():
                self.allocator.free(slots)
            self.counters.fill_skipped += 1
            return None
        if ranking is not None:
            ranking = ranking.to("cpu", torch.float32).clone()
            self.counters.ranked_fills += 1
        segment = Segment(key, slots, positions.to("cpu", torch.long).clone(), ranking=ranking)
        if self.page_size > 1:
            segment.pages, segment.slots = slots, slots[:n]
        self._segments[key] = segment
        self._num_tokens += size
        self.counters.fills += 1
        return segment

    def paged_size(self, n: int) -> int:
        """Slots a segment of ``n`` tokens holds: ``n`` rounded up to whole pages."""
        return -(-n // self.page_size) * self.page_size

    def _make_room(self, n: int) -> None:
        """Free store slots for a new segment of ``n`` tokens: compress (scored
        eviction), then drop least recently used segments. Only the store's own
        slots are touched, never the radix tree's or a running request's."""
        short = n - self.allocator.available_size()
        if short > 0:
            short -= self.compress_for(short)
        if short > 0 and self._num_tokens >= short:
            self.evict_lru(short)

    def discard(self, key: SegmentKey) -> None:
        """Drop ``key`` and free its slots (a fill whose KV could not be written)."""
        segment = self._segments.pop(key, None)
        if segment is not None:
            self._release(segment, free_slots=True)
            self.counters.fills -= 1
            self.counters.ranked_fills -= segment.ranking is not None

    def evict_lru(self, num_tokens: int) -> int:
        """Free least recently used segments until ``num_tokens`` slots are freed
        (or the store is empty). Returns the number of slots freed."""
        freed = 0
        for key, segment in list(self._segments.items()):
            if freed >= num_tokens:
                break
            if segment.pinned:
                continue
            del self._segments[key]
            freed += self._release(segment, free_slots=True)
            self.counters.evictions += 1
            self.counters.evicted_tokens += segment.num_tokens
        return freed

    def compress(self, segment: Segment, budget: float) -> int:
        """Keep the top ``ceil(budget * n)`` tokens of ``segment`` by its ranking and
        free the other slots. Returns the slots freed (0 for a segment already
        compressed or without a ranking). With a paged allocator see
        :meth:`_compress_pages`."""
        if segment.compressed or segment.ranking is None or not segment.alive or segment.pinned:
            return 0
        if self.page_size > 1:
            return self._compress_pages(segment, budget)
        n = segment.image_tokens
        keep = top_tokens(segment.ranking, budget)
        if keep.numel() >= n:
            return 0
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[keep] = False
        freed_slots = segment.slots[dropped.to(segment.slots.device)]
        poison_slots(self.kv_pool, freed_slots)
        self.allocator.free(freed_slots)
        segment.slots = segment.slots[keep.to(segment.slots.device)]
        segment.kept = keep
        freed = int(dropped.sum())
        self._num_tokens -= freed
        self.counters.compressions += 1
        self.counters.compressed_tokens += freed
        return freed

    def _compress_pages(self, segment: Segment, budget: float) -> int:
        """Paged :meth:`compress`: the top ``ceil(budget * n)`` tokens need ``k`` pages;
        the segment keeps its top ``min(n, k * page)`` tokens (the last kept page is
        filled), their KV moved down into its first ``k`` pages in token order, and
        frees its other pages whole. Nothing changes when no page would be freed."""
        n, pages = segment.image_tokens, segment.pages
        count = self.paged_size(budget_count(budget, n))
        if count >= int(pages.numel()):  # then also count < n: a page is freed
            return 0
        keep = torch.topk(segment.ranking, count, sorted=False).indices.sort().values
        src = segment.slots[keep.to(segment.slots.device)]
        dst = pages[: keep.numel()]
        pool = self.kv_pool
        for layer in range(pool.layer_num):
            for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
                put_rows(buffer, dst, buffer[src])  # gathered first: src and dst may overlap
        freed_slots = pages[count:]
        poison_slots(self.kv_pool, freed_slots)
        self.allocator.free(freed_slots)
        segment.pages, segment.slots, segment.kept = pages[:count], dst, keep
        freed = int(freed_slots.numel())
        self._num_tokens -= freed
        self.counters.compressions += 1
        self.counters.compressed_tokens += n - int(keep.numel())
        return freed

    def compress_lru(self, num_tokens: int, budget: float) -> int:
        """Compress least recently used segments until ``num_tokens`` slots are freed
        or none is left to compress. Returns the slots freed."""
        freed = 0
        for segment in list(self._segments.values()):
            if freed >= num_tokens:
                break
            freed += self.compress(segment, budget)
        return freed

    def compress_for(self, num_tokens: int) -> int:
        """Free up to ``num_tokens`` slots by compressing least recently used segments
        to the store's ``compress_budget``; 0 without scored eviction. Returns the
        slots freed."""
        if self.compress_budget is None or num_tokens <= 0:
            return 0
        return self.compress_lru(num_tokens, self.compress_budget)

    def forget_weights(self, fingerprint: KVFingerprint | None) -> None:
        """The model's weights changed: every segment and its embeddings go (their KV
        and encoder output are the old weights'), and the L3 storage serves
        ``fingerprint`` (the new identity's) from now on, dropping queued writes."""
        self.clear(free_slots=True)
        self.counters.weight_updates += 1
        if self.storage is not None and fingerprint is not None:
            self.storage.rebind(fingerprint)

    def clear(self, free_slots: bool) -> None:
        """Drop every segment; ``free_slots=False`` when the allocator is being
        cleared anyway (SGLang's ``flush_cache`` resets the pool after the cache)."""
        while self._segments:
            _, segment = self._segments.popitem(last=False)
            self._release(segment, free_slots=free_slots)
            self.counters.flushed += 1

    def _release(self, segment: Segment, free_slots: bool) -> int:
        segment.alive = False
        if segment.embeddings is not None:
            self._drop_embeddings(segment)
        if free_slots:
            poison_slots(self.kv_pool, segment.owned_slots)
            self.allocator.free(segment.owned_slots)
        self._num_tokens -= segment.num_tokens
        return segment.num_tokens

    def stats(self) -> dict:
        return {
            "segments": len(self),
            "tokens": self.num_tokens,
            "embedding_bytes": self.embedding_bytes,
            **self.counters.as_dict(),
        }

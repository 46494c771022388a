"""Reuse plans: which image spans of an extend batch are served from the segment store.

For request ``i`` of an extend batch the uncached part of its row is
``[prefix_i, prefix_i + extend_i)``. An image item whose content key is in the store
becomes a :class:`ReuseSpan` over its tokens inside that range (the whole image,
or its part in this chunk when chunked prefill cut it), provided its new positions
are the stored ones shifted by one constant ``delta`` (true for an image moved as a
whole, for 1-D RoPE and M-RoPE alike). Everything else in the
extend is computed as stock would. Items computed fresh by the end of this
extend and not yet stored are :class:`FillCandidate` s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sgl_mmkv.segments.key import UNTAGGED, SegmentKey, item_key, item_span, read_namespace
from sgl_mmkv.segments.store import Segment, SegmentStore


@dataclass(frozen=True, slots=True)
class ReuseSpan:
    """Row positions ``[start, end)`` filled from ``segment``, shifted by ``delta``.

    The image itself begins at row position ``image_start`` (``-1``: at ``start``).
    A span is the whole image, or the part of it inside this extend when chunked
    prefill cut the image at a chunk boundary. A compressed segment fills only its
    kept tokens (:meth:`reused_positions`); the others are computed fresh like text,
    or, when the request's plan allows holes, left out of the extend altogether.
    """

    start: int
    end: int
    segment: Segment
    delta: int
    image_start: int = -1

    def _kept_in_window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kept image-token indices in the window, their mask over kept tokens)``."""
        first = self.start if self.image_start < 0 else self.image_start
        kept = self.segment.kept_indices()
        inside = (kept >= self.start - first) & (kept < self.end - first)
        return kept[inside] + first, inside

    def reused_positions(self) -> torch.Tensor:
        """``(m,)`` int64 row positions served from the segment."""
        return self._kept_in_window()[0]

    def source_slots(self) -> torch.Tensor:
        """``(m,)`` int64 store slots of :meth:`reused_positions`, in the same order, on
        the slots' device (the host index moved there: no boolean mask on the device)."""
        index = self._kept_in_window()[1].nonzero().flatten()
        return self.segment.slots[index.to(self.segment.slots.device)]

    @property
    def num_reused(self) -> int:
        return int(self._kept_in_window()[1].sum())


@dataclass(frozen=True, slots=True)
class FillCandidate:
    """An image computed in full in this row: ``[start, end)`` at ``positions`` ``(P, n)``."""

    key: SegmentKey
    start: int
    end: int
    positions: torch.Tensor


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the refresh executor does for request ``index`` of the batch.

    Frozen: planning (``planning.py``) finishes a plan by making a new one
    (``dataclasses.replace``). A plan is host metadata: its masks are host tensors
    built from host facts, moved to the KV pool's device by whoever meets device
    tensors with them."""

    index: int
    prefix_len: int
    seq_len: int
    spans: tuple[ReuseSpan, ...] = ()
    fills: tuple[FillCandidate, ...] = ()
    visual: torch.Tensor | None = None  # (extend_len,) bool: image tokens of the extend
    images: tuple[tuple[int, int], ...] = ()  # images wholly in the extend
    # a compressed segment's dropped tokens are holes: neither computed nor attended
    holes: bool = False

    @property
    def extend_len(self) -> int:
        """Tokens this extend computes or serves: row positions ``[prefix_len, seq_len)``."""
        return self.seq_len - self.prefix_len

    def rows(self, mask: torch.Tensor) -> torch.Tensor:
        """``(n,)`` int64 row positions of the extend tokens where ``mask``
        ``(extend_len,)`` is True, on the mask's device."""
        return mask.nonzero().flatten() + self.prefix_len

    def text_mask(self) -> torch.Tensor:
        """``(extend_len,)`` bool: True for the extend's non-image tokens."""
        if self.visual is None:
            return torch.ones(self.extend_len, dtype=torch.bool)
        return ~self.visual

    @property
    def reused_tokens(self) -> int:
        return sum(s.num_reused for s in self.spans)

    def dropped_mask(self) -> torch.Tensor:
        """``(extend_len,)`` bool: tokens of reused images whose segment was compressed
        without them (computed fresh, like text)."""
        mask = torch.zeros(self.extend_len, dtype=torch.bool)
        for s in self.spans:
            mask[s.start - self.prefix_len : s.end - self.prefix_len] = True
        return mask & ~self.reused_mask()

    def hole_mask(self) -> torch.Tensor:
        """``(extend_len,)`` bool: the dropped tokens when this plan has holes, else none."""
        if not self.holes:
            return torch.zeros(self.extend_len, dtype=torch.bool)
        return self.dropped_mask()

    def fresh_mask(self) -> torch.Tensor:
        """``(extend_len,)`` bool: the tokens computed (neither reused nor holes)."""
        return ~self.reused_mask() & ~self.hole_mask()

    def reused_mask(self) -> torch.Tensor:
        """``(extend_len,)`` bool: True where the extend token comes from a segment."""
        mask = torch.zeros(self.extend_len, dtype=torch.bool)
        for s in self.spans:
            mask[s.reused_positions() - self.prefix_len] = True
        return mask


def row_positions(mm_inputs, start: int, end: int) -> torch.Tensor:
    """``(P, end - start)`` rotary positions of row positions ``[start, end)``."""
    mrope = getattr(mm_inputs, "mrope_positions", None)
    if mrope is not None:
        return mrope[:, start:end].to("cpu", torch.long)
    return torch.arange(start, end, dtype=torch.long)[None]


def constant_delta(new: torch.Tensor, old: torch.Tensor) -> int | None:
    """The one shift ``new - old`` if it is the same for every entry, else None."""
    if new.shape != old.shape:
        return None
    diff = new - old
    first = int(diff.flatten()[0])
    return first if bool((diff == first).all()) else None


def _request_items(mm_inputs, prefix_len: int, extend_len: int):
    """``(visual, images, items)`` of one request: its visual extend mask, the images
    whole in its extend, and ``(key, start, end, lo, hi)`` per image it may reuse or
    fill (none if its inputs were never tagged)."""
    seq_len = prefix_len + extend_len
    visual = torch.zeros(extend_len, dtype=torch.bool)
    images, items = [], []
    namespace = read_namespace(mm_inputs)
    for item in getattr(mm_inputs, "mm_items", None) or []:
        span = item_span(item)
        if span is None or span[0] >= seq_len:
            continue  # no content hash, or in a later chunk
        start, end = span
        lo, hi = max(start, prefix_len), min(end, seq_len)
        if lo < hi:
            visual[lo - prefix_len : hi - prefix_len] = True
        if (lo, hi) == (start, end):
            images.append((start, end))
        if namespace is not UNTAGGED:
            items.append((item_key(item, namespace, end - start), start, end, lo, hi))
    return visual, images, items


def plan_request(
    store: SegmentStore,
    index: int,
    mm_inputs,
    prefix_len: int,
    extend_len: int,
    found: dict | None = None,
    request_items: tuple | None = None,
) -> RequestPlan:
    """The reuse plan of one request of an extend batch: its images are looked up and
    filled in the request's own namespace only (none if its inputs were never tagged).
    ``found``: the segments of its keys already looked up (:func:`plan_batch` looks up
    a whole batch at once); without it, the images in its extend are looked up
    together (``SegmentStore.lookup_many``). ``request_items``: its
    :func:`_request_items`, when the caller already made them."""
    seq_len = prefix_len + extend_len
    if request_items is None:
        request_items = _request_items(mm_inputs, prefix_len, extend_len)
    visual, images, items = request_items
    if found is None:
        in_extend = [key for key, _, _, lo, hi in items if lo < hi]
        found = dict(zip(in_extend, store.lookup_many(in_extend), strict=True))
    spans, fills = [], []
    for key, start, end, lo, hi in items:
        positions = row_positions(mm_inputs, start, end)
        segment = found.get(key) if lo < hi else None  # the same image may be in the prefix
        if segment is not None and segment.alive:  # a chunk-cut image is reused part by part
            delta = constant_delta(positions, segment.positions)
            if delta is not None:
                whole = (lo, hi) == (start, end)
                spans.append(ReuseSpan(lo, hi, segment, delta, -1 if whole else start))
                continue
        if end <= seq_len and key not in store:
            fills.append(FillCandidate(key, start, end, positions))
    return RequestPlan(
        index, prefix_len, seq_len, tuple(spans), tuple(fills), visual, tuple(images)
    )


def plan_batch(store: SegmentStore, forward_batch) -> list[RequestPlan]:
    """One plan per request of an extend ``forward_batch`` (mm_inputs may be None).
    Only spans whose segment is still alive once every request is planned are kept."""
    mm_list = forward_batch.mm_inputs or [None] * forward_batch.batch_size
    prefix = forward_batch.extend_prefix_lens_cpu
    extend = forward_batch.extend_seq_lens_cpu
    # Every request's images in one lookup: one storage deadline for the forward.
    made = [_request_items(mm, int(prefix[i]), int(extend[i])) for i, mm in enumerate(mm_list)]
    keys = [key for _, _, items in made for key, _, _, lo, hi in items if lo < hi]
    found = dict(zip(keys, store.lookup_many(keys), strict=True)) if keys else {}
    plans = [
        plan_request(store, i, mm, int(prefix[i]), int(extend[i]), found, made[i])
        for i, mm in enumerate(mm_list)
    ]
    # A later request's lookup may load a segment from L3 storage and evict one an
    # earlier plan holds; those tokens are computed fresh instead.
    return [replace(p, spans=tuple(s for s in p.spans if s.segment.alive)) for p in plans]

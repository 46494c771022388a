"""Image embeddings that travel with segments: no vision tower for an image a segment holds.

SGLang builds an extend's input embeddings in ``prepare_mm_inputs``: each image that
overlaps the extend is looked up in its ViT cache (``MultiModalStaticCache``, by item
hash) and the rest go through the model's encoder (``get_image_feature``), one call
for all of them. :class:`SegmentEncoders` wraps that encoder for one such build:

- an image whose segment (in its request's namespace, :func:`item_key`) holds its
  encoder output gets that output, bit for bit what the encoder returned when the
  segment was filled, here or in the instance that wrote it to L3; the vision tower
  runs only for the other images (``store.vision_skipped`` / ``vision_encoded``);
- the output of every image encoded (or found in SGLang's ViT cache, which only this
  server fills) is captured for the segment its request fills (``refresh/fill.py``).

Tensor parallelism: the vision tower is sharded over the TP group (its own
all-reduces), so every rank must encode the same images. At ``--tp-size`` > 1 an
image's stored embeddings are used only where every rank's store holds them (one
MIN all-reduce of a flag per image of the batch, :meth:`RankAgreement.all_of`);
elsewhere every rank encodes it.

Isolation: a segment's embeddings are used only where every request of the batch that
shows the image is in the segment's namespace, and the ViT cache entries SGLang makes
of them in the build are removed after it, so embeddings read from storage never reach
another namespace. An encoder result that cannot be split per image (EVS video
pruning) is left to SGLang: the build then encodes every image as stock does.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sgl_mmkv.refresh.rank_agreement import RankAgreement
from sgl_mmkv.segments.key import UNTAGGED, SegmentKey, item_key, item_span, read_namespace
from sgl_mmkv.segments.store import SegmentStore

logger = logging.getLogger(__name__)


def item_rows(item: Any) -> int:
    """Encoder output rows of a ``MultimodalDataItem``: its placeholder tokens."""
    return sum(int(end) - int(start) + 1 for start, end in item.offsets or [])


def _per_item(out: Any, items: list) -> list[torch.Tensor] | None:
    """``out`` of an encoder call over ``items`` as one ``(rows, W)`` tensor per item, or
    None if it cannot be split so (not tensors, rows that do not add up)."""
    rows = [item_rows(item) for item in items]
    if isinstance(out, list) and len(out) == len(items):
        if not all(isinstance(t, torch.Tensor) for t in out):
            return None
        per = [t.reshape(-1, t.shape[-1]) for t in out]
    elif isinstance(out, torch.Tensor):
        flat = out.reshape(-1, out.shape[-1])
        if flat.shape[0] != sum(rows):
            return None
        per = list(torch.split(flat, rows))
    else:
        return None
    return per if [int(t.shape[0]) for t in per] == rows else None


class _Encoder:
    """One modality's encoder as SGLang calls it (``items -> embeddings``), with the
    bound method's ``__self__`` and ``__name__`` (SGLang reads them to defer moving
    pixel features to the device for some models)."""

    def __init__(self, base: Callable, owner: SegmentEncoders) -> None:
        self.base = base
        self.owner = owner
        self.__self__ = getattr(base, "__self__", None)
        self.__name__ = getattr(base, "__name__", "encoder")

    def __call__(self, items: list):
        return self.owner.encode(self.base, items)


class SegmentEncoders:
    """One embedding build of an extend batch.

    Args:
        store: the segment store (read with ``peek``: no lookup counted).
        supply: item hash -> ``(rows, W)`` CPU embeddings of a segment usable here.
        images: ``(key, item hash, rows)`` of every image overlapping the extend in a
            tagged namespace (what :meth:`captured` answers for).
        device: where embeddings given to SGLang go (the batch's).
    """

    def __init__(
        self,
        store: SegmentStore,
        supply: dict[int, torch.Tensor],
        images: list[tuple[SegmentKey, int, int]],
        device: torch.device,
    ) -> None:
        self.store = store
        self.supply = supply
        self.images = images
        self.device = device
        self.encoded: dict[int, torch.Tensor] = {}
        self.used: set[int] = set()
        cache = _vit_cache()
        self._cached_before = {h for h in supply if cache is not None and cache.has(h)}
        self._combined: list[tuple[int, set[int]]] = []  # (combined hash, its items')

    @classmethod
    def of_batch(cls, store: SegmentStore, batch: Any) -> SegmentEncoders | None:
        """The build of extend ``batch`` (SGLang's ``ForwardBatch``), or None when it
        embeds no image (decode, text only)."""
        mode = getattr(batch, "forward_mode", None)
        if mode is None or mode.is_decode() or mode.is_target_verify():
            return None
        if not batch.contains_mm_inputs():
            return None
        namespaces: dict[int, set] = defaultdict(set)
        found: dict[int, torch.Tensor] = {}
        images, combined = [], []
        prefix, extend = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
        for i, mm_inputs in enumerate(batch.mm_inputs or []):
            if mm_inputs is None:
                continue
            namespace = read_namespace(mm_inputs)
            lo, hi = int(prefix[i]), int(prefix[i]) + int(extend[i])
            by_modality: dict[Any, list[int]] = defaultdict(list)
            for item in mm_inputs.mm_items or []:
                if item is None:
                    continue
                by_modality[item.modality].append(item.hash)
                span = item_span(item)
                if span is None or span[1] <= lo or span[0] >= hi:
                    continue
                namespaces[item.hash].add(namespace)
                if namespace is UNTAGGED:
                    continue
                key = item_key(item, namespace, span[1] - span[0])
                images.append((key, item.hash, item_rows(item)))
                segment = store.peek(key)
                stored = None if segment is None else segment.embeddings
                if stored is not None and segment.alive and stored.shape[0] == item_rows(item):
                    found.setdefault(item.hash, stored)
            combined += list(by_modality.values())
        supply = {h: e for h, e in found.items() if len(namespaces[h]) == 1}
        build = cls(store, supply, images, batch.input_ids.device)
        build._note_combined(combined)
        return build

    def _note_combined(self, groups: list[list[int]]) -> None:
        """SGLang caches the images of a request laid out in several runs (Pixtral)
        under the combined hash of the request's items of one modality, in order:
        those entries that may come to hold supplied embeddings."""
        from sglang.srt.mem_cache.multimodal_cache import MultimodalCache

        cache = _vit_cache()
        for hashes in groups:
            if set(hashes) & set(self.supply):
                combined = MultimodalCache.combine_hashes(hashes)
                if cache is None or not cache.has(combined):
                    self._combined.append((combined, set(hashes)))

    def encoders(self, multimodal_model: Any, funcs: dict | None) -> dict:
        """SGLang's ``data_embedding_funcs`` for this build: each modality's encoder
        (``funcs``' or the model's ``get_<modality>_feature``) wrapped."""
        from sglang.srt.managers.schedule_batch import Modality

        wrapped = dict(funcs or {})
        for modality in Modality.all():
            base = wrapped.get(modality) or getattr(
                multimodal_model, f"get_{modality.name.lower()}_feature", None
            )
            if base is not None:
                wrapped[modality] = _Encoder(base, self)
        return wrapped

    def encode(self, base: Callable, items: list):
        """``base(items)``, with the supplied images' embeddings in place of encoding
        them: one ``(rows, W)`` tensor per item then, else ``base``'s own result. If
        that fails, every image is encoded as stock."""
        try:
            return self._encode(base, items)
        except Exception as error:
            logger.warning("sgl_mmkv: stored image embeddings not used (%r)", error)
            return self._stock(base, items)

    def _encode(self, base: Callable, items: list):
        supplied = [self.supply.get(item.hash) for item in items]
        todo = [item for item, s in zip(items, supplied, strict=True) if s is None]
        if len(todo) == len(items):
            return self._stock(base, items)
        computed: list[torch.Tensor] = []
        if todo:
            computed = _per_item(base(todo), todo)
            self.store.counters.vision_encoded += len(todo)
            if computed is None:  # cannot place them among the supplied ones
                return self._stock(base, items)
            self._keep(todo, computed)
        device = computed[0].device if computed else self.device
        fresh = iter(computed)
        out = []
        for item, stored in zip(items, supplied, strict=True):
            if stored is None:
                out.append(next(fresh))
            else:
                out.append(stored.to(device))
                self.used.add(item.hash)
        self.store.counters.vision_skipped += len(items) - len(todo)
        return out

    def _stock(self, base: Callable, items: list):
        out = base(items)
        self.store.counters.vision_encoded += len(items)
        per = _per_item(out, items)
        if per is not None:
            self._keep(items, per)
        return out

    def _keep(self, items: list, per: list[torch.Tensor]) -> None:
        for item, embeddings in zip(items, per, strict=True):
            self.encoded[item.hash] = embeddings

    def finish(self) -> dict[SegmentKey, torch.Tensor]:
        """After the build: the ViT cache entries SGLang made of supplied embeddings
        removed; returns the captured embeddings, segment key -> ``(rows, W)``."""
        from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

        cache = _vit_cache()
        if cache is not None:
            for h in self.used - self._cached_before:
                cache.free(h, None)
            for h, hashes in self._combined:
                if hashes & self.used:
                    cache.free(h, None)
        captured = {}
        for key, h, rows in self.images:
            if h in self.supply:
                continue
            embeddings = self.encoded.get(h)
            if embeddings is None and cache is not None and cache.has(h):
                entry = cache.get_single(h)
                if type(entry) is EmbeddingResult:
                    embeddings = entry.embedding.reshape(-1, entry.embedding.shape[-1])
            if embeddings is not None and int(embeddings.shape[0]) == rows:
                captured[key] = embeddings
        return captured


def _agree_supply(build: SegmentEncoders | None, batch: Any) -> None:
    """At TP > 1: keep in ``build.supply`` only the images every rank can supply, so
    every rank's vision tower encodes the same images. Every rank runs the one
    collective for a batch with images (``_batch_images``: the same on every rank),
    a rank whose build failed with no image to supply."""
    agreement = RankAgreement.shared()
    if not agreement.active:
        return
    hashes = _batch_images(batch)
    if not hashes:
        return
    supply = {} if build is None else build.supply
    usable = agreement.all_of([h in supply for h in hashes])
    if build is not None:
        build.supply = {h: supply[h] for h, ok in zip(hashes, usable, strict=True) if ok}


def _batch_images(batch: Any) -> list[int]:
    """The item hashes of every image overlapping ``batch``'s extend, in batch order,
    once each; none for a batch :meth:`SegmentEncoders.of_batch` builds nothing for."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or mode.is_decode() or mode.is_target_verify():
        return []
    if not batch.contains_mm_inputs():
        return []
    prefix, extend = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
    hashes: dict[int, None] = {}
    for i, mm_inputs in enumerate(batch.mm_inputs or []):
        if mm_inputs is None:
            continue
        lo, hi = int(prefix[i]), int(prefix[i]) + int(extend[i])
        for item in mm_inputs.mm_items or []:
            span = None if item is None else item_span(item)
            if span is not None and span[1] > lo and span[0] < hi:
                hashes[item.hash] = None
    return list(hashes)


def _vit_cache():
    """SGLang's ViT cache of this process (``MultiModalStaticCache``), or None."""
    from sglang.srt.managers import mm_schedule

    return mm_schedule.embedding_cache


@contextmanager
def segment_encoders(
    store: SegmentStore, slot: Any, batch: Any, multimodal_model: Any, funcs: dict | None
) -> Iterator[dict | None]:
    """The ``data_embedding_funcs`` to build ``batch``'s embeddings with: wrapped by a
    :class:`SegmentEncoders` when the batch embeds images (``funcs`` otherwise); what
    the build captured goes to ``slot.captured`` (the embedding slot) when it ends."""
    try:
        build = SegmentEncoders.of_batch(store, batch)
    except Exception as error:  # never the reason a forward fails: the stock encoders
        logger.warning("sgl_mmkv: image embeddings built as stock (%r)", error)
        build = None
    _agree_supply(build, batch)
    wrapped = None
    if build is not None:
        try:
            wrapped = build.encoders(multimodal_model, funcs)
        except Exception as error:
            logger.warning("sgl_mmkv: image embeddings built as stock (%r)", error)
            build = None
    if build is None:
        yield funcs
        return
    try:
        yield wrapped
    finally:
        try:
            slot.captured = build.finish()
        except Exception as error:
            logger.warning("sgl_mmkv: image embeddings not captured (%r)", error)
            slot.captured = {}

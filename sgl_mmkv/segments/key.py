"""What a segment is stored under: who may reuse it, and what image it holds.

A segment is reusable under any prefix, so its key must isolate at least what
SGLang's radix tree isolates. The namespace is SGLang's own
(``storage_namespace_seed(extra_key, cache_salt)``, the seed HiCache storage uses
too; the LoRA id is part of ``extra_key``, and is kept apart here as well). The
content part is the item's full identity (32 bytes when SGLang has it, else its
64-bit content hash), its modality and its grid, and the token count.

The namespace reaches the forward on the request's ``MultimodalInputs``, tagged by
the radix cache when it matches the request (:func:`tag_namespace`); a request
whose inputs carry no tag reuses and fills nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NAMESPACE_ATTR = "sgl_mmkv_namespace"
UNTAGGED = object()  # read_namespace's answer for inputs the radix cache never tagged


@dataclass(frozen=True, slots=True)
class Namespace:
    """Requests share segments only within one namespace; no salt, no extra key and
    no adapter is one shared namespace, as in stock SGLang."""

    seed: str | None  # storage_namespace_seed(extra_key, cache_salt)
    lora_id: str | None


@dataclass(frozen=True, slots=True)
class SegmentKey:
    namespace: Namespace
    content: bytes  # item.identity (32 bytes) or the item hash (8 bytes, big endian)
    modality: str
    grid: tuple[int, ...]
    num_tokens: int


def request_namespace(req: Any) -> Namespace:
    """The namespace of a scheduler ``Req``."""
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    extra_key, cache_salt = getattr(req, "extra_key", None), getattr(req, "cache_salt", None)
    return Namespace(storage_namespace_seed(extra_key, cache_salt), getattr(req, "lora_id", None))


def tag_namespace(req: Any) -> None:
    """Record the request's namespace on its multimodal inputs (no-op for text)."""
    mm_inputs = getattr(req, "multimodal_inputs", None)
    if mm_inputs is not None:
        setattr(mm_inputs, NAMESPACE_ATTR, request_namespace(req))


def read_namespace(mm_inputs: Any) -> Namespace | object:
    """The namespace :func:`tag_namespace` recorded, else :data:`UNTAGGED`."""
    return getattr(mm_inputs, NAMESPACE_ATTR, UNTAGGED)


def _grid(item: Any) -> tuple[int, ...]:
    for name in ("image_grid_thw", "video_grid_thw", "grid_thws"):
        try:
            value = getattr(item, name)
        except AttributeError:
            continue
        if value is not None:
            return tuple(int(v) for v in value.reshape(-1).tolist())
    return ()


def item_span(item: Any) -> tuple[int, int] | None:
    """``[start, end)`` from an item's first placeholder run to its last, else None.

    An item laid out in several runs (Pixtral / LLaVA: one run of ``[IMG]`` per
    patch row, ``[IMG_BREAK]`` between rows) is one span with its separators: the
    processor emits them inside that one image's expansion, fixed by the image
    itself, so they belong to its segment like its placeholder tokens.
    """
    offsets = sorted((int(s), int(e)) for s, e in item.offsets or [])
    if not offsets or item.hash is None:
        return None
    if any(s <= e for (_, e), (s, _) in zip(offsets, offsets[1:], strict=False)):
        return None  # overlapping runs: not one image's layout
    return offsets[0][0], offsets[-1][1] + 1


def item_key(item: Any, namespace: Namespace, num_tokens: int) -> SegmentKey:
    """The key of multimodal data item ``item`` (a ``MultimodalDataItem``) in
    ``namespace``, spanning ``num_tokens`` tokens."""
    identity = getattr(item, "identity", None)
    content = bytes(identity) if identity else int(item.hash).to_bytes(8, "big")
    modality = getattr(getattr(item, "modality", None), "name", str(item.modality))
    return SegmentKey(namespace, content, modality, _grid(item), num_tokens)

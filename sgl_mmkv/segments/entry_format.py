"""The bytes of a stored segment entry: the header and the payload layout.

An entry is a header of :data:`HEADER_BYTES` bytes (magic, sha256 of its JSON, the
JSON's length, then the JSON) and a payload of raw tensor bytes, named by its
checksum (:func:`payload_name`). :mod:`sgl_mmkv.segments.storage` reads and writes
them through SGLang's storage backends.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from sgl_mmkv.segments.key import SegmentKey

FORMAT_VERSION = 1
HEADER_BYTES = 4096
MAGIC = b"SGLMMKV\x01"
PREFIX_BYTES = len(MAGIC) + 32 + 4  # magic, sha256 of the JSON, JSON length (big endian)


@dataclass(frozen=True, slots=True)
class KVFingerprint:
    """What must match for stored KV to be valid in this server.

    Attributes:
        model: the model's identity (path, revision, config hash).
        dtype: KV buffer dtype (``torch.bfloat16``).
        layers: KV layers.
        heads: KV heads per layer (of this rank).
        head_dim: K head dim.
        v_head_dim: V head dim.
    """

    model: str
    dtype: str
    layers: int
    heads: int
    head_dim: int
    v_head_dim: int

    @classmethod
    def of_pool(cls, kv_pool, model: str) -> KVFingerprint:
        """The fingerprint of SGLang's KV pool (buffers ``(slots, heads, dim)`` per layer)."""
        k, v = kv_pool.get_key_buffer(0), kv_pool.get_value_buffer(0)
        return cls(
            model, str(k.dtype), int(kv_pool.layer_num), int(k.shape[1]), int(k.shape[2]),
            int(v.shape[2]),
        )  # fmt: skip


@dataclass(slots=True)
class StoredSegment:
    """One segment's content, on the CPU.

    Attributes:
        positions: ``(P, n)`` int64 rotary positions the K was computed at.
        kept: ``(m,)`` int64 kept image-token indices; None when whole (``m = n``).
        ranking: ``(n,)`` float32 eviction ranking, or None.
        keys: ``(L, m, H, D)`` K of the kept tokens, every layer.
        values: ``(L, m, H, Dv)`` V of the kept tokens, every layer.
    """

    positions: torch.Tensor
    kept: torch.Tensor | None
    ranking: torch.Tensor | None
    keys: torch.Tensor
    values: torch.Tensor


def key_fields(key: SegmentKey) -> dict[str, Any]:
    """``key`` as JSON-able fields (what the header records)."""
    return {
        "namespace_seed": key.namespace.seed,
        "lora_id": key.namespace.lora_id,
        "content": key.content.hex(),
        "modality": key.modality,
        "grid": list(key.grid),
        "num_tokens": key.num_tokens,
    }


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def payload_parts(stored: StoredSegment) -> list[torch.Tensor]:
    parts = [stored.positions.to(torch.long)]
    if stored.kept is not None:
        parts.append(stored.kept.to(torch.long))
    if stored.ranking is not None:
        parts.append(stored.ranking.to(torch.float32))
    return [*parts, stored.keys, stored.values]


def encode_header(fields: dict[str, Any]) -> torch.Tensor | None:
    """``(HEADER_BYTES,)`` uint8, or None if the JSON does not fit."""
    text = json.dumps(fields, sort_keys=True).encode()
    if PREFIX_BYTES + len(text) > HEADER_BYTES:
        return None
    raw = MAGIC + hashlib.sha256(text).digest() + len(text).to_bytes(4, "big") + text
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def decode_header(raw: bytes) -> dict[str, Any] | None:
    """The header's fields, or None if it is not an intact header."""
    if len(raw) != HEADER_BYTES or raw[: len(MAGIC)] != MAGIC:
        return None
    digest = raw[len(MAGIC) : len(MAGIC) + 32]
    size = int.from_bytes(raw[len(MAGIC) + 32 : PREFIX_BYTES], "big")
    text = raw[PREFIX_BYTES : PREFIX_BYTES + size]
    if size > HEADER_BYTES - PREFIX_BYTES or hashlib.sha256(text).digest() != digest:
        return None
    try:
        fields = json.loads(text)
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def payload_name(entry: str, digest: str) -> str:
    """The payload object of entry ``entry``, named by its checksum: two instances that
    write one image at once write two payloads, and the header that lands first names
    its own (the other payload is left unused), never a mix of the two."""
    return f"{entry}_p{digest[:16]}"

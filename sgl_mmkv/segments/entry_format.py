"""The bytes of a stored segment entry: the header and the payload layout.

An entry is a header of :data:`HEADER_BYTES` bytes (magic, sha256 of its JSON, the
JSON's length, then the JSON) and a payload of raw tensor bytes, named by its
checksum (:func:`payload_name`). Since version 3 the payload may end with the image's
vision-encoder output (``embeds`` in the header), so a loading instance skips the
vision tower for it. :mod:`sgl_mmkv.segments.storage` reads and writes
them through SGLang's storage backends. A header is untrusted input:
:func:`payload_layout` checks every field against the key and the fingerprint
before anything is read or allocated, so a load never reads more than
:func:`max_payload_bytes` of the key. Entries of older versions have other names
(the version is part of them): they are misses, and the next fill writes a new one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from sgl_mmkv.segments.key import Namespace, SegmentKey

FORMAT_VERSION = 3  # 3: the optional embeddings section
HEADER_BYTES = 4096
MAGIC = b"SGLMMKV\x01"
PREFIX_BYTES = len(MAGIC) + 32 + 4  # magic, sha256 of the JSON, JSON length (big endian)
MAX_POSITION_ROWS = 3  # M-RoPE: t, h, w; 1-D RoPE: 1


@dataclass(frozen=True, slots=True)
class KVFingerprint:
    """What must match for stored KV to be valid in this server.

    Attributes:
        model: the model's identity (:func:`sgl_mmkv.segments.fingerprint.model_identity`:
            path, revision, config, weights, dtype, quantization).
        dtype: KV buffer dtype (``torch.bfloat16``).
        layers: KV layers.
        heads: KV heads per layer (of this rank).
        head_dim: K head dim.
        v_head_dim: V head dim.
        fill: ``--mm-segment-fill`` (``first`` KV carries its request's context,
            ``canonical`` KV does not: they are not interchangeable).
        pool: the KV pool's class (quantized pools store other bytes).
        embed_width: the width of the vision encoder's output per image token (the
            language model's hidden size, times 1 + its DeepStack layers for
            Qwen3-VL); 0: entries carry no embeddings.
        embed_dtype: the dtype of that output (the model's).
        kv_scales: fp8 KV: 16 hex digits over the dtype and every layer's K and V
            scales (:meth:`sgl_mmkv.refresh.kv_scales.KVScales.digest`), so KV
            stored under other scales never loads; ``""`` for plain KV.
        tp_size, tp_rank: the tensor-parallel size and this rank: a segment holds the
            rank's own KV heads, so an entry is valid only at the same TP size and
            rank (left out of :meth:`fields` at TP 1, whose entries keep their names).
    """

    model: str
    dtype: str
    layers: int
    heads: int
    head_dim: int
    v_head_dim: int
    fill: str = "first"
    pool: str = ""
    embed_width: int = 0
    embed_dtype: str = ""
    kv_scales: str = ""
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def of_pool(
        cls,
        kv_pool,
        model: str,
        fill: str = "first",
        embeds: tuple[int, str] = (0, ""),
        kv_scales: str = "",
        tp: tuple[int, int] = (1, 0),
    ) -> KVFingerprint:
        """The fingerprint of SGLang's KV pool (buffers ``(slots, heads, dim)`` per layer,
        its dtype as they read it: an fp8 pool's fp8 view, not its uint8 storage);
        ``embeds``: ``(embed_width, embed_dtype)`` of the model's vision encoder output;
        ``kv_scales``: the digest of an fp8 pool's scales; ``tp``: ``(tp_size, tp_rank)``
        of this scheduler."""
        k, v = kv_pool.get_key_buffer(0), kv_pool.get_value_buffer(0)
        return cls(
            model, str(k.dtype), int(kv_pool.layer_num), int(k.shape[1]), int(k.shape[2]),
            int(v.shape[2]), fill, type(kv_pool).__name__, int(embeds[0]), str(embeds[1]),
            kv_scales, int(tp[0]), int(tp[1]),
        )  # fmt: skip

    def fields(self) -> dict[str, Any]:
        """The fields an entry's name digest and header carry; the TP fields only at
        TP > 1 (so TP 1 names and headers are those of before they existed, and a
        TP 1 entry never matches a TP 2 rank's, nor rank 0's rank 1's)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if self.tp_size == 1:
            del out["tp_size"], out["tp_rank"]
        return out

    def fits_embeddings(self, embeddings: torch.Tensor, key: SegmentKey) -> bool:
        """Whether ``embeddings`` ``(n_e, embed_width)`` can be stored with ``key``'s
        segment: this layout, at most one row per image token."""
        shape = tuple(embeddings.shape)
        return (
            self.embed_width > 0
            and str(embeddings.dtype) == self.embed_dtype
            and len(shape) == 2
            and 0 < shape[0] <= key.num_tokens
            and shape[1] == self.embed_width
        )


@dataclass(slots=True)
class StoredSegment:
    """One segment's content, on the CPU.

    Attributes:
        positions: ``(P, n)`` int64 rotary positions the K was computed at.
        kept: ``(m,)`` int64 kept image-token indices; None when whole (``m = n``).
        ranking: ``(n,)`` float32 eviction ranking, or None.
        keys: ``(L, m, H, D)`` K of the kept tokens, every layer.
        values: ``(L, m, H, Dv)`` V of the kept tokens, every layer.
        embeddings: ``(n_e, W)`` the vision encoder's output for the image (its rows
            for the image's placeholder tokens, DeepStack features included), or None.
    """

    positions: torch.Tensor
    kept: torch.Tensor | None
    ranking: torch.Tensor | None
    keys: torch.Tensor
    values: torch.Tensor
    embeddings: torch.Tensor | None = None


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


def key_from_fields(fields: dict[str, Any]) -> SegmentKey:
    """The key :func:`key_fields` recorded (fields of a header that passed
    :func:`decode_header`; a stored header is checked against the key asked for)."""
    return SegmentKey(
        Namespace(fields["namespace_seed"], fields["lora_id"]),
        bytes.fromhex(fields["content"]),
        fields["modality"],
        tuple(fields["grid"]),
        fields["num_tokens"],
    )


def namespace_tag(key: SegmentKey) -> str:
    """16 hex digits naming ``key``'s namespace in entry names (per-namespace caps);
    the salt itself is not in the name."""
    fields = {"seed": key.namespace.seed, "lora": key.namespace.lora_id}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def payload_parts(stored: StoredSegment) -> list[torch.Tensor]:
    parts = [stored.positions.to(torch.long)]
    if stored.kept is not None:
        parts.append(stored.kept.to(torch.long))
    if stored.ranking is not None:
        parts.append(stored.ranking.to(torch.float32))
    parts += [stored.keys, stored.values]
    if stored.embeddings is not None:
        parts.append(stored.embeddings)
    return parts


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
    if not isinstance(name, str):
        raise ValueError(f"dtype {name!r} is not a name")
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def payload_name(entry: str, digest: str) -> str:
    """The payload object of entry ``entry``, named by its checksum: two instances that
    write one image at once write two payloads, and the header that lands first names
    its own (the other payload is left unused), never a mix of the two."""
    return f"{entry}_p{digest[:16]}"


_HEX = set("0123456789abcdef")


class BadHeader(ValueError):
    """A header whose fields do not describe an entry of the key and fingerprint."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value, length: int) -> tuple[int, ...]:
    if not (isinstance(value, list) and len(value) == length):
        raise BadHeader(f"{value!r} is not a list of {length} integers")
    if not all(_is_int(d) for d in value):
        raise BadHeader(f"{value!r} is not a list of {length} integers")
    return tuple(value)


def max_payload_bytes(key: SegmentKey, fp: KVFingerprint) -> int:
    """The most payload bytes an entry of ``key`` can have under ``fp``: positions
    (at most :data:`MAX_POSITION_ROWS` rows), kept indices, ranking, K and V of every
    token, and an embedding row of ``fp.embed_width`` per token."""
    n = key.num_tokens
    kv = fp.layers * n * fp.heads * (fp.head_dim + fp.v_head_dim) * dtype_of(fp.dtype).itemsize
    embeds = n * fp.embed_width * dtype_of(fp.embed_dtype).itemsize if fp.embed_width else 0
    return MAX_POSITION_ROWS * n * 8 + n * 8 + n * 4 + kv + embeds


def payload_layout(
    fields: dict[str, Any], key: SegmentKey, fp: KVFingerprint, entry: str
) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    """``(shape, dtype, bytes)`` of each payload tensor of a header's ``fields``, once
    every field is checked against ``key`` and ``fp`` (the key and fingerprint fields
    themselves are compared by the caller).

    Raises:
        BadHeader: a field is missing, of the wrong type, or does not fit.
    """
    try:
        dtype = dtype_of(fields["dtype"])
        positions = _ints(fields["positions"], 2)
        k_shape, v_shape = _ints(fields["k_shape"], 4), _ints(fields["v_shape"], 4)
        kept, ranking = fields["kept"], fields["ranking"]
        size, digest, payload = fields["payload_bytes"], fields["sha256"], fields["payload"]
        embeds = None if fields["embeds"] is None else _ints(fields["embeds"], 2)
    except (KeyError, TypeError, ValueError) as error:
        raise BadHeader(f"bad layout ({error!r})") from error
    n = key.num_tokens
    if fields["dtype"] != fp.dtype or not 1 <= positions[0] <= MAX_POSITION_ROWS:
        raise BadHeader(f"dtype {fields['dtype']!r} or positions {positions} do not fit")
    if positions[1] != n or not isinstance(ranking, bool):
        raise BadHeader(f"positions {positions} or ranking {ranking!r} do not fit {n} tokens")
    if kept is not None and not _is_int(kept):
        raise BadHeader(f"kept {kept!r} is not an integer")
    m = n if kept is None else kept
    if not 0 < m <= n:
        raise BadHeader(f"kept {kept!r} does not fit {n} tokens")
    if k_shape != (fp.layers, m, fp.heads, fp.head_dim) or v_shape != (
        fp.layers, m, fp.heads, fp.v_head_dim
    ):  # fmt: skip
        raise BadHeader(f"shapes {k_shape} {v_shape} do not fit the fingerprint")
    shapes = [(positions, torch.long)]
    if kept is not None:
        shapes.append(((m,), torch.long))
    if ranking:
        shapes.append(((n,), torch.float32))
    shapes += [(k_shape, dtype), (v_shape, dtype)]
    if embeds is not None:
        if fp.embed_width <= 0 or embeds[1] != fp.embed_width or not 0 < embeds[0] <= n:
            raise BadHeader(f"embeddings {embeds} do not fit {n} tokens of the fingerprint")
        shapes.append((embeds, dtype_of(fp.embed_dtype)))
    layout = []
    for shape, kind in shapes:
        count = 1
        for dim in shape:
            count *= dim
        layout.append((shape, kind, count * kind.itemsize))
    bound = max_payload_bytes(key, fp)
    if not _is_int(size) or sum(b for _, _, b in layout) != size or size > bound:
        raise BadHeader(f"payload size {size!r} does not match its shapes")
    hex_digest = isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX
    if not hex_digest or payload != payload_name(entry, digest):
        raise BadHeader("payload name does not match its checksum")
    return layout

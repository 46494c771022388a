"""The per-tensor scales of an fp8 KV pool, read from the model's attention layers.

SGLang stores fp8 KV as ``value / scale`` with one K and one V scale per layer
(``RadixAttention.k_scale_float`` / ``v_scale_float``, 1.0 when the checkpoint has
none). The refresh path reads them here: its attention backend per layer, the
scoring reads of pool KV per layer id, and the L3 fingerprint as a digest. A plain
(bf16 / fp16 / fp32) pool applies no scale, whatever the layers hold: its scales
are 1.0.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any

from sgl_mmkv.kernels.kv_dtype import is_fp8

_BY_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_is_fp8(kv_pool: Any) -> bool:
    """Whether ``kv_pool`` holds fp8 KV (its ``dtype``, else its buffers')."""
    dtype = getattr(kv_pool, "dtype", None)
    if dtype is None:
        dtype = kv_pool.get_key_buffer(0).dtype
    return is_fp8(dtype)


def layer_scales(layer: Any, kv_pool: Any) -> tuple[float, float]:
    """``(k_scale, v_scale)`` of one ``RadixAttention`` ``layer`` over ``kv_pool``:
    the layer's floats for an fp8 pool (1.0 where unset), else ``(1.0, 1.0)``."""
    if not pool_is_fp8(kv_pool):
        return 1.0, 1.0
    k = getattr(layer, "k_scale_float", None)
    v = getattr(layer, "v_scale_float", None)
    return float(k) if k is not None else 1.0, float(v) if v is not None else 1.0


@dataclass(frozen=True)
class KVScales:
    """Per layer id ``(k_scale, v_scale)`` of one pool; layers not listed: 1.0.

    Attributes:
        dtype: the pool's KV dtype name (``torch.float8_e4m3fn``).
        scales: layer id -> ``(k_scale, v_scale)``; empty for a plain pool.
    """

    dtype: str
    scales: dict[int, tuple[float, float]] = field(default_factory=dict)

    def k(self, layer_id: int) -> float:
        return self.scales.get(layer_id, (1.0, 1.0))[0]

    def v(self, layer_id: int) -> float:
        return self.scales.get(layer_id, (1.0, 1.0))[1]

    def digest(self) -> str:
        """16 hex digits over the dtype and every layer's scales (``repr`` of the
        floats: exact); what the L3 fingerprint records. ``""`` for a plain pool
        (no scale applies; its dtype is a field of the fingerprint already)."""
        if "float8" not in self.dtype:
            return ""
        text = (
            self.dtype
            + ";"
            + ";".join(f"{i}:{k!r}:{v!r}" for i, (k, v) in sorted(self.scales.items()))
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_scales(model: Any, kv_pool: Any) -> KVScales:
    """The scales of every ``RadixAttention`` of ``model`` (any module with a
    ``layer_id`` and ``k_scale_float``) over ``kv_pool``; read on the host, once."""
    dtype = getattr(kv_pool, "dtype", None) or kv_pool.get_key_buffer(0).dtype
    if model is None or not is_fp8(dtype):
        return KVScales(str(dtype))
    scales = {}
    for module in model.modules():
        if hasattr(module, "k_scale_float") and isinstance(getattr(module, "layer_id", None), int):
            scales[module.layer_id] = layer_scales(module, kv_pool)
    return KVScales(str(dtype), scales)


def scales_of(model_runner: Any) -> KVScales:
    """:func:`read_scales` of ``model_runner``'s model and pool, read once per model
    (a weight update that changes scales loads a new model object or must call
    :func:`forget_scales`)."""
    model = getattr(model_runner, "model", None)
    pool = model_runner.token_to_kv_pool
    if model is None:
        return read_scales(None, pool)
    try:
        cached = _BY_MODEL.get(model)
    except TypeError:  # not weak-referenceable: read every time
        return read_scales(model, pool)
    if cached is None:
        cached = read_scales(model, pool)
        _BY_MODEL[model] = cached
    return cached


def forget_scales(model: Any) -> None:
    """Drop the scales read of ``model`` (its weights changed)."""
    _BY_MODEL.pop(model, None)

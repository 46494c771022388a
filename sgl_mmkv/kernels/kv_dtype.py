"""fp8 KV as SGLang's per-tensor-scaled pools hold it.

SGLang's ``MHATokenToKVPool`` with ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``
stores ``x / scale`` cast to fp8 (bytes in ``uint8`` buffers, read back through an
fp8 view), one scale per layer for K and one for V (``layer.k_scale_float``,
``layer.v_scale_float``; 1.0 when the checkpoint gives none). The true value is
``stored * scale``. A per-tensor scale commutes with a rotation of K, so a
re-positioned copy needs no scale: upcast, rotate in float32, cast back
(:func:`to_kv_dtype`, saturating as Triton's fp8 cast does). Attention over such
KV folds ``k_scale`` into the softmax scale and multiplies its output by
``v_scale``; a copy read out for scoring is dequantized (:func:`dequantize`).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the fp8 formats SGLang's KV pools use."""
    return dtype in FP8_DTYPES


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (any float) cast to the KV ``dtype``; an fp8 cast saturates at the
    format's largest finite value (a rotated pair can grow by up to sqrt(2) per
    element, past e4m3's 448, where an unclamped cast gives NaN)."""
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def dequantize(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """``rows`` of a KV buffer as values: fp8 rows as ``float32 * scale``, plain rows
    unchanged (their pool applies no scale). Any shape."""
    if is_fp8(rows.dtype):
        return rows.float() * scale
    return rows


def put_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``buffer[slots] = rows`` in place; fp8 through byte views (the bytes SGLang
    stores, and an ``index_put`` every device has).

    Args:
        buffer: ``(S, H, d)`` one layer's K or V buffer.
        slots: ``(n,)`` int64 slots.
        rows: ``(n, H, d)`` in ``buffer``'s dtype.
    """
    if is_fp8(buffer.dtype):
        buffer.view(torch.uint8)[slots] = rows.to(buffer.dtype).view(torch.uint8)
    else:
        buffer[slots] = rows

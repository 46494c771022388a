"""Gather-and-rotate: copy cached K/V rows to new slots, rotating K by a position delta.

A segment's K was stored after RoPE at its old positions ``p``. At new positions
``p + delta`` the correct K is ``R(p + delta) k = R(delta) R(p) k``, so rotating the
cached K by ``delta`` re-positions it exactly (up to rounding). V carries no
position and is copied as is. For M-RoPE (Qwen2-VL / Qwen2.5-VL) an image moved
as a whole shifts its t, h and w components by the same ``delta``, so every
frequency rotates by ``delta * inv_freq`` exactly as in 1-D RoPE
(``tests/test_gather_rotate.py`` checks this against SGLang's MRotaryEmbedding).

fp8 KV (SGLang's per-tensor-scaled pools): the scale commutes with the rotation,
so K is upcast, rotated in float32 and cast back to the buffer's fp8 dtype
(saturating, :func:`~sgl_mmkv.kernels.kv_dtype.to_kv_dtype`); no scale is read.

``gather_rotate_kv`` dispatches to the Triton kernel on CUDA (or under
``TRITON_INTERPRET=1``) and to ``gather_rotate_kv_reference`` otherwise.
"""

from __future__ import annotations

import os

import torch

from sgl_mmkv.kernels.kv_dtype import put_rows, to_kv_dtype


def rope_inv_freq(rotary_dim: int, base: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(rotary_dim // 2,)`` float32 inverse frequencies, as SGLang's RotaryEmbedding."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (base**exponents)


def rotate_neox(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate neox-style (half-split) RoPE keys by ``delta`` positions.

    Args:
        k: ``(n, heads, head_dim)``; the first ``2 * len(inv_freq)`` dims are rotary.
        delta: ``(n,)`` integer position shifts.
        inv_freq: ``(rotary_dim // 2,)`` float32.
    Returns:
        ``(n, heads, head_dim)`` in ``k``'s dtype, computed in float32 (fp8:
        saturated to the format's range).
    """
    half = inv_freq.numel()
    angle = delta.to(torch.float32)[:, None] * inv_freq[None, :]  # (n, half)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x = k.to(torch.float32)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return to_kv_dtype(out, k.dtype)


def gather_rotate_kv_reference(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_loc: torch.Tensor,
    dst_loc: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """``k[dst] = R(delta) k[src]``, ``v[dst] = v[src]``, in place, for one layer.

    Args:
        k_buffer, v_buffer: ``(slots, kv_heads, head_dim)`` one layer of the KV pool
            (plain float, or fp8 with a per-tensor scale).
        src_loc, dst_loc: ``(n,)`` int64 slots; ``dst`` must not overlap ``src``.
        delta: ``(n,)`` int64 position shifts (new - old).
        inv_freq: ``(rotary_dim // 2,)`` float32.
    """
    put_rows(k_buffer, dst_loc, rotate_neox(k_buffer[src_loc], delta, inv_freq))
    put_rows(v_buffer, dst_loc, v_buffer[src_loc])


def _triton_enabled(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def gather_rotate_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_loc: torch.Tensor,
    dst_loc: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """Same contract as :func:`gather_rotate_kv_reference`; Triton where it can run."""
    if src_loc.numel() != dst_loc.numel() or src_loc.numel() != delta.numel():
        raise ValueError(
            f"src_loc ({src_loc.numel()}), dst_loc ({dst_loc.numel()}) and delta "
            f"({delta.numel()}) must have one entry per token"
        )
    if src_loc.numel() == 0:
        return
    if not _triton_enabled(k_buffer):
        gather_rotate_kv_reference(k_buffer, v_buffer, src_loc, dst_loc, delta, inv_freq)
        return
    from sgl_mmkv.kernels.gather_rotate_triton import gather_rotate_kv_triton

    gather_rotate_kv_triton(k_buffer, v_buffer, src_loc, dst_loc, delta, inv_freq)

"""Triton kernel of :func:`sgl_mmkv.kernels.gather_rotate.gather_rotate_kv`.

One program per token: it loads the token's K (all KV heads, both rotary halves)
and V from the source slot, rotates K by ``delta * inv_freq`` in float32 and
stores both to the destination slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rotate_kernel(
    k_ptr,
    v_ptr,
    src_ptr,
    dst_ptr,
    delta_ptr,
    inv_freq_ptr,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    num_heads,
    half,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    src = tl.load(src_ptr + token).to(tl.int64)
    dst = tl.load(dst_ptr + token).to(tl.int64)
    delta = tl.load(delta_ptr + token).to(tl.float32)

    heads = tl.arange(0, BLOCK_H)
    freq = tl.arange(0, BLOCK_HALF)
    head_mask = heads < num_heads
    freq_mask = freq < half
    mask = head_mask[:, None] & freq_mask[None, :]

    inv_freq = tl.load(inv_freq_ptr + freq, mask=freq_mask, other=0.0)
    angle = delta * inv_freq
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]

    k_src = k_ptr + src * stride_k_slot + heads[:, None] * stride_k_head
    k_dst = k_ptr + dst * stride_k_slot + heads[:, None] * stride_k_head
    x1 = tl.load(k_src + freq[None, :], mask=mask, other=0.0)
    x2 = tl.load(k_src + half + freq[None, :], mask=mask, other=0.0)
    y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
    y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
    tl.store(k_dst + freq[None, :], y1.to(x1.dtype), mask=mask)
    tl.store(k_dst + half + freq[None, :], y2.to(x1.dtype), mask=mask)

    # Dims past the rotary part (partial rotary) are copied unchanged.
    tail = 2 * half + tl.arange(0, BLOCK_D)
    tail_mask = head_mask[:, None] & (tail < head_dim)[None, :]
    rest = tl.load(k_src + tail[None, :], mask=tail_mask, other=0.0)
    tl.store(k_dst + tail[None, :], rest, mask=tail_mask)

    dims = tl.arange(0, BLOCK_D)
    v_mask = head_mask[:, None] & (dims < head_dim)[None, :]
    v_src = v_ptr + src * stride_v_slot + heads[:, None] * stride_v_head + dims[None, :]
    v_dst = v_ptr + dst * stride_v_slot + heads[:, None] * stride_v_head + dims[None, :]
    tl.store(v_dst, tl.load(v_src, mask=v_mask, other=0.0), mask=v_mask)


def gather_rotate_kv_triton(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_loc: torch.Tensor,
    dst_loc: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """Launch the kernel; shapes as in ``gather_rotate_kv_reference``."""
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("K/V buffers must be contiguous in head_dim")
    if k_buffer.shape[-1] != v_buffer.shape[-1]:
        raise ValueError("gather_rotate_kv_triton needs equal K and V head dims")
    num_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    half = inv_freq.numel()
    grid = (src_loc.numel(),)
    _gather_rotate_kernel[grid](
        k_buffer,
        v_buffer,
        src_loc,
        dst_loc,
        delta,
        inv_freq.to(torch.float32),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        num_heads,
        half,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )

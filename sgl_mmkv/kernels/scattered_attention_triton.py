"""Triton kernel over a paged row with queries at scattered positions.

``_attention_mass_kernel``: CONDUIT's scoring reduction, the mean softmax mass
each row position receives (one program per (query, head); two passes: softmax
statistics, then atomic sums). The refresh pass's attention itself is the tiled
kernel of ``refresh_attention_triton.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_scores(
    q,
    k_ptr,
    slots_ptr,
    start,
    n_keys,
    pos,
    kv_head,
    stride_ks,
    stride_kh,
    sm_scale,
    dims,
    dmask,
    BLOCK_N: tl.constexpr,
):
    """Scores of one key block: (scaled q.k with -inf where not visible, slots, visible)."""
    j = start + tl.arange(0, BLOCK_N)
    in_row = j < n_keys
    visible = in_row & (j <= pos)
    slot = tl.load(slots_ptr + j, mask=in_row, other=0).to(tl.int64)
    k = tl.load(
        k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
        mask=visible[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    s = tl.where(visible, tl.sum(k * q[None, :], axis=1) * sm_scale, float("-inf"))
    return s, slot, visible, j


@triton.jit
def _attention_mass_kernel(
    q_ptr,
    k_ptr,
    out_ptr,
    qpos_ptr,
    slots_ptr,
    n_keys,
    head_dim,
    stride_qn,
    stride_qh,
    stride_ks,
    stride_kh,
    sm_scale,
    weight,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    pos = tl.load(qpos_ptr + i)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    q = tl.load(q_ptr + i * stride_qn + h * stride_qh + dims, mask=dmask, other=0.0).to(tl.float32)

    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    for start in range(0, n_keys, BLOCK_N):
        s, _, visible, j = _block_scores(
            q,
            k_ptr,
            slots_ptr,
            start,
            n_keys,
            pos,
            kv_head,
            stride_ks,
            stride_kh,
            sm_scale,
            dims,
            dmask,
            BLOCK_N,
        )
        m_new = tl.maximum(m, tl.max(s, axis=0))
        denom = denom * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), axis=0)
        m = m_new
    for start in range(0, n_keys, BLOCK_N):
        s, _, visible, j = _block_scores(
            q,
            k_ptr,
            slots_ptr,
            start,
            n_keys,
            pos,
            kv_head,
            stride_ks,
            stride_kh,
            sm_scale,
            dims,
            dmask,
            BLOCK_N,
        )
        p = tl.exp(s - m) / denom * weight
        tl.atomic_add(out_ptr + j, p, mask=visible)


def _common(q: torch.Tensor, k_buffer: torch.Tensor, sm_scale: float | None):
    n_q, h_q, d = q.shape
    group = h_q // k_buffer.shape[1]
    scale = sm_scale if sm_scale is not None else d**-0.5
    return n_q, h_q, d, group, scale


def attention_mass_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    row_slots: torch.Tensor,
    query_positions: torch.Tensor,
    sm_scale: float | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """``(n,)`` float32 mean causal attention mass per row position (see
    ``sgl_mmkv.scoring.attention.attention_mass``)."""
    n_q, h_q, d, group, scale = _common(q, k_buffer, sm_scale)
    out = torch.zeros(row_slots.numel(), dtype=torch.float32, device=q.device)
    _attention_mass_kernel[(n_q, h_q)](
        q,
        k_buffer,
        out,
        query_positions,
        row_slots,
        row_slots.numel(),
        d,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        scale,
        1.0 / (n_q * h_q),
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(d),
    )
    return out

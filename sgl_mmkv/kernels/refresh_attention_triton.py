"""The refresh pass's attention as one Triton kernel for the whole batch.

FlashAttention-2 style: one program per (query head, query block), a query block
being at most ``BLOCK_M`` queries of *one* request (the plan's ``blocks`` table,
heaviest first). The program loads its queries once, then walks its request's
compacted row in ``BLOCK_N`` key tiles gathered through ``kv_indices`` (paged KV,
read in place), scores them with ``tl.dot`` (tensor cores), masks causally by
position (key ``j`` visible to query ``i`` iff ``j <= q_positions[i]``), and keeps
an online softmax in float32 (fp8 KV: the tiles are upcast to the queries'
dtype, ``k_scale`` is folded into the softmax scale and ``v_scale`` applied to
the output once). The walk stops at the block's last visible key, so a
block of early queries reads only the start of the row. GQA: query head ``h``
reads KV head ``h // (H_q / H_kv)``.

Tested against the torch reference under ``TRITON_INTERPRET=1`` on the CPU; block
sizes are Hopper guesses (SGLang's extend kernel uses 128 x 64, 8 warps there)
until ``benchmarks/gpu_kernels.py`` has timed them on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl_mmkv.kernels.refresh_attention import RefreshAttentionPlan

LOG2_E = 1.0 / math.log(2.0)


@triton.jit
def _refresh_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qpos_ptr,
    kv_indices_ptr,
    blocks_ptr,
    head_dim,
    v_head_dim,
    stride_qn,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_on,
    stride_oh,
    qk_scale,
    v_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = h // GROUP
    q_start = tl.load(blocks_ptr + b * 4)
    q_end = tl.load(blocks_ptr + b * 4 + 1)
    kv_start = tl.load(blocks_ptr + b * 4 + 2)
    kv_len = tl.load(blocks_ptr + b * 4 + 3)

    rows = q_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    pos = tl.load(qpos_ptr + rows, mask=row_ok, other=0)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    vdims = tl.arange(0, BLOCK_DV)
    vmask = vdims < v_head_dim
    q = tl.load(
        q_ptr + rows.to(tl.int64)[:, None] * stride_qn + h * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dmask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        slot = tl.load(kv_indices_ptr + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + slot[None, :] * stride_ks + kv_head * stride_kh + dims[:, None],
            mask=col_ok[None, :] & dmask[:, None],
            other=0.0,
        )
        s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * qk_scale
        s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + vdims[None, :],
            mask=col_ok[:, None] & vmask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None] * v_scale
    tl.store(
        o_ptr + rows.to(tl.int64)[:, None] * stride_on + h * stride_oh + vdims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & vmask[None, :],
    )


def refresh_attention_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: RefreshAttentionPlan,
    sm_scale: float | None = None,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Contract of :func:`~sgl_mmkv.kernels.refresh_attention.refresh_attention`.

    Args:
        q: ``(N_q, H_q, d)``, last dim contiguous.
        k_buffer, v_buffer: ``(slots, H_kv, d)`` / ``(slots, H_kv, d_v)``, last dim
            contiguous; read as ``q``'s dtype (fp8 KV: upcast, ``k_scale`` folded
            into the softmax scale, the output times ``v_scale``).
        plan: its ``blocks`` were cut at ``plan.block_m`` queries.
        block_n, num_warps, num_stages: launch tuning (ignored by the interpreter).
    Returns:
        ``(N_q, H_q, d_v)`` in ``q``'s dtype.
    """
    n_q, h_q, d = q.shape
    d_v = v_buffer.shape[-1]
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("refresh_attention_triton needs a contiguous last dimension")
    out = torch.empty((n_q, h_q, d_v), dtype=q.dtype, device=q.device)
    n_blocks = plan.blocks.shape[0]
    if n_blocks == 0:
        return out
    scale = sm_scale if sm_scale is not None else d**-0.5
    _refresh_attention_kernel[(h_q, n_blocks)](
        q,
        k_buffer,
        v_buffer,
        out,
        plan.q_positions,
        plan.kv_indices,
        plan.blocks,
        d,
        d_v,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        scale * k_scale * LOG2_E,
        v_scale,
        GROUP=h_q // k_buffer.shape[1],
        BLOCK_M=plan.block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out

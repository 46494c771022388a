"""Attention for queries at scattered row positions over a paged row.

A refresh forward recomputes only some rows of a request (all text and the
selected image tokens). Their queries sit at arbitrary positions of the row and
attend causally *by position* over the whole row, whose KV lives in pool slots
``row_slots`` (fresh KV for refreshed rows, re-positioned stale KV for the rest).

``scattered_attention`` runs ``scattered_attention_sdpa`` on every device; the
Triton kernel (one program per query and head, no tensor cores) runs only with
``SGL_MMKV_TRITON_ATTENTION=1``: on an H200 it measured 9x slower than masked SDPA
at 2k-token rows and 72x at 8k (``benchmarks/gpu_kernels.py``). When the queries
are a contiguous suffix of the row (an ordinary extend, or a refresh at budget
1.0), the SDPA path places them in a full-length query block and runs one causal
``scaled_dot_product_attention``, exactly as SGLang's ``torch_native`` backend does,
so a full refresh matches stock prefill bit for bit on the CPU. Scattered queries
run one SDPA of only those queries with a ``(n_q, n)`` causal-by-position mask:
``n_q * n`` work instead of the placed block's ``n * n``.
"""

from __future__ import annotations

import os

import torch

TRITON_ATTENTION_ENV = "SGL_MMKV_TRITON_ATTENTION"


def use_triton_attention(tensor: torch.Tensor) -> bool:
    """Whether the attention Triton kernels are asked for (and can run) here."""
    triton_runs = tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return triton_runs and os.environ.get(TRITON_ATTENTION_ENV) == "1"


def scattered_attention_sdpa(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    row_slots: torch.Tensor,
    query_positions: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`~sgl_mmkv.kernels.reference.scattered_attention_reference`,
    through SDPA."""
    n_q, h_q, d = q.shape
    n = row_slots.numel()
    gqa = h_q != k_buffer.shape[1]
    k = k_buffer[row_slots].transpose(0, 1).to(q.dtype)[None]
    v = v_buffer[row_slots].transpose(0, 1).to(q.dtype)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    positions = query_positions.to(row_slots.device)
    suffix = torch.arange(n - n_q, n, device=positions.device)
    if torch.equal(positions, suffix):
        placed = q.new_zeros((h_q, n, d))
        placed[:, n - n_q :] = q.transpose(0, 1)
        out = sdpa(placed[None], k, v, is_causal=True, scale=sm_scale, enable_gqa=gqa)[0]
        return out[:, n - n_q :].transpose(0, 1)
    visible = torch.arange(n, device=positions.device)[None, :] <= positions[:, None]
    out = sdpa(
        q.transpose(0, 1)[None],
        k,
        v,
        attn_mask=visible.to(q.device),
        scale=sm_scale,
        enable_gqa=gqa,
    )[0]
    return out.transpose(0, 1)


def scattered_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    row_slots: torch.Tensor,
    query_positions: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`~sgl_mmkv.kernels.reference.scattered_attention_reference`."""
    if q.shape[1] % k_buffer.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_buffer.shape[1]}")
    if int(query_positions.max()) >= row_slots.numel() or int(query_positions.min()) < 0:
        raise ValueError("a query position lies outside the row")
    if not use_triton_attention(q):
        return scattered_attention_sdpa(q, k_buffer, v_buffer, row_slots, query_positions, sm_scale)
    from sgl_mmkv.kernels.scattered_attention_triton import scattered_attention_triton

    return scattered_attention_triton(q, k_buffer, v_buffer, row_slots, query_positions, sm_scale)

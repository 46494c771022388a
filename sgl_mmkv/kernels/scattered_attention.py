"""Attention for queries at scattered row positions over one paged row (SDPA).

A refresh forward recomputes only some rows of a request (all text and the
selected image tokens). Their queries sit at arbitrary positions of the row and
attend causally *by position* over the whole row, whose KV lives in pool slots
``row_slots`` (fresh KV for refreshed rows, re-positioned stale KV for the rest).

This is the one-row SDPA path; the batched refresh attention
(:mod:`sgl_mmkv.kernels.refresh_attention`) runs it per request on the CPU. A
whole row (first prefill, or a refresh at budget 1.0 with nothing cached) runs one
causal ``scaled_dot_product_attention``; any other query set, a contiguous suffix
(a request without reuse after a cached prefix) included, runs one SDPA of only
those queries with an ``(n_q, n)`` causal-by-position mask: ``n_q * n`` work, as
stock's GPU backends do, where placing the queries in a full-length block would
cost ``n * n`` (on 2 CPU cores, 16 new tokens after a 16k-token row: 15 ms
against 2.8 s).

``SGL_MMKV_TRITON_ATTENTION=1`` (:func:`use_triton_attention`) switches the
scorers' attention-mass reduction to its Triton kernel
(``scattered_attention_triton.py``); it measured 2.5-4x slower than the torch
reduction on an H200, so it is off by default.

fp8 KV (per-tensor scales): ``k_scale`` is folded into the softmax scale and the
output multiplied by ``v_scale``; with scales of 1 the call is the plain one.
"""

from __future__ import annotations

import os

import torch

TRITON_ATTENTION_ENV = "SGL_MMKV_TRITON_ATTENTION"


def use_triton_attention(tensor: torch.Tensor) -> bool:
    """Whether the attention-mass Triton kernel is asked for (and can run) here."""
    triton_runs = tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return triton_runs and os.environ.get(TRITON_ATTENTION_ENV) == "1"


def scattered_attention_sdpa(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    row_slots: torch.Tensor,
    query_positions: torch.Tensor,
    sm_scale: float | None = None,
    whole_row: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as :func:`~sgl_mmkv.kernels.reference.scattered_attention_reference`,
    through SDPA. ``whole_row``: whether the queries are the whole row in order,
    when the caller knows (None: compared here, one host read). ``k_scale``,
    ``v_scale``: the layer's per-tensor scales of fp8 KV (1.0 for plain KV)."""
    n_q, h_q, d = q.shape
    if k_scale != 1.0:
        sm_scale = (d**-0.5 if sm_scale is None else sm_scale) * k_scale
    n = row_slots.numel()
    gqa = h_q != k_buffer.shape[1]
    k = k_buffer[row_slots].transpose(0, 1).to(q.dtype)[None]
    v = v_buffer[row_slots].transpose(0, 1).to(q.dtype)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    positions = query_positions.to(row_slots.device)
    if whole_row is None:
        whole_row = n_q == n and torch.equal(positions, torch.arange(n, device=positions.device))
    if whole_row:
        out = sdpa(q.transpose(0, 1)[None], k, v, is_causal=True, scale=sm_scale, enable_gqa=gqa)
        return _descaled(out[0].transpose(0, 1), v_scale)
    visible = torch.arange(n, device=positions.device)[None, :] <= positions[:, None]
    out = sdpa(
        q.transpose(0, 1)[None],
        k,
        v,
        attn_mask=visible.to(q.device),
        scale=sm_scale,
        enable_gqa=gqa,
    )[0]
    return _descaled(out.transpose(0, 1), v_scale)


def _descaled(out: torch.Tensor, v_scale: float) -> torch.Tensor:
    """``out`` ``(n_q, H_q, d_v)`` of attention over stored V, as values."""
    return out if v_scale == 1.0 else out * v_scale


def scattered_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    row_slots: torch.Tensor,
    query_positions: torch.Tensor,
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as :func:`~sgl_mmkv.kernels.reference.scattered_attention_reference`,
    checked, through SDPA."""
    if q.shape[1] % k_buffer.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_buffer.shape[1]}")
    if int(query_positions.max()) >= row_slots.numel() or int(query_positions.min()) < 0:
        raise ValueError("a query position lies outside the row")
    return scattered_attention_sdpa(
        q, k_buffer, v_buffer, row_slots, query_positions, sm_scale, None, k_scale, v_scale
    )

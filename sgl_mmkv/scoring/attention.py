"""Attention reductions the scorers share, over :mod:`sgl_mmkv.kernels.reference`.

``attention_mass`` (CONDUIT, ProphetKV) runs the chunked torch reference on every
device; the Triton kernel, which never materialises scores, runs only with
``SGL_MMKV_TRITON_ATTENTION=1``: on an H200 it measured 2.5-4x slower than the
torch reduction (``benchmarks/gpu_kernels.py``). ``kv_head_attention`` is the
eviction scorers' per-KV-head view.
"""

from __future__ import annotations

import torch

from sgl_mmkv.kernels.reference import attention_mass_reference, causal_probs
from sgl_mmkv.kernels.scattered_attention import use_triton_attention


def attention_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean causal softmax attention each key receives from the queries.

    ``alpha[j] = 1 / (n_q * H_q) * sum_i sum_h softmax_{j' <= p_i}(q_ih . k_j'h / sqrt(d))[j]``,
    with key ``j`` at row position ``j`` and query ``i`` at ``query_positions[i]``.

    Args:
        queries: ``(n_q, H_q, d)``.
        keys: ``(n, H_kv, d)``; with ``slots``, a ``(S, H_kv, d)`` pool buffer.
        query_positions: ``(n_q,)`` int.
        slots: optional ``(n,)`` int64 rows of ``keys`` that make the row (the Triton
            kernel reads them in place; the torch reference gathers them).
    Returns:
        ``(n,)`` float32; sums to 1 over keys when every query sees at least one key.
    """
    h_q, h_kv = queries.shape[1], keys.shape[1]
    if h_q % h_kv:
        raise ValueError(f"{h_q} query heads are not a multiple of {h_kv} KV heads")
    if use_triton_attention(queries):
        from sgl_mmkv.kernels.scattered_attention_triton import attention_mass_triton

        if slots is None:
            slots = torch.arange(keys.shape[0], device=keys.device)
        return attention_mass_triton(queries, keys, slots, query_positions.to(keys.device))
    row = keys if slots is None else keys[slots]
    return attention_mass_reference(queries, row, query_positions)


def kv_head_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention, query heads averaged within each GQA group.

    Args:
        queries: ``(n_q, H_q, d)``, RoPE applied.
        keys: ``(n, H_kv, d)``, RoPE applied.
        query_positions: ``(n_q,)`` int.
        key_positions: optional ``(n,)`` int (default: key ``j`` at position ``j``).
    Returns:
        ``(H_kv, n_q, n)`` float32 probabilities; rows sum to 1 where a key is visible.
    """
    n_q, h_q, _ = queries.shape
    n, h_kv, _ = keys.shape
    probs = causal_probs(queries, keys, query_positions, key_positions)  # (H_q, n_q, n)
    return probs.view(h_kv, h_q // h_kv, n_q, n).mean(dim=1)

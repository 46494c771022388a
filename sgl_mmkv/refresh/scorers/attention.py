"""Torch reference of the scoring reduction: causal attention mass on each key.

``attention_mass`` is what CONDUIT and ProphetKV share, and the reference of the
Triton scoring kernel. It runs in torch over chunks of queries (memory bounded by
:data:`CHUNK_ELEMENTS` scores); the Triton kernel, which never materialises scores,
runs only with ``SGL_MMKV_TRITON_ATTENTION=1``: on an H200 it measured 2.5-4x
slower than the torch reduction (``benchmarks/gpu_kernels.py``).
"""

from __future__ import annotations

import torch

from sgl_mmkv.kernels.scattered_attention import use_triton_attention

CHUNK_ELEMENTS = 1 << 27  # scores per chunk of queries: 512 MiB of float32


def attention_mass(
    queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor
) -> torch.Tensor:
    """Mean causal softmax attention each key receives from the queries.

    ``alpha[j] = 1 / (n_q * H_q) * sum_i sum_h softmax_{j' <= p_i}(q_ih . k_j'h / sqrt(d))[j]``,
    with key ``j`` at row position ``j`` and query ``i`` at ``query_positions[i]``.
    GQA: each KV head serves ``H_q / H_kv`` consecutive query heads.

    Args:
        queries: ``(n_q, H_q, d)``.
        keys: ``(n, H_kv, d)``.
        query_positions: ``(n_q,)`` int.
    Returns:
        ``(n,)`` float32; sums to 1 over keys when every query sees at least one key.
    """
    n_q, h_q, d = queries.shape
    n, h_kv, _ = keys.shape
    if h_q % h_kv:
        raise ValueError(f"{h_q} query heads are not a multiple of {h_kv} KV heads")
    if use_triton_attention(queries):
        from sgl_mmkv.kernels.scattered_attention_triton import attention_mass_triton

        slots = torch.arange(n, device=keys.device)
        return attention_mass_triton(queries, keys, slots, query_positions.to(keys.device))
    return attention_mass_reference(queries, keys, query_positions)


def attention_mass_reference(
    queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor
) -> torch.Tensor:
    """:func:`attention_mass` in torch on any device, ``(H_q, chunk, n)`` scores at a time."""
    n_q, h_q, d = queries.shape
    n, h_kv, _ = keys.shape
    k = keys.float().repeat_interleave(h_q // h_kv, dim=1)  # (n, H_q, d)
    positions = query_positions.to(keys.device)
    keys_at = torch.arange(n, device=keys.device)
    total = torch.zeros(n, dtype=torch.float32, device=keys.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, h_q * n))
    for start in range(0, n_q, chunk):
        q = queries[start : start + chunk].float()
        logits = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        causal = keys_at[None, :] <= positions[start : start + chunk, None]  # (chunk, n)
        logits = logits.masked_fill(~causal[None], float("-inf"))
        total += torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # (H_q, chunk, n) -> (n,)
    return total / (n_q * h_q)

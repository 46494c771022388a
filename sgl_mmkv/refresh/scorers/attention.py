"""Torch reference of the scoring reduction: causal attention mass on each key.

``attention_mass`` is what CONDUIT and ProphetKV share, and the reference of the
Triton scoring kernel, which it dispatches to for CUDA tensors (the scoring
reduction of a refresh on the GPU never materialises the ``H x n_q x n`` scores).
"""

from __future__ import annotations

import torch


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
    if queries.is_cuda:
        from sgl_mmkv.kernels.scattered_attention_triton import attention_mass_triton

        slots = torch.arange(n, device=keys.device)
        return attention_mass_triton(queries, keys, slots, query_positions.to(keys.device))
    k = keys.float().repeat_interleave(h_q // h_kv, dim=1)  # (n, H_q, d)
    logits = torch.einsum("qhd,khd->hqk", queries.float(), k) / d**0.5
    causal = torch.arange(n)[None, :] <= query_positions[:, None]  # (n_q, n)
    logits = logits.masked_fill(~causal[None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (H_q, n_q, n)
    return probs.sum(dim=(0, 1)) / (n_q * h_q)

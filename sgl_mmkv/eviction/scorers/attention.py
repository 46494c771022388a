"""Torch reference shared by the eviction scorers: causal attention per KV head."""

from __future__ import annotations

import torch


def kv_head_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention, query heads averaged within each GQA group.

    Key ``j`` sits at ``key_positions[j]`` (default: ``j``); query ``i`` sees the keys
    at positions ``<= query_positions[i]``.

    Args:
        queries: ``(n_q, H_q, d)``, RoPE applied.
        keys: ``(n, H_kv, d)``, RoPE applied.
        query_positions: ``(n_q,)`` int.
        key_positions: optional ``(n,)`` int.
    Returns:
        ``(H_kv, n_q, n)`` float32 probabilities; rows sum to 1 where a key is visible.
    """
    n_q, h_q, d = queries.shape
    n, h_kv, _ = keys.shape
    if h_q % h_kv:
        raise ValueError(f"{h_q} query heads are not a multiple of {h_kv} KV heads")
    if key_positions is None:
        key_positions = torch.arange(n)
    k = keys.float().repeat_interleave(h_q // h_kv, dim=1)  # (n, H_q, d)
    logits = torch.einsum("qhd,khd->hqk", queries.float(), k) / d**0.5
    visible = key_positions[None, :].to(query_positions.device) <= query_positions[:, None]
    logits = logits.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # (H_q, n_q, n)
    return probs.view(h_kv, h_q // h_kv, n_q, n).mean(dim=1)

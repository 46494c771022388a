"""The one torch reference of causal-by-position softmax attention.

Every kernel and scorer that needs attention probabilities builds on
:func:`causal_probs`: the scattered-attention kernel's reference (probabilities
times V), the attention-mass reduction's reference (CONDUIT, ProphetKV and the
Triton mass kernel) and the eviction scorers' per-KV-head attention.
"""

from __future__ import annotations

import torch

from sgl_mmkv.kernels.kv_dtype import dequantize

CHUNK_ELEMENTS = 1 << 25  # scores per chunk of queries in attention_mass_reference: 128 MiB fp32


def causal_probs(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention probabilities, computed in float32.

    Key ``j`` sits at ``key_positions[j]`` (default ``j``); query ``i`` sees the keys at
    positions ``<= query_positions[i]``. GQA: each KV head serves ``H_q / H_kv``
    consecutive query heads (the keys are not repeated per query head).

    Args:
        queries: ``(n_q, H_q, d)``, RoPE applied.
        keys: ``(n, H_kv, d)``, RoPE applied.
        query_positions: ``(n_q,)`` int.
        key_positions: optional ``(n,)`` int.
        scale: softmax scale; default divides the logits by ``sqrt(d)``.
    Returns:
        ``(H_q, n_q, n)`` float32; a query that sees no key gets zeros.
    """
    n_q, h_q, d = queries.shape
    n, h_kv, _ = keys.shape
    if h_q % h_kv:
        raise ValueError(f"{h_q} query heads are not a multiple of {h_kv} KV heads")
    device = keys.device
    if key_positions is None:
        key_positions = torch.arange(n, device=device)
    grouped = queries.float().to(device).view(n_q, h_kv, h_q // h_kv, d)
    logits = torch.einsum("qkgd,nkd->kgqn", grouped, keys.float()).reshape(h_q, n_q, n)
    logits.mul_(d**-0.5 if scale is None else scale)
    visible = key_positions.to(device)[None, :] <= query_positions.to(device)[:, None]
    logits.masked_fill_(~visible[None], float("-inf"))
    logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # softmax in place: one buffer
    return logits.div_(logits.sum(dim=-1, keepdim=True)).nan_to_num_(0.0)


def attention_mass_reference(
    queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor
) -> torch.Tensor:
    """Mean causal attention each key receives, ``(H_q, chunk, n)`` scores at a time.

    ``alpha[j] = 1 / (n_q * H_q) * sum_i sum_h causal_probs(...)[h, i, j]``, key ``j`` at
    row position ``j``: the reference of ``attention_mass_triton``.

    Args:
        queries: ``(n_q, H_q, d)``.
        keys: ``(n, H_kv, d)``.
        query_positions: ``(n_q,)`` int.
    Returns:
        ``(n,)`` float32; sums to 1 over keys when every query sees at least one key.
    """
    n_q, h_q, _ = queries.shape
    n = keys.shape[0]
    total = torch.zeros(n, dtype=torch.float32, device=keys.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, h_q * n))
    for start in range(0, n_q, chunk):
        probs = causal_probs(
            queries[start : start + chunk], keys, query_positions[start : start + chunk]
        )
        total += probs.sum(dim=(0, 1))
    return total / (n_q * h_q)


def scattered_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    row_slots: torch.Tensor,
    query_positions: torch.Tensor,
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal-by-position attention of scattered queries over one request row.

    Args:
        q: ``(n_q, H_q, d)`` queries, RoPE applied.
        k_buffer, v_buffer: ``(slots, H_kv, d)`` one layer of the KV pool; fp8 ones
            are dequantized on read (``stored * k_scale``, ``stored * v_scale``).
        row_slots: ``(n,)`` int64: the slot of row position ``j`` is ``row_slots[j]``.
        query_positions: ``(n_q,)`` row position of each query; query ``i`` sees
            keys ``j <= query_positions[i]``.
        sm_scale: softmax scale, default ``1 / sqrt(d)``.
        k_scale, v_scale: the layer's per-tensor KV scales (fp8 buffers only).
    Returns:
        ``(n_q, H_q, d)`` in ``q``'s dtype (computed in float32).
    """
    h_q, h_kv = q.shape[1], k_buffer.shape[1]
    keys = dequantize(k_buffer[row_slots], k_scale)
    probs = causal_probs(q, keys, query_positions, scale=sm_scale)
    v = dequantize(v_buffer[row_slots], v_scale).float().repeat_interleave(h_q // h_kv, dim=1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)

"""Refresh attention for a whole batch: a plan made once per pass, run per layer.

A refresh pass computes, per request, some *active* queries at scattered row
positions; each attends causally by position over its request's whole row, whose
KV lives in pool slots (fresh KV for the active rows, re-positioned segment KV for
the rest; holes of a compressed segment are not part of the row). The batch is
packed as FlashInfer / SGLang's ragged extend packs it:

- queries: ``(N_q, H_q, d)``, request after request (``q_indptr``);
- keys: ``kv_indices``, the pool slots of each request's row without its holes,
  request after request (``kv_indptr``); key ``j`` of a request sits at position
  ``j`` of its compacted row;
- ``q_positions``: ``(N_q,)`` each query's position in its request's compacted row;
  query ``i`` sees the keys ``j <= q_positions[i]`` of its own request.

:class:`RefreshAttentionPlan` holds all of that on the device together with the
host integers a launch needs, so a layer's :func:`refresh_attention` reads no
tensor value on the host (no ``.item()``, no ``torch.equal``, no ``nonzero``).

Kernels: on CUDA the Triton kernel of ``refresh_attention_triton.py`` (tiled with
``tl.dot``, one program per query block of one request and query head); elsewhere,
or with ``SGL_MMKV_REFRESH_ATTENTION=sdpa``, the per-request SDPA of
:func:`~sgl_mmkv.kernels.scattered_attention.scattered_attention_sdpa` (the CPU
path: a whole row runs one causal SDPA, bit for bit SGLang's ``torch_native``;
other query sets one SDPA with an ``(n_q, n)`` causal-by-position mask).

fp8 KV with per-tensor scales (SGLang's fp8 pools): both kernels read the stored
fp8 values, fold ``k_scale`` into the softmax scale and multiply the output by
``v_scale`` (:mod:`sgl_mmkv.kernels.kv_dtype`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgl_mmkv.kernels.scattered_attention import scattered_attention_sdpa

KERNEL_ENV = "SGL_MMKV_REFRESH_ATTENTION"
KERNELS = ("triton", "sdpa")
BLOCK_M = 64


def default_kernel(device: torch.device) -> str:
    """``triton`` on CUDA, ``sdpa`` elsewhere; ``SGL_MMKV_REFRESH_ATTENTION`` overrides."""
    asked = os.environ.get(KERNEL_ENV, "")
    if asked in KERNELS:
        return asked
    if asked:
        raise ValueError(f"{KERNEL_ENV}={asked!r}: expected one of {KERNELS}")
    return "triton" if device.type == "cuda" else "sdpa"


@dataclass(frozen=True)
class RefreshAttentionPlan:
    """Everything one layer's refresh attention needs, built once per pass.

    Attributes:
        q_indptr: ``n_req + 1`` host ints; request ``r``'s queries are packed rows
            ``[q_indptr[r], q_indptr[r + 1])``.
        kv_indptr: ``n_req + 1`` host ints into ``kv_indices``.
        kv_indices: ``(N_kv,)`` int64 pool slots, each request's row without holes.
        q_positions: ``(N_q,)`` int32, position of each query in its compacted row.
        whole_row: per request, whether its queries are its whole row in order
            (the SDPA path then runs one causal SDPA).
        blocks: ``(n_blocks, 4)`` int32 rows ``(q_start, q_end, kv_start, kv_len)``:
            at most ``block_m`` queries of one request, and the keys they can see
            (``kv_len = max position + 1``); heaviest first.
        block_m: queries per block (the Triton kernel's ``BLOCK_M``).
        max_q_len, max_kv_len: longest query set and row, host ints.
        kernel: ``"triton"`` or ``"sdpa"``.
    """

    q_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: torch.Tensor
    q_positions: torch.Tensor
    whole_row: list[bool]
    blocks: torch.Tensor
    block_m: int
    max_q_len: int
    max_kv_len: int
    kernel: str

    @property
    def num_queries(self) -> int:
        return self.q_indptr[-1]


def plan_refresh_attention(
    query_positions: Sequence[torch.Tensor],
    kv_indices: torch.Tensor,
    kv_lens: Sequence[int],
    *,
    kernel: str | None = None,
    block_m: int = BLOCK_M,
) -> RefreshAttentionPlan:
    """Pack a batch's queries and rows into a :class:`RefreshAttentionPlan`.

    Args:
        query_positions: per request ``(n_r,)`` int positions of its queries in its
            compacted row, in packed order (host tensors: read here, once).
        kv_indices: ``(sum kv_lens,)`` int pool slots of the rows, request after
            request, on the device the kernels run on.
        kv_lens: per request, the length of its compacted row.
        kernel: ``"triton"`` / ``"sdpa"``; default :func:`default_kernel`.
        block_m: queries per Triton block.
    Raises:
        ValueError: a query outside its row, lengths that do not add up, or a bad
            ``block_m``.
    """
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m}: a power of two >= 16 (tl.dot's smallest tile)")
    if len(query_positions) != len(kv_lens):
        raise ValueError(f"{len(query_positions)} query sets for {len(kv_lens)} rows")
    if sum(kv_lens) != kv_indices.numel():
        raise ValueError(f"kv_lens add up to {sum(kv_lens)}, kv_indices has {kv_indices.numel()}")
    device = kv_indices.device
    positions = [p.detach().to("cpu", torch.int64).flatten() for p in query_positions]
    q_indptr, kv_indptr, whole_row, blocks = [0], [0], [], []
    for pos, kv_len in zip(positions, kv_lens, strict=True):
        n, q0, kv0 = pos.numel(), q_indptr[-1], kv_indptr[-1]
        if n and (int(pos.min()) < 0 or int(pos.max()) >= kv_len):
            raise ValueError("a query position lies outside the row")
        whole_row.append(n == kv_len and n > 0 and bool((pos == torch.arange(n)).all()))
        for lo in range(0, n, block_m):
            hi = min(n, lo + block_m)
            blocks.append((q0 + lo, q0 + hi, kv0, int(pos[lo:hi].max()) + 1))
        q_indptr.append(q0 + n)
        kv_indptr.append(kv0 + kv_len)
    blocks.sort(key=lambda b: -b[3])
    table = torch.tensor(blocks, dtype=torch.int32).reshape(-1, 4)
    flat = torch.cat(positions) if positions else torch.empty(0, dtype=torch.int64)
    return RefreshAttentionPlan(
        q_indptr=q_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices.to(torch.int64),
        q_positions=flat.to(torch.int32).to(device),
        whole_row=whole_row,
        blocks=table.to(device),
        block_m=block_m,
        max_q_len=max((p.numel() for p in positions), default=0),
        max_kv_len=max(kv_lens, default=0),
        kernel=kernel or default_kernel(device),
    )


def refresh_attention_sdpa(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: RefreshAttentionPlan,
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Per-request SDPA (the reference path; host integers only, from the plan).

    Args:
        q: ``(N_q, H_q, d)``; k_buffer, v_buffer: ``(slots, H_kv, d / d_v)``.
        k_scale, v_scale: per-tensor scales of fp8 KV (1.0 for plain KV).
    Returns:
        ``(N_q, H_q, d_v)`` in ``q``'s dtype.
    """
    out = q.new_empty((q.shape[0], q.shape[1], v_buffer.shape[-1]))
    for r, whole in enumerate(plan.whole_row):
        q0, q1 = plan.q_indptr[r], plan.q_indptr[r + 1]
        if q0 == q1:
            continue
        slots = plan.kv_indices[plan.kv_indptr[r] : plan.kv_indptr[r + 1]]
        out[q0:q1] = scattered_attention_sdpa(
            q[q0:q1],
            k_buffer,
            v_buffer,
            slots,
            plan.q_positions[q0:q1],
            sm_scale,
            whole_row=whole,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return out


def refresh_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    plan: RefreshAttentionPlan,
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal-by-position attention of every request's queries over its row.

    Args:
        q: ``(N_q, H_q, d)`` packed queries, RoPE applied (``N_q = plan.num_queries``).
        k_buffer, v_buffer: ``(slots, H_kv, d)`` / ``(slots, H_kv, d_v)``, one layer
            of the KV pool; ``H_q`` a multiple of ``H_kv``. Plain float, or fp8
            holding ``value / scale``.
        plan: from :func:`plan_refresh_attention`.
        sm_scale: softmax scale, default ``1 / sqrt(d)``.
        k_scale, v_scale: the layer's per-tensor KV scales (fp8; 1.0 for plain KV).
    Returns:
        ``(N_q, H_q, d_v)`` in ``q``'s dtype.
    """
    if q.shape[1] % k_buffer.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_buffer.shape[1]}")
    if q.shape[0] != plan.num_queries:
        raise ValueError(f"{q.shape[0]} queries for a plan of {plan.num_queries}")
    if plan.kernel == "sdpa":
        return refresh_attention_sdpa(q, k_buffer, v_buffer, plan, sm_scale, k_scale, v_scale)
    from sgl_mmkv.kernels.refresh_attention_triton import refresh_attention_triton

    return refresh_attention_triton(
        q, k_buffer, v_buffer, plan, sm_scale, k_scale=k_scale, v_scale=v_scale
    )

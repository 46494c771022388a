"""Decode-time compression (``--mm-compress-at decode``): after its prefill, a request's
own row keeps only the top ``--mm-kv-budget`` of each image's tokens for decoding.

The refresh executor hands over each extend's rankings (:meth:`DecodeCompressor.plan`);
the prefill-result patch calls :meth:`before` and :meth:`after` around SGLang's
``process_batch_result_prefill``. In :meth:`after` the dropped slots go back to the
allocator, the kept ones move down in ``req_to_token`` so the row stays dense, and
every length SGLang keeps for the request shrinks by the dropped count ``d``:
``kv_committed_len`` / ``kv_allocated_len`` (what release frees), the batch's
``seq_lens`` (where decode writes and how far it attends).

Positions stay right through M-RoPE's per-request offset: a decode token's position
is ``seq_len - 1 + mrope_position_delta``, so the delta grows by ``d``. The kept
tokens' KV already carries its rotary positions. Models without M-RoPE derive the
position from ``seq_len`` alone and are refused at start-up.

A compressed row is not the KV of its token ids, so the request is kept out of the
radix tree (``skip_radix_cache_insert``); its images still fill the segment store
whole, from the prefill. On release (finish or retraction) the request's M-RoPE
state is put back, so a retracted request prefills again from its original inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_mmkv.counters import Counters
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.ranker import Span
from sgl_mmkv.scoring.base import top_tokens


@dataclass(slots=True)
class DecodeCompressionCounters(Counters):
    compressed_requests: int = 0
    freed_tokens: int = 0
    skipped_requests: int = 0  # planned, but finished, retracted or still chunked
    failures: int = 0  # batches left uncompressed because compressing them raised


@dataclass(slots=True)
class RowPlan:
    """Row positions ``drop`` (sorted, all in ``[prefix_len, seq_len)``) to free from
    the request's row once its prefill of ``seq_len`` tokens is committed."""

    seq_len: int
    drop: torch.Tensor


@dataclass(slots=True)
class SavedRequestState:
    mrope_positions: torch.Tensor | None
    mrope_position_delta: torch.Tensor
    skip_radix_cache_insert: bool


def dropped_positions(budget: float, ranked: dict[Span, torch.Tensor]) -> torch.Tensor:
    """``(d,)`` sorted row positions outside each image's top ``ceil(budget * n)``."""
    drop = []
    for (start, _end), ranking in ranked.items():
        keep = torch.zeros(ranking.numel(), dtype=torch.bool)
        keep[top_tokens(ranking, budget)] = True
        drop.append((~keep).nonzero().flatten() + start)
    if not drop:
        return torch.empty(0, dtype=torch.long)
    return torch.cat(drop).sort().values


class DecodeCompressor:
    """Args:
    budget: ``--mm-kv-budget``, the fraction of each image's tokens kept.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.counters = DecodeCompressionCounters()
        self._pending: dict[int, RowPlan] = {}  # req_to_token row -> plan
        self._eligible: set[int] = set()
        self._saved: dict[str, SavedRequestState] = {}  # rid -> state to restore

    def plan(
        self, forward_batch, plans: list[RequestPlan], ranked: dict[int, dict[Span, torch.Tensor]]
    ) -> None:
        """Remember which positions each ranked request of this extend drops."""
        for plan in plans:
            drop = dropped_positions(self.budget, ranked.get(plan.index, {}))
            if drop.numel():
                row = int(forward_batch.req_pool_indices[plan.index])
                self._pending[row] = RowPlan(plan.seq_len, drop)

    def before(self, batch) -> None:
        """Bar from the tree every request whose row will shrink (its last prefill
        chunk, decoding to follow), before the stock result processing inserts it."""
        self._eligible.clear()
        for req in batch.reqs:
            row = req.kv.req_pool_idx
            if row not in self._pending or req.multimodal_inputs is None:
                continue
            if req.inflight_middle_chunks > 0 or req.sampling_params.max_new_tokens <= 1:
                continue
            self._eligible.add(row)
            self._saved[req.rid] = SavedRequestState(
                req.multimodal_inputs.mrope_positions,
                req.multimodal_inputs.mrope_position_delta,
                req.skip_radix_cache_insert,
            )
            req.skip_radix_cache_insert = True

    def after(self, batch, req_to_token_pool, allocator) -> None:
        """Shrink the row of every eligible request that is still running."""
        try:
            fault_point("decode_compression")
            for i, req in enumerate(batch.reqs):
                row = req.kv.req_pool_idx
                if row not in self._eligible:
                    continue
                plan = self._pending[row]
                if req.finished() or req.is_retracted or req.kv.kv_committed_len != plan.seq_len:
                    self.counters.skipped_requests += 1
                    continue
                self._shrink(batch, i, req, plan, req_to_token_pool, allocator)
        finally:
            self._pending.clear()
            self._eligible.clear()

    def _shrink(self, batch, i: int, req, plan: RowPlan, req_to_token_pool, allocator) -> None:
        table = req_to_token_pool.req_to_token
        row = table[req.kv.req_pool_idx]
        length, d = plan.seq_len, int(plan.drop.numel())
        kept = torch.ones(length, dtype=torch.bool)
        kept[plan.drop] = False
        kept = kept.to(row.device)
        allocator.free(row[:length][~kept].to(torch.int64))
        row[: length - d] = row[:length][kept].clone()
        req.kv.kv_committed_len -= d
        req.kv.kv_allocated_len -= d
        batch.seq_lens = batch.seq_lens.clone()
        batch.seq_lens[i] -= d
        batch.seq_lens_cpu = batch.seq_lens_cpu.clone()
        batch.seq_lens_cpu[i] -= d
        if batch.orig_seq_lens is not None:
            batch.orig_seq_lens = batch.orig_seq_lens.clone()
            batch.orig_seq_lens[i] -= d
        batch.seq_lens_sum = None
        mm = req.multimodal_inputs
        mm.mrope_position_delta = mm.mrope_position_delta + d
        mm.mrope_position_delta_repeated_cache = None
        mm.mrope_positions = None  # decode must derive positions from the delta
        self.counters.compressed_requests += 1
        self.counters.freed_tokens += d

    def abandon(self) -> None:
        """Compress nothing that is planned (the batch's forward or its compression
        failed); requests already barred from the tree stay out of it."""
        self._pending.clear()
        self._eligible.clear()

    def restore(self, req) -> None:
        """Put back the request's M-RoPE state and tree flag (its row is released)."""
        saved = self._saved.pop(req.rid, None)
        if saved is None:
            return
        mm = req.multimodal_inputs
        if mm is not None:
            mm.mrope_positions = saved.mrope_positions
            mm.mrope_position_delta = saved.mrope_position_delta
            mm.mrope_position_delta_repeated_cache = None
        req.skip_radix_cache_insert = saved.skip_radix_cache_insert

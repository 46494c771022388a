"""Rows that drop tokens after their prefill: reuse holes and decode-time compression.

Two sources plan rows to shrink, both handed over by the refresh executor during an
extend forward:

- **reuse holes** (:meth:`RowCompactor.plan_holes`): a reused segment that was
  compressed lacks the KV of its dropped tokens; the extend neither computes nor
  attends to them, so their row positions hold no KV and must never be read;
- **decode-time compression** (``--mm-compress-at decode``, :meth:`RowCompactor.plan`):
  each image of the extend keeps only its top ``--mm-kv-budget`` tokens for decoding.

Before the batch's forward (``patches/scheduler_run_batch.py``) :meth:`RowCompactor.admit`
names the requests whose rows may shrink after it: those whose prefill this forward
completes (not the batch's middle chunk, the scheduler's ``chunked_req``) and that no
session keeps a row or inputs for. The executor plans holes and drops for them alone;
anything else computes every row position. Right after the batch's forward, before the
scheduler builds its next batch, :meth:`RowCompactor.compact` frees the dropped
slots, moves the kept ones down in ``req_to_token`` so the row stays dense, and
shrinks every length SGLang keeps for the request by the dropped count ``d``:
``kv_committed_len`` / ``kv_allocated_len`` (what release frees), the batch's
``seq_lens`` (where decode writes and how far it attends).

Positions stay right through a per-request offset. With M-RoPE a decode token's
position is ``seq_len - 1 + mrope_position_delta``, so the delta grows by ``d``.
1-D RoPE models derive it from ``seq_len`` alone, so the request's position offset
(:meth:`RowCompactor.position_offset`) grows by ``d`` and
``patches/forward_batch_positions.py`` adds it to every later position. The kept
tokens' KV already carries its rotary positions. Decode-time compression is still
refused for 1-D RoPE models at start-up.

At ``--tp-size`` > 1 every rank's scheduler shrinks its own rows, and the ranks'
schedulers must stay in step (equal lengths, equal free memory). After an extend
batch with images, before any row shrinks, the ranks agree (one MAX all-reduce of a
failure flag over the CPU group): if any rank failed before compacting, or planned
apart from the others (its admission failed), no rank shrinks a row of that batch
and every rank keeps its rows with holes from decoding (``rank_cancelled``). A
failure inside a shrink, after the ranks agreed, is that rank's alone, as a failure
inside a pass is.

A compacted row is not the KV of its token ids, so the request is kept out of the
radix tree (``skip_radix_cache_insert``). A row with holes that cannot be shrunk is
never decoded: it is kept out of the tree and, if the request is still live, aborted
with an error (``aborted_requests``). On release (finish or retraction) the
request's position state is put back, so a retracted request prefills again from its
original inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sgl_mmkv.counters import Counters
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.rank_agreement import RankAgreement
from sgl_mmkv.refresh.ranker import Span
from sgl_mmkv.scoring.base import top_tokens

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RowCompactionCounters(Counters):
    compressed_requests: int = 0  # decode-time compression
    freed_tokens: int = 0
    holed_requests: int = 0  # rows shrunk by reuse holes
    hole_tokens: int = 0
    skipped_requests: int = 0  # decode drops planned, but the request finished or retracted
    aborted_requests: int = 0  # live rows with holes that could not be shrunk
    rank_cancelled: int = 0  # TP > 1: extend batches whose compaction a rank's failure cancelled
    failures: int = 0  # batches left uncompacted because compacting them raised


@dataclass(slots=True)
class RowPlan:
    """Row positions to free from a request's row once its prefill of ``seq_len``
    tokens is committed: ``holes`` (never computed, must go) and ``drop``
    (decode-time compression), each sorted, all in ``[prefix_len, seq_len)``, host
    tensors (moved to the row's device once, when the row shrinks)."""

    seq_len: int
    holes: torch.Tensor
    drop: torch.Tensor

    def removed(self) -> torch.Tensor:
        """``(d,)`` sorted unique row positions to free."""
        return torch.cat([self.holes, self.drop]).unique()


@dataclass(slots=True)
class SavedRequestState:
    mrope_positions: torch.Tensor | None
    mrope_position_delta: torch.Tensor | None
    skip_radix_cache_insert: bool


def dropped_positions(budget: float, ranked: dict[Span, torch.Tensor]) -> torch.Tensor:
    """``(d,)`` sorted row positions outside each image's top ``ceil(budget * n)``, on
    the rankings' device (the host without rankings)."""
    drop = []
    for (start, _end), ranking in ranked.items():
        keep = torch.zeros(ranking.numel(), dtype=torch.bool, device=ranking.device)
        keep[top_tokens(ranking, budget)] = True
        drop.append((~keep).nonzero().flatten() + start)
    if not drop:
        return torch.empty(0, dtype=torch.long)
    return torch.cat(drop).sort().values


_EMPTY = torch.empty(0, dtype=torch.long)


class RowCompactor:
    """Args:
    budget: ``--mm-kv-budget``, the fraction of each image's tokens decode-time
        compression keeps; None without decode-time compression.
    holes: whether reused compressed segments leave holes (``--mm-compressed-reuse``).
    agreement: the TP ranks' agreement (a no-op at TP 1).
    """

    def __init__(
        self, budget: float | None, holes: bool = False, agreement: RankAgreement | None = None
    ) -> None:
        self.budget = budget
        self.holes = holes
        self.agreement = agreement or RankAgreement()
        self._diverged = False  # this rank planned apart from the others (TP > 1)
        self.counters = RowCompactionCounters()
        self._pending: dict[int, RowPlan] = {}  # req_to_token row -> plan
        self._saved: dict[str, SavedRequestState] = {}  # rid -> state to restore
        self._offsets: dict[str, int] = {}  # rid -> row shorter than the sequence by
        self._admitted: frozenset[str] = frozenset()  # rids of the coming forward

    def admit(self, batch) -> None:
        """Before ``batch``'s forward: the rids whose rows may shrink after it. A request
        qualifies when this forward completes its prefill (it is not ``batch``'s middle
        chunk) and it is in no session (a session keeps the row or the multimodal
        inputs for its next turn, which extends the row as the sequence it was)."""
        chunked = getattr(batch, "chunked_req", None)
        self._admitted = frozenset(
            req.rid
            for req in batch.reqs
            if req is not chunked
            and getattr(req, "session", None) is None
            and req.multimodal_inputs is not None
        )

    @property
    def pending(self) -> bool:
        """Whether rows are planned to shrink after the current forward."""
        return bool(self._pending)

    def position_offset(self, rid: str) -> int:
        """How far the row of 1-D RoPE request ``rid`` is shorter than its sequence
        (0 unless holes left it): what its decode positions move up by."""
        return self._offsets.get(rid, 0)

    def may_shrink(self, rid: str) -> bool:
        """Whether the row of ``rid`` may lose positions after the current forward."""
        return rid in self._admitted

    def plan_holes(self, forward_batch, plans: list[RequestPlan]) -> None:
        """Remember the holes of every request of this extend that has some."""
        for plan in plans:
            holes = plan.rows(plan.hole_mask())
            if holes.numel():
                self._plan_row(forward_batch, plan, holes=holes)

    def plan(
        self, forward_batch, plans: list[RequestPlan], ranked: dict[int, dict[Span, torch.Tensor]]
    ) -> None:
        """Remember which positions decode-time compression drops from each ranked
        request of this extend."""
        if self.budget is None:
            return
        for plan in plans:
            if not self.may_shrink(forward_batch.rids[plan.index]):
                continue
            drop = dropped_positions(self.budget, ranked.get(plan.index, {}))
            if drop.numel():
                self._plan_row(forward_batch, plan, drop=drop)

    def _plan_row(self, forward_batch, plan: RequestPlan, holes=_EMPTY, drop=_EMPTY) -> None:
        row = int(forward_batch.req_pool_indices[plan.index])
        holes, drop = holes.cpu(), drop.cpu()  # a RowPlan is host metadata
        old = self._pending.get(row)
        if old is not None and old.seq_len == plan.seq_len:
            holes, drop = torch.cat([old.holes, holes]), torch.cat([old.drop, drop])
        self._pending[row] = RowPlan(plan.seq_len, holes.sort().values, drop.sort().values)

    def compact(self, batch, req_to_token_pool, allocator) -> None:
        """After ``batch``'s forward: bar every planned request from the tree and shrink
        its row (a row with holes always; a decode-compressed one only if it will
        decode). A row with holes that is not shrunk, for any reason (the request
        finished or was retracted meanwhile, or compacting raised), is barred from the
        tree and, while its request is live, aborted: its holes hold no KV."""
        pending, self._pending = self._pending, {}
        self._admitted = frozenset()
        planned = [
            (i, req, pending[req.kv.req_pool_idx])
            for i, req in enumerate(batch.reqs)
            if req.kv.req_pool_idx in pending
        ]
        error = None
        try:
            fault_point("row_compaction")
        except Exception as caught:
            error = caught
        if self._cancelled(batch, error is not None):
            for _, req, plan in planned:
                if plan.holes.numel():
                    self._bar(req)
            if error is not None:
                raise error
            return
        shrunk, barred = set(), set()
        try:
            for i, req, plan in planned:
                if self._shrinks(req, plan):
                    self._shrink(batch, i, req, plan, req_to_token_pool, allocator)
                    shrunk.add(i)
                elif plan.holes.numel():
                    self._bar(req)
                    barred.add(i)
                else:
                    self.counters.skipped_requests += 1
        except Exception:
            for i, req, plan in planned:
                if plan.holes.numel() and i not in shrunk and i not in barred:
                    self._bar(req)
            raise

    def _cancelled(self, batch, failed: bool) -> bool:
        """Whether this batch's compaction is cancelled: this rank failed before it
        or, at TP > 1 after an extend batch with images (the same batches on every
        rank), any rank failed or planned apart (one MAX all-reduce, before any row
        shrinks, so every rank's rows and free memory stay equal)."""
        diverged, self._diverged = self._diverged, False
        if not self.agreement.active or not batch.forward_mode.is_extend():
            return failed
        if all(req.multimodal_inputs is None for req in batch.reqs):
            return failed
        if self.agreement.any_failed(failed or diverged):
            self.counters.rank_cancelled += 1
            return True
        return False

    def _shrinks(self, req, plan: RowPlan) -> bool:
        """Whether ``req``'s row is shrunk by ``plan`` now (and kept out of the tree)."""
        if req.multimodal_inputs is None or req.is_retracted or req.finished():
            return False
        if req.kv.kv_committed_len != plan.seq_len:
            return False
        if plan.holes.numel():
            return True
        # decode-time compression leaves a request that stops at its first token to the tree
        return req.sampling_params.max_new_tokens > 1

    def _bar(self, req) -> None:
        """Keep a row with unshrunk holes out of the tree and from decoding (a retracted
        request prefills again from its inputs)."""
        self._save(req)
        req.skip_radix_cache_insert = True
        if not req.finished() and not req.is_retracted:
            req.set_finish_with_abort("sgl_mmkv: a reused row could not be compacted")
            self.counters.aborted_requests += 1

    def _save(self, req) -> None:
        """Remember the request's position state and tree flag, once, for :meth:`restore`."""
        if req.rid in self._saved:
            return
        mm = req.multimodal_inputs
        self._saved[req.rid] = SavedRequestState(
            None if mm is None else mm.mrope_positions,
            None if mm is None else mm.mrope_position_delta,
            req.skip_radix_cache_insert,
        )

    def _shrink(self, batch, i: int, req, plan: RowPlan, req_to_token_pool, allocator) -> None:
        mm = req.multimodal_inputs
        self._save(req)
        req.skip_radix_cache_insert = True
        removed = plan.removed()
        table = req_to_token_pool.req_to_token
        row = table[req.kv.req_pool_idx]
        length, d = plan.seq_len, int(removed.numel())
        kept = torch.ones(length, dtype=torch.bool)
        kept[removed] = False
        # host positions, moved to the row's device once: no boolean mask on the device
        kept, removed = kept.nonzero().flatten().to(row.device), removed.to(row.device)
        allocator.free(row[removed].to(torch.int64))
        row[: length - d] = row[kept]
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
        if mm.mrope_position_delta is not None:
            mm.mrope_position_delta = mm.mrope_position_delta + d
            mm.mrope_position_delta_repeated_cache = None
            mm.mrope_positions = None  # decode must derive positions from the delta
        else:
            self._offsets[req.rid] = self.position_offset(req.rid) + d
        holes = int(plan.holes.numel())
        if holes:
            self.counters.holed_requests += 1
            self.counters.hole_tokens += holes
        if d > holes:
            self.counters.compressed_requests += 1
            self.counters.freed_tokens += d - holes

    def diverge(self) -> None:
        """Compact nothing, and at TP > 1 have no rank compact the coming batch: this
        rank planned apart from the others (its admission failed)."""
        self.abandon()
        self._diverged = True

    def abandon(self) -> None:
        """Compact nothing that is planned (the batch's forward failed and ran again
        as stock, which computed every row position)."""
        self._pending.clear()
        self._admitted = frozenset()

    def restore(self, req) -> None:
        """Put back the request's position state and tree flag (its row is released)."""
        saved = self._saved.pop(req.rid, None)
        if saved is None:
            return
        mm = req.multimodal_inputs
        if mm is not None:
            mm.mrope_positions = saved.mrope_positions
            mm.mrope_position_delta = saved.mrope_position_delta
            mm.mrope_position_delta_repeated_cache = None
        req.skip_radix_cache_insert = saved.skip_radix_cache_insert
        self._offsets.pop(req.rid, None)

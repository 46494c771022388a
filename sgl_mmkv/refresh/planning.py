"""Planning an extend forward: the reuse plans, finished before anything runs.

:meth:`ExtendPlanner.plan` looks up every request's images (``plan.py``), then
finishes each plan in order and freezes the result in an :class:`ExtendContext`:

1. a request whose outputs need more prompt rows than its last (input logprobs from
   an earlier start), or a batch that returns every row's hidden states, reuses
   nothing: it is computed in full;
2. holes: a compressed segment's dropped tokens are left out (neither computed nor
   attended) when the row compactor shrinks the row after this forward
   (:meth:`RowCompactor.may_shrink`) and the extend does not end in one of them;
   elsewhere they are computed fresh;
3. the cost gate (``--mm-reuse-gate cost``): a request whose reuse would compute at
   least its full prefill reuses nothing;
4. at ``--tp-size`` > 1, the ranks' plans compared (:meth:`RankAgreement.plans`, one
   small all-reduce in a batch with images): a request planned differently on
   another rank (its store, its L3 tier or a deadline gave another answer) reuses
   nothing on every rank (and, where new images shape a collective, stores none),
   and a rank that failed to plan makes every rank answer the batch as stock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.cost import reuse_flops
from sgl_mmkv.refresh.embedding_pass import EmbeddingPass, EmbeddingSlot
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.flops import DecoderShape
from sgl_mmkv.refresh.plan import RequestPlan, plan_batch
from sgl_mmkv.refresh.rank_agreement import PeerFailed, RankAgreement, plan_signature
from sgl_mmkv.refresh.row_view import RowView
from sgl_mmkv.refresh.sub_batch import needs_every_row
from sgl_mmkv.scoring import RefreshBudget, TokenScorer
from sgl_mmkv.segments.store import SegmentStore

if TYPE_CHECKING:
    from sgl_mmkv.refresh.report import RefreshCounters
    from sgl_mmkv.refresh.row_compaction import RowCompactor

GATES = ("cost", "always")


class ExtendPlanner:
    """Args:
    store: the segment store.
    scorer: the ``--mm-reuse`` method (what reuse costs depends on its passes).
    budget: ``--mm-refresh-budget``.
    gate: ``--mm-reuse-gate``: ``cost`` or ``always``.
    counters: the executor's counters (``stock_batches``, ``declined_reuses``).
    compactor: the row compactor, when rows may shrink after their prefill.
    embedding_slot: the process's embedding slot, for the contexts' passes.
    agreement: the TP ranks' agreement (a no-op at TP 1).
    agree_fills: the ranks compare new images too (an eviction ranking or a canonical
        fill runs collectives over them); a request whose new images differ between
        ranks then stores none.
    """

    def __init__(
        self,
        store: SegmentStore,
        scorer: TokenScorer,
        budget: RefreshBudget,
        gate: str,
        counters: RefreshCounters,
        compactor: RowCompactor | None = None,
        embedding_slot: EmbeddingSlot | None = None,
        agreement: RankAgreement | None = None,
        agree_fills: bool = False,
    ) -> None:
        if gate not in GATES:
            raise ValueError(f"unknown reuse gate {gate!r}; choose one of {', '.join(GATES)}")
        self.store = store
        self.scorer = scorer
        self.budget = budget
        self.gate = gate
        self.counters = counters
        self.compactor = compactor
        self.embedding_slot = embedding_slot or EmbeddingSlot()
        self.agreement = agreement or RankAgreement()
        self.agree_fills = agree_fills
        self._shape: DecoderShape | None = None

    def plan(self, run_extend: Callable, model_runner, forward_batch) -> ExtendContext:
        """The frozen context of one extend forward. At TP > 1 every rank returns the
        same plans, or every rank raises (this rank's error, or :class:`PeerFailed`)."""
        finished, error = None, None
        try:
            finished = self._plans(model_runner, forward_batch)
        except Exception as caught:
            error = caught
        if self.agreement.active and any(m is not None for m in forward_batch.mm_inputs or ()):
            finished = self._agreed(finished, forward_batch.batch_size, error)
        elif error is not None:
            raise error
        return ExtendContext(
            run_extend=run_extend,
            model_runner=model_runner,
            forward_batch=forward_batch,
            plans=finished,
            views=tuple(RowView.of(plan) for plan in finished),
            shape=self._shape,
            embeddings=EmbeddingPass(
                full_batch=forward_batch, stock_backend=model_runner.attn_backend
            ),
            embedding_slot=self.embedding_slot,
        )

    def _plans(self, model_runner, forward_batch) -> tuple[RequestPlan, ...]:
        plans = plan_batch(self.store, forward_batch)
        fault_point("plan")
        if self._shape is None:
            self._shape = DecoderShape.from_config(model_runner.model_config.hf_text_config)
        mode = forward_batch.capture_hidden_mode
        every_row = mode is not None and mode.is_full()
        if every_row and any(p.spans for p in plans):
            self.counters.stock_batches += 1
        return tuple(self._finish(forward_batch, plan, every_row) for plan in plans)

    def _agreed(
        self, plans: tuple[RequestPlan, ...] | None, size: int, error: Exception | None
    ) -> tuple[RequestPlan, ...]:
        """``plans`` with every request the ranks planned differently reusing nothing;
        raises on every rank if any failed to plan. Run by every rank for a batch with
        images (``mm_inputs`` is the batch's, the same on every rank)."""
        signatures = None
        if plans is not None:
            signatures = [plan_signature(p, self.agree_fills) for p in plans]
        same, failed = self.agreement.plans(signatures, size, error is not None)
        if failed:
            reason = "plan" if error is None else f"plan: {error!r}"
            raise PeerFailed(reason) from error
        agreed = []
        for plan, ok in zip(plans, same, strict=True):
            if not ok and (plan.spans or (self.agree_fills and plan.fills)):
                self.counters.rank_disagreements += 1
                fills = () if self.agree_fills else plan.fills
                plan = replace(plan, spans=(), holes=False, fills=fills)
            agreed.append(plan)
        return tuple(agreed)

    def _finish(self, forward_batch, plan: RequestPlan, every_row: bool) -> RequestPlan:
        if not plan.spans:
            return plan
        if every_row or needs_every_row(forward_batch, plan.index):
            return replace(plan, spans=())
        if self._holes_allowed(forward_batch, plan):
            plan = replace(plan, holes=True)
        if self.gate == "cost" and self._too_costly(plan):
            self.counters.declined_reuses += 1
            return replace(plan, spans=(), holes=False)
        return plan

    def _holes_allowed(self, forward_batch, plan: RequestPlan) -> bool:
        compactor = self.compactor
        if compactor is None or not compactor.holes:
            return False
        if not compactor.may_shrink(forward_batch.rids[plan.index]):
            return False
        return not bool(plan.dropped_mask()[-1])  # the logits read the extend's last row

    def _too_costly(self, plan: RequestPlan) -> bool:
        full = self._shape.extend_flops(plan.prefix_len, plan.seq_len)
        deltas = tuple(span.delta for span in plan.spans)
        sizes = tuple(span.end - span.start for span in plan.spans)  # what auto's quota counts
        bound = self.scorer.budget_bound(self.budget, deltas, sizes)
        return reuse_flops(self._shape, plan, self.scorer, bound) >= full

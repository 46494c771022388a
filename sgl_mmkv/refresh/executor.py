"""The refresh executor: an extend forward with image spans served from the segment store.

One batch, top to bottom (:meth:`RefreshExecutor.execute_extend`):

1. **plan** (``planning.py``): every request's images looked up; the plans finished
   (unsupported rows, holes, the cost gate) and frozen in an :class:`ExtendContext`.
   A batch that reuses nothing runs the stock extend, observed for eviction
   ranking if asked, and goes to step 6.
2. **copy** (``kv_copy.py``): every reused span's KV copied from its segment into the
   request's own slots, K rotated by the position delta, all layers.
3. **select** (``selection.py``): the scorer's top-k of the reused image tokens,
   after a scoring pass (attention scorers) or CacheBlend's deviation pass.
4. **refresh rows** (``cost.py``): per request, the tokens the refresh pass runs:
   fresh and selected ones, none before the first whose input changed since the
   scoring pass.
5. **refresh** (``passes.py``): those tokens run through every layer, attending by
   position over the whole row; its logits are the batch's output. When it would
   compute each request's last row alone (nothing selected before it, no earlier
   row asked for), the scoring pass computed those rows over the same KV, so its
   output is the batch's and this pass is not run (``cost.only_last_rows``). Holes
   are handed to the row compactor.
6. **rank, fill, report**, shared by both paths: eviction rankings of the observed
   images (``ranker.py``), new images into the store (``fill.py``), counters and
   per-request facts (``report.py``).

Stock SGLang code runs every pass (``EagerRunner._execute_extend`` on a sub-batch,
the model's own modules); only the attention backend is ours for the pass. If
anything in our path raises, the batch is answered as stock.

At ``--tp-size`` > 1 every pass runs the model's all-reduces, so every rank must
run the same passes over the same tokens. The ranks agree (``rank_agreement.py``)
on the plans (step 1), before each pass and at the end (a failure on one rank:
every rank answers the batch as stock), and on the statistics the pick reads
(step 3): a reusing forward runs 6 small collectives (7 when it builds image
embeddings: ``segment_embeddings.py``), a batch with images that reuses nothing 1
or 2, a batch without images none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.cost import only_last_rows, refresh_rows, unchanged_prefix
from sgl_mmkv.refresh.embedding_pass import EmbeddingSlot
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.fill import SegmentFiller
from sgl_mmkv.refresh.kv_copy import SegmentCopier
from sgl_mmkv.refresh.passes import run_pass, run_whole
from sgl_mmkv.refresh.planning import ExtendPlanner
from sgl_mmkv.refresh.rank_agreement import PeerFailed, RankAgreement
from sgl_mmkv.refresh.ranker import Span, VisualRanker
from sgl_mmkv.refresh.report import RefreshCounters, ReuseReporter, phase
from sgl_mmkv.refresh.selection import TokenSelector
from sgl_mmkv.refresh.sub_batch import needs_every_row
from sgl_mmkv.segments.key import SegmentKey

if TYPE_CHECKING:
    from sgl_mmkv.config import MMKVConfig
    from sgl_mmkv.refresh.row_compaction import RowCompactor
    from sgl_mmkv.scoring import TokenScorer
    from sgl_mmkv.segments.store import SegmentStore

logger = logging.getLogger(__name__)


class RefreshExecutor:
    """Runs the extend forwards of the scheduler process with segment reuse.

    Args:
        planner, copier, selector, filler, reporter: the stages' workers, sharing
            ``counters``.
        ranker: ranks images' tokens for scored eviction (``--mm-evict``), or None.
        row_compactor: shrinks rows after their prefill (holes, decode-time
            compression), or None.
        agreement: the TP ranks' agreement, shared with the planner and selector
            (a no-op at TP 1).
    """

    def __init__(
        self,
        planner: ExtendPlanner,
        copier: SegmentCopier,
        selector: TokenSelector,
        filler: SegmentFiller,
        reporter: ReuseReporter,
        counters: RefreshCounters,
        ranker: VisualRanker | None = None,
        row_compactor: RowCompactor | None = None,
        agreement: RankAgreement | None = None,
    ) -> None:
        self.agreement = agreement or RankAgreement()
        self.planner = planner
        self.copier = copier
        self.selector = selector
        self.filler = filler
        self.reporter = reporter
        self.counters = counters
        self.ranker = ranker
        self.row_compactor = row_compactor

    @classmethod
    def from_config(
        cls,
        config: MMKVConfig,
        store: SegmentStore,
        scorer: TokenScorer,
        ranker: VisualRanker | None = None,
        row_compactor: RowCompactor | None = None,
        on_forward: Callable[[], None] | None = None,
        embedding_slot: EmbeddingSlot | None = None,
    ) -> RefreshExecutor:
        """The executor of a server started with ``config``."""
        counters = RefreshCounters()
        agreement = RankAgreement.shared()
        slot = embedding_slot or EmbeddingSlot()
        copier = SegmentCopier()
        budget = config.mm_refresh_budget
        compress = ranker.budget if ranker is not None and config.mm_compress_at == "fill" else None
        return cls(
            ExtendPlanner(
                store,
                scorer,
                budget,
                config.mm_reuse_gate,
                counters,
                row_compactor,
                slot,
                agreement,
                agree_fills=ranker is not None or config.mm_segment_fill == "canonical",
            ),
            copier,
            TokenSelector(scorer, budget, copier, counters, agreement),
            SegmentFiller(store, counters, config.mm_segment_fill, compress, agreement),
            ReuseReporter(scorer.name, counters, config.mm_report_reuse, on_forward),
            counters,
            ranker,
            row_compactor,
            agreement,
        )

    @property
    def scorer(self) -> TokenScorer:
        return self.selector.scorer

    def execute_extend(self, run_extend: Callable, model_runner, forward_batch):
        """``run_extend(forward_batch)`` is the stock eager extend; returns its output."""
        ctx = None
        try:
            started = time.perf_counter()
            ctx = self.planner.plan(run_extend, model_runner, forward_batch)
            self.counters.full_prefill_flops += ctx.full_flops()
            if not ctx.reuses:
                return self._stock(ctx)
            self.counters.plan_seconds += time.perf_counter() - started
            return self._reuse(ctx)
        except Exception as error:
            self.recover(forward_batch, error)
            return _answer_as_stock(run_extend, forward_batch, ctx)
        finally:
            self.counters.rank_collectives = self.agreement.collectives
            self.counters.rank_seconds = self.agreement.seconds

    def _stock(self, ctx: ExtendContext):
        """A batch that reuses nothing: the stock extend, then the shared tail. Its
        output stands if the tail fails (the stock extend computed every row)."""
        observer, error = None, None
        try:
            observer = self.ranker.observer_for(list(ctx.plans)) if self.ranker else None
        except Exception as caught:  # carried to the ranking check
            error = caught
        out = run_whole(ctx, observer)
        self.counters.executed_flops += ctx.full_flops()
        try:
            try:
                self._finish(ctx, out, observer, None, None, 0.0, error)
                error = None
            except PeerFailed:
                raise
            except Exception as caught:
                error = caught
            # at TP > 1, a batch with images: every rank recovers, or none (what the
            # rows shrink by after the forward stays the same on every rank)
            if any(m is not None for m in ctx.forward_batch.mm_inputs or ()):
                self.agreement.check(error, "finish")
            elif error is not None:
                raise error
        except Exception as error:
            self.recover(ctx.forward_batch, error)
        return out

    def _reuse(self, ctx: ExtendContext):
        started = time.perf_counter()
        prepared, error = None, None
        try:
            with phase(self.counters, "copy", ctx.embeddings):
                self.copier.copy(ctx.model_runner, ctx.forward_batch, list(ctx.plans))
            fault_point("copy")
            prepared = self.selector.prepare(ctx)
        except Exception as caught:
            error = caught
        self.agreement.check(error, "copy")  # before the scoring pass
        try:
            with phase(self.counters, "scoring", ctx.embeddings):
                selection = self.selector.select(ctx, prepared)
            selected, scored = selection.tokens, selection.scoring_output
            del selection
            active = self._refresh_rows(ctx, selected)
            observer = self.ranker.observer_for(list(ctx.plans), active) if self.ranker else None
            error = None
        except PeerFailed:
            raise  # every rank raised it, at the selector's own agreement
        except Exception as caught:
            error = caught
        self.agreement.check(error, "selection")  # before the refresh pass
        if observer is None and scored is not None and only_last_rows(active):
            out = scored
            self.counters.skipped_refresh_passes += 1
        else:
            scored = None  # not held through the refresh pass
            with phase(self.counters, "refresh", ctx.embeddings):
                self.counters.executed_flops += ctx.pass_flops(active)
                out = run_pass(ctx, active, observer=observer)
        error = None
        try:
            fault_point("refresh")
            if self.row_compactor is not None:
                self.row_compactor.plan_holes(ctx.forward_batch, list(ctx.plans))
        except Exception as caught:
            error = caught
        try:
            self._finish(ctx, out, observer, active, selected, started, error)
            error = None
        except PeerFailed:
            raise  # every rank raised it, at the same stage check of the tail
        except Exception as caught:
            error = caught
        # every rank returns this output, or every rank answers as stock
        self.agreement.check(error, "finish")
        return out

    def _refresh_rows(self, ctx: ExtendContext, selected: list[torch.Tensor]):
        """Per request ``(extend_len,)`` bool: the tokens the refresh pass runs. The
        tokens a compressed segment lacks got their KV in the scoring (or CacheBlend's)
        pass already, so only the text and the selected tokens run again, none before
        the first token whose input changed since that pass."""
        scorer = self.selector.scorer
        computed = scorer.needs_attention or scorer.needs_fresh_kv
        active = []
        for plan, chosen in zip(ctx.plans, selected, strict=True):
            fresh = plan.fresh_mask()
            if needs_every_row(ctx.forward_batch, plan.index):
                active.append(torch.ones_like(fresh))  # its logprobs read every row
                continue
            skip = unchanged_prefix(plan, chosen, scorer.needs_fresh_kv) if computed else 0
            active.append(refresh_rows(plan, fresh, chosen, computed, skip))
        return active

    def _finish(
        self, ctx: ExtendContext, out, observer, active, selected, started, error=None
    ) -> None:
        """Rank the observed images, store the new ones, count the forward; raises
        ``error`` (this rank's failure earlier in the tail) or its own. At TP > 1 the
        ranks pass the tail's stage checks in one order whatever failed where: a
        failed rank carries its error to the next check (``ranking`` when images are
        ranked, the canonical fill's before its pass), where every rank raises
        :class:`PeerFailed`."""
        rankings, error = self._rank(ctx, observer, active, error)
        with phase(self.counters, "fill", ctx.embeddings):
            error = self.filler.fill(ctx, rankings, error)
        if error is not None:
            raise error
        seconds = 0.0 if selected is None else time.perf_counter() - started
        self.reporter.report(ctx, selected, out, seconds)

    def _rank(
        self, ctx: ExtendContext, observer, active, error: BaseException | None
    ) -> tuple[dict[SegmentKey, torch.Tensor] | None, BaseException | None]:
        """Rank the observed images once, for the store's new segments (content key
        -> ``(n,)``) and for decode-time compression (handed over); with the error
        carried on (``error``, or this stage's own)."""
        ranks = self.ranker is not None and any(self.ranker.spans_of(p) for p in ctx.plans)
        if not ranks:  # the same on every rank (agreed plans)
            return None, error if error is not None else _fault("ranking")
        started = time.perf_counter()
        plans = list(ctx.plans)
        try:
            ranked: dict[int, dict[Span, torch.Tensor]] = self.ranker.rank_batch(
                observer, ctx.model_runner, ctx.forward_batch, plans, active, list(ctx.views), error
            )
        except PeerFailed:
            raise  # every rank raised it, at the ranking check
        except Exception as caught:  # this rank's own: on to the fill's check, if any
            return None, caught
        self.counters.ranking_seconds += time.perf_counter() - started
        try:
            if self.row_compactor is not None:
                self.row_compactor.plan(ctx.forward_batch, plans, ranked)
        except Exception as caught:
            return None, caught
        rankings = {
            fill.key: ranked[plan.index][(fill.start, fill.end)]
            for plan in plans
            for fill in plan.fills
            if (fill.start, fill.end) in ranked.get(plan.index, {})
        }
        return rankings, None

    def recover(self, forward_batch, error: BaseException) -> None:
        """After our path failed mid-forward: no row compaction stays planned for the
        batch (the stock extend that answers it computes every row position, and a
        canonical fill discards its reservations itself)."""
        self.counters.fallbacks += 1
        if self.row_compactor is not None:
            self.row_compactor.abandon()
        logger.warning(
            "sgl_mmkv: refresh path failed (%r) for rids %s; the batch runs as stock",
            error,
            forward_batch.rids,
            exc_info=error if self.counters.fallbacks == 1 else None,  # the first in full
        )


def _fault(stage: str) -> BaseException | None:
    """The fault injected at ``stage`` (tests), as an error to carry; None if none."""
    try:
        fault_point(stage)
    except Exception as caught:
        return caught
    return None


def _answer_as_stock(run_extend: Callable, forward_batch, ctx: ExtendContext | None):
    """The stock extend of the whole batch, with the image embeddings a pass already
    built (building them consumed the batch's multimodal inputs)."""
    embeddings = ctx.embeddings if ctx is not None else None
    if embeddings is None or embeddings.embeds is None:
        return run_extend(forward_batch)
    embeddings.index = torch.arange(embeddings.embeds.shape[0], device=embeddings.embeds.device)
    with ctx.embedding_slot.using(embeddings):
        return run_extend(forward_batch)

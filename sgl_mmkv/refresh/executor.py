"""The refresh executor: an extend forward with image spans served from the segment store.

For an extend batch with at least one :class:`ReuseSpan` (``plan.py``):

1. every reused span's KV is copied from its segment into the request's own slots,
   K rotated by the position delta (``gather_rotate_kv``), all layers;
2. scoring pass (scorers that read attention): the model's layers run on each
   request's fresh tokens (text, new images) over the rotated stale KV, with the
   queries of the query span (fresh tokens after the last reused image) captured;
   CacheBlend's pass instead recomputes the whole row to measure KV deviation;
3. selection: the scorer's global top-k under the refresh budget;
4. refresh pass: fresh + selected tokens run through every layer, attending by
   position over the whole row, skipping the leading tokens whose KV the scoring
   pass already made final (``cost.py``). Its logits are the batch's output.

With ``--mm-reuse-gate cost`` (default) a request whose passes would together
compute at least its full prefill is served as stock would, without reuse.

Stock SGLang code runs every pass (``EagerRunner._execute_extend`` on a sub-batch,
the model's own modules); only the attention backend is ours for the pass.
After the forward, fully computed images not yet stored fill the store: copied
from the request (fill policy ``first``), or recomputed alone in one more pass
whose attention is local to each image (``canonical``, :meth:`_fill_canonical`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from sgl_mmkv.counters import Counters
from sgl_mmkv.refresh.attention_backend import QueryCapture, RefreshAttentionBackend
from sgl_mmkv.refresh.cost import refresh_rows, reuse_flops, scoring_rows, unchanged_prefix
from sgl_mmkv.refresh.embedding_pass import EmbeddingPass, embedding_pass
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.fill import SegmentFiller
from sgl_mmkv.refresh.flops import DecoderShape
from sgl_mmkv.refresh.kv_copy import SegmentCopier
from sgl_mmkv.refresh.observer import PrefillObserver, observing
from sgl_mmkv.refresh.plan import RequestPlan, plan_batch
from sgl_mmkv.refresh.ranker import Span, VisualRanker
from sgl_mmkv.refresh.row_kv import row_kv
from sgl_mmkv.refresh.row_view import RowView
from sgl_mmkv.refresh.sub_batch import active_sub_batch, needs_every_row
from sgl_mmkv.scoring import ScoringInputs, TokenScorer
from sgl_mmkv.segments.store import SegmentStore

if TYPE_CHECKING:
    from sgl_mmkv.refresh.row_compaction import RowCompactor

logger = logging.getLogger(__name__)

META_INFO_KEY = "sgl_mmkv"


@dataclass(slots=True)
class RefreshCounters(Counters):
    """Server-wide token counts of refresh forwards."""

    refresh_forwards: int = 0
    reused_tokens: int = 0
    hole_tokens: int = 0  # dropped tokens of reused compressed segments left out
    refreshed_tokens: int = 0
    declined_reuses: int = 0
    stock_batches: int = 0  # batches with reuse run as stock (every row's outputs asked)
    fallbacks: int = 0  # forwards our path failed, served again by the stock extend
    recomputed_tokens: int = 0
    executed_flops: int = 0
    full_prefill_flops: int = 0
    seconds: float = 0.0
    ranking_seconds: float = 0.0
    # wall time by phase of refresh forwards (host clock: on CUDA without a
    # synchronize they time the launches); embedding build is its own phase
    plan_seconds: float = 0.0
    copy_seconds: float = 0.0
    embedding_seconds: float = 0.0
    scoring_seconds: float = 0.0
    refresh_seconds: float = 0.0
    fill_seconds: float = 0.0


class RefreshExecutor:
    """Runs extend forwards of the scheduler process with segment reuse.

    Args:
        store: the segment store of this server.
        scorer: the ``--mm-reuse`` method.
        budget: ``--mm-refresh-budget``.
        fill_policy: ``--mm-segment-fill`` (``first`` or ``canonical``).
        gate: ``--mm-reuse-gate``: ``cost`` serves a request as stock does when its
            reuse would compute more than its full prefill (``cost.py``); ``always``
            reuses every match.
        ranker: ranks images' tokens for scored eviction (``--mm-evict``).
        compress_on_fill: compress each ranked segment as soon as it is stored
            (``--mm-compress-at fill``) to ``ranker.budget``.
        row_compactor: shrinks requests' rows after their prefill: it receives the
            holes of rows that reuse compressed segments (``--mm-compressed-reuse
            holes``) and each extend's rankings (``--mm-compress-at decode``).
        report_reuse: attach each request's reuse facts to its meta info and log them
            (``--mm-report-reuse``); the counters are kept either way.
        on_forward: called after every extend's counters are updated (metrics).
    """

    def __init__(
        self,
        store: SegmentStore,
        scorer: TokenScorer,
        budget: float,
        fill_policy: str = "first",
        gate: str = "cost",
        ranker: VisualRanker | None = None,
        compress_on_fill: bool = False,
        row_compactor: RowCompactor | None = None,
        report_reuse: bool = False,
        on_forward: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.scorer = scorer
        self.budget = budget
        self.gate = gate
        self.ranker = ranker
        self.counters = RefreshCounters()
        self.row_compactor = row_compactor
        self.report_reuse = report_reuse
        self.on_forward = on_forward
        compress_budget = ranker.budget if ranker is not None and compress_on_fill else None
        self.filler = SegmentFiller(store, self.counters, fill_policy, compress_budget)
        self._copier = SegmentCopier()
        self._shape: DecoderShape | None = None
        # What a stock fallback of the current forward can use (execute_extend).
        self._stock_out = None
        self._embeddings: EmbeddingPass | None = None
        self._views: list[RowView | None] = []  # per request of the current forward

    def execute_extend(self, run_extend: Callable, model_runner, forward_batch):
        """``run_extend(forward_batch)`` is the stock eager extend; returns its output.

        If anything in our path raises, the batch is answered as stock: by the stock
        forward that already ran on it, else by running it again (with the image
        embeddings a pass already built, since building them consumes the batch's
        multimodal inputs)."""
        self._stock_out, self._embeddings = None, None
        try:
            return self._execute(run_extend, model_runner, forward_batch)
        except Exception as error:
            self.recover(forward_batch, error)
            if self._stock_out is not None:
                return self._stock_out
            embeddings = self._embeddings
            if embeddings is None or embeddings.embeds is None:
                return run_extend(forward_batch)
            embeddings.index = torch.arange(embeddings.embeds.shape[0])
            with embedding_pass(embeddings):
                return run_extend(forward_batch)
        finally:
            self._stock_out, self._embeddings = None, None

    @contextmanager
    def _phase(self, name: str, embeddings: EmbeddingPass | None = None) -> Iterator[None]:
        """Add the block's wall time to counter ``{name}_seconds``, less the time it
        spent building ``embeddings`` (counted in ``embedding_seconds`` instead)."""
        started = time.perf_counter()
        embedded = embeddings.seconds if embeddings is not None else 0.0
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            if embeddings is not None:
                built = embeddings.seconds - embedded
                elapsed -= built
                self.counters.embedding_seconds += built
            field = f"{name}_seconds"
            setattr(self.counters, field, getattr(self.counters, field) + elapsed)

    def _execute(self, run_extend: Callable, model_runner, forward_batch):
        planning = time.perf_counter()
        self._views = []
        plans = plan_batch(self.store, forward_batch)
        fault_point("plan")
        self._drop_unsupported(forward_batch, plans)
        self._allow_holes(forward_batch, plans)
        full_flops = self._full_flops(model_runner, forward_batch)
        self.counters.full_prefill_flops += full_flops
        if self.gate == "cost":
            self._decline_costly_reuse(plans)
        if not any(p.spans for p in plans):
            observer = self.ranker.observer_for(plans) if self.ranker is not None else None
            out = self._run_observed(run_extend, model_runner, forward_batch, observer)
            self._stock_out = out
            self.counters.executed_flops += full_flops
            rankings = self._rank(observer, model_runner, forward_batch, plans, None)
            fault_point("ranking")
            self.filler.fill(
                self._pass_runner(run_extend), model_runner, forward_batch, plans, None, rankings
            )
            self._report(forward_batch, plans, None, out, 0.0)
            return out
        started = time.perf_counter()
        self.counters.plan_seconds += started - planning
        self._views = [RowView.of(p) for p in plans]
        with self._phase("copy"):
            self._copier.copy(model_runner, forward_batch, plans)
        fault_point("copy")
        fresh = [p.fresh_mask() for p in plans]
        embeddings = EmbeddingPass(
            full_batch=forward_batch, stock_backend=model_runner.attn_backend
        )
        self._embeddings = embeddings
        with self._phase("scoring", embeddings):
            selected = self._select(
                run_extend, model_runner, forward_batch, plans, fresh, embeddings
            )
        # The tokens a compressed segment lacks got their KV in the scoring (or
        # CacheBlend's) pass already; recomputing them again would cost more than
        # the reuse saves, so only the text and the selected tokens run again, and
        # none before the first token whose input changed since that pass.
        computed = self.scorer.needs_attention or self.scorer.needs_fresh_kv
        active = []
        for plan, mask, chosen in zip(plans, fresh, selected, strict=True):
            if needs_every_row(forward_batch, plan.index):
                active.append(torch.ones_like(mask))  # its logprobs read every row
                continue
            skip = unchanged_prefix(plan, chosen, self.scorer.needs_fresh_kv) if computed else 0
            active.append(refresh_rows(plan, mask, chosen, computed, skip))
        observer = self.ranker.observer_for(plans, active) if self.ranker is not None else None
        with self._phase("refresh", embeddings):
            out = self._run_pass(
                run_extend, model_runner, forward_batch, active, embeddings, observer=observer
            )
        fault_point("refresh")
        if self.row_compactor is not None:
            self.row_compactor.plan_holes(forward_batch, plans)
        rankings = self._rank(observer, model_runner, forward_batch, plans, active)
        fault_point("ranking")
        with self._phase("fill", embeddings):
            self.filler.fill(
                self._pass_runner(run_extend),
                model_runner,
                forward_batch,
                plans,
                embeddings,
                rankings,
            )
        self._report(forward_batch, plans, selected, out, time.perf_counter() - started)
        return out

    def recover(self, forward_batch, error: BaseException) -> None:
        """After our path failed mid-forward, before the stock extend runs the batch
        again: no decode compression stays planned for it (the stock extend rewrites
        every extend slot, so KV copied into request slots is overwritten, and a
        canonical fill discards its reservations itself)."""
        self.counters.fallbacks += 1
        if self.row_compactor is not None:
            self.row_compactor.abandon()
        logger.warning(
            "sgl_mmkv: refresh path failed (%r) for rids %s; the batch runs as stock",
            error,
            forward_batch.rids,
        )

    # -- eviction ranking -----------------------------------------------------------------

    def _rank(self, observer, model_runner, forward_batch, plans, active):
        """Rank the observed images once, for the segment store's new segments (returned,
        content key -> ``(n,)``) and for decode-time compression (handed over)."""
        if observer is None:
            return None
        started = time.perf_counter()
        ranked: dict[int, dict[Span, torch.Tensor]] = self.ranker.rank_batch(
            observer, model_runner, forward_batch, plans, active, self._views or None
        )
        self.counters.ranking_seconds += time.perf_counter() - started
        if self.row_compactor is not None:
            self.row_compactor.plan(forward_batch, plans, ranked)
        return {
            fill.key: ranked[plan.index][(fill.start, fill.end)]
            for plan in plans
            for fill in plan.fills
            if (fill.start, fill.end) in ranked.get(plan.index, {})
        }

    # -- passes ---------------------------------------------------------------------------

    def _run_pass(
        self,
        run_extend,
        model_runner,
        forward_batch,
        active,
        embeddings,
        capture=None,
        backend=None,
        observer: PrefillObserver | None = None,
    ):
        """Run the model on the ``active`` rows; ``backend`` defaults to attention over
        each request's whole row (:class:`RefreshAttentionBackend`)."""
        sub, index = active_sub_batch(forward_batch, active)
        embeddings.index = index
        if backend is None:
            positions = [
                plan_row.nonzero().flatten() + int(prefix)
                for plan_row, prefix in zip(
                    active, forward_batch.extend_prefix_lens_cpu, strict=True
                )
            ]
            self.counters.executed_flops += sum(self._shape.pass_flops(p) for p in positions)
            backend = RefreshAttentionBackend(
                model_runner.req_to_token_pool,
                model_runner.token_to_kv_pool,
                positions,
                capture,
                self._views,
            )
        with (
            observing(observer, model_runner.model, backend) as backend,
            forward_context(ForwardContext(attn_backend=backend), forward_batch=sub),
            embedding_pass(embeddings),
        ):
            return run_extend(sub)

    def _pass_runner(self, run_extend) -> Callable:
        """``f(model_runner, forward_batch, active, embeddings, backend)`` for the filler;
        FLOPs of a pass with its own ``backend`` are counted by the caller."""

        def run(model_runner, forward_batch, active, embeddings, backend):
            return self._run_pass(
                run_extend, model_runner, forward_batch, active, embeddings, backend=backend
            )

        return run

    @staticmethod
    def _run_observed(run_extend, model_runner, forward_batch, observer):
        """The stock extend of the whole batch, observed for eviction ranking if asked."""
        if observer is None:
            return run_extend(forward_batch)
        with (
            observing(observer, model_runner.model, model_runner.attn_backend) as backend,
            forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch),
        ):
            return run_extend(forward_batch)

    def _select(self, run_extend, model_runner, forward_batch, plans, fresh, embeddings):
        """Per request, ``(k,)`` sorted row positions of the image tokens to refresh."""
        scorer = self.scorer
        if scorer.needs_fresh_kv:
            return self._select_by_deviation(
                run_extend, model_runner, forward_batch, plans, embeddings
            )
        captures = None
        if scorer.needs_attention:
            rows = {}
            for plan, mask in zip(plans, fresh, strict=True):
                if plan.spans:
                    rows[plan.index] = self._query_rows(plan, mask)
            captures = QueryCapture(rows)
            active = [scoring_rows(mask) for mask in fresh]
            self._run_pass(run_extend, model_runner, forward_batch, active, embeddings, captures)
            fault_point("scoring")
        selected = []
        for plan in plans:
            if not plan.spans:
                selected.append(torch.empty(0, dtype=torch.long))
                continue
            inputs = self._scoring_inputs(model_runner, forward_batch, plan, captures)
            selected.append(self._expand(plan, scorer.select(inputs, self.budget).cpu()))
        fault_point("selection")
        return selected

    def _select_by_deviation(self, run_extend, model_runner, forward_batch, plans, embeddings):
        """CacheBlend's signal: the whole extend recomputed once (as costly as a full
        prefill; the paper's layer-by-layer shrinking is not done), its KV compared
        with the stale KV, then the stale KV restored for the refresh pass."""
        stale = {p.index: self._row_kv(model_runner, forward_batch, p) for p in plans}
        whole = [~p.hole_mask() for p in plans]
        self._run_pass(run_extend, model_runner, forward_batch, whole, embeddings)
        selected = []
        for plan in plans:
            if not plan.spans:
                selected.append(torch.empty(0, dtype=torch.long))
                continue
            keys, values = stale[plan.index]
            fresh_k, fresh_v = self._row_kv(model_runner, forward_batch, plan)
            inputs = ScoringInputs(
                queries=(),
                keys=keys,
                values=values,
                query_positions=torch.empty(0, dtype=torch.long),
                image_spans=self._spans(plan),
                fresh_keys=fresh_k,
                fresh_values=fresh_v,
            )
            selected.append(self._expand(plan, self.scorer.select(inputs, self.budget).cpu()))
        self._copier.copy(model_runner, forward_batch, plans)
        return selected

    @staticmethod
    def _query_rows(plan: RequestPlan, fresh_mask: torch.Tensor) -> torch.Tensor:
        """Rows (within the request's active tokens of the scoring pass) of the query
        span: fresh tokens after the last reused image, else all fresh tokens."""
        positions = scoring_rows(fresh_mask).nonzero().flatten() + plan.prefix_len
        last_image_end = max(s.end for s in plan.spans)
        tail = (positions >= last_image_end).nonzero().flatten()
        return tail if tail.numel() else torch.arange(positions.numel())

    def _scoring_inputs(self, model_runner, forward_batch, plan, captures) -> ScoringInputs:
        """What the scorer sees of ``plan``'s row: without its holes, if it has some
        (positions and spans then index the compacted row, see :meth:`_expand`)."""
        spans = self._spans(plan)
        if captures is None:
            empty = torch.empty(0, dtype=torch.long)
            return ScoringInputs((), (), (), empty, spans)
        keys, values = self._row_kv(model_runner, forward_batch, plan)
        per_layer = captures.queries[plan.index]
        positions = scoring_rows(plan.fresh_mask()).nonzero().flatten() + plan.prefix_len
        query_positions = positions[captures.rows[plan.index]]
        view = self._views[plan.index]
        if view is not None:
            query_positions = view.compact(query_positions)
        layers = tuple(sorted(per_layer))
        queries = tuple(per_layer[layer] for layer in layers)
        return ScoringInputs(queries, keys, values, query_positions, spans, layer_ids=layers)

    def _spans(self, plan: RequestPlan) -> tuple[tuple[int, int], ...]:
        """The reused spans of ``plan``, in its row without holes."""
        view = self._views[plan.index]
        if view is None:
            return tuple((s.start, s.end) for s in plan.spans)
        return tuple(view.span(s.start, s.end) for s in plan.spans)

    def _row_kv(self, model_runner, forward_batch, plan: RequestPlan):
        keys, values = row_kv(model_runner, forward_batch, plan.index)
        view = self._views[plan.index]
        if view is None:
            return keys, values
        return view.rows(keys), view.rows(values)

    def _expand(self, plan: RequestPlan, selected: torch.Tensor) -> torch.Tensor:
        """Row positions of a scorer's ``selected`` (indices of the compacted row)."""
        view = self._views[plan.index]
        return selected if view is None else view.expand(selected)

    def _decline_costly_reuse(self, plans: list[RequestPlan]) -> None:
        """Requests whose reuse would compute at least their full prefill lose their
        spans and run as stock would (counted in ``declined_reuses``)."""
        for plan in plans:
            if not plan.spans:
                continue
            full = self._shape.extend_flops(plan.prefix_len, plan.seq_len)
            if reuse_flops(self._shape, plan, self.scorer, self.budget) >= full:
                plan.spans.clear()
                self.counters.declined_reuses += 1

    def _allow_holes(self, forward_batch, plans: list[RequestPlan]) -> None:
        """Holes for every request whose row the compactor shrinks after this forward
        (:meth:`RowCompactor.admit`: its last prefill chunk, no session) and that ends
        in a computed token. Elsewhere a compressed segment's dropped tokens are
        computed fresh."""
        compactor = self.row_compactor
        if compactor is None or not compactor.holes:
            return
        for plan in plans:
            if not compactor.may_shrink(forward_batch.rids[plan.index]):
                continue
            plan.holes = True
            if bool(plan.hole_mask()[-1]):
                plan.holes = False

    def _drop_unsupported(self, forward_batch, plans) -> None:
        """Requests whose outputs cover more prompt rows than the last (input logprobs
        from an earlier start) are computed in full, without reuse; a batch that
        returns every row's hidden states runs as stock."""
        mode = forward_batch.capture_hidden_mode
        every_row = mode is not None and mode.is_full()
        if every_row and any(p.spans for p in plans):
            self.counters.stock_batches += 1
        for plan in plans:
            if every_row or needs_every_row(forward_batch, plan.index):
                plan.spans.clear()

    # -- FLOPs ---------------------------------------------------------------------------

    def _full_flops(self, model_runner, forward_batch) -> int:
        """What the stock extend of this batch computes."""
        if self._shape is None:
            self._shape = DecoderShape.from_config(model_runner.model_config.hf_text_config)
        return sum(
            self._shape.extend_flops(int(prefix), int(prefix) + int(ext))
            for prefix, ext in zip(
                forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu, strict=True
            )
        )

    # -- observability --------------------------------------------------------------------

    def _report(self, forward_batch, plans, selected, out, seconds: float) -> None:
        """Counters; with ``report_reuse`` also a log line per reusing request and
        per-request meta info."""
        c = self.counters
        if selected is not None:
            c.refresh_forwards += 1
            c.seconds += seconds
        infos = []
        for i, plan in enumerate(plans):
            reused = plan.reused_tokens
            holes = int(plan.hole_mask().sum())
            refreshed = 0 if selected is None else int(selected[i].numel())
            recomputed = (plan.seq_len - plan.prefix_len) - reused - holes + refreshed
            c.reused_tokens += reused
            c.hole_tokens += holes
            c.refreshed_tokens += refreshed
            c.recomputed_tokens += recomputed
            info = {
                "method": self.scorer.name,
                "reused_segments": len(plan.spans),
                "reused_tokens": reused,
                "hole_tokens": holes,
                "refreshed_tokens": refreshed,
                "recomputed_tokens": recomputed,
            }
            infos.append(info)
            if plan.spans and self.report_reuse:
                rid = forward_batch.rids[plan.index] if forward_batch.rids else plan.index
                logger.info("sgl_mmkv: rid=%s %s", rid, info)
        if self.on_forward is not None:
            self.on_forward()
        logits_output = getattr(out, "logits_output", out)
        if self.report_reuse and hasattr(logits_output, "customized_info"):
            extra = dict(logits_output.customized_info or {})
            extra[META_INFO_KEY] = infos
            logits_output.customized_info = extra

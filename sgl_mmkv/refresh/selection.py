"""Which reused image tokens a refresh recomputes: the scorer's pick at the budget.

A scorer that reads attention (CONDUIT, ProphetKV) gets one scoring pass: every
fresh token of each reusing request runs over the rotated stale KV. The queries
of the query span (fresh tokens after the last reused image) are reduced layer by
layer inside the pass to the scorer's per-layer statistic
(:class:`~sgl_mmkv.refresh.layer_statistics.LayerStatistics`), so no layer's row
or queries are kept; a scorer without a per-layer reduction gets the queries and
a copy of the row instead. CacheBlend (one layer) and the oracle (every layer)
recompute the whole extend once and compare the K/V of their layers at the reused
tokens, copied before and after, with the stale KV copied back. Position-only
methods need no pass. Scorers see a row with holes through its :class:`RowView`
(compacted positions); their picks are mapped back to row positions. At
``--tp-size`` > 1 each rank keeps the additive parts of these statistics over its
own KV heads; one all-reduce sums them and the scorer finishes them into the
statistics of every head (:meth:`TokenSelector._agreed`), before any top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sgl_mmkv.refresh.attention_backend import QueryCapture
from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.cost import scoring_rows
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.kv_copy import SegmentCopier
from sgl_mmkv.refresh.kv_scales import scales_of
from sgl_mmkv.refresh.layer_statistics import LayerStatistics, ReducedRow
from sgl_mmkv.refresh.passes import run_pass
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.probes import ProbePass
from sgl_mmkv.refresh.rank_agreement import RankAgreement, summed_inputs
from sgl_mmkv.refresh.row_kv import kv_at, row_kv, row_slots_at
from sgl_mmkv.scoring import RefreshBudget, ScoringInputs, TokenScorer


@dataclass(frozen=True, slots=True)
class Selection:
    """What :meth:`TokenSelector.select` found.

    Attributes:
        tokens: per request, ``(k,)`` sorted row positions of the image tokens to
            refresh, on the KV pool's device (empty for a request that reuses nothing).
        scoring_output: the scoring pass's output (the stock extend's, for its active
            tokens, every request's last row among them), or None without a scoring
            pass. It is the batch's answer when the refresh pass would compute only
            last rows over the KV this pass saw
            (:func:`~sgl_mmkv.refresh.cost.only_last_rows`).
    """

    tokens: list[torch.Tensor]
    scoring_output: Any = None


@dataclass(slots=True)
class Prepared:
    """What :meth:`TokenSelector.prepare` made before the selection's pass.

    Attributes:
        capture: the attention scorer's query capture (its per-layer statistics).
        probes: the scorer's staleness probes.
        active: per request ``(extend_len,)`` bool host mask of the scoring pass's rows.
        slots: a deviation scorer's ``(N_v,)`` visual slots per request.
        stale: a deviation scorer's per layer ``(K, V)`` copies at those slots.
    """

    capture: QueryCapture | None = None
    probes: ProbePass | None = None
    active: list[torch.Tensor] | None = None
    slots: dict[int, torch.Tensor] = field(default_factory=dict)
    stale: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


class TokenSelector:
    """Args:
    scorer: the ``--mm-reuse`` method.
    budget: ``--mm-refresh-budget``.
    copier: re-copies the stale KV after CacheBlend's deviation pass.
    counters: the executor's counters (``executed_flops``).
    agreement: the TP ranks' agreement (a no-op at TP 1).
    """

    def __init__(
        self,
        scorer: TokenScorer,
        budget: RefreshBudget,
        copier: SegmentCopier,
        counters,
        agreement: RankAgreement | None = None,
    ):
        self.scorer = scorer
        self.budget = budget
        self.copier = copier
        self.counters = counters
        self.agreement = agreement or RankAgreement()

    def prepare(self, ctx: ExtendContext) -> Prepared:
        """What the selection's pass needs, made before it runs (no collective): the
        probes and their stale K/V, the active rows and the capture of an attention
        scorer; the visual slots and stale K/V of a deviation scorer."""
        prepared = Prepared()
        if self.scorer.needs_fresh_kv:
            pool, scales = ctx.model_runner.token_to_kv_pool, scales_of(ctx.model_runner)
            layers = self.scorer.deviation_layers(pool.layer_num)
            slots = {p.index: _visual_slots(ctx, p) for p in ctx.plans if p.spans}
            prepared.slots = slots
            prepared.stale = {
                i: [kv_at(pool, layer, s, scales) for layer in layers] for i, s in slots.items()
            }
        elif self.scorer.needs_attention:
            probes = ProbePass(ctx, self.scorer, partial=self.agreement.active)
            active = [scoring_rows(p.fresh_mask()) | probes.mask(p) for p in ctx.plans]
            prepared.capture = self._capture(ctx, active)
            probes.keep_stale(ctx)
            prepared.probes, prepared.active = probes, active
        return prepared

    def select(self, ctx: ExtendContext, prepared: Prepared | None = None) -> Selection:
        """The scorer's pick of each request's reused image tokens at the budget. At
        TP > 1 the ranks agree after the pass (:meth:`RankAgreement.any_failed`) and
        sum the parts of the statistics the picks read (:meth:`RankAgreement.sum`),
        so every rank picks what TP 1 picks."""
        if prepared is None:
            prepared = self.prepare(ctx)
        if self.scorer.needs_fresh_kv:
            return Selection(self._select_by_deviation(ctx, prepared))
        capture, probes, active, output = prepared.capture, prepared.probes, prepared.active, None
        error = None
        try:
            if self.scorer.needs_attention:
                self.counters.executed_flops += ctx.pass_flops(active)
                output = run_pass(ctx, active, capture=capture)
                fault_point("scoring")
            inputs = {
                p.index: self._inputs(ctx, p, capture, probes, active) for p in ctx.plans if p.spans
            }
        except Exception as caught:
            error = caught
        self.agreement.check(error, "scoring")
        inputs = self._agreed(inputs)
        selected = [self._pick(ctx, p, inputs[p.index]) if p.spans else None for p in ctx.plans]
        fault_point("selection")
        return Selection(self._filled(ctx, selected), output)

    def _agreed(self, inputs: dict[int, ScoringInputs]) -> dict[int, ScoringInputs]:
        """At TP > 1, every request's ``layer_statistics`` and ``probe_deviation``
        summed over the ranks and finished by the scorer (:func:`summed_inputs`)."""
        finish = {
            "layer_statistics": self.scorer.finish_layers,
            "probe_deviation": self.scorer.finish_deviation,
        }
        return summed_inputs(self.agreement, inputs, finish)

    def _capture(self, ctx: ExtendContext, active: list[torch.Tensor]) -> QueryCapture:
        """What the scoring pass keeps: per layer statistics when the scorer has a
        reduction (its query span narrowed to the last query if it reads that alone),
        else every layer's queries."""
        reduction = self.scorer.layer_reduction()
        rows, reduced = {}, {}
        for plan in ctx.plans:
            if not plan.spans:
                continue
            query_rows, positions = _query_rows(ctx, plan, active[plan.index])
            if reduction is not None and reduction.last_query_only:
                last = positions.argmax(dim=0, keepdim=True)
                query_rows, positions = query_rows[last], positions[last]
            rows[plan.index] = query_rows
            reduced[plan.index] = ReducedRow(positions, _spans(ctx, plan))
        if reduction is None:
            return QueryCapture(rows)
        statistics = LayerStatistics(self.scorer, reduced, partial=self.agreement.active)
        return QueryCapture(rows, statistics=statistics)

    def _select_by_deviation(self, ctx: ExtendContext, prepared: Prepared) -> list[torch.Tensor]:
        """CacheBlend's signal (and the oracle's): the whole extend recomputed once (as
        costly as a full prefill; the paper's layer-by-layer shrinking is not done),
        the K/V of the scorer's layers at the reused tokens compared with the stale
        ones (copied before, ``(N_v, H_kv, d)`` per layer, :meth:`prepare`), then the
        stale KV restored for the refresh pass. At TP > 1 each rank compares its KV
        heads' ``deviation_parts`` (``(L, P, N_v)``), summed over the ranks and
        finished into the ``(L, N_v)`` deviations of every head before the pick."""
        pool, scales = ctx.model_runner.token_to_kv_pool, scales_of(ctx.model_runner)
        layers = self.scorer.deviation_layers(pool.layer_num)
        slots, stale = prepared.slots, prepared.stale
        whole = [~p.hole_mask() for p in ctx.plans]
        self.counters.executed_flops += ctx.pass_flops(whole)
        run_pass(ctx, whole)
        partial = self.agreement.active
        deviate = self.scorer.deviation_parts if partial else self.scorer.deviation
        deviations, error = {}, None
        try:
            for plan in ctx.plans:
                if plan.spans:
                    deviations[plan.index] = torch.stack(
                        [
                            deviate(*kv, *kv_at(pool, layer, slots[plan.index], scales))
                            for layer, kv in zip(layers, stale[plan.index], strict=True)
                        ]
                    )
        except Exception as caught:
            error = caught
        self.agreement.check(error, "scoring")
        if partial:
            order = sorted(deviations)
            sums = self.agreement.sum([deviations[i] for i in order])
            deviations = {
                i: self.scorer.finish_deviation(p) for i, p in zip(order, sums, strict=True)
            }
        selected = []
        for plan in ctx.plans:
            if not plan.spans:
                selected.append(None)
                continue
            inputs = ScoringInputs(
                queries=(),
                keys=(),
                values=(),
                query_positions=torch.empty(0, dtype=torch.long),
                image_spans=_spans(ctx, plan),
                layer_ids=layers,
                layer_statistics=deviations[plan.index],
                device=ctx.device,
            )
            selected.append(self._pick(ctx, plan, inputs))
        self.copier.copy(ctx.model_runner, ctx.forward_batch, list(ctx.plans))
        return self._filled(ctx, selected)

    def _pick(self, ctx: ExtendContext, plan: RequestPlan, inputs: ScoringInputs) -> torch.Tensor:
        """Row positions of the scorer's top-k (indices of the compacted row if holes).
        Probes it picks run again in the refresh pass, over the refreshed row (the
        scoring pass computed them over the stale one); the others keep the K/V of
        the scoring pass."""
        chosen = self.scorer.select(inputs, self.budget)
        view = ctx.views[plan.index]
        return chosen if view is None else view.expand(chosen)

    def _inputs(
        self, ctx: ExtendContext, plan: RequestPlan, capture, probes=None, active=None
    ) -> ScoringInputs:
        """What the scorer sees of ``plan``'s row: without its holes, if it has some."""
        spans = _spans(ctx, plan)
        if capture is None:  # position-only methods
            empty = torch.empty(0, dtype=torch.long)
            return ScoringInputs((), (), (), empty, spans, device=ctx.device)
        if capture.statistics is not None:
            inputs = capture.statistics.inputs(plan.index, ctx.device)
        else:
            keys, values = _row_kv(ctx, plan)
            per_layer = capture.queries[plan.index]
            _, query_positions = _query_rows(ctx, plan, active[plan.index])
            layers = tuple(sorted(per_layer))
            queries = tuple(per_layer[layer] for layer in layers)
            inputs = ScoringInputs(queries, keys, values, query_positions, spans, layer_ids=layers)
        deviation = probes.deviation(ctx, plan)
        if deviation is None:
            return inputs
        rows = probes.rows[plan.index]
        view = ctx.views[plan.index]
        positions = rows if view is None else view.compact(rows)
        return replace(inputs, probe_positions=positions, probe_deviation=deviation)

    @staticmethod
    def _filled(ctx: ExtendContext, selected: list) -> list[torch.Tensor]:
        empty = torch.empty(0, dtype=torch.long, device=ctx.device)
        return [empty if s is None else s for s in selected]


def _query_rows(
    ctx: ExtendContext, plan: RequestPlan, active: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query span: ``(m,)`` rows within the request's ``active`` tokens of the
    scoring pass (those after the last reused image, else every active token), and
    their ``(m,)`` positions in the row without its holes; host tensors."""
    positions = plan.rows(active)
    last_image_end = max(s.end for s in plan.spans)
    tail = (positions >= last_image_end).nonzero().flatten()
    rows = tail if tail.numel() else torch.arange(positions.numel())
    view = ctx.views[plan.index]
    positions = positions[rows]
    return rows, positions if view is None else view.compact(positions)


def _spans(ctx: ExtendContext, plan: RequestPlan) -> tuple[tuple[int, int], ...]:
    """The reused spans of ``plan``, in its row without holes."""
    view = ctx.views[plan.index]
    if view is None:
        return tuple((s.start, s.end) for s in plan.spans)
    return tuple(view.span(s.start, s.end) for s in plan.spans)


def _row_kv(ctx: ExtendContext, plan: RequestPlan):
    """Per layer ``(n, H_kv, d)`` K and V of ``plan``'s row, holes left out (for a
    scorer without a per-layer reduction)."""
    keys, values = row_kv(ctx.model_runner, ctx.forward_batch, plan.index)
    view = ctx.views[plan.index]
    if view is None:
        return keys, values
    return view.rows(keys), view.rows(values)


def _visual_slots(ctx: ExtendContext, plan: RequestPlan) -> torch.Tensor:
    """``(N_v,)`` pool slots of ``plan``'s reused tokens that hold KV, in :func:`_spans`
    order, on the pool's device (made once per request, read per layer)."""
    compacted = [torch.arange(s, e) for s, e in _spans(ctx, plan)]
    positions = torch.cat(compacted)
    view = ctx.views[plan.index]
    if view is not None:
        positions = view.kept[positions]
    return row_slots_at(ctx.model_runner, ctx.forward_batch, plan.index, positions)

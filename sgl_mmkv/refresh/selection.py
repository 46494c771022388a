"""Which reused image tokens a refresh recomputes: the scorer's pick at the budget.

A scorer that reads attention (CONDUIT, ProphetKV) gets one scoring pass: every
fresh token of each reusing request runs over the rotated stale KV, and the
queries of the query span (fresh tokens after the last reused image) are kept.
CacheBlend instead recomputes the whole extend once, compares its KV with the
stale KV, and the stale KV is copied back. Position-only methods need no pass.
Scorers see a row with holes through its :class:`RowView` (compacted positions);
their picks are mapped back to row positions.
"""

from __future__ import annotations

import torch

from sgl_mmkv.refresh.attention_backend import QueryCapture
from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.cost import scoring_rows
from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.kv_copy import SegmentCopier
from sgl_mmkv.refresh.passes import run_pass
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.row_kv import row_kv
from sgl_mmkv.scoring import ScoringInputs, TokenScorer


class TokenSelector:
    """Args:
    scorer: the ``--mm-reuse`` method.
    budget: ``--mm-refresh-budget``.
    copier: re-copies the stale KV after CacheBlend's deviation pass.
    counters: the executor's counters (``executed_flops``).
    """

    def __init__(self, scorer: TokenScorer, budget: float, copier: SegmentCopier, counters):
        self.scorer = scorer
        self.budget = budget
        self.copier = copier
        self.counters = counters

    def select(self, ctx: ExtendContext) -> list[torch.Tensor]:
        """Per request, ``(k,)`` sorted row positions of the image tokens to refresh, on
        the KV pool's device (empty for a request that reuses nothing)."""
        if self.scorer.needs_fresh_kv:
            return self._select_by_deviation(ctx)
        captures = None
        if self.scorer.needs_attention:
            captures = QueryCapture({p.index: _query_rows(p) for p in ctx.plans if p.spans})
            active = [scoring_rows(p.fresh_mask()) for p in ctx.plans]
            self.counters.executed_flops += ctx.pass_flops(active)
            run_pass(ctx, active, capture=captures)
            fault_point("scoring")
        selected = [
            self._pick(ctx, plan, self._inputs(ctx, plan, captures)) if plan.spans else None
            for plan in ctx.plans
        ]
        fault_point("selection")
        return self._filled(ctx, selected)

    def _select_by_deviation(self, ctx: ExtendContext) -> list[torch.Tensor]:
        """CacheBlend's signal: the whole extend recomputed once (as costly as a full
        prefill; the paper's layer-by-layer shrinking is not done), its KV compared
        with the stale KV, then the stale KV restored for the refresh pass."""
        stale = {p.index: _row_kv(ctx, p) for p in ctx.plans if p.spans}
        whole = [~p.hole_mask() for p in ctx.plans]
        self.counters.executed_flops += ctx.pass_flops(whole)
        run_pass(ctx, whole)
        selected = []
        for plan in ctx.plans:
            if not plan.spans:
                selected.append(None)
                continue
            keys, values = stale[plan.index]
            fresh_keys, fresh_values = _row_kv(ctx, plan)
            inputs = ScoringInputs(
                queries=(),
                keys=keys,
                values=values,
                query_positions=torch.empty(0, dtype=torch.long),
                image_spans=_spans(ctx, plan),
                fresh_keys=fresh_keys,
                fresh_values=fresh_values,
                device=ctx.device,
            )
            selected.append(self._pick(ctx, plan, inputs))
        self.copier.copy(ctx.model_runner, ctx.forward_batch, list(ctx.plans))
        return self._filled(ctx, selected)

    def _pick(self, ctx: ExtendContext, plan: RequestPlan, inputs: ScoringInputs) -> torch.Tensor:
        """Row positions of the scorer's top-k (indices of the compacted row if holes)."""
        chosen = self.scorer.select(inputs, self.budget)
        view = ctx.views[plan.index]
        return chosen if view is None else view.expand(chosen)

    def _inputs(self, ctx: ExtendContext, plan: RequestPlan, captures) -> ScoringInputs:
        """What the scorer sees of ``plan``'s row: without its holes, if it has some."""
        spans = _spans(ctx, plan)
        if captures is None:  # position-only methods
            empty = torch.empty(0, dtype=torch.long)
            return ScoringInputs((), (), (), empty, spans, device=ctx.device)
        keys, values = _row_kv(ctx, plan)
        per_layer = captures.queries[plan.index]
        positions = plan.rows(scoring_rows(plan.fresh_mask()))
        query_positions = positions[captures.rows[plan.index]]
        view = ctx.views[plan.index]
        if view is not None:
            query_positions = view.compact(query_positions)
        layers = tuple(sorted(per_layer))
        queries = tuple(per_layer[layer] for layer in layers)
        return ScoringInputs(queries, keys, values, query_positions, spans, layer_ids=layers)

    @staticmethod
    def _filled(ctx: ExtendContext, selected: list) -> list[torch.Tensor]:
        empty = torch.empty(0, dtype=torch.long, device=ctx.device)
        return [empty if s is None else s for s in selected]


def _query_rows(plan: RequestPlan) -> torch.Tensor:
    """Rows (within the request's tokens of the scoring pass) of the query span: fresh
    tokens after the last reused image, else every fresh token."""
    positions = plan.rows(scoring_rows(plan.fresh_mask()))
    last_image_end = max(s.end for s in plan.spans)
    tail = (positions >= last_image_end).nonzero().flatten()
    return tail if tail.numel() else torch.arange(positions.numel())


def _spans(ctx: ExtendContext, plan: RequestPlan) -> tuple[tuple[int, int], ...]:
    """The reused spans of ``plan``, in its row without holes."""
    view = ctx.views[plan.index]
    if view is None:
        return tuple((s.start, s.end) for s in plan.spans)
    return tuple(view.span(s.start, s.end) for s in plan.spans)


def _row_kv(ctx: ExtendContext, plan: RequestPlan):
    """Per layer ``(n, H_kv, d)`` K and V of ``plan``'s row, holes left out."""
    keys, values = row_kv(ctx.model_runner, ctx.forward_batch, plan.index)
    view = ctx.views[plan.index]
    if view is None:
        return keys, values
    return view.rows(keys), view.rows(values)

"""Rankings of an extend's image tokens, from the prefill of the request that shows them.

When ``--mm-evict`` names a scorer, the refresh executor observes the queries and
attention inputs of the text tokens of each request with images to rank
(:class:`~sgl_mmkv.refresh.observer.PrefillObserver`); each layer's queries and the
request's own row of KV are reduced to the scorer's per-layer statistic right after
the layer's attention (:class:`~sgl_mmkv.refresh.layer_statistics.LayerStatistics`),
and after the forward this ranker combines them into a ranking of those images'
tokens. (:meth:`VisualRanker.rankings` is the same ranking from kept queries and a
copy of the row's keys: the reference, and the path of a scorer without a
per-layer reduction.) New
images' rankings go into their segments (compression later keeps their top
tokens); with ``--mm-compress-at decode`` every image of the extend is ranked and
the request's own row keeps its top tokens for decoding.

At ``--tp-size`` > 1 each rank reduces its own KV heads' additive parts of the
statistic (``scoring/head_parts.py``); after a ``ranking`` stage check the parts are
summed in one all-reduce and finished, so every rank ranks from the statistics of
every head and keeps the same tokens of every segment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_mmkv.refresh.faults import fault_point
from sgl_mmkv.refresh.layer_statistics import LayerStatistics, ReducedRow
from sgl_mmkv.refresh.observer import PrefillObserver, QueryProjector
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.rank_agreement import RankAgreement, summed_inputs
from sgl_mmkv.refresh.row_kv import row_keys
from sgl_mmkv.refresh.row_view import RowView
from sgl_mmkv.scoring import ScoringInputs, TokenScorer

Span = tuple[int, int]
# Which ``[start, end)`` row spans of a plan are ranked.
SpansOf = Callable[[RequestPlan], list[Span]]


def fill_spans(plan: RequestPlan) -> list[Span]:
    """The images of ``plan`` that enter the segment store."""
    return [(f.start, f.end) for f in plan.fills]


def extend_image_spans(plan: RequestPlan) -> list[Span]:
    """Every image of ``plan`` computed in this extend (new, reused or refreshed), but
    one with holes (it keeps exactly the tokens its segment kept)."""
    holes = plan.hole_mask()
    return [
        (s, e) for s, e in plan.images if not holes[s - plan.prefix_len : e - plan.prefix_len].any()
    ]


class VisualRanker:
    """Args:
    scorer: the ``--mm-evict`` scorer.
    budget: ``--mm-kv-budget`` (AirCache's layer budgets depend on it).
    spans_of: which images of a request are ranked (:func:`fill_spans` or
        :func:`extend_image_spans`).
    agreement: the TP ranks' agreement (a no-op at TP 1).
    """

    def __init__(
        self,
        scorer: TokenScorer,
        budget: float,
        spans_of: SpansOf = fill_spans,
        agreement: RankAgreement | None = None,
    ) -> None:
        self.agreement = agreement or RankAgreement()
        if self.agreement.active and scorer.needs_attention and scorer.layer_reduction() is None:
            raise ValueError(f"{scorer.name} reads whole rows: ranks cannot sum its ranking")
        self.scorer = scorer
        self.budget = budget
        self.spans_of = spans_of
        self._projector: QueryProjector | None = None

    def observer_for(
        self, plans: list[RequestPlan], active: list[torch.Tensor] | None = None
    ) -> PrefillObserver | None:
        """An observer of the text rows of every request with images to rank.

        ``active``: per request, the tokens the pass runs (a refresh pass); None for
        a whole extend.
        """
        rows, reduced = {}, {}
        for plan in plans:
            spans = self.spans_of(plan)
            if not spans:
                continue
            text = plan.text_mask()
            text[-1] = True  # the last prompt token is always an observer
            if active is not None:
                text = text[active[plan.index]]
            rows[plan.index] = text.nonzero().flatten()
            mask = None if active is None else active[plan.index]
            reduced[plan.index] = _reduced_row(plan, spans, rows[plan.index], mask)
        if not rows:
            return None
        if self.scorer.layer_reduction() is None:
            return PrefillObserver(rows)
        statistics = LayerStatistics(
            self.scorer, reduced, self._projector, partial=self.agreement.active
        )
        return PrefillObserver(rows, statistics=statistics)

    def rank_batch(
        self,
        observer: PrefillObserver | None,
        model_runner,
        forward_batch,
        plans: list[RequestPlan],
        active: list[torch.Tensor] | None = None,
        views: list[RowView | None] | None = None,
        error: BaseException | None = None,
    ) -> dict[int, dict[Span, torch.Tensor]]:
        """Request index -> ``[start, end)`` -> ``(end - start,)`` float32 ranking of
        the image's tokens (higher: keep), for every ranked image of the batch.

        ``views``: per request, the row view the forward used (built here if None).
        ``error``: this rank's failure earlier in the forward (its observer None if
        building it failed). Where the agreed plans rank images, every rank passes the
        ``ranking`` stage check (raising there if any rank failed), then sums its
        statistics' parts."""
        if observer is None and error is None:
            return {}
        ranked, inputs = {}, {}
        if error is None:
            try:
                fault_point("ranking")
                if observer.statistics is not None:
                    inputs = self._reduced_inputs(observer.statistics, model_runner, plans)
                else:
                    ranked = self._rank_kept(
                        observer, model_runner, forward_batch, plans, active, views
                    )
            except Exception as caught:
                error = caught
        self.agreement.check(error, "ranking")
        if observer.statistics is None:
            return ranked
        finish = {"layer_statistics": self.scorer.finish_layers}
        by_index = {plan.index: plan for plan in plans}
        for i, agreed in summed_inputs(self.agreement, inputs, finish).items():
            ranking = self.scorer.ranking(agreed, self.budget).float()
            sizes = [end - start for start, end in agreed.image_spans]
            spans = self.spans_of(by_index[i])
            ranked[i] = dict(zip(spans, ranking.split(sizes), strict=True))
        return ranked

    def _rank_kept(
        self, observer, model_runner, forward_batch, plans, active, views
    ) -> dict[int, dict[Span, torch.Tensor]]:
        """:meth:`rank_batch` from kept queries (a scorer without a per-layer
        reduction; at TP > 1 only one that reads no attention)."""
        ranked = {}
        for plan in plans:
            spans = self.spans_of(plan)
            if spans and plan.index in observer.queries:
                mask = None if active is None else active[plan.index]
                view = views[plan.index] if views is not None else RowView.of(plan)
                rankings = self.rankings(
                    observer, model_runner, forward_batch, plan, spans, mask, view
                )
                ranked[plan.index] = dict(zip(spans, rankings, strict=True))
        return ranked

    def _reduced_inputs(
        self, statistics: LayerStatistics, model_runner, plans: list[RequestPlan]
    ) -> dict[int, ScoringInputs]:
        """Per ranked request, the statistics the pass reduced (this rank's parts at
        TP > 1)."""
        if statistics.project_queries is not None:
            self._projector = statistics.project_queries
        device = model_runner.token_to_kv_pool.get_key_buffer(0).device
        return {
            plan.index: statistics.inputs(plan.index, device)
            for plan in plans
            if plan.index in statistics.rows
        }

    def rankings(
        self,
        observer: PrefillObserver,
        model_runner,
        forward_batch,
        plan: RequestPlan,
        spans: list[Span],
        active: torch.Tensor | None = None,
        view: RowView | None = None,
    ) -> list[torch.Tensor]:
        """Per span of ``spans``, ``(n,)`` float32 ranking of its tokens (higher: keep),
        on the KV pool's device; ``view``: the row's holes left out (:meth:`RowView.of`),
        None for a whole row."""
        if self._projector is None:
            self._projector = QueryProjector(model_runner.model)
        pass_rows = active if active is not None else torch.ones(plan.extend_len, dtype=torch.bool)
        positions = plan.rows(pass_rows.bool())
        query_positions = positions[observer.rows[plan.index]]  # host, moved by ScoringInputs
        per_layer = observer.queries[plan.index]
        layers = sorted(per_layer)
        keys = row_keys(model_runner, forward_batch, plan.index, layers)
        if view is not None:  # ranked against the KV the row holds, never its holes
            keys, query_positions = view.rows(keys), view.compact(query_positions)
            spans = [view.span(start, end) for start, end in spans]
        stats = observer.hidden_stats.get(plan.index, {})
        inputs = ScoringInputs(
            queries=tuple(per_layer[layer] for layer in layers),
            keys=keys,  # the pool's dtype: the scorers' attention computes in float32
            values=(),
            query_positions=query_positions,
            image_spans=tuple(spans),
            hidden_stats=tuple(stats[layer] for layer in layers) if stats else None,
            project_queries=self._projector,
        )
        ranking = self.scorer.ranking(inputs, self.budget).float()
        return list(ranking.split([end - start for start, end in spans]))


def _reduced_row(
    plan: RequestPlan, spans: list[Span], rows: torch.Tensor, active: torch.Tensor | None
) -> ReducedRow:
    """What the observer reduces of ``plan``: the observed rows' positions and the
    ranked spans in the row without its holes (as :meth:`VisualRanker.rankings`)."""
    pass_rows = active if active is not None else torch.ones(plan.extend_len, dtype=torch.bool)
    positions = plan.rows(pass_rows.bool())[rows]
    view = RowView.of(plan)
    if view is None:
        return ReducedRow(positions, tuple(spans))
    compacted = tuple(view.span(start, end) for start, end in spans)
    return ReducedRow(view.compact(positions), compacted, view.kept)

"""Rankings of a new image's tokens, from the prefill of the request that shows it.

When ``--mm-evict`` names a scorer, the refresh executor observes the queries and
attention inputs of each request that fills the segment store (its text tokens,
:class:`~sgl_mmkv.eviction.observer.PrefillObserver`), and after the forward this
ranker scores the new images' tokens against the request's own row of KV. The
ranking goes into the segment; compression later keeps its top tokens.
"""

from __future__ import annotations

import torch

from sgl_mmkv.eviction.observer import PrefillObserver, QueryProjector
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.row_kv import row_keys
from sgl_mmkv.refresh.scorers import RefreshScorer, ScoringInputs


class FillRanker:
    """Args:
    scorer: the ``--mm-evict`` scorer.
    budget: ``--mm-kv-budget`` (AirCache's layer budgets depend on it).
    """

    def __init__(self, scorer: RefreshScorer, budget: float) -> None:
        self.scorer = scorer
        self.budget = budget
        self._projector: QueryProjector | None = None

    def observer_for(
        self, plans: list[RequestPlan], active: list[torch.Tensor] | None = None
    ) -> PrefillObserver | None:
        """An observer of the text rows of every request with images to store.

        ``active``: per request, the tokens the pass runs (a refresh pass); None for
        a whole extend.
        """
        rows = {}
        for plan in plans:
            if not plan.fills:
                continue
            text = plan.text_mask()
            text[-1] = True  # the last prompt token is always an observer
            if active is not None:
                text = text[active[plan.index]]
            rows[plan.index] = text.nonzero().flatten()
        return PrefillObserver(rows) if rows else None

    def rankings(
        self,
        observer: PrefillObserver,
        model_runner,
        forward_batch,
        plan: RequestPlan,
        active: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Per fill of ``plan``, ``(n,)`` float32 ranking of its tokens (higher: keep)."""
        if self._projector is None:
            self._projector = QueryProjector(model_runner.model)
        pass_rows = active if active is not None else torch.ones(plan.seq_len - plan.prefix_len)
        positions = pass_rows.bool().nonzero().flatten() + plan.prefix_len
        query_positions = positions[observer.rows[plan.index]]
        per_layer = observer.queries[plan.index]
        layers = sorted(per_layer)
        keys = row_keys(model_runner, forward_batch, plan.index)
        stats = observer.hidden_stats.get(plan.index, {})
        inputs = ScoringInputs(
            queries=tuple(per_layer[layer] for layer in layers),
            keys=tuple(keys[layer].float().cpu() for layer in layers),
            values=(),
            query_positions=query_positions,
            image_spans=tuple((f.start, f.end) for f in plan.fills),
            hidden_stats=tuple(stats[layer] for layer in layers) if stats else None,
            project_queries=self._projector,
        )
        ranking = self.scorer.ranking(inputs, self.budget).float()
        return list(ranking.split([f.end - f.start for f in plan.fills]))

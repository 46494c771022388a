"""A scorer's staleness probe, run inside its scoring pass.

A scorer that names spans to probe (:meth:`~sgl_mmkv.scoring.TokenScorer.probe_spans`)
gets the middle reused token of each of those spans computed in the scoring pass,
over the stale row like the fresh tokens; the probes keep their new K/V (those the
scorer then picks run again in the refresh pass). Their K/V of every layer is copied
before the pass (``(m, H_kv, d)`` per layer, ``m`` probes per request) and compared
with what the pass wrote, through the scorer's ``deviation``: ``(L, m)`` per request
(:attr:`ScoringInputs.probe_deviation`); at ``--tp-size`` > 1 its ``deviation_parts``
over the rank's heads, ``(L, P, m)``, which the selector sums over the ranks and
finishes.
"""

from __future__ import annotations

import torch

from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.kv_scales import scales_of
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.row_kv import kv_at, row_slots_at
from sgl_mmkv.scoring import TokenScorer


def probe_rows(plan: RequestPlan, scorer: TokenScorer) -> torch.Tensor:
    """``(m,)`` int64 sorted host row positions: the middle reused token of each span
    ``scorer`` probes (none of a span that reuses no token)."""
    probed = scorer.probe_spans(tuple(span.delta for span in plan.spans))
    rows = []
    for i in probed:
        reused = plan.spans[i].reused_positions()
        if reused.numel():
            rows.append(int(reused[reused.numel() // 2]))
    return torch.tensor(sorted(rows), dtype=torch.long)


class ProbePass:
    """The probes of one extend forward.

    Args:
        scorer: the scorer that names the spans to probe and compares their K/V.
        partial: compare through ``scorer.deviation_parts`` (a tensor-parallel rank's
            parts over its heads) instead of ``scorer.deviation``.

    Attributes:
        rows: request index -> ``(m,)`` host row positions of its probes (requests
            without probes are absent).
        stale: request index -> per layer ``(K, V)`` copies at those rows, from
            :meth:`keep_stale`.
    """

    def __init__(self, ctx: ExtendContext, scorer: TokenScorer, partial: bool = False) -> None:
        self.scorer = scorer
        self.partial = partial
        self.rows: dict[int, torch.Tensor] = {}
        for plan in ctx.plans:
            rows = probe_rows(plan, scorer) if plan.spans else torch.empty(0, dtype=torch.long)
            if rows.numel():
                self.rows[plan.index] = rows
        self.stale: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.slots: dict[int, torch.Tensor] = {}  # the probes' pool slots, on the device

    def mask(self, plan: RequestPlan) -> torch.Tensor:
        """``(extend_len,)`` bool host mask of ``plan``'s probes."""
        mask = torch.zeros(plan.extend_len, dtype=torch.bool)
        rows = self.rows.get(plan.index)
        if rows is not None:
            mask[rows - plan.prefix_len] = True
        return mask

    def keep_stale(self, ctx: ExtendContext) -> None:
        """Copy every probe's K/V of every layer before the pass writes over it."""
        pool, scales = ctx.model_runner.token_to_kv_pool, scales_of(ctx.model_runner)
        for index, rows in self.rows.items():
            self.slots[index] = row_slots_at(ctx.model_runner, ctx.forward_batch, index, rows)
            self.stale[index] = [
                kv_at(pool, layer, self.slots[index], scales) for layer in range(pool.layer_num)
            ]

    def deviation(self, ctx: ExtendContext, plan: RequestPlan) -> torch.Tensor | None:
        """``(L, m)`` float32 on the pool's device: the scorer's ``deviation`` of each
        probe's K/V now from its stale copy, per layer (``partial``: ``(L, P, m)``
        ``deviation_parts``); None without probes."""
        rows = self.rows.get(plan.index)
        if rows is None:
            return None
        pool, slots = ctx.model_runner.token_to_kv_pool, self.slots[plan.index]
        scales = scales_of(ctx.model_runner)
        deviate = self.scorer.deviation_parts if self.partial else self.scorer.deviation
        per_layer = [
            deviate(*stale, *kv_at(pool, layer, slots, scales))
            for layer, stale in enumerate(self.stale[plan.index])
        ]
        return torch.stack(per_layer)

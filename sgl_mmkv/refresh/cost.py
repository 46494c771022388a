"""What reuse costs a request, and which of its tokens a refresh pass can skip.

A scorer that reads attention runs two passes over a reusing request: the scoring
pass computes every fresh token (text, new images, tokens a compressed segment
lacks) over the stale reused KV, the refresh pass then computes the fresh and the
selected tokens again over the partly refreshed row. A token before the first
position whose input changed between the passes computes the same KV twice, so
the refresh pass skips it (:func:`unchanged_prefix`). What remains can still cost
more than the full prefill it replaces when a request reuses little and computes
much (one stored image among many new ones): :func:`reuse_flops` estimates it so
that the executor can serve such a request as stock does (``--mm-reuse-gate cost``).
"""

from __future__ import annotations

import torch

from sgl_mmkv.refresh.flops import DecoderShape
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.probes import probe_rows
from sgl_mmkv.scoring import TokenScorer
from sgl_mmkv.scoring.base import budget_count


def unchanged_prefix(plan: RequestPlan, selected: torch.Tensor, deviation_pass: bool) -> int:
    """How many leading extend tokens of ``plan`` already hold their final KV.

    Args:
        selected: ``(k,)`` row positions refreshed by the refresh pass.
        deviation_pass: the earlier pass recomputed the whole extend and the stale KV
            was restored afterwards (CacheBlend): the first reused token changed too.
    """
    first = plan.extend_len
    if selected.numel():
        first = min(first, int(selected.min()) - plan.prefix_len)
    if deviation_pass and plan.spans:
        first = min(first, int(plan.reused_mask().nonzero()[0]))
    return first


def scoring_rows(fresh: torch.Tensor) -> torch.Tensor:
    """``(extend_len,)`` bool rows the scoring pass runs: the fresh tokens and the last
    prompt token (the logits processor reads every request's last row)."""
    rows = fresh.clone()
    rows[-1] = True
    return rows


def refresh_rows(
    plan: RequestPlan,
    fresh: torch.Tensor,
    selected: torch.Tensor,
    after_scoring_pass: bool,
    skip: int = 0,
) -> torch.Tensor:
    """``(extend_len,)`` bool: the extend tokens the refresh pass of ``plan`` computes.

    The rows are a host mask like the plan's masks; ``selected`` (on the scorer's
    device) is copied to the host here, once.

    Args:
        fresh: ``(extend_len,)`` bool, the tokens not served from a segment.
        selected: ``(k,)`` row positions of the reused tokens to refresh.
        after_scoring_pass: an earlier pass (scoring or CacheBlend's) computed the
            fresh tokens, so the tokens a compressed segment lacks are not run again.
        skip: leading tokens whose KV is final already (:func:`unchanged_prefix`).
    """
    rows = fresh & ~plan.dropped_mask() if after_scoring_pass else fresh.clone()
    rows[selected.to(rows.device) - plan.prefix_len] = True
    rows[:skip] = False
    rows[-1] = True  # every request keeps its last row for the logits
    return rows


def only_last_rows(active: list[torch.Tensor]) -> bool:
    """Whether a refresh pass over ``active`` (per request ``(extend_len,)`` bool, from
    :func:`refresh_rows`) would compute each request's last row alone: no token before
    it was refreshed (it may itself be a selected image token, where a chunk ends
    inside an image) and no earlier row is asked for. That row's inputs and the KV it
    attends to are then those of the scoring pass, which computed it already, so the
    scoring pass's output is the batch's and the refresh pass is not run."""
    return all(int(rows.sum()) == 1 for rows in active)


def reuse_flops(shape: DecoderShape, plan: RequestPlan, scorer: TokenScorer, budget: float) -> int:
    """Estimated FLOPs of serving ``plan`` with reuse, all passes (the scoring pass
    with the tokens the scorer probes).

    The refresh pass is bounded from above: its ``ceil(budget * image tokens)``
    selected tokens are taken as the last reused ones and nothing before the first
    reused token is assumed skipped."""
    positions = torch.arange(plan.prefix_len, plan.seq_len)
    fresh = plan.fresh_mask()
    reused_rows = plan.reused_mask().nonzero().flatten()
    total = 0
    if scorer.needs_fresh_kv:
        total += shape.extend_flops(plan.prefix_len, plan.seq_len)
    if scorer.needs_attention:
        scored = scoring_rows(fresh)
        scored[probe_rows(plan, scorer) - plan.prefix_len] = True  # staleness probes
        total += shape.pass_flops(positions[scored])
    after_scoring_pass = scorer.needs_attention or scorer.needs_fresh_kv
    num_image_tokens = sum(s.end - s.start for s in plan.spans) - int(plan.hole_mask().sum())
    k = budget_count(budget, num_image_tokens)
    selected = reused_rows[max(0, reused_rows.numel() - k) :] + plan.prefix_len
    # a compressed segment cut by a chunk boundary may reuse no token in this chunk
    skip = int(reused_rows[0]) if after_scoring_pass and reused_rows.numel() else 0
    rows = refresh_rows(plan, fresh, selected, after_scoring_pass, skip)
    return total + shape.pass_flops(positions[rows])

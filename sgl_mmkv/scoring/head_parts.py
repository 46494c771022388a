"""Statistics over KV heads in additive parts, so that tensor-parallel ranks can sum them.

At ``--tp-size`` N each rank holds ``H / N`` of the heads. A statistic that is a
norm over the concatenated heads (CONDUIT's value norm, the K/V deviations of
CacheBlend, the oracle and the probes) or a mean over them (attention mass) is not
the mean of the ranks' statistics, but it is a function of sums over heads: each
rank computes its *parts* over its own heads, one SUM all-reduce adds them
(:meth:`~sgl_mmkv.refresh.rank_agreement.RankAgreement.sum`), and a *finish* step
(a square root, a ratio, a division by the head count) gives what one rank holding
every head computes. At TP 1 the scorers compute their statistics directly, as
before; these parts are for TP > 1 only.

Parts are float32 and stacked on a leading parts axis: ``(P, ..., N)`` per layer,
``(L, P, ..., N)`` stacked over layers, which is what the finish steps read.
"""

from __future__ import annotations

import torch

_EPS = 1e-12  # the oracle's floor of a layer's mean fresh norm


def squares(x: torch.Tensor) -> torch.Tensor:
    """``(N,)`` float32 sum of squares of ``(N, H, d)`` over its heads and dims: the
    squared norm of each token's concatenated heads."""
    return x.float().flatten(1).square().sum(dim=-1)


def mean_parts(mean: torch.Tensor, heads: int) -> torch.Tensor:
    """``(2, ..., N)``: a ``(..., N)`` mean over ``heads`` heads as its sum over them
    and their count (a row of ``heads``)."""
    return torch.stack([mean * heads, torch.full_like(mean, heads)])


def finish_mean(parts: torch.Tensor) -> torch.Tensor:
    """``(L, ..., N)`` mean over every head from ``(L, 2, ..., N)`` summed
    :func:`mean_parts`."""
    return parts[:, 0] / parts[:, 1]


def distance_parts(stale: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``(1, N)``: the squared distance of ``(N, H, d)`` fresh K (or V) from stale."""
    return squares(fresh.float() - stale.float())[None]


def relative_parts(stale: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``(2, N)``: the squared distance of ``(N, H, d)`` fresh K (or V) from stale,
    and the fresh one's squared norm."""
    fresh = fresh.float()
    return torch.stack([squares(fresh - stale.float()), squares(fresh)])


def finish_relative(parts: torch.Tensor) -> torch.Tensor:
    """``(L, N)`` ``||fresh - stale||_2 / mean_u ||fresh_u||_2`` (the mean over the
    ``N`` tokens, floored at ``1e-12``) from ``(L, 2, N)`` summed
    :func:`relative_parts`."""
    scale = parts[:, 1].sqrt().mean(dim=-1, keepdim=True).clamp_min(_EPS)
    return parts[:, 0].sqrt() / scale

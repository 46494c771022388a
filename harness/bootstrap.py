"""Percentile bootstrap intervals over paired per-example outcomes.

A fidelity summary compares a probe with its cold reference on the same examples,
so examples are resampled as pairs: relative accuracy's interval carries the
reference's own sampling error as well as the probe's.
"""

from __future__ import annotations

import torch

RESAMPLES = 2000
LEVEL = 0.95


def _resampled_means(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values``: ``(n,)``; ``index``: ``(B, n)`` draws -> ``(B,)`` resample means."""
    return values[index].mean(dim=1)


def paired_intervals(
    reference: list[float],
    probe: list[float],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """95 % (``level``) percentile intervals of the probe's mean (``accuracy``) and of
    probe mean / reference mean (``relative_accuracy``), resampling example pairs.

    ``reference``, ``probe``: one outcome per example (1.0 correct, 0.0 not), same order.
    Resamples whose reference mean is 0 are left out of the ratio's interval."""
    if len(reference) != len(probe):
        raise ValueError(f"{len(reference)} reference outcomes for {len(probe)} probes")
    if not probe:
        return {"accuracy": (float("nan"),) * 2, "relative_accuracy": (float("nan"),) * 2}
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(len(probe), (resamples, len(probe)), generator=generator)
    ref = _resampled_means(torch.tensor(reference, dtype=torch.float64), index)
    acc = _resampled_means(torch.tensor(probe, dtype=torch.float64), index)
    ratio = acc[ref > 0] / ref[ref > 0]
    tail = (1 - level) / 2
    quantiles = torch.tensor([tail, 1 - tail], dtype=torch.float64)

    def interval(samples: torch.Tensor) -> tuple[float, float]:
        if samples.numel() == 0:
            return (float("nan"), float("nan"))
        lo, hi = torch.quantile(samples, quantiles).tolist()
        return (round(lo, 4), round(hi, 4))

    return {"accuracy": interval(acc), "relative_accuracy": interval(ratio)}


def gap_share(
    floor: list[float],
    method: list[float],
    ceiling: list[float],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[float, tuple[float, float]]:
    """The share of the gap between a floor and a ceiling that a method closes,
    ``(mean(method) - mean(floor)) / (mean(ceiling) - mean(floor))``, and its
    ``level`` percentile interval, the three outcomes resampled together per example.

    ``floor``, ``method``, ``ceiling``: one outcome per example (1.0 correct, 0.0
    not), same order (e.g. plain reuse, a refresh method, the oracle). Resamples
    whose gap is not positive are left out; the share is NaN when the gap of the
    examples themselves is not."""
    if not len(floor) == len(method) == len(ceiling):
        raise ValueError(f"{len(floor)}, {len(method)} and {len(ceiling)} outcomes")
    if not floor:
        return float("nan"), (float("nan"), float("nan"))
    values = torch.tensor([floor, method, ceiling], dtype=torch.float64)  # (3, n)
    low, mid, high = values.mean(dim=1).tolist()
    share = (mid - low) / (high - low) if high > low else float("nan")
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(len(floor), (resamples, len(floor)), generator=generator)
    means = values[:, index].mean(dim=2)  # (3, B)
    gap = means[2] - means[0]
    shares = (means[1] - means[0])[gap > 0] / gap[gap > 0]
    if shares.numel() == 0:
        return share, (float("nan"), float("nan"))
    tail = (1 - level) / 2
    lo, hi = torch.quantile(shares, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return share, (round(lo, 4), round(hi, 4))

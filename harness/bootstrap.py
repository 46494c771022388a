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

"""StaleProbe (this project's rule): probe one token of each image that may have moved
relative to its predecessor, refresh by attention inside the images the probe finds
stale."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.base import ScoringInputs
from sgl_mmkv.scoring.oracle import OracleScorer
from sgl_mmkv.scoring.prophetkv import ProphetKVScorer


@dataclass
class StaleProbeScorer(ProphetKVScorer):
    """``s_t = alpha_t * z_j(t)``: ProphetKV's layer-averaged attention mass ``alpha_t``
    (its knobs apply) times the staleness ``z_j`` of token ``t``'s image.

    The probe: the scoring pass also recomputes, over the stale row, the middle
    reused token of every image whose position shift (``delta``) differs from the
    previous reused image's (the first image always): an image that moved together
    with its predecessor kept its context. ``z_j`` is the oracle's deviation of that
    token's new K/V from its stale K/V, summed over every layer
    (:meth:`OracleScorer.deviation`); an image without a probe has ``z_j = 0``.
    The probes keep their new K/V. An image is stale when ``z_j >= stale_fraction *
    max z``; the budget's ``k`` tokens hold the probes of stale images (refreshed
    again, over the refreshed row) and the top of ``s`` elsewhere; probes of images
    found fresh keep the K/V of the scoring pass and are the probe's cost, outside
    ``k``.

    Without probe inputs it ranks as ProphetKV."""

    name: ClassVar[str] = "staleprobe"
    summary: ClassVar[str] = (
        "this project's rule: attention mass inside the images a one-token probe finds stale"
    )
    stale_fraction: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.stale_fraction <= 1.0:
            raise ValueError(
                f"{self.name}: stale_fraction must be in [0, 1], got {self.stale_fraction}"
            )

    def probe_spans(self, deltas: tuple[int, ...]) -> tuple[int, ...]:
        """The first span and every span shifted by another delta than the previous."""
        return tuple(i for i, d in enumerate(deltas) if i == 0 or d != deltas[i - 1])

    deviation = staticmethod(OracleScorer.deviation)

    def staleness(self, inputs: ScoringInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(num_images,)`` float32 ``z_j``, and the ``(m,)`` visual-order index and
        ``(m,)`` image of each probe."""
        probe = torch.searchsorted(inputs.visual_positions, inputs.probe_positions)
        images = inputs.image_ids()[probe]
        z = torch.zeros(len(inputs.image_spans), device=inputs.device)
        z = z.index_add(0, images, inputs.probe_deviation.float().sum(dim=0))
        return z, probe, images

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        alpha = super().score(inputs)
        if inputs.probe_positions is None:
            return alpha
        z, _, _ = self.staleness(inputs)
        return alpha * z[inputs.image_ids()]

    def ranking(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        """The scores, with the probes of stale images first (``+inf``: counted in the
        budget) and those of fresh images last (``-inf``)."""
        scores = self.score(inputs)
        if inputs.probe_positions is None:
            return scores
        z, probe, images = self.staleness(inputs)
        stale = z >= self.stale_fraction * z.max()
        inf = torch.full(probe.shape, float("inf"), device=scores.device, dtype=scores.dtype)
        return scores.index_put((probe,), torch.where(stale[images], inf, -inf))

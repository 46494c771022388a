"""StaleProbe (this project's rule): probe one token of each image that may have moved
relative to its predecessor, refresh by attention inside the images the probe finds
stale."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.base import AUTO_BUDGET, RefreshBudget, ScoringInputs
from sgl_mmkv.scoring.oracle import OracleScorer
from sgl_mmkv.scoring.prophetkv import ProphetKVScorer

# --mm-refresh-budget auto's defaults, calibrated on the committed staleness models
# (docs/fidelity.md, "A budget that adapts"): a probe's K/V deviation from its fresh
# K/V, per layer, relative to the fresh norm; and the share of a stale image refreshed.
AUTO_THRESHOLD = 0.5
AUTO_FRACTION = 1.0


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

    Without probe inputs it ranks as ProphetKV.

    At ``--mm-refresh-budget auto`` each request gets the budget its probes ask for:
    an image is stale when its ``z_j`` averaged over layers reaches ``auto_threshold``
    (a fixed per-layer relative deviation, not a share of the request's largest),
    and ``ceil(auto_fraction * n_j)`` of a stale image's ``n_j`` reused tokens are
    refreshed, its probe first, then by ``alpha``; images found fresh, and those
    not probed, refresh nothing. A request whose images all came back fresh pays
    only for its probes."""

    name: ClassVar[str] = "staleprobe"
    summary: ClassVar[str] = (
        "this project's rule: attention mass inside the images a one-token probe finds stale"
    )
    adapts_budget: ClassVar[bool] = True
    stale_fraction: float = 0.5
    auto_threshold: float = AUTO_THRESHOLD
    auto_fraction: float = AUTO_FRACTION

    def __post_init__(self) -> None:
        super().__post_init__()
        for knob in ("stale_fraction", "auto_fraction"):
            value = getattr(self, knob)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{self.name}: {knob} must be in [0, 1], got {value}")
        if not 0.0 <= self.auto_threshold < float("inf"):
            raise ValueError(f"{self.name}: auto_threshold must be >= 0, got {self.auto_threshold}")

    def probe_spans(self, deltas: tuple[int, ...]) -> tuple[int, ...]:
        """The first span and every span shifted by another delta than the previous."""
        return tuple(i for i, d in enumerate(deltas) if i == 0 or d != deltas[i - 1])

    deviation = staticmethod(OracleScorer.deviation)
    deviation_parts = staticmethod(OracleScorer.deviation_parts)
    finish_deviation = staticmethod(OracleScorer.finish_deviation)

    def budget_bound(
        self, budget: RefreshBudget, deltas: tuple[int, ...] = (), sizes: tuple[int, ...] = ()
    ) -> float:
        """At ``auto``: ``auto_fraction`` of the images it probes (only those can be
        found stale), as a share of the reused tokens; ``auto_fraction`` without spans."""
        if budget != AUTO_BUDGET:
            return budget
        total = sum(sizes)
        if not total:
            return self.auto_fraction
        probed = sum(_share(self.auto_fraction, sizes[i]) for i in self.probe_spans(deltas))
        return min(1.0, probed / total)

    def stale_images(self, inputs: ScoringInputs) -> torch.Tensor:
        """``(num_images,)`` bool: the probed images whose probe's deviation, averaged
        over layers, reaches ``auto_threshold`` (an image without a probe moved with its
        predecessor: never stale)."""
        if inputs.probe_positions is None or inputs.probe_deviation is None:
            return torch.zeros(len(inputs.image_spans), dtype=torch.bool, device=inputs.device)
        z, _, images = self.staleness(inputs)
        return self._stale(z, images, inputs.probe_deviation.shape[0])

    def _stale(self, z: torch.Tensor, images: torch.Tensor, num_layers: int) -> torch.Tensor:
        probed = torch.zeros_like(z, dtype=torch.bool).index_fill(0, images, True)
        return probed & (z / num_layers >= self.auto_threshold)

    def select_adaptive(self, inputs: ScoringInputs) -> torch.Tensor:
        """Sorted ``(k,)`` row positions: ``ceil(auto_fraction * n_j)`` tokens of each
        stale image ``j`` (its probe, then the highest ``alpha``); ``k`` is the
        request's own. One device-side pass: tokens ordered by image, then by rank
        within it; a token is kept while its rank is below its image's quota."""
        if inputs.probe_positions is None or inputs.probe_deviation is None:
            return torch.empty(0, dtype=torch.long, device=inputs.device)
        z, probe, images = self.staleness(inputs)
        stale = self._stale(z, images, inputs.probe_deviation.shape[0])
        lengths = [e - s for s, e in inputs.image_spans]
        quotas = [_share(self.auto_fraction, n) for n in lengths]  # host ints: exact
        starts = [sum(lengths[:j]) for j in range(len(lengths))]
        ids = inputs.image_ids()
        quota = inputs.per_image(quotas) * stale[ids]  # per token: its image's quota
        start = inputs.per_image(starts)  # per token: its image's first visual index
        ranking = self._weighted(inputs, z).float().index_fill(0, probe, float("inf"))
        by_score = torch.argsort(ranking, descending=True, stable=True)
        order = by_score[torch.argsort(ids[by_score], stable=True)]  # by image, then score
        rank = torch.arange(order.numel(), device=inputs.device) - start[order]
        keep = order[rank < quota[order]]
        return inputs.visual_positions[keep].sort().values

    def staleness(self, inputs: ScoringInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(num_images,)`` float32 ``z_j``, and the ``(m,)`` visual-order index and
        ``(m,)`` image of each probe."""
        probe = torch.searchsorted(inputs.visual_positions, inputs.probe_positions)
        images = inputs.image_ids()[probe]
        z = torch.zeros(len(inputs.image_spans), device=inputs.device)
        z = z.index_add(0, images, inputs.probe_deviation.float().sum(dim=0))
        return z, probe, images

    def _weighted(self, inputs: ScoringInputs, z: torch.Tensor) -> torch.Tensor:
        """ProphetKV's ``(N_v,)`` attention mass times each token's image's ``z``."""
        return super().score(inputs) * z[inputs.image_ids()]

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.probe_positions is None:
            return super().score(inputs)
        z, _, _ = self.staleness(inputs)
        return self._weighted(inputs, z)

    def ranking(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        """The scores, with the probes of stale images first (``+inf``: counted in the
        budget) and those of fresh images last (``-inf``)."""
        if inputs.probe_positions is None:
            return super().score(inputs)
        z, probe, images = self.staleness(inputs)
        scores = self._weighted(inputs, z)
        stale = z >= self.stale_fraction * z.max()
        inf = torch.full(probe.shape, float("inf"), device=scores.device, dtype=scores.dtype)
        return scores.index_put((probe,), torch.where(stale[images], inf, -inf))


def _share(fraction: float, count: int) -> int:
    """``ceil(fraction * count)`` tokens, in float64 on the host (float32 would round
    0.3 * 50 up to 16)."""
    return min(count, math.ceil(fraction * count - 1e-9))

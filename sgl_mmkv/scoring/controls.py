"""The controls every method is measured against, no attention needed: ``first`` (EPIC /
MPIC style), ``random`` (the floor), ``full`` (budget 1) and ``reuse`` (budget 0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.base import ScoringInputs, TokenScorer, budget_count


@dataclass
class FirstTokensScorer(TokenScorer):
    """EPIC / MPIC style: the first ``ceil(r * n_j)`` tokens of every image."""

    name: ClassVar[str] = "first"
    summary: ClassVar[str] = "EPIC / MPIC style: refresh the first tokens of every image"
    needs_attention: ClassVar[bool] = False

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        offsets = [torch.arange(e - s, device=inputs.device) for s, e in inputs.image_spans]
        return -torch.cat(offsets).float()

    def select(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        chosen = [
            torch.arange(s, s + budget_count(budget, e - s), device=inputs.device)
            for s, e in inputs.image_spans
        ]
        return torch.cat(chosen).sort().values


@dataclass
class RandomScorer(TokenScorer):
    """A seeded random subset: the floor every real score must beat."""

    name: ClassVar[str] = "random"
    summary: ClassVar[str] = "refresh a seeded random subset (the floor every score must beat)"
    needs_attention: ClassVar[bool] = False
    seed: int = 0

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """Drawn on the host, so that every device draws the same subset."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(inputs.num_visual, generator=generator).to(inputs.device)


@dataclass
class FullRecomputeScorer(TokenScorer):
    """``full``: every visual token is recomputed, whatever the budget."""

    name: ClassVar[str] = "full"
    summary: ClassVar[str] = "refresh every reused image token (equals full prefill)"
    needs_attention: ClassVar[bool] = False

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return torch.ones(inputs.num_visual, device=inputs.device)

    def select(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        return inputs.visual_positions


@dataclass
class NoRefreshScorer(TokenScorer):
    """``reuse``: budget 0, only the text is recomputed over the re-positioned KV."""

    name: ClassVar[str] = "reuse"
    summary: ClassVar[str] = "refresh no image token, only the text (budget 0)"
    needs_attention: ClassVar[bool] = False

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return torch.zeros(inputs.num_visual, device=inputs.device)

    def select(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        return inputs.visual_positions[:0]


@dataclass
class RandomKeepScorer(RandomScorer):
    """Eviction control: a compressed segment keeps a seeded random subset of its
    tokens, the floor every eviction score must beat."""

    name: ClassVar[str] = "random_keep"
    summary: ClassVar[str] = "a seeded random subset (the control)"

"""The refresh baselines CONDUIT is compared against, behind the same interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.refresh.scorers.attention import attention_mass
from sgl_mmkv.refresh.scorers.base import RefreshScorer, ScoringInputs, budget_count


@dataclass
class ProphetKVScorer(RefreshScorer):
    """ProphetKV (arXiv 2602.02579): CONDUIT's attention mass alone, layer-averaged."""

    name: ClassVar[str] = "prophetkv"

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        positions = inputs.visual_positions
        layers = [
            attention_mass(q, k, inputs.query_positions)[positions]
            for q, k in zip(inputs.queries, inputs.keys, strict=True)
        ]
        return torch.stack(layers).mean(dim=0)


@dataclass
class FirstTokensScorer(RefreshScorer):
    """EPIC / MPIC style: the first ``ceil(r * n_j)`` tokens of every image."""

    name: ClassVar[str] = "first"
    needs_attention: ClassVar[bool] = False

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        offsets = torch.cat([torch.arange(e - s) for s, e in inputs.image_spans])
        return -offsets.float()

    def select(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        chosen = [torch.arange(s, s + budget_count(budget, e - s)) for s, e in inputs.image_spans]
        return torch.cat(chosen).sort().values


@dataclass
class RandomScorer(RefreshScorer):
    """A seeded random subset: the floor every real score must beat."""

    name: ClassVar[str] = "random"
    needs_attention: ClassVar[bool] = False
    seed: int = 0

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(inputs.num_visual, generator=generator)


@dataclass
class CacheBlendScorer(RefreshScorer):
    """CacheBlend (arXiv 2405.16444), first-layer selection: the tokens whose fresh
    K/V deviate most from the reused ones, ``||dK||_2 + ||dV||_2`` at the first
    layer where they can differ (``layer``, default 1: layer 0's K/V depend on the
    token alone). Needs ``fresh_keys`` / ``fresh_values``. One set for every layer:
    the paper's layer-by-layer shrinking of the set is not implemented."""

    name: ClassVar[str] = "cacheblend"
    needs_attention: ClassVar[bool] = False
    needs_fresh_kv: ClassVar[bool] = True
    layer: int = 1

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.fresh_keys is None or inputs.fresh_values is None:
            raise ValueError("cacheblend needs the fresh K/V of the row in ScoringInputs")
        layer = min(self.layer, len(inputs.keys) - 1)
        positions = inputs.visual_positions
        dk = inputs.fresh_keys[layer] - inputs.keys[layer]
        dv = inputs.fresh_values[layer] - inputs.values[layer]
        return dk[positions].float().flatten(1).norm(dim=-1) + dv[positions].float().flatten(
            1
        ).norm(dim=-1)


@dataclass
class FullRecomputeScorer(RefreshScorer):
    """``full``: every visual token is recomputed, whatever the budget."""

    name: ClassVar[str] = "full"
    needs_attention: ClassVar[bool] = False

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return torch.ones(inputs.num_visual)

    def select(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        return inputs.visual_positions


@dataclass
class NoRefreshScorer(RefreshScorer):
    """``reuse``: budget 0, only the text is recomputed over the re-positioned KV."""

    name: ClassVar[str] = "reuse"
    needs_attention: ClassVar[bool] = False

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return torch.zeros(inputs.num_visual)

    def select(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        return inputs.visual_positions[:0]

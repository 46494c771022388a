"""CacheBlend (arXiv 2405.16444): the tokens whose fresh K/V deviate most from the reused ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.base import ScoringInputs, TokenScorer


@dataclass
class CacheBlendScorer(TokenScorer):
    """CacheBlend (arXiv 2405.16444), first-layer selection: the tokens whose fresh
    K/V deviate most from the reused ones, ``||dK||_2 + ||dV||_2`` at the first
    layer where they can differ (``layer``, default 1: layer 0's K/V depend on the
    token alone). Needs ``fresh_keys`` / ``fresh_values``. One set for every layer:
    the paper's layer-by-layer shrinking of the set is not implemented."""

    name: ClassVar[str] = "cacheblend"
    summary: ClassVar[str] = (
        "CacheBlend: refresh the tokens whose fresh K/V deviate most at layer 1"
    )
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

"""ProphetKV (arXiv 2602.02579): CONDUIT's attention mass alone, layer-averaged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.attention import attention_mass
from sgl_mmkv.scoring.base import ScoringInputs, TokenScorer


@dataclass
class ProphetKVScorer(TokenScorer):
    """ProphetKV (arXiv 2602.02579): CONDUIT's attention mass alone, layer-averaged."""

    name: ClassVar[str] = "prophetkv"
    summary: ClassVar[str] = "ProphetKV: refresh the tokens with the most attention mass"

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        positions = inputs.visual_positions
        layers = [
            attention_mass(q, k, inputs.query_positions)[positions]
            for q, k in zip(inputs.queries, inputs.keys, strict=True)
        ]
        return torch.stack(layers).mean(dim=0)

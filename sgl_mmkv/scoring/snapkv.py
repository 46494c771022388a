"""SnapKV (arXiv 2404.14469): attention from the prompt's last window, pooled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.attention import kv_head_attention
from sgl_mmkv.scoring.base import LayerInputs, LayerReduction, ScoringInputs, TokenScorer


@dataclass
class SnapKVScorer(TokenScorer):
    """``s_j = mean_{l,h} avgpool_5(sum_{i in window} A^l_h[i, j])``: attention each key
    gets from the last ``window`` observed queries, summed, pooled along the keys
    (kernel ``pool_kernel``), averaged over KV heads and layers (one keep set for
    all layers, since a dropped token frees its slot in every layer)."""

    name: ClassVar[str] = "snapkv"
    summary: ClassVar[str] = "SnapKV window attention"
    window: int = 64
    pool_kernel: int = 5

    def layer_reduction(self) -> LayerReduction:
        return LayerReduction()

    def layer_statistic(self, layer: LayerInputs) -> torch.Tensor:
        """``(H_kv, N_v)`` pooled window votes of one layer."""
        w = min(self.window, layer.queries.shape[0])
        probs = kv_head_attention(layer.queries[-w:], layer.row_keys(), layer.query_positions[-w:])
        votes = probs.sum(dim=1)  # (H_kv, n)
        pooled = torch.nn.functional.avg_pool1d(
            votes[:, None], self.pool_kernel, stride=1, padding=self.pool_kernel // 2
        )[:, 0]
        return pooled[:, layer.visual_positions]

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return self.statistics(inputs).mean(dim=(0, 1))

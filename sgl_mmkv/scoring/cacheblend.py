"""CacheBlend (arXiv 2405.16444): the tokens whose fresh K/V deviate most from the reused ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring import head_parts
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

    def deviation_layer(self, num_layers: int) -> int:
        """The layer compared in a model of ``num_layers`` layers."""
        return min(self.layer, num_layers - 1)

    def deviation_layers(self, num_layers: int) -> tuple[int, ...]:
        """The one layer compared: :meth:`deviation_layer`."""
        return (self.deviation_layer(num_layers),)

    @staticmethod
    def deviation(
        keys: torch.Tensor,
        values: torch.Tensor,
        fresh_keys: torch.Tensor,
        fresh_values: torch.Tensor,
    ) -> torch.Tensor:
        """``(N_v,)`` float32 ``||dK||_2 + ||dV||_2`` of ``(N_v, H_kv, d)`` stale and fresh
        K/V of the visual tokens at one layer."""
        dk = (fresh_keys - keys).float().flatten(1).norm(dim=-1)
        return dk + (fresh_values - values).float().flatten(1).norm(dim=-1)

    @staticmethod
    def deviation_parts(
        keys: torch.Tensor,
        values: torch.Tensor,
        fresh_keys: torch.Tensor,
        fresh_values: torch.Tensor,
    ) -> torch.Tensor:
        """``(2, N_v)`` float32 ``||dK||_2^2`` and ``||dV||_2^2`` over the heads of
        ``(N_v, H_kv, d)`` stale and fresh K/V (one rank's)."""
        return torch.cat(
            [
                head_parts.distance_parts(keys, fresh_keys),
                head_parts.distance_parts(values, fresh_values),
            ]
        )

    @staticmethod
    def finish_deviation(parts: torch.Tensor) -> torch.Tensor:
        """``(L, N_v)`` :meth:`deviation` from ``(L, 2, N_v)`` summed parts."""
        return parts[:, 0].sqrt() + parts[:, 1].sqrt()

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """The deviation at :meth:`deviation_layer`; with ``layer_statistics`` (the
        selector copies that layer's visual tokens alone), ``(1, N_v)`` of it."""
        if inputs.layer_statistics is not None:
            return inputs.layer_statistics[0]
        if inputs.fresh_keys is None or inputs.fresh_values is None:
            raise ValueError("cacheblend needs the fresh K/V of the row in ScoringInputs")
        layer = self.deviation_layer(len(inputs.keys))
        positions = inputs.visual_positions
        return self.deviation(
            inputs.keys[layer][positions],
            inputs.values[layer][positions],
            inputs.fresh_keys[layer][positions],
            inputs.fresh_values[layer][positions],
        )

"""The oracle: a yardstick, not a servable method. It refreshes the reused tokens whose
K/V deviate most from a full prefill of the new prompt, summed over every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring import head_parts
from sgl_mmkv.scoring.base import ScoringInputs, TokenScorer

_EPS = 1e-12


@dataclass
class OracleScorer(TokenScorer):
    """``s_t = sum_l ( ||K~_t^l - K_t^l||_2 / mean_u ||K~_u^l||_2
    + ||V~_t^l - V_t^l||_2 / mean_u ||V~_u^l||_2 )``: stale (reused, re-positioned)
    ``K, V`` against fresh ``K~, V~`` of a full recompute of the extend, all KV heads
    concatenated, every layer; each layer's deviation is divided by the mean fresh
    norm over the request's reused tokens ``u`` at that layer, so that no layer
    weighs by its scale alone.

    It costs a full prefill plus the refresh, so the cost gate declines it always:
    it is measured with ``--mm-reuse-gate always``, as the ceiling of single-shot
    selection by staleness (docs/fidelity.md, "The ceiling")."""

    name: ClassVar[str] = "oracle"
    summary: ClassVar[str] = (
        "yardstick, not servable: refresh the tokens whose K/V deviate most over all layers"
    )
    needs_attention: ClassVar[bool] = False
    needs_fresh_kv: ClassVar[bool] = True

    def deviation_layers(self, num_layers: int) -> tuple[int, ...]:
        """Every layer of a model of ``num_layers`` layers."""
        return tuple(range(num_layers))

    @staticmethod
    def deviation(
        keys: torch.Tensor,
        values: torch.Tensor,
        fresh_keys: torch.Tensor,
        fresh_values: torch.Tensor,
    ) -> torch.Tensor:
        """``(N_v,)`` float32: one layer's term of the score, from ``(N_v, H_kv, d)``
        stale and fresh K/V of one request's reused tokens."""
        terms = []
        for stale, fresh in ((keys, fresh_keys), (values, fresh_values)):
            fresh = fresh.float().flatten(1)
            scale = fresh.norm(dim=-1).mean().clamp_min(_EPS)
            terms.append((fresh - stale.float().flatten(1)).norm(dim=-1) / scale)
        return terms[0] + terms[1]

    @staticmethod
    def deviation_parts(
        keys: torch.Tensor,
        values: torch.Tensor,
        fresh_keys: torch.Tensor,
        fresh_values: torch.Tensor,
    ) -> torch.Tensor:
        """``(4, N_v)`` float32 over the heads of ``(N_v, H_kv, d)`` stale and fresh K/V
        (one rank's): ``||K~ - K||_2^2``, ``||K~||_2^2``, ``||V~ - V||_2^2``, ``||V~||_2^2``."""
        return torch.cat(
            [
                head_parts.relative_parts(keys, fresh_keys),
                head_parts.relative_parts(values, fresh_values),
            ]
        )

    @staticmethod
    def finish_deviation(parts: torch.Tensor) -> torch.Tensor:
        """``(L, N_v)`` :meth:`deviation` per layer from ``(L, 4, N_v)`` summed parts."""
        return head_parts.finish_relative(parts[:, :2]) + head_parts.finish_relative(parts[:, 2:])

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """The sum over layers of :meth:`deviation`; with ``layer_statistics`` (the
        selector's copies of every layer's reused tokens), ``(L, N_v)`` of them."""
        if inputs.layer_statistics is not None:
            return inputs.layer_statistics.sum(dim=0)
        if inputs.fresh_keys is None or inputs.fresh_values is None:
            raise ValueError("oracle needs the fresh K/V of the row in ScoringInputs")
        positions = inputs.visual_positions
        per_layer = [
            self.deviation(k[positions], v[positions], fk[positions], fv[positions])
            for k, v, fk, fv in zip(
                inputs.keys, inputs.values, inputs.fresh_keys, inputs.fresh_values, strict=True
            )
        ]
        return torch.stack(per_layer).sum(dim=0)

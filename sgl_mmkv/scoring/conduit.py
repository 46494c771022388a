"""CONDUIT (arXiv 2609.05821): attention mass x value norm, image-amplified."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.attention import attention_mass
from sgl_mmkv.scoring.base import ScoringInputs, TokenScorer


def image_amplification(scores: torch.Tensor, image_ids: torch.Tensor, lam: float) -> torch.Tensor:
    """``c_j = 1 + lam * (m_j / mean_j m_j - 1)``, ``m_j = mean_{t in j} max(s_t, 0)``.

    Returns ``(N_v,)``: each token's image factor. One image gives 1 everywhere.
    """
    image_ids = image_ids.to(scores.device)
    num_images = int(image_ids.max()) + 1
    positive = scores.float().clamp(min=0)
    sums = torch.zeros(num_images, device=scores.device).index_add_(0, image_ids, positive)
    counts = torch.bincount(image_ids, minlength=num_images).float()
    m = sums / counts
    m_bar = m.mean()
    if m_bar <= 0:
        return torch.ones_like(scores)
    return (1 + lam * (m / m_bar - 1))[image_ids]


@dataclass
class ConduitScorer(TokenScorer):
    """``s_t = mean_l alpha_t^l * ||V_t^l||_2`` (all KV heads concatenated), times the
    image factor ``c_j`` (lambda = 1). Layer choice is the caller's (default: all)."""

    name: ClassVar[str] = "conduit"
    summary: ClassVar[str] = (
        "CONDUIT: refresh the tokens with the most attention mass x value norm, image-amplified"
    )
    amplification: float = 1.0
    use_value_norm: bool = True

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        positions = inputs.visual_positions
        per_layer = []
        for q, k, v in zip(inputs.queries, inputs.keys, inputs.values, strict=True):
            alpha = attention_mass(q, k, inputs.query_positions)[positions]
            if self.use_value_norm:
                alpha = alpha * v[positions].float().flatten(1).norm(dim=-1)
            per_layer.append(alpha)
        scores = torch.stack(per_layer).mean(dim=0)
        if self.amplification:
            scores = scores * image_amplification(scores, inputs.image_ids(), self.amplification)
        return scores

"""CONDUIT (arXiv 2609.05821): attention mass x value norm, image-amplified."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.attention import attention_mass
from sgl_mmkv.scoring.base import ScoringInputs, TokenScorer

# Which captured queries score: every fresh token after the last reused image, or the
# prompt's last token alone.
QUERY_SPANS: tuple[str, ...] = ("tail_text", "last_text")


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
    """``s_t = mean_{l in layers} alpha_t^l * ||V_t^l||_2`` (all KV heads concatenated),
    times the image factor ``c_j``.

    Knobs (``--mm-refresh-scorer-args``), each a part the ablations switch off:
        amplification: lambda of the image factor; 0 turns it off.
        use_value_norm: weight the attention mass by the value norm.
        query_span: one of :data:`QUERY_SPANS`.
        layers: model layer ids averaged over; None: every scored layer.
    """

    name: ClassVar[str] = "conduit"
    summary: ClassVar[str] = (
        "CONDUIT: refresh the tokens with the most attention mass x value norm, image-amplified"
    )
    amplification: float = 1.0
    use_value_norm: bool = True
    query_span: str = "tail_text"
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.amplification >= 0:
            raise ValueError(f"{self.name}: amplification must be >= 0, got {self.amplification}")
        if self.query_span not in QUERY_SPANS:
            raise ValueError(
                f"{self.name}: query_span {self.query_span!r} is unknown; "
                f"choose one of {', '.join(QUERY_SPANS)}"
            )
        if self.layers is not None:
            layers = list(self.layers)
            if not layers or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
            ):
                raise ValueError(
                    f"{self.name}: layers must be a non-empty list of layer ids, got {self.layers}"
                )
            self.layers = tuple(sorted(set(layers)))

    def _scored(self, inputs: ScoringInputs) -> list[int]:
        """Indices into the per-layer inputs of the layers averaged over."""
        ids = inputs.layer_ids or tuple(range(len(inputs.queries)))
        if self.layers is None:
            return list(range(len(ids)))
        missing = set(self.layers) - set(ids)
        if missing:
            raise ValueError(f"{self.name}: layers {sorted(missing)} were not scored ({ids})")
        return [i for i, layer in enumerate(ids) if layer in self.layers]

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        positions = inputs.visual_positions
        query_positions = inputs.query_positions
        rows = slice(None)
        if self.query_span == "last_text" and query_positions.numel():
            last = int(query_positions.argmax())
            rows, query_positions = slice(last, last + 1), query_positions[last : last + 1]
        per_layer = []
        for i in self._scored(inputs):
            alpha = attention_mass(inputs.queries[i][rows], inputs.keys[i], query_positions)
            alpha = alpha[positions]
            if self.use_value_norm:
                alpha = alpha * inputs.values[i][positions].float().flatten(1).norm(dim=-1)
            per_layer.append(alpha)
        scores = torch.stack(per_layer).mean(dim=0)
        if self.amplification:
            scores = scores * image_amplification(scores, inputs.image_ids(), self.amplification)
        return scores

"""CONDUIT (arXiv 2609.05821): attention mass x value norm, image-amplified."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from sgl_mmkv.scoring import head_parts
from sgl_mmkv.scoring.attention import attention_mass
from sgl_mmkv.scoring.base import LayerInputs, LayerReduction, ScoringInputs, TokenScorer

# Which captured queries score: every fresh token after the last reused image, or the
# prompt's last token alone.
QUERY_SPANS: tuple[str, ...] = ("tail_text", "last_text")


def image_amplification(
    scores: torch.Tensor, image_ids: torch.Tensor, lam: float, num_images: int | None = None
) -> torch.Tensor:
    """``c_j = 1 + lam * (m_j / mean_j m_j - 1)``, ``m_j = mean_{t in j} max(s_t, 0)``;
    1 everywhere when every ``m_j`` is 0.

    Args:
        scores: ``(N_v,)``.
        image_ids: ``(N_v,)`` int64 on ``scores``' device, image ``0 .. num_images - 1``
            of each token.
        num_images: how many images (default: read from ``image_ids``, a host sync).
    Returns ``(N_v,)`` float32: each token's image factor. One image gives 1 everywhere.
    """
    if num_images is None:
        num_images = int(image_ids.max()) + 1
    positive = scores.float().clamp(min=0)
    sums = torch.zeros(num_images, device=scores.device).index_add_(0, image_ids, positive)
    counts = torch.bincount(image_ids, minlength=num_images).float()
    m = sums / counts
    m_bar = m.mean()
    factor = 1 + lam * (m / m_bar - 1)
    return torch.where(m_bar > 0, factor, torch.ones_like(factor))[image_ids]


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
        count = len(inputs.queries)
        if inputs.layer_statistics is not None:
            count = inputs.layer_statistics.shape[0]
        ids = inputs.layer_ids or tuple(range(count))
        if self.layers is None:
            return list(range(len(ids)))
        missing = set(self.layers) - set(ids)
        if missing:
            raise ValueError(f"{self.name}: layers {sorted(missing)} were not scored ({ids})")
        return [i for i, layer in enumerate(ids) if layer in self.layers]

    def layer_reduction(self) -> LayerReduction:
        """Only the layers averaged over, the last query for ``last_text``, V only with
        the value norm."""
        return LayerReduction(
            layers=self.layers,
            last_query_only=self.query_span == "last_text",
            needs_values=self.use_value_norm,
        )

    def layer_statistic(self, layer: LayerInputs) -> torch.Tensor:
        """``(N_v,)`` ``alpha_t^l`` at the visual tokens, times ``||V_t^l||_2`` if asked."""
        alpha = self._mass(layer)
        if self.use_value_norm:
            alpha = alpha * layer.visual_values.float().flatten(1).norm(dim=-1)
        return alpha

    def layer_parts(self, layer: LayerInputs) -> torch.Tensor:
        """``(2, N_v)``: ``alpha_t^l`` summed over the ``H_q`` query heads in ``layer``,
        and ``H_q``; ``(3, N_v)`` with the value norm: then ``||V_t^l||_2^2`` over its
        KV heads."""
        parts = head_parts.mean_parts(self._mass(layer), layer.queries.shape[1])
        if self.use_value_norm:
            parts = torch.cat([parts, head_parts.squares(layer.visual_values)[None]])
        return parts

    def finish_layers(self, parts: torch.Tensor) -> torch.Tensor:
        """``(L, N_v)`` :meth:`layer_statistic` from ``(L, 2 or 3, N_v)`` summed parts."""
        alpha = head_parts.finish_mean(parts[:, :2])
        if self.use_value_norm:
            alpha = alpha * parts[:, 2].sqrt()
        return alpha

    @staticmethod
    def _mass(layer: LayerInputs) -> torch.Tensor:
        """``(N_v,)`` float32 ``alpha_t^l``: the mean over the queries and query heads of
        the attention each visual token receives."""
        mass = attention_mass(layer.queries, layer.keys, layer.query_positions, layer.key_slots)
        return mass[layer.visual_positions]

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        scored = self._scored(inputs)
        if inputs.layer_statistics is not None:
            per_layer = torch.stack([inputs.layer_statistics[i] for i in scored])
        else:
            inputs = self._query_span(inputs)
            per_layer = torch.stack([self.layer_statistic(inputs.layer(i)) for i in scored])
        scores = per_layer.mean(dim=0)
        if self.amplification:
            factor = image_amplification(
                scores, inputs.image_ids(), self.amplification, len(inputs.image_spans)
            )
            scores = scores * factor
        return scores

    def _query_span(self, inputs: ScoringInputs) -> ScoringInputs:
        """``inputs`` with only the query span's queries (``last_text``: the query at
        the highest position, found on the device)."""
        positions = inputs.query_positions
        if self.query_span != "last_text" or not positions.numel():
            return inputs
        last = positions.argmax(dim=0, keepdim=True)  # (1,), no host sync
        queries = tuple(q[last] for q in inputs.queries)
        return replace(inputs, queries=queries, query_positions=positions[last])

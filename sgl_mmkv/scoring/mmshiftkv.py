"""MM-ShiftKV (ACL 2026 Findings): votes of variance-expanded query proxies at
future decode positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring import head_parts
from sgl_mmkv.scoring.attention import kv_head_attention
from sgl_mmkv.scoring.base import LayerInputs, LayerReduction, ScoringInputs, TokenScorer


def top_p_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per row of ``(..., n)`` non-negative ``scores``, the smallest set of entries
    whose mass reaches ``top_p`` of the row's total (bool, same shape)."""
    order = torch.argsort(scores, dim=-1, descending=True)
    sorted_scores = scores.gather(-1, order)
    total = sorted_scores.sum(dim=-1, keepdim=True)
    before = sorted_scores.cumsum(dim=-1) - sorted_scores
    keep_sorted = before < top_p * total
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@dataclass
class MMShiftKVScorer(TokenScorer):
    """Per layer, ``num_samples`` proxies ``x ~ N(mu 1, (expansion sigma)^2 I)`` (``mu``,
    ``sigma``: global scalars of the attention input) through ``q_proj`` with RoPE
    at ``last + group_stride * k``, ``k = 1..samples_per_group``; each group's
    attention to the prompt keys (last token excluded) summed with the real last
    query's and divided by ``samples_per_group + 1``; per (KV head, group) the
    top-``top_p`` set votes. A token's rank is its votes over layers and KV heads
    (ties: the last query's attention), one keep set for all layers and heads
    since a dropped token frees its slot everywhere."""

    name: ClassVar[str] = "mmshiftkv"
    summary: ClassVar[str] = "MM-ShiftKV votes"
    num_samples: int = 512
    expansion: float = 10.0
    group_stride: int = 32
    samples_per_group: int = 16
    top_p: float = 0.95
    seed: int = 0

    def proxy_positions(self, last: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(num_samples,)``: group after group, positions ``last + stride * k``."""
        k = torch.arange(1, self.samples_per_group + 1, device=device)
        return (last + self.group_stride * k).repeat(self.num_samples // self.samples_per_group)

    def layer_votes(
        self, inputs: ScoringInputs, layer: int, last: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(H_kv, N_v)`` votes and ``(H_kv, N_v)`` last-query attention at per-layer
        entry ``layer`` of ``inputs`` (``last``: the last query's row position, default
        read from the inputs, a host sync)."""
        votes, attention = self.layer_statistic(inputs.layer(layer, last))
        return votes, attention

    def layer_reduction(self) -> LayerReduction:
        return LayerReduction()

    def layer_statistic(self, layer: LayerInputs) -> torch.Tensor:
        """``(2, H_kv, N_v)``: the votes and the last query's attention at one layer.

        The proxies' noise is drawn on the host, so every device draws the same, and
        moved to the layer's device."""
        if layer.hidden_stats is None or layer.project_queries is None:
            raise ValueError("mmshiftkv needs the attention-input statistics and q_proj")
        device = layer.queries.device
        last = layer.last_position
        if last is None:
            last = int(layer.query_positions[-1])
        mean, std, hidden_size = layer.hidden_stats
        gen = torch.Generator().manual_seed(self.seed + layer.layer)
        noise = torch.randn(self.num_samples, hidden_size, generator=gen).to(device)
        x = mean + self.expansion * std * noise
        positions = self.proxy_positions(last, device)
        proxies = layer.project_queries(layer.layer, x, positions).float()  # (S, H_q, d)
        keys = layer.keys_at(torch.arange(last, device=device))
        probs = kv_head_attention(proxies, keys, positions)  # (H_kv, S, last)
        last_position = torch.full((1,), last, device=device)
        last_probs = kv_head_attention(layer.queries[-1:], keys, last_position)[:, 0]
        groups = self.num_samples // self.samples_per_group
        h_kv = probs.shape[0]
        grouped = probs.view(h_kv, groups, self.samples_per_group, last).sum(dim=2)
        grouped = (grouped + last_probs[:, None]) / (self.samples_per_group + 1)
        votes = top_p_mask(grouped, self.top_p).sum(dim=1).float()  # (H_kv, last)
        visual = layer.visual_positions
        return torch.stack([votes[:, visual], last_probs[:, visual]])

    def layer_parts(self, layer: LayerInputs) -> torch.Tensor:
        """``(3, N_v)``: this rank's votes and last-query attention summed over its KV
        heads, and their count. The proxies' noise and positions are the same on every
        rank, so a head votes as it would with every head in one process."""
        votes, attention = self.layer_statistic(layer)
        return torch.stack(
            [votes.sum(dim=0), *head_parts.mean_parts(attention.mean(dim=0), attention.shape[0])]
        )

    def finish_layers(self, parts: torch.Tensor) -> torch.Tensor:
        """``(L, 2, 1, N_v)`` from ``(L, 3, N_v)`` summed parts: the votes of every head,
        and their last-query attention's mean (what :meth:`score` reads of a layer)."""
        return torch.stack([parts[:, 0], head_parts.finish_mean(parts[:, 1:])], dim=1)[:, :, None]

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        last = None
        if inputs.layer_statistics is None:
            last = int(inputs.query_positions[-1])  # one host sync, not one per layer
        per_layer = self.statistics(inputs, last)  # (L, 2, H_kv, N_v)
        return per_layer[:, 0].sum(dim=(0, 1)) + 0.5 * per_layer[:, 1].mean(dim=(0, 1))

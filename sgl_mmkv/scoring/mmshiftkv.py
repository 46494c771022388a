"""MM-ShiftKV (ACL 2026 Findings): votes of variance-expanded query proxies at
future decode positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.attention import kv_head_attention
from sgl_mmkv.scoring.base import ScoringInputs, TokenScorer


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
        """``(H_kv, N_v)`` votes and ``(H_kv, N_v)`` last-query attention at ``layer``.

        ``last``: the last query's row position (default: read from the inputs, a
        host sync). The proxies' noise is drawn on the host, so every device draws
        the same, and moved to the inputs' device."""
        if inputs.hidden_stats is None or inputs.project_queries is None:
            raise ValueError("mmshiftkv needs the attention-input statistics and q_proj")
        q, k = inputs.queries[layer], inputs.keys[layer]
        mean, std, hidden_size = inputs.hidden_stats[layer]
        if last is None:
            last = int(inputs.query_positions[-1])
        gen = torch.Generator().manual_seed(self.seed + layer)
        noise = torch.randn(self.num_samples, hidden_size, generator=gen).to(inputs.device)
        x = mean + self.expansion * std * noise
        positions = self.proxy_positions(last, inputs.device)
        proxies = inputs.project_queries(layer, x, positions).float()  # (S, H_q, d)
        keys = k[:last]
        probs = kv_head_attention(proxies, keys, positions)  # (H_kv, S, last)
        last_position = torch.full((1,), last, device=inputs.device)
        last_probs = kv_head_attention(q[-1:], keys, last_position)[:, 0]  # (H_kv, last)
        groups = self.num_samples // self.samples_per_group
        h_kv = probs.shape[0]
        grouped = probs.view(h_kv, groups, self.samples_per_group, last).sum(dim=2)
        grouped = (grouped + last_probs[:, None]) / (self.samples_per_group + 1)
        votes = top_p_mask(grouped, self.top_p).sum(dim=1).float()  # (H_kv, last)
        visual = inputs.visual_positions
        return votes[:, visual], last_probs[:, visual]

    def _votes(self, inputs: ScoringInputs) -> tuple[torch.Tensor, torch.Tensor]:
        last = int(inputs.query_positions[-1])  # one host sync, not one per layer
        per_layer = [self.layer_votes(inputs, layer, last) for layer in range(len(inputs.queries))]
        votes = torch.stack([v for v, _ in per_layer])  # (L, H_kv, N_v)
        attention = torch.stack([a for _, a in per_layer])
        return votes, attention

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        votes, attention = self._votes(inputs)
        return votes.sum(dim=(0, 1)) + 0.5 * attention.mean(dim=(0, 1))

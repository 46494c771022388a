"""AirCache (arXiv 2503.23956): importance from an elite text observation window,
with layer budgets from the strength and skewness of each layer's importance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring.attention import kv_head_attention
from sgl_mmkv.scoring.base import LayerInputs, LayerReduction, ScoringInputs, TokenScorer


def elite_mask(query: torch.Tensor, text_keys: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(n_t,)`` bool: the text rows ``j`` with ``Att[last, j] >= alpha * max_j Att[last, :]``.

    Args:
        query: ``(1, H_q, d)`` the last text query.
        text_keys: ``(n_t, H_kv, d)`` keys of the observed text tokens (all before it).
    """
    n_t = text_keys.shape[0]
    last = torch.full((1,), n_t - 1, device=text_keys.device)
    att = kv_head_attention(query, text_keys, last).mean(dim=0)[0]  # (n_t,)
    return att >= alpha * att.max()


def skewness(x: torch.Tensor) -> torch.Tensor:
    """Sample skewness ``n / ((n-1)(n-2)) * sum(((x - mu) / sigma)^3)`` of ``(..., n)``."""
    n = x.shape[-1]
    if n < 3:
        return x.new_zeros(x.shape[:-1])
    mu = x.mean(dim=-1, keepdim=True)
    sigma = x.std(dim=-1, keepdim=True).clamp(min=1e-12)
    return n / ((n - 1) * (n - 2)) * (((x - mu) / sigma) ** 3).sum(dim=-1)


def mean_normalised(x: torch.Tensor) -> torch.Tensor:
    """``x`` shifted to be non-negative and divided by its mean (all ones if constant)."""
    shifted = x - x.min() if bool((x < 0).any()) else x
    mean = shifted.mean()
    return shifted / mean if mean > 1e-12 else torch.ones_like(x)


def capped_to_mean(raw: torch.Tensor, budget: float) -> torch.Tensor:
    """Scale ``raw`` (non-negative) to mean ``budget`` with every entry in [0, 1]:
    entries over 1 are capped and their excess is spread over the others."""
    r = raw.clone().float()
    capped = torch.zeros_like(r, dtype=torch.bool)
    for _ in range(r.numel()):
        free_total = budget * r.numel() - capped.sum()
        weights = raw.float().masked_fill(capped, 0.0)
        if weights.sum() <= 0:
            r = torch.where(capped, 1.0, free_total / max(1, int((~capped).sum())))
            break
        r = torch.where(capped, torch.ones_like(r), weights / weights.sum() * free_total)
        over = (r > 1.0) & ~capped
        if not bool(over.any()):
            break
        capped |= over
    return r.clamp(0.0, 1.0)


@dataclass
class AirCacheScorer(TokenScorer):
    """Per layer ``I_v = mean_{elite} softmax(Q_elite [K_vis; K_elite]^T / sqrt(d))[:, :N_v]``
    (heads averaged); layer ``l`` keeps its top ``r_l N_v`` tokens with
    ``r_l = r (s'_t + s'_k) / 2`` (:meth:`layer_budgets`); a token's rank is the
    number of layers that keep it (ties: mean importance), one keep set for all
    layers since a dropped token frees its slot in every layer.

    At ``--tp-size`` > 1 a rank's elite set is its own heads' (the paper's set reads
    every head's attention of the last query: an all-reduce inside each layer, which
    this scorer does not add); the importance is then the mean over every head
    (:meth:`layer_parts`' default), so every rank ranks alike, close to TP 1's."""

    name: ClassVar[str] = "aircache"
    summary: ClassVar[str] = "AirCache importance"
    alpha: float = 0.9

    def layer_reduction(self) -> LayerReduction:
        return LayerReduction()

    def layer_statistic(self, layer: LayerInputs) -> torch.Tensor:
        """``(N_v,)`` importance of the visual tokens at one layer. The elite set stays
        a mask on the device: every text query runs, a text key outside the set is
        moved past every query (never visible) and a query outside it weighs 0."""
        visual, positions = layer.visual_positions, layer.query_positions
        text_keys = layer.keys_at(positions)
        elite = elite_mask(layer.queries[-1:], text_keys, self.alpha)
        beyond = positions.max() + 1
        key_positions = torch.cat([visual, torch.where(elite, positions, beyond)])
        keys = torch.cat([layer.keys_at(visual), text_keys])
        probs = kv_head_attention(layer.queries, keys, positions, key_positions)
        weights = elite.float() / elite.sum()  # (n_t,), the mean over the elite queries
        return (probs[..., : visual.numel()].mean(dim=0) * weights[:, None]).sum(dim=0)

    def layer_importance(self, inputs: ScoringInputs) -> torch.Tensor:
        """``(L, N_v)`` importance of each visual token per layer.

        The observed queries are the prompt's text tokens; the visual tokens are the
        image spans being scored.
        """
        return self.statistics(inputs)

    @staticmethod
    def layer_budgets(importance: torch.Tensor, budget: float) -> torch.Tensor:
        """``(L,)`` budgets in [0, 1] whose mean is ``budget``: half the layer's strength
        ``s_t = sum_i I_v[i]``, half its skewness, each normalised by its mean across
        layers (skewness first shifted to be non-negative), capped at 1 with the
        excess spread over the other layers."""
        strength = mean_normalised(importance.sum(dim=-1))
        skew = mean_normalised(skewness(importance))
        return capped_to_mean(0.5 * (strength + skew), budget)

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        return self.layer_importance(inputs).mean(dim=0)

    def ranking(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        importance = self.layer_importance(inputs)
        num_layers, n = importance.shape
        counts = layer_keep_counts(self.layer_budgets(importance, budget), n).tolist()
        votes = importance.new_zeros(n)
        for layer in range(num_layers):
            votes[torch.topk(importance[layer], counts[layer]).indices] += 1
        mean = importance.mean(dim=0)
        return votes + 0.5 * mean / mean.max().clamp(min=1e-12)


def layer_keep_counts(layer_budgets: torch.Tensor, n: int) -> torch.Tensor:
    """``(L,)`` token counts ``~ r_l n`` summing to ``round(sum_l r_l n)`` (largest
    remainders), each at most ``n``."""
    exact = layer_budgets.double() * n
    counts = exact.floor().long()
    left = int(round(float(exact.sum()))) - int(counts.sum())
    if left > 0:
        order = torch.argsort(exact - counts, descending=True)
        room = order[counts[order] < n][:left]
        counts[room] += 1
    return counts.clamp(max=n)


__all__ = ["AirCacheScorer", "elite_mask", "layer_keep_counts", "skewness"]

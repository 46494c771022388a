"""One interface for every token scorer: ``score()`` per visual token, shared top-k.

Refresh scorers rank reused image tokens by how much recomputing them is worth;
eviction scorers rank cached image tokens by how much keeping them is worth. Both
are :class:`TokenScorer` s: a higher score means more important.

A scorer sees what the scoring pass of a reuse plan produces (queries of the
query span, the row's re-positioned K and V per layer) and returns one score per
visual token; :meth:`TokenScorer.select` turns scores into the chosen set
under a budget (recomputed for a refresh scorer, kept for an eviction scorer).
Methods with a selection rule of their own override ``select``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, slots=True)
class ScoringInputs:
    """What the scoring pass of one request hands to a scorer.

    Attributes:
        queries: per scored layer ``(n_q, H_q, d)``, RoPE applied, of the query span.
        keys: per scored layer ``(n, H_kv, d)``, the whole row (stale, re-positioned
            image K; fresh text K), RoPE applied.
        values: per scored layer ``(n, H_kv, d)``, the row's V (pre-o_proj).
        query_positions: ``(n_q,)`` row positions of the queries.
        image_spans: ``[(start, end), ...]`` row ranges of the reused images, in order.
        fresh_keys, fresh_values: optional, per scored layer ``(n, H_kv, d)``, the
            row recomputed in full at that layer (CacheBlend's deviation signal).
        hidden_stats: optional, per scored layer ``(mean, std, hidden_size)``: global
            scalar mean and std (floats or 0-dim tensors) of the attention input
            (after ``input_layernorm``) over the request's prompt tokens, and its width.
        project_queries: optional ``f(layer, x, positions) -> (S, H_q, d)``: the
            layer's ``q_proj`` of ``x`` ``(S, D)`` with RoPE at text positions
            ``positions`` ``(S,)`` (MM-ShiftKV's query proxies).
        layer_ids: optional, the model layer of each per-layer entry (None: 0, 1, ...).
        device: where the scorer computes and returns its results; default the
            keys' device, else ``query_positions``'. Every tensor input is moved
            there once, here (a no-op for those already there).
    """

    queries: tuple[torch.Tensor, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    query_positions: torch.Tensor
    image_spans: tuple[tuple[int, int], ...]
    fresh_keys: tuple[torch.Tensor, ...] | None = None
    fresh_values: tuple[torch.Tensor, ...] | None = None
    hidden_stats: tuple[tuple[torch.Tensor | float, torch.Tensor | float, int], ...] | None = None
    project_queries: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    layer_ids: tuple[int, ...] | None = None
    device: torch.device | None = None

    def __post_init__(self) -> None:
        device = self.device
        if device is None:
            device = self.keys[0].device if self.keys else self.query_positions.device
        device = torch.device(device)
        object.__setattr__(self, "device", device)
        for name in ("queries", "keys", "values", "fresh_keys", "fresh_values"):
            tensors = getattr(self, name)
            if tensors is not None:
                object.__setattr__(self, name, tuple(t.to(device) for t in tensors))
        object.__setattr__(self, "query_positions", self.query_positions.to(device))
        if self.hidden_stats is not None:
            stats = tuple(
                (_on(mean, device), _on(std, device), width)
                for mean, std, width in self.hidden_stats
            )
            object.__setattr__(self, "hidden_stats", stats)

    @property
    def visual_positions(self) -> torch.Tensor:
        """``(N_v,)`` row positions of the visual tokens, image by image, on :attr:`device`."""
        parts = [torch.arange(s, e, device=self.device) for s, e in self.image_spans]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=self.device)

    @property
    def num_visual(self) -> int:
        return sum(e - s for s, e in self.image_spans)

    def image_ids(self) -> torch.Tensor:
        """``(N_v,)`` index of the image each visual token belongs to, on :attr:`device`."""
        counts = torch.tensor([e - s for s, e in self.image_spans], dtype=torch.long)
        ids = torch.arange(len(self.image_spans)).repeat_interleave(counts)
        return ids.to(self.device)


def _on(x: torch.Tensor | float, device: torch.device) -> torch.Tensor | float:
    """A tensor statistic moved to ``device``; a Python number as it is."""
    return x.to(device) if isinstance(x, torch.Tensor) else x


def budget_count(budget: float, num_visual: int) -> int:
    """``ceil(r * N_v)`` tokens, as the CONDUIT paper's selection."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"refresh budget must be in [0, 1], got {budget}")
    return min(num_visual, math.ceil(budget * num_visual - 1e-9))


def top_tokens(ranking: torch.Tensor, budget: float) -> torch.Tensor:
    """``(k,)`` sorted indices of the ``budget_count(budget, n)`` highest of the ``(n,)``
    ``ranking``: the tokens an eviction budget keeps."""
    k = budget_count(budget, ranking.numel())
    return torch.topk(ranking, k, sorted=False).indices.sort().values


class TokenScorer(ABC):
    """Scores visual tokens; higher means more worth recomputing (refresh) or keeping
    (eviction)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # what it ranks by, in a few words (CLI help)
    # What the executor must compute before ``select``: the scoring pass's queries
    # and the row's KV (``needs_attention``), or the row recomputed in full
    # (``needs_fresh_kv``). Position-only methods need neither.
    needs_attention: ClassVar[bool] = True
    needs_fresh_kv: ClassVar[bool] = False

    @abstractmethod
    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """``(N_v,)`` float scores in :attr:`ScoringInputs.visual_positions` order."""

    def ranking(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        """``(N_v,)`` scores whose top-k is the selection at ``budget``; the plain
        scores unless the method's rule depends on the budget (AirCache's layer
        budgets)."""
        return self.score(inputs)

    def select(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        """Sorted ``(k,)`` row positions chosen: one global top-k of the ranking."""
        k = budget_count(budget, inputs.num_visual)
        scores = self.ranking(inputs, budget)
        if scores.shape != (inputs.num_visual,):
            raise ValueError(
                f"{self.name}: {tuple(scores.shape)} scores for {inputs.num_visual} tokens"
            )
        top = torch.topk(scores.float(), k, sorted=False).indices
        return inputs.visual_positions[top].sort().values

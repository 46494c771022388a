"""One interface for every token scorer: ``score()`` per visual token, shared top-k.

Refresh scorers rank reused image tokens by how much recomputing them is worth;
eviction scorers rank cached image tokens by how much keeping them is worth. Both
are :class:`TokenScorer` s: a higher score means more important.

A scorer sees what the scoring pass of a reuse plan produces (queries of the
query span, the row's re-positioned K and V per layer) and returns one score per
visual token; :meth:`TokenScorer.select` turns scores into the chosen set
under a budget (recomputed for a refresh scorer, kept for an eviction scorer).
Methods with a selection rule of their own override ``select``.

A scorer whose score is a combination of per-layer statistics (every method that
reads attention) says so with :meth:`TokenScorer.layer_reduction`: the pass then
reduces each layer as it runs (:meth:`TokenScorer.layer_statistic` over a
:class:`LayerInputs`, the row's K read where the attention reads it) and hands the
``(L, ..., N_v)`` statistics over in :attr:`ScoringInputs.layer_statistics`,
instead of every layer's queries and row. ``score`` of whole-row inputs is the
reference: it runs the same ``layer_statistic`` layer by layer.

At ``--tp-size`` > 1 each rank holds some of the heads, so a pass computes the
statistics' additive parts over them instead (:meth:`TokenScorer.layer_parts`,
:meth:`TokenScorer.deviation_parts`); the ranks sum the parts and the scorer
finishes them (:meth:`TokenScorer.finish_layers`, :meth:`TokenScorer.finish_deviation`)
into what one rank holding every head computes (:mod:`sgl_mmkv.scoring.head_parts`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_mmkv.scoring import head_parts


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
            row recomputed in full at that layer (the deviation signal of CacheBlend and
            the oracle).
        hidden_stats: optional, per scored layer ``(mean, std, hidden_size)``: global
            scalar mean and std (floats or 0-dim tensors) of the attention input
            (after ``input_layernorm``) over the request's prompt tokens, and its width.
        project_queries: optional ``f(layer, x, positions) -> (S, H_q, d)``: the
            layer's ``q_proj`` of ``x`` ``(S, D)`` with RoPE at text positions
            ``positions`` ``(S,)`` (MM-ShiftKV's query proxies).
        layer_ids: optional, the model layer of each per-layer entry (None: 0, 1, ...).
        layer_statistics: optional ``(L, ..., N_v)`` float32, the scorer's
            :meth:`TokenScorer.layer_statistic` of each layer of ``layer_ids``, reduced
            while the pass ran (then ``queries``, ``keys`` and ``values`` are empty).
        probe_positions: optional ``(m,)`` int64 row positions of reused tokens the
            scoring pass recomputed over the stale row and kept (a staleness probe,
            :meth:`TokenScorer.probe_spans`), in row order.
        probe_deviation: optional ``(L, m)`` float32, the scorer's ``deviation`` of
            each probe's K/V after that pass from its stale K/V, per layer.
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
    layer_statistics: torch.Tensor | None = None
    probe_positions: torch.Tensor | None = None
    probe_deviation: torch.Tensor | None = None
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
        for name in ("layer_statistics", "probe_positions", "probe_deviation"):
            tensor = getattr(self, name)
            if tensor is not None:
                object.__setattr__(self, name, tensor.to(device))
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

    def layer(self, i: int, last_position: int | None = None) -> LayerInputs:
        """Per-layer entry ``i`` as a :class:`LayerInputs` (values at the visual tokens)."""
        visual = self.visual_positions
        return LayerInputs(
            layer=self.layer_ids[i] if self.layer_ids is not None else i,
            queries=self.queries[i],
            keys=self.keys[i],
            query_positions=self.query_positions,
            visual_positions=visual,
            visual_values=self.values[i][visual] if self.values else None,
            last_position=last_position,
            hidden_stats=self.hidden_stats[i] if self.hidden_stats is not None else None,
            project_queries=self.project_queries,
        )

    def image_ids(self) -> torch.Tensor:
        """``(N_v,)`` index of the image each visual token belongs to, on :attr:`device`
        (made there from host integers: no host-to-device copy)."""
        return self.per_image([*range(len(self.image_spans))])

    def per_image(self, values: list[int]) -> torch.Tensor:
        """``(N_v,)`` int64 on :attr:`device`: ``values[j]`` at every token of image
        ``j`` (filled there, one small fill per image: no host-to-device copy, which
        is a stream sync on CUDA from pageable memory)."""
        parts = [
            torch.full((e - s,), v, dtype=torch.long, device=self.device)
            for (s, e), v in zip(self.image_spans, values, strict=True)
        ]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=self.device)


@dataclass(frozen=True, slots=True)
class LayerInputs:
    """One layer of one request, as a per-layer reduction reads it.

    Attributes:
        layer: the model layer (MM-ShiftKV's ``q_proj``, noise seed and statistics).
        queries: ``(n_q, H_q, d)`` RoPE applied.
        keys: ``(n, H_kv, d)`` the row; with ``key_slots``, a ``(slots, H_kv, d)`` pool
            buffer whose rows ``key_slots`` are the row (read in place, not gathered).
        query_positions: ``(n_q,)`` int64 row positions of the queries.
        visual_positions: ``(N_v,)`` int64 row positions of the scored tokens.
        visual_values: ``(N_v, H_kv, d)`` V of the scored tokens, if the reduction
            asked for them (:attr:`LayerReduction.needs_values`).
        key_slots: optional ``(n,)`` int64 pool slots of the row, in row order.
        last_position: the last query's row position as a host int, if known.
        hidden_stats: ``(mean, std, hidden_size)`` of the layer's attention input.
        project_queries: MM-ShiftKV's ``q_proj`` (see :class:`ScoringInputs`).
    Everything is on one device; the statistic is computed there.
    """

    layer: int
    queries: torch.Tensor
    keys: torch.Tensor
    query_positions: torch.Tensor
    visual_positions: torch.Tensor
    visual_values: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    last_position: int | None = None
    hidden_stats: tuple[torch.Tensor | float, torch.Tensor | float, int] | None = None
    project_queries: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def row_keys(self) -> torch.Tensor:
        """``(n, H_kv, d)`` the row's keys (a gather when read from the pool)."""
        return self.keys if self.key_slots is None else self.keys[self.key_slots]

    def keys_at(self, positions: torch.Tensor) -> torch.Tensor:
        """``(m, H_kv, d)`` the keys at row ``positions`` ``(m,)``, read alone."""
        rows = positions if self.key_slots is None else self.key_slots[positions]
        return self.keys[rows]


@dataclass(frozen=True, slots=True)
class LayerReduction:
    """What a pass must hand a scorer's :meth:`TokenScorer.layer_statistic`.

    Attributes:
        layers: model layers reduced (None: every layer); the others are skipped.
        last_query_only: only the query at the highest row position is read.
        needs_values: the visual tokens' V is read (:attr:`LayerInputs.visual_values`).
    """

    layers: tuple[int, ...] | None = None
    last_query_only: bool = False
    needs_values: bool = False

    def reduces(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


def _on(x: torch.Tensor | float, device: torch.device) -> torch.Tensor | float:
    """A tensor statistic moved to ``device``; a Python number as it is."""
    return x.to(device) if isinstance(x, torch.Tensor) else x


# --mm-refresh-budget auto: each request's budget picked by the scorer from what its
# scoring pass measured (a scorer with ``adapts_budget``).
AUTO_BUDGET = "auto"
RefreshBudget = float | str  # a fraction in [0, 1], or AUTO_BUDGET


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
    # (``needs_fresh_kv``: such a scorer names the layers it compares,
    # ``deviation_layers(num_layers)``, and its ``deviation`` of the visual tokens'
    # stale and fresh K/V at each; the per-layer results are its ``(L, N_v)``
    # ``layer_statistics``). Position-only methods need neither.
    needs_attention: ClassVar[bool] = True
    needs_fresh_kv: ClassVar[bool] = False
    # Whether ``select`` takes AUTO_BUDGET: the scorer sizes each request's budget.
    adapts_budget: ClassVar[bool] = False

    @abstractmethod
    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        """``(N_v,)`` float scores in :attr:`ScoringInputs.visual_positions` order."""

    def layer_reduction(self) -> LayerReduction | None:
        """How a pass reduces each layer for this scorer, or None: ``score`` reads
        whole rows (position-only methods, CacheBlend)."""
        return None

    def probe_spans(self, deltas: tuple[int, ...]) -> tuple[int, ...]:
        """Indices of the reused spans (in row order, each shifted by ``deltas[i]``
        since it was stored) whose middle reused token the scoring pass recomputes
        and keeps, to be compared with its stale K/V (``probe_deviation``); none by
        default."""
        return ()

    def deviation_layers(self, num_layers: int) -> tuple[int, ...]:
        """The model layers a ``needs_fresh_kv`` scorer compares, in a model of
        ``num_layers`` layers."""
        raise NotImplementedError(f"{self.name} compares no fresh K/V")

    def layer_statistic(self, layer: LayerInputs) -> torch.Tensor:
        """``(..., N_v)`` float32 statistic of one layer (same shape for every layer);
        no host sync. Defined when :meth:`layer_reduction` is."""
        raise NotImplementedError(f"{self.name} has no per-layer reduction")

    def layer_parts(self, layer: LayerInputs) -> torch.Tensor:
        """``(P, ..., N_v)`` float32 additive parts of :meth:`layer_statistic` over the
        heads in ``layer`` (one tensor-parallel rank's), to be summed over the ranks and
        finished by :meth:`finish_layers`. Default: the statistic and a count of 1,
        whose finish is the ranks' mean (exact for a mean over heads, every rank
        holding as many heads)."""
        return head_parts.mean_parts(self.layer_statistic(layer), 1)

    def finish_layers(self, parts: torch.Tensor) -> torch.Tensor:
        """``(L, ..., N_v)`` statistics over every head from ``(L, P, ..., N_v)``
        :meth:`layer_parts` summed over the ranks."""
        return head_parts.finish_mean(parts)

    def deviation_parts(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        fresh_keys: torch.Tensor,
        fresh_values: torch.Tensor,
    ) -> torch.Tensor:
        """``(P, N)`` float32 additive parts of ``deviation`` over the heads of the
        ``(N, H_kv, d)`` stale and fresh K/V (one rank's), for a scorer that compares
        them (``needs_fresh_kv``, or one that probes)."""
        raise NotImplementedError(f"{self.name} compares no fresh K/V")

    def finish_deviation(self, parts: torch.Tensor) -> torch.Tensor:
        """``(L, N)`` ``deviation`` per layer over every head from ``(L, P, N)``
        :meth:`deviation_parts` summed over the ranks."""
        raise NotImplementedError(f"{self.name} compares no fresh K/V")

    def statistics(self, inputs: ScoringInputs, last_position: int | None = None) -> torch.Tensor:
        """``(L, ..., N_v)``: ``inputs.layer_statistics`` when the pass reduced them,
        else :meth:`layer_statistic` of every per-layer entry (the reference)."""
        if inputs.layer_statistics is not None:
            return inputs.layer_statistics
        per_layer = [inputs.layer(i, last_position) for i in range(len(inputs.queries))]
        return torch.stack([self.layer_statistic(layer) for layer in per_layer])

    def ranking(self, inputs: ScoringInputs, budget: float) -> torch.Tensor:
        """``(N_v,)`` scores whose top-k is the selection at ``budget``; the plain
        scores unless the method's rule depends on the budget (AirCache's layer
        budgets)."""
        return self.score(inputs)

    def budget_bound(
        self, budget: RefreshBudget, deltas: tuple[int, ...] = (), sizes: tuple[int, ...] = ()
    ) -> float:
        """The largest fraction of reused image tokens ``select`` refreshes at ``budget``
        (the cost gate's estimate), for reused spans shifted by ``deltas`` holding
        ``sizes`` reused tokens each."""
        if budget == AUTO_BUDGET:
            raise ValueError(f"{self.name} does not size its budget: give a fraction")
        return budget

    def select_adaptive(self, inputs: ScoringInputs) -> torch.Tensor:
        """Sorted ``(k,)`` row positions chosen at ``auto``, ``k`` the scorer's own (a
        scorer with :attr:`adapts_budget`)."""
        raise ValueError(f"{self.name} does not size its budget: give a fraction")

    def select(self, inputs: ScoringInputs, budget: RefreshBudget) -> torch.Tensor:
        """Sorted ``(k,)`` row positions chosen: one global top-k of the ranking; at
        ``auto``, :meth:`select_adaptive`."""
        if budget == AUTO_BUDGET:
            return self.select_adaptive(inputs)
        k = budget_count(budget, inputs.num_visual)
        scores = self.ranking(inputs, budget)
        if scores.shape != (inputs.num_visual,):
            raise ValueError(
                f"{self.name}: {tuple(scores.shape)} scores for {inputs.num_visual} tokens"
            )
        top = torch.topk(scores.float(), k, sorted=False).indices
        return inputs.visual_positions[top].sort().values

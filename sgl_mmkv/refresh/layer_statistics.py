"""A scorer's per-layer statistics, reduced while a pass runs: no row kept past its layer.

An attention-reading scorer (CONDUIT, ProphetKV, the eviction scorers) combines one
statistic per layer (:meth:`~sgl_mmkv.scoring.TokenScorer.layer_statistic`). During
the pass, right after a layer's attention (its K and V are then in the pool and
stay as they are), :class:`LayerStatistics` computes that statistic per request from
the layer's queries and the row read in place through its pool slots, and keeps
only the ``(..., N_v)`` result: the memory is O(layers x N_v), not the O(layers x row
x H_kv x d) of a copy of every layer's row. Nothing in a layer reads a tensor on
the host. An fp8 pool's row is read as one dequantized float32 copy per reduced
layer (``stored * scale``, :mod:`sgl_mmkv.kernels.kv_dtype`), freed after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sgl_mmkv.kernels.kv_dtype import dequantize, is_fp8
from sgl_mmkv.scoring import ScoringInputs, TokenScorer
from sgl_mmkv.scoring.base import LayerInputs


@dataclass(frozen=True)
class ReducedRow:
    """One request as a reduction reads it; host facts, moved to the device once.

    Attributes:
        query_positions: ``(n_q,)`` int64 positions of the reduced queries in the
            row without its holes, in the order the queries are handed over.
        image_spans: ``[(start, end), ...]`` the scored images in that row.
        kept: ``(m,)`` int64 row positions that hold KV (a row with holes), or None
            (the whole row); for readers that gather the row's slots themselves.
    """

    query_positions: torch.Tensor
    image_spans: tuple[tuple[int, int], ...]
    kept: torch.Tensor | None = None

    @property
    def visual_positions(self) -> torch.Tensor:
        """``(N_v,)`` int64 positions of the scored tokens, image by image."""
        parts = [torch.arange(s, e) for s, e in self.image_spans]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    @property
    def last_position(self) -> int | None:
        """The last query's position (a host read of a host tensor)."""
        return int(self.query_positions[-1]) if self.query_positions.numel() else None


class LayerStatistics:
    """Per request and reduced layer, ``scorer.layer_statistic``, taken during a pass.

    Args:
        scorer: a scorer with a :meth:`~sgl_mmkv.scoring.TokenScorer.layer_reduction`.
        rows: request index in the pass -> its :class:`ReducedRow`.
        project_queries: MM-ShiftKV's ``q_proj`` (set by the observer if None).
        partial: keep ``scorer.layer_parts`` (this tensor-parallel rank's additive parts
            over its heads, ``(P, ..., N_v)``), to be summed over the ranks and
            finished, instead of the statistic.

    Attributes:
        statistics: request -> layer -> ``(..., N_v)`` float32 on the pool's device
            (``(P, ..., N_v)`` parts if ``partial``).
    """

    def __init__(
        self,
        scorer: TokenScorer,
        rows: dict[int, ReducedRow],
        project_queries: Callable | None = None,
        partial: bool = False,
    ) -> None:
        reduction = scorer.layer_reduction()
        if reduction is None:
            raise ValueError(f"{scorer.name} has no per-layer reduction")
        self.scorer = scorer
        self.reduction = reduction
        self.rows = rows
        self.project_queries = project_queries
        self.partial = partial
        self.statistics: dict[int, dict[int, torch.Tensor]] = {}
        self._last = {i: row.last_position for i, row in rows.items()}
        self._placed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def place(self, device: torch.device) -> None:
        """Move every request's positions to ``device``, once for every layer."""
        for i, row in self.rows.items():
            if i not in self._placed:
                self._placed[i] = (
                    row.query_positions.to(device),
                    row.visual_positions.to(device),
                )

    def reduces(self, layer_id: int) -> bool:
        return self.reduction.reduces(layer_id)

    def reduce(
        self,
        i: int,
        layer_id: int,
        queries: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        row_slots: torch.Tensor,
        hidden_stats: tuple | None = None,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """Request ``i``'s statistic at ``layer_id``.

        Args:
            queries: ``(n_q, H_q, d)`` its reduced queries, in ``query_positions`` order.
            k_buffer, v_buffer: ``(slots, H_kv, d)`` the layer's pool buffers, read in place.
            row_slots: ``(n,)`` int64 pool slots of its row without holes, on the device.
            hidden_stats: ``(mean, std, hidden_size)`` of the layer's attention input.
            scales: the layer's ``(k_scale, v_scale)`` of an fp8 pool.
        """
        self.place(k_buffer.device)
        query_positions, visual_positions = self._placed[i]
        values = None
        if self.reduction.needs_values:
            values = dequantize(v_buffer[row_slots[visual_positions]], scales[1])
        keys, key_slots = k_buffer, row_slots
        if is_fp8(k_buffer.dtype):  # scorers read values: the row dequantized, once
            keys, key_slots = dequantize(k_buffer[row_slots], scales[0]), None
        layer = LayerInputs(
            layer=layer_id,
            queries=queries,
            keys=keys,
            query_positions=query_positions,
            visual_positions=visual_positions,
            visual_values=values,
            key_slots=key_slots,
            last_position=self._last[i],
            hidden_stats=hidden_stats,
            project_queries=self.project_queries,
        )
        reduce = self.scorer.layer_parts if self.partial else self.scorer.layer_statistic
        self.statistics.setdefault(i, {})[layer_id] = reduce(layer)

    def inputs(self, i: int, device: torch.device) -> ScoringInputs:
        """What the scorer's ``select`` / ``ranking`` reads of request ``i``: the
        stacked statistics of its reduced layers, no queries and no row (``partial``:
        their ``(L, P, ..., N_v)`` parts, which the selector sums and finishes)."""
        row = self.rows[i]
        per_layer = self.statistics.get(i, {})
        layers = tuple(sorted(per_layer))
        if layers:
            stacked = torch.stack([per_layer[layer] for layer in layers])
        else:
            n_v = sum(e - s for s, e in row.image_spans)
            stacked = torch.empty(0, n_v, device=device)
        return ScoringInputs(
            queries=(),
            keys=(),
            values=(),
            query_positions=row.query_positions,
            image_spans=row.image_spans,
            layer_ids=layers,
            layer_statistics=stacked,
            device=device,
        )

"""One extend forward as the refresh path sees it: its inputs and its frozen plans.

Built once per forward by :class:`~sgl_mmkv.refresh.planning.ExtendPlanner`; every
later stage (copy, select, refresh, rank, fill, report) reads it and none edits it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sgl_mmkv.refresh.embedding_pass import EmbeddingPass, EmbeddingSlot
from sgl_mmkv.refresh.flops import DecoderShape
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.row_view import RowView


@dataclass(frozen=True, slots=True)
class ExtendContext:
    """Attributes:
    run_extend: the stock eager extend, ``run_extend(forward_batch) -> output``.
    model_runner: SGLang's ``ModelRunner`` (pools, model, stock attention backend).
    forward_batch: the extend ``ForwardBatch``.
    plans: one :class:`RequestPlan` per request, in batch order, final.
    views: per request, the :class:`RowView` of a row with holes (None: no holes).
    shape: the decoder's shape, for FLOPs.
    embeddings: the batch's input embeddings, built once by the first pass that
        needs them and shared by every later pass (``embedding_pass.py``).
    embedding_slot: where a pass puts ``embeddings`` for the model's embedding
        routine to find (``patches/mm_embed_routine.py``).
    """

    run_extend: Callable
    model_runner: Any
    forward_batch: Any
    plans: tuple[RequestPlan, ...]
    views: tuple[RowView | None, ...]
    shape: DecoderShape
    embeddings: EmbeddingPass
    embedding_slot: EmbeddingSlot

    @property
    def reuses(self) -> bool:
        """Whether any request of the batch is served partly from the segment store."""
        return any(plan.spans for plan in self.plans)

    @property
    def device(self) -> torch.device:
        """The KV pool's device: where every tensor the refresh path makes lives."""
        return self.model_runner.token_to_kv_pool.get_key_buffer(0).device

    def full_flops(self) -> int:
        """What the stock extend of this batch computes."""
        return sum(self.shape.extend_flops(p.prefix_len, p.seq_len) for p in self.plans)

    def pass_positions(self, active: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per request, ``(n_i,)`` int64 row positions of a pass's ``active`` tokens."""
        return [plan.rows(mask) for plan, mask in zip(self.plans, active, strict=True)]

    def pass_flops(self, active: list[torch.Tensor]) -> int:
        """FLOPs of a pass over ``active`` tokens, each attending to its row up to itself."""
        return sum(self.shape.pass_flops(p) for p in self.pass_positions(active))

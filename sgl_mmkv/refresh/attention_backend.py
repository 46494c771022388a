"""The attention backends of refresh passes: queries at scattered row positions.

A refresh pass runs the model's own layers on the *active* tokens of each request
(text and the selected image tokens); the other image tokens keep the rotated
segment KV already written into the request's slots. So a query of request ``i``
sits at an arbitrary row position and attends causally by position over the whole
row ``req_to_token[i, :seq_len]``. Ordinary requests in the same batch are the
special case ``positions = arange(prefix_len, seq_len)``.

The backend is installed for one pass through SGLang's ``forward_context``; the
stock backend stays the server's backend for everything else. SGLang plans only
its own backend (``model_runner.attn_backend.init_forward_metadata``), never the
one in the context, so :class:`RefreshAttentionBackend` plans itself: once per
pass, on the first layer (or when :meth:`~RefreshAttentionBackend.init_forward_metadata`
is called before the forward), into a :class:`RefreshPassPlan`; every layer then
runs one batched :func:`~sgl_mmkv.kernels.refresh_attention.refresh_attention`
launch with no host read of a tensor. With a :class:`QueryCapture` it also keeps
the queries a scorer needs, per layer, or, with the capture's
:class:`~sgl_mmkv.refresh.layer_statistics.LayerStatistics`, reduces them with the
row, read through the plan's ``kv_indices``, to the scorer's per-layer statistic
right after the layer's attention, and keeps only that.

fp8 KV (SGLang's per-tensor-scaled pools): both backends write K and V through the
pool's ``set_kv_buffer`` with the layer's scales (stored as ``value / scale``, as
SGLang's scale-aware backends store them), and the refresh attention reads them
back descaled (:func:`~sgl_mmkv.refresh.kv_scales.layer_scales`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sgl_mmkv.kernels.refresh_attention import (
    RefreshAttentionPlan,
    plan_refresh_attention,
    refresh_attention,
)
from sgl_mmkv.refresh.kv_scales import layer_scales
from sgl_mmkv.refresh.layer_statistics import LayerStatistics
from sgl_mmkv.refresh.row_view import RowView


def save_kv(
    pool: Any,
    layer: Any,
    loc: KVWriteLoc,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: tuple[float, float],
) -> None:
    """``k`` / ``v`` (``(N, H_kv * d)`` or ``(N, H_kv, d)``) into ``pool`` at ``loc``;
    with fp8 scales other than 1 through ``set_kv_buffer(..., k_scale, v_scale)``,
    which divides in place, so on copies (the caller's ``k`` / ``v`` stay)."""
    if scales == (1.0, 1.0):
        pool.set_kv_buffer(layer, loc, k, v)
    else:
        pool.set_kv_buffer(layer, loc, k.clone(), v.clone(), *scales)


@dataclass
class QueryCapture:
    """Queries to keep: for request ``i``, the rows ``rows[i]`` of its active tokens.

    After the pass ``queries[i][layer]`` is ``(len(rows[i]), H_q, d)``, RoPE applied.
    With ``statistics`` no query is kept: each reduced layer's queries and row go
    into ``statistics`` (its rows' query positions in ``rows[i]`` order), the other
    layers are skipped.
    """

    rows: dict[int, torch.Tensor]
    queries: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    statistics: LayerStatistics | None = None

    def take(
        self,
        i: int,
        layer_id: int,
        queries: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        row_slots: torch.Tensor,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """Request ``i``'s ``(len(rows[i]), H_q, d)`` queries at ``layer_id``, with its
        row's ``(n,)`` pool slots in the layer's buffers and the layer's fp8
        ``(k_scale, v_scale)``."""
        if self.statistics is None:
            self.queries.setdefault(i, {})[layer_id] = queries.detach()
        else:
            self.statistics.reduce(
                i, layer_id, queries.detach(), k_buffer, v_buffer, row_slots, scales=scales
            )

    def takes(self, layer_id: int) -> bool:
        return self.statistics is None or self.statistics.reduces(layer_id)


@dataclass(frozen=True)
class RefreshPassPlan:
    """One pass's metadata: the attention plan, and per captured request the
    ``(k,)`` int64 packed query rows to keep (on the queries' device)."""

    attention: RefreshAttentionPlan
    captures: dict[int, torch.Tensor]


class RefreshAttentionBackend(AttentionBackend):
    """Extend attention over each request's whole row, causal by row position.

    Args:
        req_to_token_pool, token_to_kv_pool: SGLang's pools.
        query_positions: per request of the pass, ``(n_i,)`` int64 row positions of
            its active tokens, in the order they appear in the batch (host tensors
            are read without a device sync).
        capture: optional queries to keep for scoring.
        views: optional, per request, the :class:`RowView` of a row with holes
            (None: the whole row holds KV); its holes are never attended.
    """

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool,
        query_positions: list[torch.Tensor],
        capture: QueryCapture | None = None,
        views: list[RowView | None] | None = None,
    ) -> None:
        super().__init__()
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.query_positions = query_positions
        self.capture = capture
        self.views = views or [None] * len(query_positions)
        self.plan: RefreshPassPlan | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan the pass: each request's compacted row gathered from ``req_to_token``
        (``kv_indices``), its queries' positions in it, the kernel's block table.

        Reads ``seq_lens_cpu`` and the host query positions; the gathers run on the
        device. SGLang does not call this for a backend in the ``forward_context``:
        the first :meth:`forward_extend` does, unless the caller did before.
        """
        seq_lens = forward_batch.seq_lens_cpu
        if seq_lens is None:
            seq_lens = forward_batch.seq_lens.cpu()
        req_to_token = self.req_to_token_pool.req_to_token
        device = req_to_token.device
        positions, kv_lens, key_req, key_pos = [], [], [], []
        for i, pos in enumerate(self.query_positions):
            pos = pos.cpu()
            if pos.numel() == 0:
                positions.append(pos)
                kv_lens.append(0)
                continue
            view = self.views[i]
            if view is None:
                kept = torch.arange(int(seq_lens[i]))
            else:
                kept, pos = view.kept, view.compact(pos)
            positions.append(pos)
            kv_lens.append(kept.numel())
            key_req.append(torch.full((kept.numel(),), i, dtype=torch.long))
            key_pos.append(kept)
        if key_pos:
            pool_rows = forward_batch.req_pool_indices[torch.cat(key_req).to(device)]
            kv_indices = req_to_token[pool_rows, torch.cat(key_pos).to(device)]
        else:
            kv_indices = torch.empty(0, dtype=torch.int64, device=device)
        attention = plan_refresh_attention(positions, kv_indices, kv_lens)
        captures = {}
        if self.capture is not None:
            for i, rows in self.capture.rows.items():
                packed = rows.to(torch.long).cpu() + attention.q_indptr[i]
                captures[i] = packed.to(forward_batch.out_cache_loc.device)
            if self.capture.statistics is not None:
                self.capture.statistics.place(device)
        self.plan = RefreshPassPlan(attention, captures)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kw):
        """``q``: ``(N_q, H_q * d)`` the pass's queries; returns ``(N_q, H_q * d_v)``."""
        if self.plan is None:
            self.init_forward_metadata(forward_batch)
        scales = layer_scales(layer, self.token_to_kv_pool)
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, None)
            save_kv(self.token_to_kv_pool, layer, loc, k, v, scales)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        attention = self.plan.attention
        out = refresh_attention(q_, k_buffer, v_buffer, attention, layer.scaling, *scales)
        if self.capture is not None and self.capture.takes(layer.layer_id):
            for i, rows in self.plan.captures.items():
                slots = attention.kv_indices[attention.kv_indptr[i] : attention.kv_indptr[i + 1]]
                self.capture.take(i, layer.layer_id, q_[rows], k_buffer, v_buffer, slots, scales)
        return out.view(q_.shape[0], -1)

    def forward_decode(self, *args, **kwargs):
        raise RuntimeError("RefreshAttentionBackend serves extend passes only")


class GroupLocalAttentionBackend(AttentionBackend):
    """Each group of consecutive active tokens attends causally to its own group only.

    The canonical fill pass: a group is an image's tokens after the token before
    the image (its ``<|vision_start|>``), so the image is computed as if alone. Only
    the rows ``write_rows`` keep their KV, written to ``write_slots`` (the segment
    store's slots); no request slot is written.

    Args:
        token_to_kv_pool: SGLang's KV pool.
        group_sizes: sizes of the consecutive groups, in batch order (sum = tokens).
        write_rows: ``(m,)`` int64 rows of the pass whose KV is kept.
        write_slots: ``(m,)`` int64 pool slots they are written to.
    """

    def __init__(
        self,
        token_to_kv_pool,
        group_sizes: list[int],
        write_rows: torch.Tensor,
        write_slots: torch.Tensor,
    ) -> None:
        super().__init__()
        self.token_to_kv_pool = token_to_kv_pool
        self.group_sizes = group_sizes
        self.write_rows = write_rows
        self.write_slots = write_slots

    def init_forward_metadata(self, forward_batch) -> None:
        """Nothing to plan: attention uses the pass's own K and V."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kw):
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_ = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v_ = v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
        if save_kv_cache and self.write_rows.numel():
            rows = self.write_rows.to(k.device)
            loc = KVWriteLoc(self.write_slots.to(k.device), None)
            scales = layer_scales(layer, self.token_to_kv_pool)
            save_kv(self.token_to_kv_pool, layer, loc, k_[rows], v_[rows], scales)
        out = q.new_empty((q_.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        out_ = out.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        start = 0
        for n in self.group_sizes:
            group = slice(start, start + n)
            out_[group] = torch.nn.functional.scaled_dot_product_attention(
                q_[group].transpose(0, 1)[None],
                k_[group].transpose(0, 1)[None],
                v_[group].transpose(0, 1)[None],
                is_causal=True,
                scale=layer.scaling,
                enable_gqa=gqa,
            )[0].transpose(0, 1)
            start += n
        return out

    def forward_decode(self, *args, **kwargs):
        raise RuntimeError("GroupLocalAttentionBackend serves extend passes only")

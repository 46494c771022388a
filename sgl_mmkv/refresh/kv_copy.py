"""Reused spans' KV into the request's own slots: copied from the segment store and
re-positioned (K rotated by each span's position delta), every layer."""

from __future__ import annotations

import torch

from sgl_mmkv.kernels.gather_rotate import gather_rotate_kv
from sgl_mmkv.refresh.plan import RequestPlan
from sgl_mmkv.refresh.rotary import rope_rates_of
from sgl_mmkv.segments.poison import poison_slots


class SegmentCopier:
    """Copies with the model's RoPE rates, looked up once (or why the model cannot be
    re-positioned, raised on every copy)."""

    def __init__(self) -> None:
        self._rates: torch.Tensor | NotImplementedError | None = None

    def rates(self, model) -> torch.Tensor:
        """``(d / 2,)`` inverse frequencies the copies rotate K by."""
        if self._rates is None:
            try:
                self._rates = rope_rates_of(model)
            except NotImplementedError as refused:
                self._rates = refused
        if isinstance(self._rates, NotImplementedError):
            raise self._rates
        return self._rates

    def copy(self, model_runner, forward_batch, plans: list[RequestPlan]) -> None:
        """Rotated copies of every reused span of ``plans`` into the request rows of
        ``forward_batch``, all layers; a row's holes hold no KV (poisoned in tests)."""
        rates = self.rates(model_runner.model)
        src, dst, delta = [], [], []
        req_to_token = model_runner.req_to_token_pool.req_to_token
        for plan in plans:
            pool_index = forward_batch.req_pool_indices[plan.index]
            row = req_to_token[pool_index]
            holes = plan.hole_mask().nonzero().flatten() + plan.prefix_len
            poison_slots(model_runner.token_to_kv_pool, row[holes.to(row.device)])
            for span in plan.spans:
                src.append(span.source_slots())
                dst.append(row[span.reused_positions().to(row.device)])
                delta.append(torch.full((span.num_reused,), span.delta, dtype=torch.long))
        if not src:
            return
        pool = model_runner.token_to_kv_pool
        device = pool.get_key_buffer(0).device
        src_loc = torch.cat(src).to(device)
        dst_loc = torch.cat(dst).to(device, torch.long)
        deltas = torch.cat(delta).to(device)
        inv_freq = rates.to(device)
        for layer in range(pool.layer_num):
            gather_rotate_kv(
                pool.get_key_buffer(layer),
                pool.get_value_buffer(layer),
                src_loc,
                dst_loc,
                deltas,
                inv_freq,
            )

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
        ``forward_batch``, all layers; a row's holes hold no KV (poisoned in tests).

        The plans' host positions and deltas are moved to the pool's device once per
        request, before the layer loop; a request's pool row is picked on the device,
        never read on the host, so the copy does not wait for the device."""
        rates = self.rates(model_runner.model)
        pool = model_runner.token_to_kv_pool
        table = model_runner.req_to_token_pool.req_to_token
        src, dst, delta = [], [], []
        for plan in plans:
            pool_row = forward_batch.req_pool_indices[plan.index : plan.index + 1]  # (1,)
            holes = plan.rows(plan.hole_mask())
            if holes.numel():
                poison_slots(pool, table[pool_row, holes.to(table.device)])
            if not plan.spans:
                continue
            positions = torch.cat([span.reused_positions() for span in plan.spans])
            src += [span.source_slots() for span in plan.spans]
            dst.append(table[pool_row, positions.to(table.device)])
            delta += [torch.full((s.num_reused,), s.delta, dtype=torch.long) for s in plan.spans]
        if not src:
            return
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

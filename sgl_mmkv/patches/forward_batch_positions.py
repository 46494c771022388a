"""Patch of ``sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new``
(SGLang 0.5.23).

AFTER hook, registered when reused compressed segments leave holes
(``--mm-compressed-reuse holes`` with a scored ``--mm-evict``). It gives 1-D RoPE
models what M-RoPE models get from their per-request position offset: a request
whose row dropped ``d`` hole slots (:meth:`RowCompactor.position_offset` of the
published runtime's compactor) has every decode token's position moved up by ``d``:
SGLang derives it from the row's length (``seq_len - 1``), which is now ``d`` short
of the sequence's. M-RoPE batches are left alone (their offset moved instead). A
shrunk row never extends again: a retracted request prefills from its original inputs
(offset put back to 0), session requests never shrink, and ``--enable-mixed-chunk``,
which would run decode steps as extends, is refused at start-up.
"""

from __future__ import annotations

from typing import Any

import torch

TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def positions_after_holes(positions: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Decode ``positions`` ``(B,)`` (one token per request) with request ``i``'s moved
    up by ``offsets[i]``."""
    return positions + torch.tensor(offsets, dtype=positions.dtype, device=positions.device)


def after_init_new(forward_batch: Any, _cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    reqs = getattr(batch, "reqs", None)
    if not reqs or not forward_batch.forward_mode.is_decode():
        return forward_batch
    if forward_batch.mrope_positions is not None:
        return forward_batch
    from sgl_mmkv.refresh.runtime import current

    compactor = current().compactor
    offsets = [compactor.position_offset(r.rid) for r in reqs]
    if any(offsets):
        forward_batch.positions = positions_after_holes(forward_batch.positions, offsets)
    return forward_batch


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, after_init_new, HookType.AFTER)

"""Patch of ``sglang.srt.managers.scheduler.Scheduler.run_batch`` (SGLang 0.5.23).

AROUND hook, registered when rows shrink after prefill (reuse holes, or
``--mm-compress-at decode``). Before a batch runs, the compactor learns which of its
requests may shrink (their last prefill chunk, in no session); once it has run, the
rows that drop tokens are kept out of the radix tree and shrunk
(:class:`~sgl_mmkv.refresh.row_compaction.RowCompactor`). Doing it here, before the
scheduler builds the next batch from this one, keeps it right under the overlap
scheduler too: that builds the next decode batch before it processes this batch's
result. On a GPU under the overlap scheduler the forward runs on SGLang's forward
stream while this runs on the scheduler's: the scheduler's stream first waits for
the forward (a device-side wait, no host sync) so the row is not edited while the
forward still reads it, and the next forward waits for the scheduler's stream
(stock SGLang's own ``forward_stream.wait_stream(schedule_stream)``). The stock
method's result is returned untouched.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"


def run_batch_with_row_compaction(original, scheduler: Any, batch: Any, *args, **kwargs):
    from sgl_mmkv.refresh.runtime import current

    compactor = current().compactor
    try:
        compactor.admit(batch)
    except Exception as error:  # admitting nobody: every row position is computed
        compactor.diverge()
        logger.warning("sgl_mmkv: row compaction admission failed (%r)", error)
    result = original(scheduler, batch, *args, **kwargs)
    try:
        if compactor.pending:
            wait_for_forward(scheduler)
        compactor.compact(batch, scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator)
    except Exception as error:  # never the reason the scheduler dies: leave rows whole
        compactor.abandon()
        compactor.counters.failures += 1
        logger.warning("sgl_mmkv: row compaction failed (%r); rows left whole", error)
    return result


def wait_for_forward(scheduler: Any) -> None:
    """Order the scheduler's stream after the forward stream (overlap on a GPU)."""
    stream = getattr(scheduler, "forward_stream", None)
    if not getattr(scheduler, "enable_overlap", False) or stream is None:
        return
    device = getattr(stream, "device", None)
    if getattr(device, "type", "cpu") == "cpu":
        return
    import torch

    torch.get_device_module(device).current_stream().wait_stream(stream)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, run_batch_with_row_compaction, HookType.AROUND)

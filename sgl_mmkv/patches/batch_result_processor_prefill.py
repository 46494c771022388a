"""Patch of ``sglang.srt.managers.scheduler_components.batch_result_processor.
SchedulerBatchResultProcessor.process_batch_result_prefill`` (SGLang 0.5.23).

AROUND hook, registered only with ``--mm-compress-at decode``: before the stock
method commits a prefill's output, requests whose rows will shrink are kept out of
the radix tree; after it, their rows keep only their top visual tokens for
decoding (:class:`~sgl_mmkv.refresh.decode_compression.DecodeCompressor`).
Without a compressor the stock method runs untouched.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor.process_batch_result_prefill"
)


def process_prefill_with_compression(original, processor: Any, batch: Any, *args, **kwargs):
    compressor = getattr(processor.tree_cache, "decode_compressor", None)
    if compressor is None or not processor.is_generation:
        return original(processor, batch, *args, **kwargs)
    try:
        compressor.before(batch)
    except Exception as error:  # never the reason the scheduler dies: leave rows whole
        _failed(compressor, error)
    result = original(processor, batch, *args, **kwargs)
    try:
        compressor.after(batch, processor.req_to_token_pool, processor.token_to_kv_pool_allocator)
    except Exception as error:
        _failed(compressor, error)
    return result


def _failed(compressor: Any, error: BaseException) -> None:
    compressor.abandon()
    compressor.counters.failures += 1
    logger.warning("sgl_mmkv: decode compression failed (%r); rows left whole", error)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, process_prefill_with_compression, HookType.AROUND)

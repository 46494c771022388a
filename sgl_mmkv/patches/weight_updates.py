"""Patch of ``sglang.srt.managers.scheduler_components.weight_updater
.SchedulerWeightUpdaterManager.update_weights_from_{disk,tensor,distributed,ipc}``
(SGLang 0.5.23).

AROUND hook: after any weight update, whether it succeeded, failed or was rolled back
(a failed distributed update leaves the weights partly changed), every stored segment
and its image embeddings are dropped (they hold the old weights' KV and vision
output), writes still queued for the L3 storage are dropped, and the storage serves
the new weights' identity from then on, so no entry of other weights is ever loaded
and no new entry is written under the old identity. SGLang's own ``flush_cache``
(when the update asks for it) empties the radix tree as in stock; SGLang's vision
embedding cache, which stock keeps across an update, is cleared too. Registered in
refresh modes.
"""

from __future__ import annotations

import logging
from typing import Any

OWNER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
METHODS = (
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "update_weights_from_ipc",
)
TARGETS = tuple(f"{OWNER}.{name}" for name in METHODS)

logger = logging.getLogger(__name__)


def hook_for(method: str):
    """The AROUND hook of ``SchedulerWeightUpdaterManager.<method>``."""

    def forget_old_weights(original, manager: Any, *args: Any, **kwargs: Any):
        try:
            return original(manager, *args, **kwargs)
        finally:
            forget(manager, from_disk=method == "update_weights_from_disk")

    return forget_old_weights


def forget(manager: Any, from_disk: bool) -> None:
    """Drop the old weights' segments and serve the new identity (see the module)."""
    from dataclasses import replace

    from sglang.srt.runtime_context import get_serving

    from sgl_mmkv.refresh.kv_scales import forget_scales, scales_of
    from sgl_mmkv.refresh.runtime import current
    from sgl_mmkv.segments.fingerprint import updated_identity

    store = current().store
    runner = getattr(manager.tp_worker, "model_runner", None)
    version = getattr(get_serving(), "weight_version", None)
    identity = updated_identity(getattr(runner, "model_config", None), from_disk, version)
    storage = store.storage
    scales = storage.fingerprint.kv_scales if storage is not None else ""
    if getattr(runner, "model", None) is not None and hasattr(runner, "token_to_kv_pool"):
        forget_scales(runner.model)  # an fp8 checkpoint's new scales
        scales = scales_of(runner).digest()
    fingerprint = None
    if storage is not None:
        fingerprint = replace(storage.fingerprint, model=identity, kv_scales=scales)
    store.forget_weights(fingerprint)
    _clear_sglang_embedding_cache()
    logger.info("sgl_mmkv: weights updated: segments dropped, storage identity %s", identity)


def _clear_sglang_embedding_cache() -> None:
    """SGLang's own vision-encoder output cache (``mm_schedule.embedding_cache``, keyed
    by image hash) survives a weight update and ``flush_cache`` in 0.5.23: a stock
    server then answers a seen image with the old weights' vision output."""
    from sglang.srt.managers import mm_schedule

    if mm_schedule.embedding_cache is not None:
        mm_schedule.embedding_cache.clear()


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for method, target in zip(METHODS, TARGETS, strict=True):
        HookRegistry.register(target, hook_for(method), HookType.AROUND)

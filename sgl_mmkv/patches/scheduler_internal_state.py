"""Patch of ``sglang.srt.managers.scheduler.Scheduler.get_internal_state`` (SGLang 0.5.23).

AFTER hook: when the scheduler's tree cache is sgl_mmkv's, its counters are added
to the internal state as ``"sgl_mmkv"``, so ``GET /get_server_info`` shows them
(``internal_states[i]["sgl_mmkv"]``). Registered only when sgl_mmkv's cache is
configured; the stock return value is otherwise untouched.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"


def add_mmkv_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    stats = getattr(getattr(scheduler, "tree_cache", None), "mmkv_stats", None)
    if stats is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["sgl_mmkv"] = stats()
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, add_mmkv_state, HookType.AFTER)

"""Patch of ``sglang.srt.managers.scheduler.Scheduler.init_running_status`` (SGLang 0.5.23).

BEFORE hook, registered with a ``--mm-reuse`` scorer mode. SGLang calls the method
in ``Scheduler.__init__`` right after building the KV cache, so this is the first
moment the scheduler can tell whether sgl_mmkv's radix cache published its runtime.
If it did not (sgl_mmkv's config in the environment of a server started without
``--radix-cache-backend sgl_mmkv``), the scheduler stops at start-up with one line,
instead of the forward patches failing on the first request.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.scheduler.Scheduler.init_running_status"


def require_runtime(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_mmkv.config import ConfigError
    from sgl_mmkv.refresh.runtime import current

    try:
        current()
    except RuntimeError:
        raise ConfigError(
            "sgl_mmkv refuses to start: its refresh mode runs only with its radix cache; "
            "start the server with `python -m sgl_mmkv.launch_server` (or pass "
            "--radix-cache-backend sgl_mmkv)"
        ) from None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, require_runtime, HookType.BEFORE)

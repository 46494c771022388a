"""The refresh executor of this scheduler process, if its ``--mm-reuse`` mode has one.

Set by sgl_mmkv's radix cache when SGLang builds it (scheduler process), read by
the forward patch (same process, same thread with the overlap scheduler off).
"""

from __future__ import annotations

from sgl_mmkv.refresh.executor import RefreshExecutor

_executor: RefreshExecutor | None = None


def set_active_executor(executor: RefreshExecutor | None) -> None:
    global _executor
    _executor = executor


def active_executor() -> RefreshExecutor | None:
    return _executor

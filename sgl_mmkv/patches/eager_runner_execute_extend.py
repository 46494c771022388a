"""Patch of ``sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend``
(SGLang 0.5.23).

AROUND hook, registered with a ``--mm-reuse`` scorer mode: every eager extend
forward of the scheduler goes through the published runtime's
:meth:`RefreshExecutor.execute_extend`, which calls the stock method on the whole
batch when nothing is reused and on active-token sub-batches when something is.
If anything in that path raises, the executor answers the batch as stock (a
stock fallback, counted as ``fallbacks``).
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend"


def execute_extend_with_reuse(original, runner: Any, forward_batch: Any, *args: Any, **kwargs):
    from sgl_mmkv.refresh.runtime import current

    return current().executor.execute_extend(
        lambda batch: original(runner, batch, *args, **kwargs), runner.model_runner, forward_batch
    )


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, execute_extend_with_reuse, HookType.AROUND)

"""Patch of ``sglang.srt.distributed.parallel_state.init_model_parallel_group`` (SGLang 0.5.23).

BEFORE hook, registered by the plugin in every mode a ``sgl_mmkv.launch_server``
starts (``--mm-reuse off`` included). It acts only when the group's device is the
CPU: there SGLang 0.5.23 defaults ``use_pynccl`` to True, and ``GroupCoordinator``
then builds a ``PyNcclCommunicator``, which raises "Expected a cuda device, but got:
cpu" at ``--tp-size`` > 1. The hook passes ``use_pynccl=False``, so the group's
all-reduces go through ``torch.distributed`` on its gloo group, as SGLang's CPU path
intends. On any other device, and for groups of one rank (no communicator is built),
the call is left as it is.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

ACTING_LOG_PREFIX = "sgl_mmkv: CPU process group over gloo"
TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def _group_device_type(local_rank: int) -> str:
    """The device type ``GroupCoordinator`` will pick for ``local_rank``."""
    from sglang.srt.distributed import parallel_state

    return parallel_state._group_coordinator_device(local_rank).type


def gloo_on_cpu(*args: Any, **kwargs: Any) -> tuple[tuple, dict] | None:
    """``use_pynccl=False`` when the group lives on the CPU (pynccl needs CUDA)."""
    from sglang.srt.distributed import parallel_state

    # The hook wrapper carries the original's signature (``functools.wraps``).
    bound = inspect.signature(parallel_state.init_model_parallel_group).bind(*args, **kwargs)
    if bound.arguments.get("use_pynccl") is False:
        return None
    if all(len(ranks) <= 1 for ranks in bound.arguments["group_ranks"]):
        return None  # one rank per group: no communicator is built, leave it stock
    if _group_device_type(bound.arguments["local_rank"]) != "cpu":
        return None
    bound.arguments["use_pynccl"] = False
    logger.info(
        "%s: group=%s use_pynccl=False (pynccl needs CUDA) file=%s",
        ACTING_LOG_PREFIX,
        bound.arguments.get("group_name"),
        __file__,
    )
    return bound.args, bound.kwargs


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, gloo_on_cpu, HookType.BEFORE)

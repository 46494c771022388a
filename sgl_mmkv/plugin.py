"""Entry point of group ``sglang.srt.plugins``; SGLang runs it in every process.

It registers sgl_mmkv's radix cache backend. That alone changes nothing: the
backend is used only when ``--radix-cache-backend sgl_mmkv`` is passed, which
``sgl_mmkv.launch_server`` does for every ``--mm-reuse`` mode but ``off``. A
stock ``python -m sglang.launch_server`` with sgl_mmkv installed stays stock.

SGLang logs and swallows plugin exceptions; a server started by sgl_mmkv must
not silently run without it, so failures there raise ``SystemExit``.
"""

from __future__ import annotations

import logging
import os

from sgl_mmkv.config import CONFIG_ENV, RADIX_CACHE_BACKEND_NAME, active_config

logger = logging.getLogger(__name__)

# Targets whose hooks this process registered (checked by verify_hooks).
REGISTERED_TARGETS: list[str] = []


def _register_radix_cache_backend() -> None:
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    from sgl_mmkv.radix_cache import build_mmkv_radix_cache

    if RADIX_CACHE_BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_CACHE_BACKEND_NAME, build_mmkv_radix_cache)


def _patches_for(config) -> list:
    """The patch modules ``config`` needs, each registered by the plugin."""
    from sgl_mmkv import patches

    modules = []
    if config is None:
        return modules
    # Every mode a launcher starts, off included: tensor parallelism on the CPU.
    modules.append(patches.model_parallel_group_cpu)
    if config.mm_report_reuse:
        modules.append(patches.scheduler_internal_state)
    if config.uses_refresh:
        modules += [
            patches.eager_runner_execute_extend,
            patches.mm_embed_routine,
            patches.mm_processor_flush,
            patches.tokenizer_caller_hashes,
            patches.scheduler_runtime_check,
            patches.weight_updates,
        ]
    if config.compresses_at_decode or config.reuses_with_holes:
        modules.append(patches.scheduler_run_batch)
    if config.reuses_with_holes:
        modules.append(patches.forward_batch_positions)
    return modules


def _install(config) -> None:
    _register_radix_cache_backend()
    for module in _patches_for(config):
        module.register()
        REGISTERED_TARGETS.extend(targets_of(module))


def targets_of(module) -> list[str]:
    """The SGLang functions a patch module hooks (``TARGETS``, or its one ``TARGET``)."""
    return list(getattr(module, "TARGETS", None) or [module.TARGET])


def verify_hooks() -> None:
    """Raise unless SGLang applied every hook this process registered (its registry
    only logs a target it could not patch): each target must now be a hook wrapper,
    which carries the original as ``__wrapped__``."""
    import pkgutil

    def applied(target: str) -> bool:
        owner, name = target.rsplit(".", 1)
        try:
            return hasattr(getattr(pkgutil.resolve_name(owner), name), "__wrapped__")
        except (ImportError, AttributeError, ValueError):
            return False

    missing = [t for t in REGISTERED_TARGETS if not applied(t)]
    if missing:
        raise RuntimeError(
            f"SGLang did not apply sgl_mmkv's hooks to {', '.join(missing)}: the patched "
            "functions changed (sgl_mmkv is written against sglang 0.5.23)"
        )


def load() -> None:
    """Register sgl_mmkv with SGLang in this process."""
    try:
        config = active_config()
        _install(config)
    except Exception as exc:
        if os.environ.get(CONFIG_ENV):
            raise SystemExit(f"sgl_mmkv plugin failed in pid {os.getpid()}: {exc!r}") from exc
        raise
    if config is not None:
        logger.info("sgl_mmkv plugin loaded: mode=%s pid=%d", config.mm_reuse, os.getpid())

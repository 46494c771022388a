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


def _register_radix_cache_backend() -> None:
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    from sgl_mmkv.radix_cache import build_mmkv_radix_cache

    if RADIX_CACHE_BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_CACHE_BACKEND_NAME, build_mmkv_radix_cache)


def _install(config) -> None:
    _register_radix_cache_backend()
    if config is not None and config.mm_report_reuse:
        from sgl_mmkv.patches import scheduler_internal_state

        scheduler_internal_state.register()
    if config is not None and config.uses_refresh:
        from sgl_mmkv.patches import (
            eager_runner_execute_extend,
            mm_embed_routine,
            tokenizer_caller_hashes,
        )

        eager_runner_execute_extend.register()
        mm_embed_routine.register()
        tokenizer_caller_hashes.register()
    if config is not None and config.compresses_at_decode:
        from sgl_mmkv.patches import batch_result_processor_prefill

        batch_result_processor_prefill.register()


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

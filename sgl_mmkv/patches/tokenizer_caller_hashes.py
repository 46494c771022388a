"""Patch of ``sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request``
(SGLang 0.5.23).

BEFORE hook: a native ``/generate`` caller may send ``mm_hashes``, which stock SGLang
adopts as the images' content hashes. The segment store keys images by that hash
and reuses them under any prefix, so a caller could bind its own image's KV to
another image's key. In refresh modes the hook drops caller ``mm_hashes`` (the
tokenizer then hashes the media itself), unless the operator trusts callers'
content hashes with SGLang's own ``--trust-mm-content-hashes``. Registered only in
refresh modes.
"""

from __future__ import annotations

import logging
from typing import Any

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request"

logger = logging.getLogger(__name__)


def drop_caller_hashes(manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    if getattr(obj, "mm_hashes", None) is None:
        return
    if getattr(manager.server_args, "trust_mm_content_hashes", False):
        return
    logger.info("sgl_mmkv: ignoring caller mm_hashes (rid=%s)", getattr(obj, "rid", None))
    obj.mm_hashes = None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, drop_caller_hashes, HookType.BEFORE)

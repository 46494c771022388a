"""Patch of ``sglang.srt.multimodal.processors.base_processor.BaseMultimodalProcessor
.clear_preprocess_cache`` (SGLang 0.5.23).

AROUND hook: ``/flush_cache`` clears the tokenizer's multimodal preprocessing cache
after the scheduler flushed. SGLang's ``LlavaMultimodalProcessor`` (HF-format LLaVA)
is a wrapper that never runs the base ``__init__`` and keeps the real processor in
``inner``, so the stock call raises ``AttributeError`` and the endpoint answers 500
although the caches were flushed. The hook clears the inner processor's cache
instead; every other processor runs the stock method. Registered in refresh modes,
whose tests and benchmarks flush between requests.
"""

from __future__ import annotations

from typing import Any

TARGET = (
    "sglang.srt.multimodal.processors.base_processor.BaseMultimodalProcessor.clear_preprocess_cache"
)


def clear_inner_cache(original, processor: Any) -> None:
    inner = getattr(processor, "inner", None)
    if inner is not None and not hasattr(processor, "mm_preprocess_cache"):
        return inner.clear_preprocess_cache()
    return original(processor)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, clear_inner_cache, HookType.AROUND)

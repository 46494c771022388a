"""Patch of ``sglang.srt.managers.mm_utils.general_mm_embed_routine`` (SGLang 0.5.23).

AROUND hook: during a refresh pass (the runtime's ``embedding_slot``) the
batch holds only its active tokens, but multimodal embedding must see the whole
extend to place image features. So the full batch's embeddings are built once
by SGLang's own ``prepare_mm_inputs`` (vision encoder and its cache included),
and the language model gets the active rows. The other per-token inputs that
``prepare_mm_inputs`` writes into its ``kwargs`` (Qwen3-VL's DeepStack features)
are kept with the embeddings and passed at the same rows. Outside a refresh pass
the stock routine runs.

Either way an extend that embeds images builds them with its encoders wrapped
(``refresh/segment_embeddings.py``): an image whose segment holds its encoder output
skips the vision tower, and the output of the others is captured for the segments
the forward fills.
"""

from __future__ import annotations

import time
from typing import Any

TARGET = "sglang.srt.managers.mm_utils.general_mm_embed_routine"


def embed_active_rows(
    original,
    input_ids: Any,
    forward_batch: Any,
    language_model: Any,
    multimodal_model: Any = None,
    data_embedding_funcs: Any = None,
    placeholder_tokens: Any = None,
    use_deepstack: Any = None,
    feature_dtypes: Any = None,
    **kwargs: Any,
):
    from sgl_mmkv.refresh.runtime import current
    from sgl_mmkv.refresh.segment_embeddings import segment_encoders

    runtime = current()
    slot = runtime.embedding_slot
    embeddings = slot.current
    if embeddings is None:
        with segment_encoders(
            runtime.store, slot, forward_batch, multimodal_model, data_embedding_funcs
        ) as funcs:
            return original(
                input_ids,
                forward_batch,
                language_model,
                multimodal_model,
                funcs,
                placeholder_tokens,
                use_deepstack if use_deepstack is not None else {},
                feature_dtypes,
                **kwargs,
            )
    import torch
    from sglang.srt.managers.mm_utils import prepare_mm_inputs

    if embeddings.embeds is None:
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        full = embeddings.full_batch
        started = time.perf_counter()
        made: dict[str, Any] = {}
        with (
            forward_context(ForwardContext(attn_backend=embeddings.stock_backend)),
            segment_encoders(
                runtime.store, slot, full, multimodal_model, data_embedding_funcs
            ) as funcs,
        ):
            embeddings.embeds = prepare_mm_inputs(
                full.input_ids,
                full,
                language_model,
                made,
                multimodal_model,
                funcs,
                placeholder_tokens,
                use_deepstack if use_deepstack is not None else {},
                feature_dtypes,
            )
        embeddings.seconds += time.perf_counter() - started
        embeddings.token_inputs = {
            name: value for name, value in made.items() if isinstance(value, torch.Tensor)
        }
    input_embeds = embeddings.embeds[embeddings.index]
    return language_model(
        input_ids=None,
        forward_batch=forward_batch,
        input_embeds=input_embeds,
        **kwargs,
        **embeddings.active_inputs(),
    )


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, embed_active_rows, HookType.AROUND)

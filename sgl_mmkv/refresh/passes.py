"""Running the model on an extend forward: the whole batch, or some tokens of each row.

Both run SGLang's own eager extend (model, logits processor) under an attention
backend installed for the pass through ``forward_context``; only the backend, the
tokens and the input embeddings differ from a stock forward.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from sgl_mmkv.refresh.attention_backend import QueryCapture, RefreshAttentionBackend
from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.observer import PrefillObserver, observing
from sgl_mmkv.refresh.sub_batch import active_sub_batch


def run_pass(
    ctx: ExtendContext,
    active: list[torch.Tensor],
    *,
    capture: QueryCapture | None = None,
    backend=None,
    observer: PrefillObserver | None = None,
):
    """The model on the ``active`` tokens of each request (per request ``(extend_len,)``
    bool); returns the stock extend's output for them. ``backend`` defaults to
    attention over each request's whole row, holes left out
    (:class:`RefreshAttentionBackend`), keeping ``capture``'s queries."""
    runner = ctx.model_runner
    sub, index = active_sub_batch(ctx.forward_batch, active)
    ctx.embeddings.index = index
    if backend is None:
        backend = RefreshAttentionBackend(
            runner.req_to_token_pool,
            runner.token_to_kv_pool,
            ctx.pass_positions(active),
            capture,
            list(ctx.views),
        )
    with (
        observing(observer, runner.model, backend) as backend,
        forward_context(ForwardContext(attn_backend=backend), forward_batch=sub),
        ctx.embedding_slot.using(ctx.embeddings),
    ):
        return ctx.run_extend(sub)


def run_whole(ctx: ExtendContext, observer: PrefillObserver | None = None):
    """The stock extend of the whole batch, observed for eviction ranking if asked."""
    if observer is None:
        return ctx.run_extend(ctx.forward_batch)
    runner = ctx.model_runner
    with (
        observing(observer, runner.model, runner.attn_backend) as backend,
        forward_context(ForwardContext(attn_backend=backend), forward_batch=ctx.forward_batch),
    ):
        return ctx.run_extend(ctx.forward_batch)

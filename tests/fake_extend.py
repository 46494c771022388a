"""A fake extend forward over SGLang-shaped pools, for the refresh path's unit tests.

Two requests (:func:`plans`): request 0 reuses a whole image and a compressed one
whose missing tokens are computed fresh; request 1 reuses a compressed image whose
missing tokens are holes (a ``RowView``) and a whole one. A fake model plays the
layers: each token's q / k / v is a fixed function of its KV slot, so every run of
a pass writes the same KV.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_context import get_forward_context

from sgl_mmkv.refresh.context import ExtendContext
from sgl_mmkv.refresh.embedding_pass import EmbeddingPass, EmbeddingSlot
from sgl_mmkv.refresh.flops import DecoderShape
from sgl_mmkv.refresh.observer import PrefillObserver
from sgl_mmkv.refresh.plan import RequestPlan, ReuseSpan
from sgl_mmkv.refresh.row_view import RowView
from sgl_mmkv.segments.store import Segment
from sgl_mmkv.testing.stand_ins import StandInPool, extend_batch, model_runner

H_Q, H_KV, D, LAYERS, HIDDEN = 4, 2, 16, 3, 12
SLOTS = 256
BUDGET = 0.3
POOL_ROWS = [3, 1]


def segment(n: int, kept: list[int] | None = None) -> Segment:
    slots = torch.arange(len(kept) if kept is not None else n)
    kept_t = None if kept is None else torch.tensor(kept)
    return Segment(("s", n), slots, torch.arange(n)[None], kept=kept_t)


def plans() -> tuple[RequestPlan, RequestPlan]:
    """Request 0: a whole image and a compressed one computed fresh where it lacks
    tokens; request 1: a compressed image whose missing tokens are holes, and a whole
    one. Text around them, a tail of text after the last image."""
    spans0 = (
        ReuseSpan(6, 18, segment(12), 3),
        ReuseSpan(20, 28, segment(8, [0, 2, 3, 5, 6]), -2),
    )
    visual0 = torch.zeros(40 - 2, dtype=torch.bool)
    visual0[6 - 2 : 18 - 2] = visual0[20 - 2 : 28 - 2] = True
    plan0 = RequestPlan(0, 2, 40, spans0, (), visual0, ((6, 18), (20, 28)))
    spans1 = (
        ReuseSpan(4, 16, segment(12, [0, 1, 3, 4, 6, 7, 8, 10, 11]), 5),
        ReuseSpan(18, 26, segment(8), 1),
    )
    visual1 = torch.zeros(34, dtype=torch.bool)
    visual1[4:16] = visual1[18:26] = True
    plan1 = RequestPlan(1, 0, 34, spans1, (), visual1, ((4, 16), (18, 26)), holes=True)
    return plan0, plan1


class FakeModel:
    """Plays the layers of a pass: each token's q / k / v at a layer is a fixed
    function of its KV slot; hidden states (for the observer) likewise."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 100)
        self.q = [torch.randn(SLOTS, H_Q * D, generator=g) for _ in range(LAYERS)]
        self.k = [torch.randn(SLOTS, H_KV * D, generator=g) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, H_KV * D, generator=g) for _ in range(LAYERS)]
        self.hidden = [torch.randn(SLOTS, HIDDEN, generator=g) for _ in range(LAYERS)]
        self.layers = [
            SimpleNamespace(
                layer_id=i,
                tp_q_head_num=H_Q,
                tp_k_head_num=H_KV,
                qk_head_dim=D,
                v_head_dim=D,
                scaling=D**-0.5,
            )
            for i in range(LAYERS)
        ]

    def run(self, batch, backend, observer: PrefillObserver | None = None) -> torch.Tensor:
        """``(N, H_q * D)``: the last layer's attention output of the batch's tokens,
        which reads the KV each token attends to."""
        loc = batch.out_cache_loc
        out = None
        for layer in self.layers:
            i = layer.layer_id
            if observer is not None:
                observer.observe_hidden(i, self.hidden[i][loc], batch)
            out = backend.forward(self.q[i][loc], self.k[i][loc], self.v[i][loc], layer, batch)
        return out

    def run_extend(self, sub):
        return self.run(sub, get_forward_context().attn_backend)


def setup(seed: int = 0):
    """A fresh pool (stale segment KV everywhere, NaN in the holes' slots), the
    batch of both requests, the context."""
    g = torch.Generator().manual_seed(seed)
    pool = StandInPool(LAYERS, SLOTS, H_KV, D, g)
    requests = plans()
    req_to_token = torch.zeros(4, 48, dtype=torch.int32)
    slots = torch.randperm(SLOTS, generator=g)
    start = 0
    for row, plan in zip(POOL_ROWS, requests, strict=True):
        req_to_token[row, : plan.seq_len] = slots[start : start + plan.seq_len].to(torch.int32)
        start += plan.seq_len
    holes = requests[1].rows(requests[1].hole_mask())
    for layer in range(LAYERS):
        pool.k[layer][req_to_token[POOL_ROWS[1], holes].long()] = float("nan")
        pool.v[layer][req_to_token[POOL_ROWS[1], holes].long()] = float("nan")
    lens = [p.extend_len for p in requests]
    out_cache_loc = torch.cat(
        [
            req_to_token[row, p.prefix_len : p.seq_len].long()
            for row, p in zip(POOL_ROWS, requests, strict=True)
        ]
    )
    batch = extend_batch([p.seq_len for p in requests], lens, POOL_ROWS, out_cache_loc)
    model = FakeModel(seed)
    runner = model_runner(pool, req_to_token)
    ctx = ExtendContext(
        run_extend=model.run_extend,
        model_runner=runner,
        forward_batch=batch,
        plans=requests,
        views=tuple(RowView.of(p) for p in requests),
        shape=DecoderShape(LAYERS, H_Q * D, 4 * H_Q * D, H_Q, H_KV, D, 64),
        embeddings=EmbeddingPass(full_batch=batch),
        embedding_slot=EmbeddingSlot(),
    )
    return ctx, model

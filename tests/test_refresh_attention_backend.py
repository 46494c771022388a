"""RefreshAttentionBackend: one plan per pass, the whole batch per layer, no host sync.

The backend runs over SGLang-shaped pools (``req_to_token``, per-layer K/V buffers)
and is compared with the per-request loop it replaced: each request's row read
from ``req_to_token`` (without its holes), its queries at their row positions.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("sglang")

from sgl_mmkv.kernels import refresh_attention as kernels  # noqa: E402
from sgl_mmkv.kernels.reference import scattered_attention_reference  # noqa: E402
from sgl_mmkv.refresh.attention_backend import (  # noqa: E402
    QueryCapture,
    RefreshAttentionBackend,
)
from sgl_mmkv.refresh.layer_statistics import LayerStatistics, ReducedRow  # noqa: E402
from sgl_mmkv.refresh.row_view import RowView  # noqa: E402
from sgl_mmkv.refresh.sub_batch import active_sub_batch  # noqa: E402
from sgl_mmkv.scoring import (  # noqa: E402
    ScoringInputs,
    make_eviction_scorer,
    make_refresh_scorer,
)
from sgl_mmkv.testing.stand_ins import StandInPool  # noqa: E402

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
H_Q, H_KV, D, LAYERS = 4, 2, 16, 2
SEQ_LENS = [30, 9, 45]  # request rows
PREFIX = [10, 0, 20]  # request 2's row has holes after its prefix
HOLES = [23, 24, 31]  # row positions of request 2 without KV
SYNCS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero", "masked_select"}


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor value on the host (a device sync on CUDA)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in SYNCS:
            raise AssertionError(f"host sync: {func.__name__}")
        return func(*args, **(kwargs or {}))


def _view(i: int) -> RowView | None:
    if i != 2:
        return None
    mask = torch.zeros(SEQ_LENS[i] - PREFIX[i], dtype=torch.bool)
    mask[torch.tensor(HOLES) - PREFIX[i]] = True
    plan = SimpleNamespace(prefix_len=PREFIX[i], seq_len=SEQ_LENS[i], hole_mask=lambda: mask)
    return RowView.of(plan)


def _pass(seed: int = 0):
    """Three requests in pool rows 5, 1, 3: active queries at scattered positions
    (request 1: its whole row), fresh K/V for them, NaN in the holes' slots."""
    g = torch.Generator().manual_seed(seed)
    pool = StandInPool(LAYERS, 256, H_KV, D, g)
    req_to_token = torch.zeros(8, 64, dtype=torch.int32)
    slots = torch.randperm(256, generator=g)
    start = 0
    pool_rows = [5, 1, 3]
    for row, n in zip(pool_rows, SEQ_LENS, strict=True):
        req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
        start += n
    for layer in range(LAYERS):
        holes = req_to_token[3, HOLES].long()
        pool.k[layer][holes] = float("nan")
        pool.v[layer][holes] = float("nan")
    positions = [
        torch.tensor([10, 14, 15, 29]),
        torch.arange(9),
        torch.tensor([20, 21, 22, 25, 40, 44]),
    ]
    out_cache_loc = torch.cat(
        [req_to_token[r, p].long() for r, p in zip(pool_rows, positions, strict=True)]
    )
    batch = SimpleNamespace(
        seq_lens_cpu=torch.tensor(SEQ_LENS),
        seq_lens=torch.tensor(SEQ_LENS),
        req_pool_indices=torch.tensor(pool_rows),
        out_cache_loc=out_cache_loc,
    )
    n_q = out_cache_loc.numel()
    qkv = [
        [torch.randn(n_q, heads * D, generator=g) for heads in (H_Q, H_KV, H_KV)]
        for _ in range(LAYERS)
    ]
    layers = [
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
    req_pool = SimpleNamespace(req_to_token=req_to_token)
    return pool, req_pool, batch, positions, qkv, layers


def _per_request(pool, req_pool, batch, positions, q, layer):
    """The loop the backend replaced: request by request over its row."""
    q_ = q.view(-1, H_Q, D)
    out, start = [], 0
    for i, pos in enumerate(positions):
        row = req_pool.req_to_token[batch.req_pool_indices[i], : SEQ_LENS[i]].long()
        view = _view(i)
        if view is not None:
            row, pos = row[view.kept], view.compact(pos)
        q_i = q_[start : start + pos.numel()]
        k, v = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        out.append(scattered_attention_reference(q_i, k, v, row, pos, layer.scaling))
        start += pos.numel()
    return torch.cat(out).view(q.shape[0], -1)


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_backend_equals_the_per_request_loop_with_holes_gqa_and_capture(kernel, monkeypatch):
    if kernel == "triton" and not TRITON_RUNS:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv(kernels.KERNEL_ENV, kernel)
    pool, req_pool, batch, positions, qkv, layers = _pass()
    capture = QueryCapture({0: torch.tensor([1, 3]), 2: torch.tensor([0, 5])})
    views = [_view(i) for i in range(3)]
    backend = RefreshAttentionBackend(req_pool, pool, positions, capture, views)
    for layer, (q, k, v) in zip(layers, qkv, strict=True):
        got = backend.forward_extend(q, k, v, layer, batch)
        want = _per_request(pool, req_pool, batch, positions, q, layer)
        assert torch.isfinite(got).all()  # the holes' NaN was never read
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        q_ = q.view(-1, H_Q, D)
        assert torch.equal(capture.queries[0][layer.layer_id], q_[[1, 3]])
        assert torch.equal(capture.queries[2][layer.layer_id], q_[[13, 18]])  # 4 + 9 before
    assert backend.plan.attention.kernel == kernel
    assert backend.plan.attention.kv_indptr == [0, 30, 39, 39 + 45 - len(HOLES)]


def test_the_plan_is_made_once_per_pass():
    pool, req_pool, batch, positions, qkv, layers = _pass(seed=1)
    backend = RefreshAttentionBackend(req_pool, pool, positions, None, None)
    plans = []
    for layer, (q, k, v) in zip(layers, qkv, strict=True):
        backend.forward_extend(q, k, v, layer, batch)
        plans.append(backend.plan)
    assert plans[0] is plans[1]


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_forward_extend_reads_no_tensor_on_the_host(kernel, monkeypatch):
    """With the plan made before the layers, a layer does no ``.item()``,
    ``torch.equal``, ``nonzero``...: nothing that syncs the device on CUDA."""
    if kernel == "triton" and not TRITON_RUNS:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv(kernels.KERNEL_ENV, kernel)
    pool, req_pool, batch, positions, qkv, layers = _pass(seed=2)
    capture = QueryCapture({1: torch.tensor([0, 8])})
    backend = RefreshAttentionBackend(
        req_pool, pool, positions, capture, [_view(i) for i in range(3)]
    )
    backend.init_forward_metadata(batch)
    with NoHostSync():
        for layer, (q, k, v) in zip(layers, qkv, strict=True):
            backend.forward_extend(q, k, v, layer, batch)
    assert sorted(capture.queries[1]) == [0, 1]
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        int(torch.tensor([3]).sum())  # the guard itself catches a sync


def _reducing_capture(scorer) -> QueryCapture:
    """Requests 1 (whole row) and 2 (holes) scored: the last queries of each (the
    last alone if the scorer reads that one, as the selector narrows them), an image
    span of each in the row without holes."""
    rows = {1: torch.tensor([6, 7, 8]), 2: torch.tensor([3, 4, 5])}
    positions = {1: torch.tensor([6, 7, 8]), 2: _view(2).compact(torch.tensor([25, 40, 44]))}
    if scorer.layer_reduction().last_query_only:
        rows = {i: r[-1:] for i, r in rows.items()}
        positions = {i: p[-1:] for i, p in positions.items()}
    spans = {1: ((1, 5),), 2: ((20, 24), (26, 36))}
    reduced = {i: ReducedRow(positions[i], spans[i]) for i in rows}
    return QueryCapture(rows, statistics=LayerStatistics(scorer, reduced))


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
@pytest.mark.parametrize(
    "scorer",
    [
        make_refresh_scorer("conduit"),
        make_refresh_scorer("conduit", layers=[1], query_span="last_text"),
        make_eviction_scorer("snapkv"),
        make_eviction_scorer("aircache"),
    ],
    ids=["conduit", "conduit-layer-1", "snapkv", "aircache"],
)
def test_a_scoring_reduction_in_the_layers_reads_no_tensor_on_the_host(kernel, scorer, monkeypatch):
    """With a scorer's per-layer reduction active, each layer still does no host
    read; it keeps a ``(..., N_v)`` statistic per request and reduced layer, equal
    to the scorer's own statistic of the row read from the pool after the pass, and
    no query."""
    if kernel == "triton" and not TRITON_RUNS:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv(kernels.KERNEL_ENV, kernel)
    pool, req_pool, batch, positions, qkv, layers = _pass(seed=3)
    capture = _reducing_capture(scorer)
    views = [_view(i) for i in range(3)]
    backend = RefreshAttentionBackend(req_pool, pool, positions, capture, views)
    backend.init_forward_metadata(batch)
    with NoHostSync():
        for layer, (q, k, v) in zip(layers, qkv, strict=True):
            backend.forward_extend(q, k, v, layer, batch)
    reduced = capture.statistics.statistics
    assert capture.queries == {}
    expected_layers = [1] if scorer.layer_reduction().layers == (1,) else [0, 1]
    for i, start in ((1, 4), (2, 13)):
        assert sorted(reduced[i]) == expected_layers
        row = req_pool.req_to_token[batch.req_pool_indices[i], : SEQ_LENS[i]].long()
        view = views[i]
        if view is not None:
            row = row[view.kept]
        inputs = capture.statistics.inputs(i, torch.device("cpu"))
        for layer_id in expected_layers:
            q_ = qkv[layer_id][0].view(-1, H_Q, D)[capture.rows[i] + start]
            keys = pool.get_key_buffer(layer_id)[row]
            whole = ScoringInputs(
                queries=(q_,),
                keys=(keys,),
                values=(pool.get_value_buffer(layer_id)[row],),
                query_positions=inputs.query_positions,
                image_spans=inputs.image_spans,
                layer_ids=(layer_id,),
            )
            want = scorer.layer_statistic(whole.layer(0, int(inputs.query_positions[-1])))
            assert reduced[i][layer_id].shape[-1] == inputs.num_visual
            torch.testing.assert_close(reduced[i][layer_id], want, rtol=1e-5, atol=1e-7)


def test_sub_batches_are_marked_planned_for_our_backends():
    """The stock backend would re-plan a sub-batch (``EagerRunner._execute_extend``
    checks ``needs_forward_metadata_init``) for a pass whose attention is ours."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=2,
        input_ids=torch.arange(7),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([4, 3]),
        out_cache_loc=torch.arange(7),
        seq_lens_sum=7,
        positions=torch.arange(7),
        extend_seq_lens=torch.tensor([4, 3]),
        extend_seq_lens_cpu=[4, 3],
    )
    active = [torch.tensor([False, True, False, True]), torch.tensor([True, True, True])]
    sub, index = active_sub_batch(batch, active)
    assert index.tolist() == [1, 3, 4, 5, 6]
    assert not sub.needs_forward_metadata_init()
    assert batch.needs_forward_metadata_init()
    stock, _ = active_sub_batch(batch, active, stock_attention=True)
    assert stock.needs_forward_metadata_init()

"""Batched refresh attention: the plan, the SDPA path and the Triton kernel against
the per-request torch reference (Triton under ``TRITON_INTERPRET=1`` on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_mmkv.kernels import refresh_attention as module
from sgl_mmkv.kernels.reference import scattered_attention_reference
from sgl_mmkv.kernels.refresh_attention import plan_refresh_attention, refresh_attention

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
KERNEL_DTYPES = [torch.float32, torch.float16] + (
    [torch.bfloat16] if torch.cuda.is_available() else []
)
# Per request: (row length, query layout). Rows of different lengths, scattered,
# whole-row, suffix, shuffled and empty query sets, a query at position 0.
REQUESTS = [(40, "scattered"), (7, "whole"), (97, "scattered"), (12, "none"), (33, "suffix")]
HEADS = [(4, 2, 16), (28, 4, 16), (2, 2, 8), (3, 1, 32)]
# (heads, block_m): few compiled variants on CUDA, both block sizes under GQA.
KERNEL_CASES = [(HEADS[0], 16), (HEADS[1], 64), (HEADS[1], 16), (HEADS[2], 64), (HEADS[3], 16)]


def _queries(n: int, layout: str, g: torch.Generator) -> torch.Tensor:
    if layout == "whole":
        return torch.arange(n)
    if layout == "none":
        return torch.empty(0, dtype=torch.long)
    if layout == "suffix":
        return torch.arange(n - 9, n)
    if layout == "shuffled":
        return torch.randperm(n, generator=g)[: n // 2]
    pos = torch.randperm(n, generator=g)[: max(1, n // 3)].sort().values
    pos[0] = 0  # a query that sees one key only
    return pos


def _batch(requests, h_q, h_kv, d, dtype, seed=0):
    """Packed queries, a KV pool whose rows are shuffled slots, and the plan inputs."""
    g = torch.Generator().manual_seed(seed)
    total = sum(n for n, _ in requests)
    slots = 2 * total + 5
    k = torch.randn(slots, h_kv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(slots, h_kv, d, generator=g).to(DEVICE, dtype)
    kv_indices = torch.randperm(slots, generator=g)[:total].to(DEVICE)
    positions = [_queries(n, layout, g) for n, layout in requests]
    n_q = sum(p.numel() for p in positions)
    q = torch.randn(n_q, h_q, d, generator=g).to(DEVICE, dtype)
    return q, k, v, kv_indices, positions, [n for n, _ in requests]


def _reference(q, k, v, kv_indices, positions, kv_lens, sm_scale=None):
    """The per-request reference, in float32."""
    out, q0, kv0 = [], 0, 0
    for pos, n in zip(positions, kv_lens, strict=True):
        q_r = q[q0 : q0 + pos.numel()].float()
        slots = kv_indices[kv0 : kv0 + n]
        out.append(
            scattered_attention_reference(
                q_r, k.float(), v.float(), slots, pos.to(DEVICE), sm_scale
            )
        )
        q0, kv0 = q0 + pos.numel(), kv0 + n
    return torch.cat(out)


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("heads, block_m", KERNEL_CASES)
def test_triton_kernel_matches_the_per_request_reference(heads, block_m, dtype):
    h_q, h_kv, d = heads
    q, k, v, kv, pos, lens = _batch(REQUESTS, h_q, h_kv, d, dtype, seed=h_q + d)
    plan = plan_refresh_attention(pos, kv, lens, kernel="triton", block_m=block_m)
    got = refresh_attention(q, k, v, plan)
    want = _reference(q, k, v, kv, pos, lens)
    assert got.dtype == dtype and got.shape == (q.shape[0], h_q, d)
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


@needs_triton
def test_triton_kernel_with_shuffled_queries_and_a_scale():
    """Queries in any order within a request (a block reads up to its farthest one);
    a softmax scale other than ``1/sqrt(d)``; a ``q`` that is a view of ``(N, H*d)``."""
    requests = [(50, "shuffled"), (21, "shuffled")]
    q, k, v, kv, pos, lens = _batch(requests, 4, 2, 16, torch.float32, seed=7)
    plan = plan_refresh_attention(pos, kv, lens, kernel="triton", block_m=16)
    q_view = q.reshape(q.shape[0], -1).view(-1, 4, 16)
    got = refresh_attention(q_view, k, v, plan, sm_scale=0.3)
    torch.testing.assert_close(got, _reference(q, k, v, kv, pos, lens, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_q, h_kv, d", HEADS)
def test_sdpa_path_matches_the_per_request_reference(h_q, h_kv, d, dtype):
    q, k, v, kv, pos, lens = _batch(REQUESTS, h_q, h_kv, d, dtype, seed=3)
    plan = plan_refresh_attention(pos, kv, lens, kernel="sdpa")
    got = refresh_attention(q, k, v, plan)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _reference(q, k, v, kv, pos, lens), rtol=tol, atol=tol)


def test_a_whole_row_runs_causal_sdpa_bit_for_bit():
    """Budget 1.0 must reproduce a full prefill exactly: a whole-row request runs the
    causal SDPA SGLang's ``torch_native`` runs, not a masked one."""
    q, k, v, kv, pos, lens = _batch([(7, "whole"), (19, "whole")], 4, 2, 16, torch.float32)
    plan = plan_refresh_attention(pos, kv, lens, kernel="sdpa")
    assert plan.whole_row == [True, True]
    got = refresh_attention(q, k, v, plan)
    for r in range(2):
        q0, q1 = plan.q_indptr[r], plan.q_indptr[r + 1]
        slots = kv[plan.kv_indptr[r] : plan.kv_indptr[r + 1]]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1)[None],
            k[slots].transpose(0, 1)[None],
            v[slots].transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )[0].transpose(0, 1)
        assert torch.equal(got[q0:q1], want)


def test_the_plan_packs_requests_into_blocks_of_one_request():
    requests = [(40, "scattered"), (7, "whole"), (97, "scattered"), (12, "none")]
    _, _, _, kv, pos, lens = _batch(requests, 4, 2, 16, torch.float32)
    plan = plan_refresh_attention(pos, kv, lens, kernel="sdpa", block_m=16)
    sizes = [p.numel() for p in pos]
    assert plan.q_indptr == [0, *torch.tensor(sizes).cumsum(0).tolist()]
    assert plan.kv_indptr == [0, 40, 47, 144, 156]
    assert plan.whole_row == [False, True, False, False]
    assert (plan.max_q_len, plan.max_kv_len, plan.num_queries) == (max(sizes), 97, sum(sizes))
    assert plan.q_positions.tolist() == torch.cat(pos).tolist()
    blocks = plan.blocks.tolist()
    assert sum(hi - lo for lo, hi, _, _ in blocks) == sum(sizes)
    assert [b[3] for b in blocks] == sorted((b[3] for b in blocks), reverse=True)
    for lo, hi, kv_start, kv_len in blocks:
        r = next(r for r in range(len(lens)) if plan.q_indptr[r] <= lo < plan.q_indptr[r + 1])
        assert hi <= plan.q_indptr[r + 1] and hi - lo <= 16  # never two requests
        assert kv_start == plan.kv_indptr[r]
        assert kv_len == int(plan.q_positions[lo:hi].max()) + 1 <= lens[r]
    assert len(blocks) == sum(-(-n // 16) for n in sizes)


def test_bad_plans_are_refused():
    kv = torch.arange(10)
    with pytest.raises(ValueError, match="outside the row"):
        plan_refresh_attention([torch.tensor([0, 10])], kv, [10])
    with pytest.raises(ValueError, match="outside the row"):
        plan_refresh_attention([torch.tensor([-1])], kv, [10])
    with pytest.raises(ValueError, match="add up"):
        plan_refresh_attention([torch.tensor([0])], kv, [9])
    with pytest.raises(ValueError, match="block_m"):
        plan_refresh_attention([torch.tensor([0])], kv, [10], block_m=24)
    plan = plan_refresh_attention([torch.tensor([0, 3])], kv, [10], kernel="sdpa")
    q = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="3 queries for a plan of 2"):
        refresh_attention(q, torch.randn(10, 2, 8), torch.randn(10, 2, 8), plan)
    with pytest.raises(ValueError, match="not a multiple"):
        refresh_attention(q[:2, :1], torch.randn(10, 2, 8), torch.randn(10, 2, 8), plan)


def test_kernel_choice(monkeypatch):
    monkeypatch.delenv(module.KERNEL_ENV, raising=False)
    assert module.default_kernel(torch.device("cpu")) == "sdpa"
    assert module.default_kernel(torch.device("cuda")) == "triton"
    monkeypatch.setenv(module.KERNEL_ENV, "sdpa")
    assert module.default_kernel(torch.device("cuda")) == "sdpa"
    plan = plan_refresh_attention([torch.tensor([1])], torch.arange(4), [4])
    assert plan.kernel == "sdpa"
    monkeypatch.setenv(module.KERNEL_ENV, "flash")
    with pytest.raises(ValueError, match="SGL_MMKV_REFRESH_ATTENTION='flash'"):
        module.default_kernel(torch.device("cpu"))

"""One-row scattered-query attention (SDPA) and the scoring reduction (Triton) against
the torch references; the batched refresh attention is in test_refresh_attention.py."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_mmkv.kernels.reference import scattered_attention_reference
from sgl_mmkv.kernels.scattered_attention import scattered_attention, scattered_attention_sdpa
from sgl_mmkv.scoring.attention import attention_mass

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# bf16 (what VLMs are served in) on CUDA; the interpreter runs the kernels through numpy.
KERNEL_DTYPES = [torch.float32, torch.float16] + (
    [torch.bfloat16] if torch.cuda.is_available() else []
)
SHAPES = [(1, 1, 1, 8, 5), (7, 4, 2, 16, 40), (12, 6, 2, 32, 97), (3, 8, 8, 64, 33)]


def _case(n_q, h_q, h_kv, d, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots_total = 2 * n + 3
    k = torch.randn(slots_total, h_kv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(slots_total, h_kv, d, generator=g).to(DEVICE, dtype)
    row_slots = torch.randperm(slots_total, generator=g)[:n].to(DEVICE)  # a paged, shuffled row
    q = torch.randn(n_q, h_q, d, generator=g).to(DEVICE, dtype)
    query_positions = torch.randint(0, n, (n_q,), generator=g).to(DEVICE)
    query_positions[0] = 0  # a query that sees one key only
    return q, k, v, row_slots, query_positions


@needs_triton
def test_the_attention_mass_kernel_runs_only_when_asked(monkeypatch):
    """Default: the torch reduction (faster on an H200); the env var switches the
    scorers' attention mass to Triton."""
    from sgl_mmkv.kernels import scattered_attention as module

    q = torch.randn(3, 2, 8, device=DEVICE)
    monkeypatch.delenv(module.TRITON_ATTENTION_ENV, raising=False)
    assert not module.use_triton_attention(q)
    monkeypatch.setenv(module.TRITON_ATTENTION_ENV, "1")
    assert module.use_triton_attention(q)


@pytest.mark.parametrize("chunk_elements", [1, 1000, 1 << 27])
def test_attention_mass_is_the_same_in_any_chunking(chunk_elements, monkeypatch):
    from sgl_mmkv.kernels import reference as module

    q, k, _, slots, pos = _case(12, 6, 2, 32, 97, torch.float32, seed=5)
    whole = module.attention_mass_reference(q.cpu(), k[slots].cpu(), pos.cpu())
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", chunk_elements)
    chunked = module.attention_mass_reference(q.cpu(), k[slots].cpu(), pos.cpu())
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)
    assert whole.sum().item() == pytest.approx(1.0, abs=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n_q, h_q, h_kv, d, n", SHAPES)
def test_attention_mass_kernel_matches_reference(n_q, h_q, h_kv, d, n, dtype):
    from sgl_mmkv.kernels.scattered_attention_triton import attention_mass_triton

    q, k, _, slots, pos = _case(n_q, h_q, h_kv, d, n, dtype, seed=1)
    want = attention_mass(q.float().cpu(), k[slots].float().cpu(), pos.cpu())
    got = attention_mass_triton(q, k, slots, pos).cpu()
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    assert got.sum().item() == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("layout", ["scattered", "suffix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q, h_q, h_kv, d, n", SHAPES)
def test_sdpa_path_matches_reference(n_q, h_q, h_kv, d, n, dtype, layout):
    """Both SDPA paths: masked scattered queries, and the placed block of an extend."""
    q, k, v, slots, _ = _case(n_q, h_q, h_kv, d, n, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    if layout == "suffix":
        pos = torch.arange(n - min(n_q, n), n, device=DEVICE)
    else:
        pos = torch.randperm(n, generator=g)[: min(n_q, n)].to(DEVICE)  # one per row position
    q = q[: pos.numel()]
    want = scattered_attention_reference(q, k, v, slots, pos)
    got = scattered_attention_sdpa(q, k, v, slots, pos)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_reference_equals_full_causal_attention_when_queries_are_the_whole_row():
    q, k, v, slots, _ = _case(9, 4, 2, 16, 9, torch.float32, seed=2)
    pos = torch.arange(9, device=DEVICE)
    got = scattered_attention_reference(q, k, v, slots, pos)
    kk = k[slots].repeat_interleave(2, 1).transpose(0, 1)
    vv = v[slots].repeat_interleave(2, 1).transpose(0, 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk, vv, is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_query_outside_the_row_is_rejected():
    q, k, v, slots, _ = _case(2, 2, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="outside the row"):
        scattered_attention(q, k, v, slots, torch.tensor([0, 4], device=DEVICE))


def test_a_suffix_of_queries_costs_its_own_rows_not_the_whole_row(monkeypatch):
    """A request without reuse after a cached prefix: ``e x n`` attention, as stock's
    GPU backends, never the ``n x n`` of queries placed in a full-length block."""
    q, k, v, slots, _ = _case(16, 4, 2, 16, 512, torch.float32, seed=9)
    pos = torch.arange(512 - 16, 512)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, *args, **kwargs):
        seen.append(tuple(query.shape))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    got = scattered_attention_sdpa(q, k, v, slots, pos)
    assert seen == [(1, 4, 16, 16)]  # (batch, heads, 16 queries, d)
    torch.testing.assert_close(got, scattered_attention_reference(q, k, v, slots, pos))

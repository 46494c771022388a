"""Gather-and-rotate: kernel vs torch reference, and rotation vs fresh RoPE at new positions."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_mmkv.kernels.gather_rotate import (
    gather_rotate_kv,
    gather_rotate_kv_reference,
    rope_inv_freq,
    rotate_neox,
)

TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# bf16 (what VLMs are served in) on CUDA; the interpreter runs the kernel through numpy.
KERNEL_DTYPES = [torch.float32, torch.float16] + (
    [torch.bfloat16] if torch.cuda.is_available() else []
)


def _buffers(slots: int, heads: int, head_dim: int, dtype, device="cpu"):
    g = torch.Generator().manual_seed(slots + heads + head_dim)
    k = torch.randn(slots, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(slots, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    return k, v


@pytest.mark.skipif(not TRITON_RUNS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n, heads, head_dim", [(1, 1, 8), (17, 2, 32), (64, 3, 64), (5, 8, 128)])
def test_triton_kernel_matches_reference(n, heads, head_dim, dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, v = _buffers(2 * n + 4, heads, head_dim, dtype, device)
    perm = torch.randperm(2 * n + 4, generator=torch.Generator().manual_seed(n)).to(device)
    src, dst = perm[:n], perm[n : 2 * n]
    delta = torch.randint(-3000, 3000, (n,), generator=torch.Generator().manual_seed(1)).to(device)
    inv_freq = rope_inv_freq(head_dim, 1e6, device)
    k_ref, v_ref = k.clone(), v.clone()
    gather_rotate_kv_reference(k_ref, v_ref, src, dst, delta, inv_freq)

    gather_rotate_kv(k, v, src, dst, delta, inv_freq)

    torch.testing.assert_close(k, k_ref, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_leaves_other_slots_untouched(dtype):
    k, v = _buffers(10, 2, 16, dtype)
    k0, v0 = k.clone(), v.clone()
    src, dst = torch.tensor([1, 2]), torch.tensor([7, 8])
    gather_rotate_kv_reference(k, v, src, dst, torch.tensor([5, -5]), rope_inv_freq(16, 1e4))
    untouched = [i for i in range(10) if i not in (7, 8)]
    assert torch.equal(k[untouched], k0[untouched]) and torch.equal(v[untouched], v0[untouched])
    assert torch.equal(v[dst], v0[src])


def test_rotation_by_zero_is_identity_and_rotations_compose():
    k, _ = _buffers(6, 2, 32, torch.float32)
    inv_freq = rope_inv_freq(32, 1e6)
    zero = torch.zeros(6, dtype=torch.int64)
    torch.testing.assert_close(rotate_neox(k, zero, inv_freq), k, rtol=0, atol=0)
    a, b = torch.full((6,), 37), torch.full((6,), -500)
    twice = rotate_neox(rotate_neox(k, a, inv_freq), b, inv_freq)
    torch.testing.assert_close(twice, rotate_neox(k, a + b, inv_freq), rtol=1e-5, atol=1e-5)


def test_mismatched_lengths_are_rejected():
    k, v = _buffers(4, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="one entry per token"):
        gather_rotate_kv(
            k, v, torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([1]), rope_inv_freq(8, 1e4)
        )


def _sglang_rope(mrope: bool, head_dim: int, base: float, interleaved: bool = False):
    pytest.importorskip("sglang")
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.mrope import MRotaryEmbedding

    if mrope:
        return MRotaryEmbedding(
            head_dim,
            head_dim,
            8192,
            base,
            True,
            torch.float32,
            [4, 6, 6],
            mrope_interleaved=interleaved,
        )
    return RotaryEmbedding(head_dim, head_dim, 8192, base, True, torch.float32)


@pytest.mark.parametrize(
    "mrope, interleaved",
    [(False, False), (True, False), (True, True)],
    ids=["rope-1d", "m-rope", "m-rope-interleaved"],
)
def test_rotated_cached_k_equals_fresh_k_at_new_positions(mrope, interleaved):
    """Layer-0 K of an image: computed at old positions then rotated by the delta ==
    computed fresh at the new positions, with SGLang's own rotary embedding
    (interleaved: Qwen3-VL's t, h, w frequency layout)."""
    head_dim, heads, base = 32, 2, 1e6
    rope = _sglang_rope(mrope, head_dim, base, interleaved)
    n = 16  # one 4 x 4 image
    k_raw = torch.randn(n, heads * head_dim, generator=torch.Generator().manual_seed(3))
    old_start, new_start = 23, 141
    if mrope:
        # Qwen2-VL image positions: start + (t, h, w) of each merged token.
        h, w = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
        offsets = torch.stack([torch.zeros(n, dtype=torch.long), h.flatten(), w.flatten()])
        old_pos, new_pos = old_start + offsets, new_start + offsets
    else:
        old_pos = old_start + torch.arange(n)
        new_pos = new_start + torch.arange(n)
    q = torch.zeros_like(k_raw)
    _, k_old = rope.forward_native(old_pos, q.clone(), k_raw.clone())
    _, k_new = rope.forward_native(new_pos, q.clone(), k_raw.clone())

    delta = torch.full((n,), new_start - old_start)
    rotated = rotate_neox(k_old.view(n, heads, head_dim), delta, rope_inv_freq(head_dim, base))

    torch.testing.assert_close(rotated, k_new.view(n, heads, head_dim), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(k_old, k_new, atol=1e-2)  # the delta matters

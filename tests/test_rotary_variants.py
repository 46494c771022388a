"""Re-positioning is exact for every rotary variant SGLang builds with ``get_rope``:
K computed at old positions and rotated by the delta with the rates of
``sgl_mmkv.refresh.rotary`` equals K computed fresh at the new positions. Variants
whose angle is not linear in position, and models whose layers disagree, are refused.

Float32 tolerance: ``atol = rtol = 2e-3``. SGLang's own angle ``fl(p * rate)`` carries
a float32 rounding of about ``p * 6e-8`` rad, so at positions below 4096 the two sides
differ by up to ~5e-4 (measured 8e-5 to 4.4e-4); a wrong rate differs by O(1).
Bfloat16 tolerance: ``atol = rtol = 6e-2``: one bf16 step of a key between 4 and 8 is
3.1e-2 (SGLang's cos/sin cache is bf16 on the CPU too).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sgl_mmkv.kernels.gather_rotate import rope_inv_freq, rotate_neox
from sgl_mmkv.refresh.rotary import rates_of_rotary, rope_rates_of

HEAD_DIM, HEADS, MAX_POS = 64, 3, 4096
F32_TOL = 2e-3
BF16_TOL = 6e-2
# name -> (get_rope's rope_scaling, partial_rotary_factor); M-RoPE sections are
# Qwen2-VL's [16, 24, 24] and Qwen3-VL's [24, 20, 20] scaled to 32 frequencies.
VARIANTS: dict[str, tuple[dict | None, float]] = {
    "default": (None, 1.0),
    "partial-rotary": (None, 0.5),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 1.0),
    "dynamic-ntk": ({"rope_type": "dynamic", "factor": 2.0}, 1.0),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        1.0,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        1.0,
    ),
    "mrope-qwen2vl": ({"rope_type": "default", "mrope_section": [8, 12, 12]}, 1.0),
    "mrope-qwen3vl-interleaved": (
        {"rope_type": "default", "mrope_section": [12, 10, 10], "mrope_interleaved": True},
        1.0,
    ),
    "yarn-mrope": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mrope_section": [8, 12, 12],
        },
        1.0,
    ),
}


def _rope(name: str, dtype: torch.dtype = torch.float32, base: float = 1e6) -> nn.Module:
    from sglang.srt.layers.rotary_embedding import get_rope

    scaling, partial = VARIANTS[name]
    return get_rope(
        HEAD_DIM,
        HEAD_DIM,
        MAX_POS,
        base,
        True,
        rope_scaling=scaling,
        dtype=dtype,
        partial_rotary_factor=partial,
    )


def _positions(name: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Old positions, new positions (``(n,)``, or ``(3, n)`` for M-RoPE) and ``(n,)`` deltas.

    M-RoPE tokens form one image moved as a whole: ``start + (t, h, w)``.
    """
    g = torch.Generator().manual_seed(seed)
    if "mrope" in name:
        side = int(n**0.5)
        h, w = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        offsets = torch.stack(
            [torch.zeros(side * side, dtype=torch.long), h.flatten(), w.flatten()]
        )
        old_start, new_start = torch.randint(0, MAX_POS - side, (2,), generator=g).tolist()
        delta = torch.full((side * side,), new_start - old_start)
        return old_start + offsets, new_start + offsets, delta
    old = torch.randint(0, MAX_POS, (n,), generator=g)
    new = torch.randint(0, MAX_POS, (n,), generator=g)
    return old, new, new - old


def _moved_and_fresh(
    name: str, rates: torch.Tensor, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, heads, head_dim)`` K rotated from old positions by the deltas with
    ``rates``, and K computed fresh at the new positions by SGLang's forward."""
    rope = _rope(name, dtype)
    old, new, delta = _positions(name, 64, seed)
    n = delta.numel()
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(n, HEADS * HEAD_DIM, generator=g).to(dtype)
    q = torch.zeros_like(k)
    _, k_old = rope.forward_native(old, q.clone(), k.clone())
    _, k_new = rope.forward_native(new, q.clone(), k.clone())
    moved = rotate_neox(k_old.view(n, HEADS, HEAD_DIM), delta, rates)
    return moved, k_new.view(n, HEADS, HEAD_DIM)


def max_error(name: str, dtype: torch.dtype = torch.float32) -> float:
    """Largest absolute difference between moved and fresh K for one variant."""
    moved, fresh = _moved_and_fresh(name, rates_of_rotary(_rope(name, dtype)), dtype)
    return float((moved.float() - fresh.float()).abs().max())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moved_k_equals_fresh_k(name):
    rope = _rope(name)
    rates = rates_of_rotary(rope)
    assert rates.dtype == torch.float32 and rates.shape == (rope.rotary_dim // 2,)

    moved, fresh = _moved_and_fresh(name, rates)

    torch.testing.assert_close(moved, fresh, rtol=F32_TOL, atol=F32_TOL)


@pytest.mark.parametrize("name", ["yarn", "mrope-qwen2vl"])
def test_moved_k_equals_fresh_k_in_bfloat16(name):
    rates = rates_of_rotary(_rope(name, torch.bfloat16))
    torch.testing.assert_close(rates, rates_of_rotary(_rope(name)), rtol=1e-6, atol=0)

    moved, fresh = _moved_and_fresh(name, rates, torch.bfloat16)

    assert moved.dtype == torch.bfloat16
    torch.testing.assert_close(moved, fresh, rtol=BF16_TOL, atol=BF16_TOL)


def test_plain_rates_are_the_inverse_frequencies():
    torch.testing.assert_close(
        rates_of_rotary(_rope("default")), rope_inv_freq(HEAD_DIM, 1e6), rtol=1e-6, atol=1e-9
    )


@pytest.mark.parametrize(
    ("name", "frequencies"),
    [
        ("linear", lambda rope: rope_inv_freq(HEAD_DIM, rope.base) / 4.0),
        ("yarn", lambda rope: rope._compute_inv_freq(rope.scaling_factor)),
        ("llama3", lambda rope: rope._compute_inv_freq(rope.base)),
    ],
)
def test_rates_are_the_frequencies_sglang_multiplies_positions_by(name, frequencies):
    rope = _rope(name)
    torch.testing.assert_close(rates_of_rotary(rope), frequencies(rope), rtol=1e-6, atol=1e-9)


def test_partial_rotary_leaves_the_rest_of_the_head_alone():
    rope = _rope("partial-rotary")
    assert rope.rotary_dim == HEAD_DIM // 2
    moved, fresh = _moved_and_fresh("partial-rotary", rates_of_rotary(rope))
    torch.testing.assert_close(
        moved[..., HEAD_DIM // 2 :], fresh[..., HEAD_DIM // 2 :], rtol=0, atol=0
    )


@pytest.mark.parametrize("name", ["yarn", "linear", "llama3"])
def test_unscaled_base_rates_fail_the_comparison(name):
    """The bug this module replaces: rates from the plain base are wrong by O(1)."""
    rope = _rope(name)
    unscaled = rope_inv_freq(rope.rotary_dim, rope.base)
    assert not torch.allclose(unscaled, rates_of_rotary(rope), rtol=1e-3)

    moved, fresh = _moved_and_fresh(name, unscaled)

    assert float((moved - fresh).abs().max()) > 0.5


def test_longrope_is_refused():
    from sglang.srt.layers.rotary_embedding import get_rope

    half = HEAD_DIM // 2
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / half for i in range(half)],
        "long_factor": [2.0 + i / half for i in range(half)],
        "original_max_position_embeddings": 1024,
    }
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, True, scaling, torch.float32)
    with pytest.raises(NotImplementedError, match="Phi3LongRoPEScaledRotaryEmbedding"):
        rates_of_rotary(rope)


def test_a_cache_whose_rates_switch_is_refused():
    """LongRoPE's short factors below the original length, long ones above, as one
    cache: linear on each side, not across."""
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    short, long = (
        _rope("default"),
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, 4e6, True, None, torch.float32),
    )
    switched = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, 1e6, True, torch.float32)
    switched.cos_sin_cache = torch.cat([short.cos_sin_cache[:1024], long.cos_sin_cache[1024:]])
    with pytest.raises(NotImplementedError, match="not linear in position"):
        rates_of_rotary(switched)


def test_stacked_linear_scaling_caches_are_refused():
    """SGLang's LinearScalingRotaryEmbedding with several factors stacks one cache
    per factor along the position axis (indexed by offsets)."""
    from sglang.srt.layers.rotary_embedding.base import LinearScalingRotaryEmbedding

    rope = LinearScalingRotaryEmbedding(
        HEAD_DIM, HEAD_DIM, 1024, 1e4, True, [1.0, 4.0], torch.float32
    )
    with pytest.raises(NotImplementedError, match="LinearScalingRotaryEmbedding: rotary angle"):
        rates_of_rotary(rope)


def test_non_neox_is_refused():
    from sglang.srt.layers.rotary_embedding import get_rope

    rope = get_rope(HEAD_DIM, HEAD_DIM, 2048, 1e4, False, None, torch.float32)
    with pytest.raises(NotImplementedError, match="neox-style RoPE only"):
        rates_of_rotary(rope)


def test_a_module_without_a_cache_is_refused():
    with pytest.raises(NotImplementedError, match="no cos_sin_cache"):
        rates_of_rotary(nn.Identity())


class _Layer(nn.Module):
    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary_emb = rotary


def _model(*rotaries: nn.Module) -> nn.Module:
    return nn.Sequential(*(_Layer(r) for r in rotaries))


def test_a_model_whose_layers_agree_gives_their_rates():
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    rope = _rope("yarn")
    twin = RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, 1e4, True, torch.float32)
    model = _model(rope, rope, rope)
    model.vision = nn.Module()
    model.vision.rotary_pos_emb = twin  # a vision tower's RoPE is not the decoder's
    torch.testing.assert_close(rope_rates_of(model), rates_of_rotary(rope), rtol=0, atol=0)


def test_a_model_with_two_bases_is_refused():
    model = _model(_rope("default", base=1e4), _rope("default", base=1e6))
    with pytest.raises(NotImplementedError, match="different frequencies"):
        rope_rates_of(model)


def test_a_model_without_rotary_is_refused():
    with pytest.raises(NotImplementedError, match="no rotary embedding"):
        rope_rates_of(nn.Sequential(nn.Linear(2, 2)))

"""Per-frequency angular rates of a model's RoPE, read from its own rotary modules.

Re-positioning (``kernels/gather_rotate.py``) rotates a cached K by
``delta * rate_i`` on frequency ``i``. That is exact whenever the module's angle is
linear in position: its cache row ``p`` holds ``mscale_i * (cos, sin)(phase_i +
p * rate_i)``, so ``R(p + delta) K = R(delta) R(p) K`` with the same ``mscale``.
Plain RoPE, linear and dynamic-NTK scaling, YaRN (with its mscale), Llama-3
scaling and M-RoPE (an image moved as a whole shifts t, h and w alike) all have
this form, each with its own rates; the rates are therefore fitted to the
module's own ``cos_sin_cache`` (row 1, powers of two, up to the last row), never
recomputed from ``base``, and every fitted row must lie on the line before the
rates are used. A variant whose
angle is not linear in position (LongRoPE's short/long switch, several caches
stacked along the position axis) fails the check and is refused.
"""

from __future__ import annotations

import torch
from torch import nn

# Allowed deviation of a cache row from the fitted line, in units of the cache's
# epsilon times (1 + angle): SGLang's caches (every variant in
# tests/test_rotary_variants.py, all rows) deviate by under 0.75 of these units.
_ROUNDING_UNITS = 8.0


def _angles(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(len(rows), half)`` complex128 ``cos + i sin`` of cache rows.

    Args:
        cache: ``(max_positions, 2 * half)``: ``cat(cos * mscale, sin * mscale)``.
        rows: ``(m,)`` int64 row indices.
    """
    picked = cache.index_select(0, rows.to(cache.device)).to("cpu", torch.float64)
    cos, sin = picked.chunk(2, dim=-1)
    return torch.complex(cos, sin)


def _check_rows(n: int) -> torch.Tensor:
    """``(m,)`` increasing rows to fit and verify at: 1, powers of two, quarters, last."""
    last = n - 1
    rows = [2**k for k in range(last.bit_length())]
    rows += [last * q // 4 for q in (1, 2, 3)] + [last - 1, last]
    return torch.tensor(sorted({r for r in rows if 1 <= r <= last}), dtype=torch.long)


def _fit_rates(rows: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """``(half,)`` float64 rates, least squares over rows of their unwrapped angles.

    Row 1's angle alone is off by a float32 rounding; far rows pin the rate down
    to the float32 frequency SGLang multiplies positions by, which halves the
    re-positioning error. Each row's whole turns are counted with the fit of the
    rows before it (row 1's rate is below pi: half a turn per position).

    Args:
        rows: ``(m,)`` increasing positive rows, starting with 1 (doubling at most).
        found: ``(m, half)`` complex (cos, sin) of those rows, row 0's phase removed.
    """
    angles = torch.angle(found)
    rates = angles[0] / rows[0]
    weighted = torch.zeros_like(rates)
    norm = 0.0
    for row, angle in zip(rows.tolist(), angles, strict=True):
        turns = torch.round((row * rates - angle) / (2 * torch.pi))
        weighted += row * (angle + 2 * torch.pi * turns)
        norm += row * row
        rates = weighted / norm
    return rates


def _float32_cache(rotary: nn.Module) -> torch.Tensor:
    """The module's ``(max_positions, rotary_dim)`` cos/sin cache in at least float32.

    SGLang stores the cache in the model's dtype off CUDA; a bfloat16 row rounds
    its angle by up to ~4e-3 rad, so the module's own float32 computation is used
    then, after checking it rounds to what was stored.
    """
    cache = getattr(rotary, "cos_sin_cache", None)
    name = type(rotary).__name__
    if not isinstance(cache, torch.Tensor):
        raise NotImplementedError(
            f"{name}: no cos_sin_cache to read its rotary frequencies from, cannot re-position"
        )
    if cache.dim() != 2 or cache.shape[-1] % 2:
        raise NotImplementedError(
            f"{name}: cos_sin_cache of shape {tuple(cache.shape)} is not one (cos, sin) row "
            "per position, cannot re-position"
        )
    if torch.finfo(cache.dtype).eps <= torch.finfo(torch.float32).eps:
        return cache
    compute = getattr(rotary, "_compute_cos_sin_cache", None)
    exact = compute() if callable(compute) else None
    if not isinstance(exact, torch.Tensor) or exact.shape[-1] != cache.shape[-1]:
        raise NotImplementedError(
            f"{name}: cos_sin_cache is {cache.dtype} and cannot be recomputed in float32"
        )
    rows = min(len(exact), len(cache))
    stored = exact[:rows].to(cache.device, cache.dtype)
    if not torch.equal(stored, cache[:rows]):
        raise NotImplementedError(
            f"{name}: its recomputed float32 cos_sin_cache differs from the stored one"
        )
    return exact.float()


def rates_of_rotary(rotary: nn.Module) -> torch.Tensor:
    """Angular rate per frequency of one rotary module, checked linear in position.

    Args:
        rotary: an SGLang rotary embedding (``RotaryEmbedding`` or a subclass) with
            ``cos_sin_cache`` of shape ``(max_positions, rotary_dim)``.
    Returns:
        ``(rotary_dim // 2,)`` float32 rates in radians per position.
    Raises:
        NotImplementedError: with a one-line reason naming the class, when the
            module is not neox-style, has no usable cache, or its angle is not
            linear in position.
    """
    name = type(rotary).__name__
    if not getattr(rotary, "is_neox_style", True):
        raise NotImplementedError(f"{name}: sgl_mmkv re-positions neox-style RoPE only")
    cache = _float32_cache(rotary)
    if len(cache) < 2:
        raise NotImplementedError(f"{name}: cos_sin_cache has fewer than two positions")
    start = _angles(cache, torch.tensor([0]))[0]  # (half,) mscale * e^(i phase) at row 0
    mscale = start.abs()
    if not bool((mscale > 0).all()):
        raise NotImplementedError(f"{name}: cos_sin_cache row 0 has a zero (cos, sin) pair")
    rows = _check_rows(len(cache))
    found = _angles(cache, rows) * (start.conj() / mscale)  # (m, half), row 0's phase removed
    rates = _fit_rates(rows, found)
    expected = mscale * torch.polar(torch.ones_like(rates), rows[:, None] * rates)
    eps = torch.finfo(cache.dtype).eps
    slack = _ROUNDING_UNITS * eps * mscale * (1 + rows[:, None] * rates.abs())
    bad = (found - expected).abs() > slack
    if bad.any():
        row = int(rows[bad.any(dim=1).nonzero()[0, 0]])
        raise NotImplementedError(
            f"{name}: rotary angle is not linear in position (cos_sin_cache row {row} "
            "departs from the rate of the rows before it), cannot re-position reused keys"
        )
    return rates.float()


def rotary_modules(model: nn.Module) -> list[nn.Module]:
    """The distinct modules held as ``rotary_emb`` by the model's submodules (the
    decoder layers' RoPE; vision towers name theirs otherwise), in module order."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        rotary = getattr(module, "rotary_emb", None)
        if isinstance(rotary, nn.Module):
            found.setdefault(id(rotary), rotary)
    return list(found.values())


def rope_rates_of(model: nn.Module) -> torch.Tensor:
    """``(rotary_dim // 2,)`` float32 rates re-positioning rotates the model's keys by.

    Every rotary module of the model must give the same rates, since one rotation
    serves all layers.

    Raises:
        NotImplementedError: with a one-line reason, when the model has no rotary
            module, one is refused by :func:`rates_of_rotary`, or two disagree
            (e.g. Gemma 3's local and global bases).
    """
    modules = rotary_modules(model)
    if not modules:
        raise NotImplementedError(
            f"{type(model).__name__}: no rotary embedding found to re-position"
        )
    rates = rates_of_rotary(modules[0])
    for other in modules[1:]:
        theirs = rates_of_rotary(other)
        if theirs.shape != rates.shape or not torch.allclose(theirs, rates, rtol=1e-6, atol=0):
            raise NotImplementedError(
                f"{type(model).__name__}: its rotary modules ({type(modules[0]).__name__}, "
                f"{type(other).__name__}) use different frequencies; one rotation cannot "
                "re-position every layer"
            )
    return rates

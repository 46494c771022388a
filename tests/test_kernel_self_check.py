"""The start-up proof of the Triton refresh kernel (run under ``TRITON_INTERPRET=1``
here, on CUDA at a GPU server's start): a kernel that agrees with the reference
serves; one that differs or raises leaves the refresh passes on the SDPA path,
logged and counted."""

from __future__ import annotations

import logging

import pytest
import torch

from sgl_mmkv.kernels import refresh_attention_triton
from sgl_mmkv.kernels.refresh_attention import KERNEL_ENV
from sgl_mmkv.kernels.self_check import check_refresh_kernel

# On a lent GPU (scripts/gpu_check.sh) the proof runs on CUDA, bf16 included.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def prove_refresh_kernel(pool):
    """The start-up hook (sgl_mmkv.assembly needs sglang, which the GPU check lacks)."""
    assembly = pytest.importorskip("sgl_mmkv.assembly")
    return assembly.prove_refresh_kernel(pool)


class _Pool:
    def __init__(self, heads: int = 2, dim: int = 16):
        self.k = torch.zeros(8, heads, dim)
        self.v = torch.zeros(8, heads, dim)

    def get_key_buffer(self, layer):
        return self.k

    def get_value_buffer(self, layer):
        return self.v


def _off_by(delta: float):
    real = refresh_attention_triton.refresh_attention_triton

    def kernel(*args, **kwargs):
        return real(*args, **kwargs) + delta

    return kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 16, 2), (4, 128, 7)], ids=["tiny", "qwen2.5-vl-7b"])
def test_the_kernel_agrees_with_the_reference(dtype, shape):
    kv_heads, head_dim, group = shape
    assert check_refresh_kernel(DEVICE, dtype, kv_heads, head_dim, group=group) is None


def test_a_kernel_that_differs_is_named_with_its_error(monkeypatch):
    monkeypatch.setattr(refresh_attention_triton, "refresh_attention_triton", _off_by(0.5))
    reason = check_refresh_kernel("cpu", torch.float32, num_kv_heads=2, head_dim=16)
    assert reason.startswith("the Triton refresh kernel differs from the reference by 0.5")


@pytest.mark.parametrize("fault", ["differs", "raises", "nan"])
def test_a_failed_proof_serves_with_the_reference_path(monkeypatch, caplog, fault):
    monkeypatch.setenv(KERNEL_ENV, "triton")  # the CUDA default, asked for on the CPU
    assert prove_refresh_kernel(_Pool())
    if fault == "raises":

        def broken(*args, **kwargs):
            raise RuntimeError("PTX was compiled for another GPU\nsecond line")

        monkeypatch.setattr(refresh_attention_triton, "refresh_attention_triton", broken)
    else:
        delta = 0.5 if fault == "differs" else float("nan")
        monkeypatch.setattr(refresh_attention_triton, "refresh_attention_triton", _off_by(delta))
    with caplog.at_level(logging.WARNING, logger="sgl_mmkv.assembly"):
        assert not prove_refresh_kernel(_Pool())
    assert __import__("os").environ[KERNEL_ENV] == "sdpa"
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.endswith("refresh passes use the reference SDPA path") and "\n" not in line


def test_no_proof_where_the_sdpa_path_serves(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(refresh_attention_triton, "refresh_attention_triton", _off_by(0.5))
    assert prove_refresh_kernel(_Pool())  # a CPU pool: SDPA, nothing to prove

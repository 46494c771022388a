"""Shared fixtures: tiny models built once per session, CPU environment for SGLang."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sgl_mmkv.cpu_support import cuda_available, prepare_cpu_process

# Two workers on two cores, each with a server or two up: one OpenMP thread per
# process (this one and every server's, which inherit it), not two spinning over the
# other worker's (two server modules took 9 % less in paired runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# SGLang reads these at import: set them before any test module imports it.
prepare_cpu_process()
# Our Triton kernels run on the CPU under the interpreter; it must be chosen
# before triton is imported. Servers started by the tests do not inherit it.
if not cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    """A server whose batches fell back to stock answers right, so only its log
    tells: every test server fails its test on a fallback it was not told to expect."""
    from sgl_mmkv.testing.server import ServerProcess

    ServerProcess.strict_fallbacks = True


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _build(model_dir: Path, arch: str, name: str) -> Path:
    from sgl_mmkv.testing.make_tiny_model import make_tiny_model

    out = model_dir / name
    if not (out / "config.json").exists():
        make_tiny_model(arch, out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_vlm(model_dir) -> Path:
    """Tiny Qwen2-VL (M-RoPE). The directory name makes SGLang's frontend pick
    the qwen2-vl chat template, as it would for a real Qwen2-VL checkpoint."""
    return _build(model_dir, "qwen2_vl", "tiny-qwen2-vl")


@pytest.fixture(scope="session")
def tiny_qwen25_vl(model_dir) -> Path:
    return _build(model_dir, "qwen2_5_vl", "tiny-qwen2.5-vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl(model_dir) -> Path:
    """Tiny Qwen3-VL: interleaved M-RoPE, QK-norm, DeepStack from both vision layers."""
    return _build(model_dir, "qwen3_vl", "tiny-qwen3-vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe(model_dir) -> Path:
    """Tiny Qwen3-VL MoE (as Qwen3-VL-30B-A3B): Qwen3-VL with a routed-expert MLP."""
    return _build(model_dir, "qwen3_vl_moe", "tiny-qwen3-vl-moe")


@pytest.fixture(scope="session")
def tiny_llava(model_dir) -> Path:
    """Tiny HF-format LLaVA (Pixtral vision, Qwen2 text, 1-D RoPE). A name that matches
    none of SGLang's chat-template rules, so the checkpoint's own template is used."""
    return _build(model_dir, "llava", "tiny-hf-lv")


@pytest.fixture(scope="session")
def tiny_llm(model_dir) -> Path:
    return _build(model_dir, "qwen2", "tiny-qwen2")

"""What SGLang 0.5.23 needs to run on a machine without a GPU.

Decided in the launching process before SGLang is imported; everything here is
inherited by the processes SGLang spawns (environment and ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "_cpu_shim"

# SGLANG_USE_CPU_ENGINE keeps device=cpu off a vllm import in the rotary code;
# TORCHDYNAMO_DISABLE avoids a ~15 s inductor compile of M-RoPE per process.
CPU_ENV_DEFAULTS: dict[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "TORCHDYNAMO_DISABLE": "1",
}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def real_sgl_kernel_installed() -> bool:
    """Whether an ``sgl_kernel`` other than sgl_mmkv's shim is importable."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return False
    return SHIM_DIR not in Path(spec.origin).resolve().parents


def enable_cpu_shim() -> None:
    """Make sgl_mmkv's ``sgl_kernel`` shim importable here and in spawned children."""
    path = str(SHIM_DIR)
    if path not in sys.path:
        sys.path.insert(0, path)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])


def prepare_cpu_process() -> None:
    """Environment for SGLang on the CPU; values the user already set are kept."""
    for key, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not real_sgl_kernel_installed():
        enable_cpu_shim()

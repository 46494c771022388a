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


def cpu_environment(base: dict[str, str]) -> dict[str, str]:
    """``base`` plus what SGLang needs on the CPU: :data:`CPU_ENV_DEFAULTS` where not
    set, and the ``sgl_kernel`` shim first on ``PYTHONPATH`` when no real one exists."""
    env = dict(base)
    for key, value in CPU_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if not real_sgl_kernel_installed():
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(SHIM_DIR) not in parts:
            env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *parts])
    return env


def prepare_cpu_process() -> None:
    """Prepare this process and its children for SGLang on the CPU; values the user
    already set are kept."""
    os.environ.update(cpu_environment(dict(os.environ)))
    if not real_sgl_kernel_installed() and str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))

"""The servers of a comparison: stock SGLang and sgl_mmkv modes, identical settings.

Each side is started with the same shared arguments (hardware and memory only:
stock runs at its defaults); :func:`compare_settings` then checks every server's
``/get_server_info`` and fails unless the settings that decide speed are equal. The
intended difference: the radix-cache backend. The overlap scheduler is on for every
side (sgl_mmkv keeps it on in every mode); it is reported, not compared.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import requests
import torch

from sgl_mmkv.config import DEFAULT_KV_BUDGET
from sgl_mmkv.cpu_support import prepare_cpu_process
from sgl_mmkv.launch_server import OMP_BIND_ENV, cpu_thread_binding
from sgl_mmkv.testing.make_tiny_model import BENCH_SPEC, make_tiny_model
from sgl_mmkv.testing.server import REPORT_REUSE, ServerProcess, mmkv_stats, stock_cpu_env

STOCK = "stock"
DEFAULT_BENCH_MODEL = Path("/tmp/sgl_mmkv-bench-qwen2-vl")
# Hardware and memory only: stock runs at its defaults (overlap scheduler on, its
# own page size, chunking and schedule policy); sgl_mmkv adds what it needs itself.
CPU_SHARED_ARGS = (
    "--device cpu --attention-backend torch_native --max-total-tokens 32768 "
    "--mem-fraction-static 0.3 --random-seed 0 --enable-cache-report"
)
GPU_SHARED_ARGS = "--mem-fraction-static 0.8 --random-seed 0 --enable-cache-report"

# Server settings that must be equal on every side of a comparison.
COMPARED_SETTINGS = (
    "model_path",
    "tokenizer_path",
    "dtype",
    "kv_cache_dtype",
    "device",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "mm_attention_backend",
    "page_size",
    "mem_fraction_static",
    "max_total_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "schedule_policy",
    "schedule_conservativeness",
    "random_seed",
    "context_length",
    "disable_radix_cache",
    "sleep_on_idle",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
    "enable_cache_report",
    "tp_size",
    "dp_size",
)
# Differences that are the point of the comparison, or plain addresses.
# (The overlap scheduler is not compared; any difference in it shows in the report.)
EXPECTED_DIFFERENCES = frozenset({"radix_cache_backend", "port", "host", "log_requests"})

_LOG_USAGE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\].*token usage: ([0-9.]+)")


@dataclass(slots=True)
class Side:
    """One server of the comparison: ``stock`` or an ``--mm-reuse`` mode."""

    name: str
    process: ServerProcess
    info: dict = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return self.process.base_url

    def server_info(self) -> dict:
        response = requests.get(f"{self.base_url}/get_server_info", timeout=60)
        response.raise_for_status()
        return response.json()

    def mmkv_stats(self) -> dict:
        """sgl_mmkv's counters (empty for stock or ``off``)."""
        return mmkv_stats(self.base_url)

    def peak_token_usage(self, start: datetime, end: datetime) -> float:
        """Highest ``token usage`` the scheduler logged in ``[start, end]`` (seconds
        resolution): the fraction of the KV pool held by running requests."""
        peak = 0.0
        for line in Path(self.process.log_path).read_text(errors="replace").splitlines():
            match = _LOG_USAGE.match(line)
            if match:
                stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
                if start.replace(microsecond=0) <= stamp <= end:
                    peak = max(peak, float(match.group(2)))
        return peak


def mode_flags(name: str, refresh_budget: float, kv_budget: float) -> list[str]:
    """sgl_mmkv flags of side ``name``: ``MODE`` or ``MODE+EVICT`` (``conduit+aircache``:
    ``--mm-reuse conduit --mm-evict aircache --mm-kv-budget kv_budget``); a suffix
    ``@R`` sets that side's kept fraction (``conduit+snapkv@0.25``)."""
    name, _, kept = name.partition("@")
    reuse, _, evict = name.partition("+")
    flags = ["--mm-reuse", reuse, "--mm-refresh-budget", str(refresh_budget), REPORT_REUSE]
    if evict:
        flags += ["--mm-evict", evict, "--mm-kv-budget", kept or str(kv_budget)]
    return flags


def build_side(
    name: str,
    model_path: str | Path,
    shared_args: Sequence[str],
    log_dir: Path,
    refresh_budget: float,
    kv_budget: float = DEFAULT_KV_BUDGET,
    log_suffix: str = "",
) -> Side:
    """A not yet started server for ``name`` (``stock``, or a mode as :func:`mode_flags`)."""
    log = log_dir / f"server-{name}{log_suffix}.log"
    if name == STOCK:
        module, env = stock_launch(shared_args)
        process = ServerProcess(module, model_path, shared_args, log_path=log, env=env)
    else:
        mmkv = mode_flags(name, refresh_budget, kv_budget)
        process = ServerProcess("sgl_mmkv.launch_server", model_path, [*mmkv, *shared_args], log)
    return Side(name, process)


def _cpu_tp_size(shared_args: Sequence[str]) -> int:
    """``--tp-size`` of CPU arguments (1 when absent or not on the CPU)."""
    args = list(shared_args)
    if "cpu" not in args or "--tp-size" not in args:
        return 1
    return int(args[args.index("--tp-size") + 1])


def stock_launch(shared_args: Sequence[str]) -> tuple[str, dict[str, str] | None]:
    """The module that starts stock SGLang with ``shared_args`` and its environment.

    SGLang's own launcher, except at ``--tp-size`` > 1 on a CPU, which stock SGLang
    0.5.23 cannot start (its groups build a CUDA-only pynccl communicator): there
    ``sgl_mmkv.testing.stock_tp_server`` (SGLang's launcher with only that fix) and
    the thread binding sgl_mmkv's launcher sets for its own side."""
    tp = _cpu_tp_size(shared_args)
    if tp <= 1:
        return "sglang.launch_server", None
    env = stock_cpu_env()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    env.setdefault(OMP_BIND_ENV, cpu_thread_binding(tp, cores or [0]))
    return "sgl_mmkv.testing.stock_tp_server", env


def bench_model(path: Path = DEFAULT_BENCH_MODEL) -> Path:
    """The benchmarks' random-weight Qwen2-VL (``make_tiny_model --preset bench``),
    built once at ``path``: large enough that prefill compute dominates on a CPU."""
    if not (path / "config.json").exists():
        make_tiny_model("qwen2_vl", path, seed=0, spec=BENCH_SPEC)
    return path


def prepare_bench(model_path: Path | None, server_args: str | None) -> tuple[Path, list[str], bool]:
    """The common start of a benchmark script: SIGTERM unwinds like Ctrl-C (so every
    server the run started is stopped), the CPU environment when there is no GPU.

    Returns ``(model, shared server arguments, cuda)``: ``model_path`` or the bench
    model, ``server_args`` split or the CPU / GPU set."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cuda = torch.cuda.is_available()
    if not cuda:
        prepare_cpu_process()
    return model_path or bench_model(), shared_server_args(server_args, cuda), cuda


def shared_server_args(server_args: str | None, cuda: bool) -> list[str]:
    """The arguments every side gets: ``server_args`` if given, else the CPU or GPU set."""
    return shlex.split(server_args or (GPU_SHARED_ARGS if cuda else CPU_SHARED_ARGS))


def command_lines(
    model: Path,
    modes: Sequence[str],
    shared: Sequence[str],
    refresh_budget: float,
    kv_budget: float = DEFAULT_KV_BUDGET,
) -> dict[str, str]:
    """The command line of each side (the port added at start aside)."""
    base = f"--model-path {model} " + shlex.join(shared)
    module, env = stock_launch(shared)
    bind = f"{OMP_BIND_ENV}={env[OMP_BIND_ENV]} " if env else ""
    lines = {STOCK: f"{bind}python -m {module} {base}"}
    for mode in modes:
        flags = shlex.join(mode_flags(mode, refresh_budget, kv_budget))
        lines[mode] = f"python -m sgl_mmkv.launch_server {base} {flags}"
    return lines


def compare_settings(infos: dict[str, dict]) -> dict[str, dict[str, object]]:
    """Raise if a setting that decides speed differs from the first side's (stock).

    ``infos``: each side's ``/get_server_info``. Returns the settings that differ
    anywhere (compared or not) by side, for the report.
    """
    names = list(infos)
    reference = infos[names[0]]
    mismatched = [
        key
        for key in COMPARED_SETTINGS
        if any(infos[n].get(key) != reference.get(key) for n in names[1:])
    ]
    if mismatched:
        detail = {key: {n: infos[n].get(key) for n in names} for key in mismatched}
        raise RuntimeError(f"servers differ in settings that decide speed: {detail}")
    keys = sorted(set().union(*infos.values()) - {"internal_states"})
    return {
        key: {n: infos[n].get(key) for n in names}
        for key in keys
        if not isinstance(reference.get(key), dict)
        and any(repr(infos[n].get(key)) != repr(reference.get(key)) for n in names[1:])
        and key not in EXPECTED_DIFFERENCES
    }

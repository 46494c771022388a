"""Run the same cells (workload x images per request x concurrency) on every side.

Sides are started once with identical shared arguments and verified from
``/get_server_info``. Every side receives the identical request sequence (the pool
warm-up first, then the cells in order), so its cache state before each cell is
the same whatever the timing; the order of the sides alternates from cell to cell
(A B, B A, ...) so that drift of the machine hits all of them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from sgl_mmkv.benchmarking import workloads as wl
from sgl_mmkv.benchmarking.client import RequestResult, run_requests
from sgl_mmkv.benchmarking.servers import STOCK, Side, build_side, verify_identical
from sgl_mmkv.config import DEFAULT_KV_BUDGET


@dataclass(frozen=True, slots=True)
class CellSpec:
    """One measured cell: what is sent and how many requests at once."""

    workload: str
    num_images: int
    concurrency: int
    requests: tuple[wl.BenchRequest, ...] = field(repr=False)

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.num_images}img/c{self.concurrency}"


@dataclass(slots=True)
class CellRun:
    """One side's measurement of one cell."""

    side: str
    cell: CellSpec
    results: list[RequestResult]
    wall_s: float
    peak_token_usage: float
    refresh_delta: dict[str, float]
    store_delta: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What the runner sends. Defaults: the CPU run of the README."""

    workloads: tuple[str, ...] = wl.WORKLOADS
    images: tuple[int, ...] = (4, 8, 16)
    concurrency: tuple[int, ...] = (1, 4)
    requests_per_cell: int = 4
    pool_size: int = 24
    image_size: int = 448
    turns: int = 4
    max_tokens: int = 8
    seed: int = 0


def plan_cells(config: BenchConfig) -> list[CellSpec]:
    """Every cell of the run, each with its own seeded requests."""
    cells = []
    for workload in config.workloads:
        if workload not in wl.WORKLOADS:
            raise ValueError(
                f"unknown workload {workload!r}; choose from {', '.join(wl.WORKLOADS)}"
            )
        for concurrency in config.concurrency:
            n = max(config.requests_per_cell, concurrency)
            seed = config.seed * 1000 + concurrency
            if workload == "multi_turn":
                sessions = max(1, n // config.turns) if concurrency == 1 else concurrency
                reqs = wl.multi_turn(sessions, config.turns, config.image_size, seed)
                cells.append(CellSpec(workload, config.turns, concurrency, tuple(reqs)))
                continue
            for k in config.images:
                if workload == "doc_qa":
                    reqs = wl.doc_qa(n, k, config.pool_size, config.image_size, seed)
                elif workload == "no_reuse":
                    reqs = wl.no_reuse(n, k, config.image_size, seed)
                else:
                    reqs = wl.same_prefix(n, k, config.pool_size, config.image_size, seed)
                cells.append(CellSpec(workload, k, concurrency, tuple(reqs)))
    return cells


def _delta(after: dict, before: dict) -> dict[str, float]:
    return {
        key: after[key] - before.get(key, 0)
        for key, value in after.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def run_cell(side: Side, cell: CellSpec, max_tokens: int) -> CellRun:
    before = side.mmkv_stats()
    started_at = datetime.now()
    started = time.perf_counter()
    results = run_requests(side.base_url, cell.requests, cell.concurrency, max_tokens)
    wall = time.perf_counter() - started
    after = side.mmkv_stats()
    return CellRun(
        side=side.name,
        cell=cell,
        results=results,
        wall_s=wall,
        peak_token_usage=side.peak_token_usage(started_at, datetime.now()),
        refresh_delta=_delta(after.get("refresh", {}), before.get("refresh", {})),
        store_delta=_delta(after.get("store", {}), before.get("store", {})),
    )


@dataclass(slots=True)
class BenchRun:
    """Everything a run measured, for the report."""

    sides: list[str]
    settings_differences: dict
    warmup: dict[str, list[RequestResult]]
    cells: list[CellRun]
    wall_s: float
    aborted: str = ""  # why the run stopped early (a server died), or empty


def run_benchmark(
    model_path: str | Path,
    modes: Sequence[str],
    shared_args: Sequence[str],
    config: BenchConfig,
    out_dir: Path,
    refresh_budget: float,
    log=print,
    kv_budget: float = DEFAULT_KV_BUDGET,
) -> BenchRun:
    """Start stock plus each mode, verify settings, warm up, run every cell on every side."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [STOCK, *[m for m in modes if m != STOCK]]
    cells = plan_cells(config)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sides = []
        for name in names:
            side = build_side(name, model_path, shared_args, out_dir, refresh_budget, kv_budget)
            stack.enter_context(side.process)
            log(f"started {name} at {side.base_url} (log {side.process.log_path})")
            sides.append(side)
        differences = verify_identical(sides)
        log(f"settings verified identical on {', '.join(names)}")
        warmup = {}
        if {"doc_qa", "same_prefix"} & set(config.workloads):
            requests = wl.pool_warmup(config.pool_size, config.image_size)
            for side in sides:
                warmup[side.name] = run_requests(side.base_url, requests, 1, config.max_tokens)
        runs = []
        aborted = ""
        for i, cell in enumerate(cells):
            if aborted:
                break
            order = sides if i % 2 == 0 else sides[::-1]
            for side in order:
                try:
                    run = run_cell(side, cell, config.max_tokens)
                except requests.RequestException as exc:
                    alive = side.process.process is not None and side.process.process.poll() is None
                    aborted = (
                        f"{side.name} {'unreachable' if alive else 'exited'} in {cell.key}: {exc}"
                    )
                    log(f"stopping: {aborted}")
                    break
                ok = f"{sum(r.ok for r in run.results)}/{len(run.results)}"
                log(f"{cell.key:<24} {side.name:<10} {ok} ok in {run.wall_s:.1f} s")
                runs.append(run)
    return BenchRun(names, differences, warmup, runs, time.perf_counter() - started, aborted)

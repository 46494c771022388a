"""Run the same cells (workload x images per request x concurrency) on every side.

Sides are started once with identical shared arguments and verified from
``/get_server_info``. Every side receives the identical request sequence (the pool
warm-up first, then the cells in order), so its cache state before each cell is
the same whatever the timing; the order of the sides alternates from cell to cell
(A B, B A, ...) so that drift of the machine hits all of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import requests

from harness import workloads as wl
from harness.client import RequestResult, run_requests
from harness.servers import STOCK, Side, build_side, compare_settings
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
    round: int = 0


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
    rounds: int = 3


def plan_cells(config: BenchConfig, round_index: int = 0) -> list[CellSpec]:
    """Every cell of one round, each with its own seeded requests (new ones each round:
    new system prompts and page orders over the same page pool)."""
    cells = []
    for workload in config.workloads:
        if workload not in wl.WORKLOADS:
            raise ValueError(
                f"unknown workload {workload!r}; choose from {', '.join(wl.WORKLOADS)}"
            )
        for concurrency in config.concurrency:
            n = max(config.requests_per_cell, concurrency)
            seed = config.seed * 1000 + concurrency + 100_000 * round_index
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


def run_cell(side: Side, cell: CellSpec, max_tokens: int, round_index: int = 0) -> CellRun:
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
        round=round_index,
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
    """Stock plus each mode, one server up at a time, in ``config.rounds`` rounds with
    the order of the sides alternating; each start reads the page pool once, then
    runs every cell of the round. Settings are verified against stock's first start."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [STOCK, *[m for m in modes if m != STOCK]]
    started = time.perf_counter()
    infos: dict[str, dict] = {}
    warmup: dict[str, list[RequestResult]] = {}
    runs: list[CellRun] = []
    aborted = ""
    for r in range(config.rounds):
        cells = plan_cells(config, r)
        for name in names if r % 2 == 0 else names[::-1]:
            if aborted:
                break
            side = build_side(
                name, model_path, shared_args, out_dir, refresh_budget, kv_budget, f"-r{r}"
            )
            with side.process:
                side.info = side.server_info()
                infos.setdefault(name, side.info)
                log(f"round {r}: started {name} at {side.base_url} (log {side.process.log_path})")
                if {"doc_qa", "same_prefix"} & set(config.workloads):
                    pool = wl.pool_warmup(config.pool_size, config.image_size)
                    warmup.setdefault(name, [])
                    warmup[name] += run_requests(side.base_url, pool, 1, config.max_tokens)
                aborted = _run_cells(side, cells, config, r, runs, log)
    differences = compare_settings(infos)
    log(f"settings verified on {', '.join(names)}")
    return BenchRun(names, differences, warmup, runs, time.perf_counter() - started, aborted)


def _run_cells(side: Side, cells, config: BenchConfig, r: int, runs: list, log) -> str:
    """Run every cell on ``side``; returns why the run must stop, or empty."""
    for cell in cells:
        try:
            run = run_cell(side, cell, config.max_tokens, r)
        except requests.RequestException as exc:
            alive = side.process.process is not None and side.process.process.poll() is None
            reason = f"{side.name} {'unreachable' if alive else 'exited'} in {cell.key}: {exc}"
            log(f"stopping: {reason}")
            return reason
        ok = f"{sum(x.ok for x in run.results)}/{len(run.results)}"
        log(f"round {r} {cell.key:<24} {side.name:<10} {ok} ok in {run.wall_s:.1f} s")
        runs.append(run)
    return ""

"""Summaries of a :class:`~harness.runner.BenchRun`: table, JSON, plots.

Prefill FLOPs per cell: for sgl_mmkv refresh modes the scheduler's own count of
what its passes computed (``refresh.executed_flops``, and ``full_prefill_flops``:
what stock's extend of the same batches would have computed); for stock and the
cache-only modes the full prefill of each request's uncached tokens, from its
usage (``prompt_tokens``, ``cached_tokens``). All use :class:`DecoderShape`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.runner import BenchRun, CellRun
from harness.servers import STOCK
from sgl_mmkv.refresh.flops import DecoderShape


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class CellSummary:
    """One side's figures for one cell; times in milliseconds."""

    cell: str
    workload: str
    num_images: int
    concurrency: int
    side: str
    completed: int
    failed: int
    duration_s: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    cached_tokens_per_req: float
    reused_tokens_per_req: float
    refreshed_tokens_per_req: float
    hole_tokens_per_req: float
    segment_hits_per_req: float
    compressed_tokens: int
    evicted_segments: int
    prefill_tflops: float
    full_prefill_tflops: float
    peak_token_usage: float
    flops_fraction: float = math.nan
    ttft_speedup: float = math.nan
    round_ttft_ms: tuple[float, ...] = ()  # mean TTFT of each round
    ttft_speedup_range: str = ""  # lowest-highest ratio of round means vs stock
    # share of the requests' image tokens served by stored segments (reused KV or a
    # compressed segment's holes): not computed in the prefill
    image_token_hit_rate: float = math.nan
    errors: tuple[str, ...] = ()


def summarise_cell(
    run: CellRun, shape: DecoderShape, tokens_per_image: int | None = None
) -> CellSummary:
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok]
    e2e = [r.latency_s * 1000 for r in ok]
    n = max(len(ok), 1)
    full = sum(shape.extend_flops(r.cached_tokens, r.prompt_tokens) for r in ok)
    flops = run.refresh_delta.get("executed_flops", full)
    full = run.refresh_delta.get("full_prefill_flops", full)
    return CellSummary(
        cell=run.cell.key,
        workload=run.cell.workload,
        num_images=run.cell.num_images,
        concurrency=run.cell.concurrency,
        side=run.side,
        completed=len(ok),
        failed=len(run.results) - len(ok),
        duration_s=run.wall_s,
        ttft_mean_ms=statistics.fmean(ttft) if ttft else math.nan,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        e2e_mean_ms=statistics.fmean(e2e) if e2e else math.nan,
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p99_ms=percentile(e2e, 99),
        request_throughput=len(ok) / run.wall_s,
        input_throughput=sum(r.prompt_tokens for r in ok) / run.wall_s,
        output_throughput=sum(r.completion_tokens for r in ok) / run.wall_s,
        total_input_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=sum(r.completion_tokens for r in ok),
        cached_tokens_per_req=sum(r.cached_tokens for r in ok) / n,
        reused_tokens_per_req=run.refresh_delta.get("reused_tokens", 0) / n,
        refreshed_tokens_per_req=run.refresh_delta.get("refreshed_tokens", 0) / n,
        hole_tokens_per_req=run.refresh_delta.get("hole_tokens", 0) / n,
        segment_hits_per_req=run.store_delta.get("hits", 0) / n,
        compressed_tokens=int(run.store_delta.get("compressed_tokens", 0)),
        evicted_segments=int(run.store_delta.get("evictions", 0)),
        prefill_tflops=flops / 1e12,
        full_prefill_tflops=full / 1e12,
        peak_token_usage=run.peak_token_usage,
        errors=tuple(r.error for r in run.results if not r.ok),
        image_token_hit_rate=_image_hit_rate(run, len(ok), tokens_per_image),
    )


def _image_hit_rate(run: CellRun, completed: int, tokens_per_image: int | None) -> float:
    """(reused + hole tokens) / image tokens of the completed requests; NaN for stock
    (its prefix hits are in ``cached``) or when the image size is unknown."""
    if run.side == STOCK or not tokens_per_image or not completed:
        return math.nan
    served = run.refresh_delta.get("reused_tokens", 0) + run.refresh_delta.get("hole_tokens", 0)
    return served / (completed * run.cell.num_images * tokens_per_image)


def merge_rounds(runs: list[CellRun]) -> CellRun:
    """One side's runs of one cell over every round, as one run."""
    total: dict[str, dict[str, float]] = {"refresh": {}, "store": {}}
    for run in runs:
        for name, delta in (("refresh", run.refresh_delta), ("store", run.store_delta)):
            for key, value in delta.items():
                total[name][key] = total[name].get(key, 0) + value
    return CellRun(
        side=runs[0].side,
        cell=runs[0].cell,
        results=[r for run in runs for r in run.results],
        wall_s=sum(run.wall_s for run in runs),
        peak_token_usage=max(run.peak_token_usage for run in runs),
        refresh_delta=total["refresh"],
        store_delta=total["store"],
    )


def _round_means(runs: list[CellRun]) -> tuple[float, ...]:
    means = []
    for run in sorted(runs, key=lambda r: r.round):
        ttft = [r.ttft_s * 1000 for r in run.results if r.ok]
        means.append(statistics.fmean(ttft) if ttft else math.nan)
    return tuple(means)


def summarise(
    run: BenchRun, shape: DecoderShape, tokens_per_image: int | None = None
) -> list[CellSummary]:
    """Every cell of every side over all rounds, with FLOPs and TTFT relative to stock's
    same cell: the ratio of the mean TTFTs, and its range over the rounds."""
    groups: dict[tuple[str, str], list[CellRun]] = {}
    for cell_run in run.cells:
        groups.setdefault((cell_run.cell.key, cell_run.side), []).append(cell_run)
    rows = []
    for runs in groups.values():
        row = summarise_cell(merge_rounds(runs), shape, tokens_per_image)
        row.round_ttft_ms = _round_means(runs)
        rows.append(row)
    stock = {row.cell: row for row in rows if row.side == STOCK}
    for row in rows:
        base = stock.get(row.cell)
        if base is not None and base.prefill_tflops > 0:
            row.flops_fraction = row.prefill_tflops / base.prefill_tflops
        if base is not None and row.ttft_mean_ms > 0:
            row.ttft_speedup = base.ttft_mean_ms / row.ttft_mean_ms
            ratios = [
                b / m for b, m in zip(base.round_ttft_ms, row.round_ttft_ms, strict=False) if m > 0
            ]
            if ratios:
                row.ttft_speedup_range = f"{min(ratios):.2f}-{max(ratios):.2f}"
    return rows


def control_overhead(rows: list[CellSummary]) -> float:
    """Worst mean-TTFT overhead of a non-stock side over stock on the ``no_reuse`` control."""
    worst = 0.0
    for row in rows:
        if row.workload == "no_reuse" and row.side != STOCK and row.ttft_speedup > 0:
            worst = max(worst, 1 / row.ttft_speedup - 1)
    return worst


def failures(run: BenchRun, rows: list[CellSummary], max_control_overhead: float) -> list[str]:
    """Why the run must exit non-zero: failed requests, or the no-reuse control's
    overhead over ``max_control_overhead`` (a fraction of stock's mean TTFT)."""
    problems = [f"run stopped early: {run.aborted}"] if run.aborted else []
    failed = sum(row.failed for row in rows)
    failed += sum(not r.ok for results in run.warmup.values() for r in results)
    if failed:
        first = next((e for row in rows for e in row.errors), "")
        problems.append(f"{failed} request(s) failed; first error: {first}")
    overhead = control_overhead(rows)
    if overhead > max_control_overhead:
        problems.append(
            f"no-reuse control: mean TTFT {overhead:+.1%} over stock "
            f"(bound {max_control_overhead:.0%})"
        )
    return problems


_COLUMNS = (
    ("cell", "cell", "{}"),
    ("side", "side", "{}"),
    ("ok", "completed", "{}"),
    ("TTFT mean", "ttft_mean_ms", "{:.0f}"),
    ("p50", "ttft_p50_ms", "{:.0f}"),
    ("p99", "ttft_p99_ms", "{:.0f}"),
    ("E2E mean", "e2e_mean_ms", "{:.0f}"),
    ("req/s", "request_throughput", "{:.3f}"),
    ("tok/s in", "input_throughput", "{:.0f}"),
    ("tok/s out", "output_throughput", "{:.2f}"),
    ("cached", "cached_tokens_per_req", "{:.0f}"),
    ("reused", "reused_tokens_per_req", "{:.0f}"),
    ("refreshed", "refreshed_tokens_per_req", "{:.0f}"),
    ("holes", "hole_tokens_per_req", "{:.0f}"),
    ("seg hits", "segment_hits_per_req", "{:.1f}"),
    ("img hit", "image_token_hit_rate", "{:.2f}"),
    ("compressed", "compressed_tokens", "{}"),
    ("evicted", "evicted_segments", "{}"),
    ("FLOPs", "flops_fraction", "{:.3f}"),
    ("peak KV", "peak_token_usage", "{:.2f}"),
    ("TTFT x", "ttft_speedup", "{:.2f}"),
    ("rounds", "ttft_speedup_range", "{}"),
)


def format_table(rows: list[CellSummary]) -> str:
    """Markdown table; times in ms, per-request token counts, FLOPs and TTFT vs stock."""
    header = "| " + " | ".join(name for name, _, _ in _COLUMNS) + " |"
    lines = [header, "|" + "---|" * len(_COLUMNS)]
    for row in rows:
        cells = [fmt.format(getattr(row, attr)) for _, attr, fmt in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_serving_block(rows: list[CellSummary], side: str) -> str:
    """A side's totals in the layout of ``sglang.bench_serving``."""
    mine = [r for r in rows if r.side == side]
    duration = sum(r.duration_s for r in mine)
    completed = sum(r.completed for r in mine)
    weights = [r.completed for r in mine]

    def wmean(attr: str) -> float:
        return sum(getattr(r, attr) * w for r, w in zip(mine, weights, strict=True)) / max(
            completed, 1
        )

    pairs = [
        ("Backend:", f"sglang ({side})"),
        ("Successful requests:", completed),
        ("Failed requests:", sum(r.failed for r in mine)),
        ("Benchmark duration (s):", f"{duration:.2f}"),
        ("Total input tokens:", sum(r.total_input_tokens for r in mine)),
        ("Total generated tokens:", sum(r.total_output_tokens for r in mine)),
        ("Request throughput (req/s):", f"{completed / max(duration, 1e-9):.3f}"),
        (
            "Input token throughput (tok/s):",
            f"{sum(r.total_input_tokens for r in mine) / max(duration, 1e-9):.2f}",
        ),
        (
            "Output token throughput (tok/s):",
            f"{sum(r.total_output_tokens for r in mine) / max(duration, 1e-9):.2f}",
        ),
        ("Mean TTFT (ms):", f"{wmean('ttft_mean_ms'):.2f}"),
        ("Mean E2E Latency (ms):", f"{wmean('e2e_mean_ms'):.2f}"),
        ("Prefill TFLOPs:", f"{sum(r.prefill_tflops for r in mine):.3f}"),
    ]
    title = " Serving Benchmark Result "
    lines = [f"{title:=^50}"]
    lines += [f"{key:<40}{value:<10}" for key, value in pairs]
    lines.append("=" * 50)
    return "\n".join(lines)


def _requests_by_cell(run: BenchRun) -> dict[str, list[dict]]:
    """``side/cell`` -> every request of every round, in round order, each with its round."""
    out: dict[str, list[dict]] = {}
    for c in sorted(run.cells, key=lambda c: c.round):
        out.setdefault(f"{c.side}/{c.cell.key}", []).extend(
            {**asdict(r), "round": c.round} for r in c.results
        )
    return out


def to_json(run: BenchRun, rows: list[CellSummary], meta: dict) -> dict:
    return {
        "meta": meta,
        "sides": run.sides,
        "settings_differences": run.settings_differences,
        "wall_s": run.wall_s,
        "aborted": run.aborted,
        "control_overhead": control_overhead(rows),
        "cells": [asdict(row) for row in rows],
        "requests": _requests_by_cell(run),
        "warmup_failures": {
            side: [r.error for r in results if not r.ok] for side, results in run.warmup.items()
        },
    }


def write_outputs(run: BenchRun, rows: list[CellSummary], meta: dict, out_dir: Path) -> None:
    """``throughput.json``, ``throughput.md`` and the two plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "throughput.json").write_text(json.dumps(to_json(run, rows, meta), indent=1))
    blocks = [format_serving_block(rows, side) for side in run.sides]
    (out_dir / "throughput.md").write_text(format_table(rows) + "\n\n" + "\n\n".join(blocks) + "\n")
    _plots(rows, run.sides, out_dir)


def _plots(rows: list[CellSummary], sides: list[str], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    doc = [r for r in rows if r.workload == "doc_qa"]
    low = min((r.concurrency for r in doc), default=1)
    most = max((r.num_images for r in doc), default=0)
    for side in sides:
        style = "--" if side == STOCK else "-"
        mine = [r for r in doc if r.side == side]
        ttft = sorted((r.num_images, r.ttft_mean_ms) for r in mine if r.concurrency == low)
        tput = sorted((r.concurrency, r.request_throughput) for r in mine if r.num_images == most)
        for ax, points in ((ax_ttft, ttft), (ax_tput, tput)):
            if points:
                xs, ys = [x for x, _ in points], [y for _, y in points]
                ax.plot(xs, ys, style, marker="o", label=side)
    ax_ttft.set(
        xlabel="images per request", ylabel="mean TTFT (ms)", title=f"doc_qa, concurrency {low}"
    )
    ax_tput.set(
        xlabel="concurrency", ylabel="requests / s", title=f"doc_qa, {most} images per request"
    )
    for ax in (ax_ttft, ax_tput):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(fig)

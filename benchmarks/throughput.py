"""Throughput and TTFT of sgl_mmkv against stock SGLang, side by side in one run.

    python benchmarks/throughput.py --modes conduit --out-dir benchmarks/results/throughput

Starts ``python -m sglang.launch_server`` at its defaults and ``python -m
sgl_mmkv.launch_server --mm-reuse MODE`` for each mode, sharing only hardware and
memory flags (the settings that decide speed are verified from each server's
``/get_server_info``; both keep the overlap scheduler on, in every mode). One server
is up at a time; over ``--rounds`` rounds, with the order of the sides alternating,
each start reads the page pool once and then gets every cell's new seeded requests
through the OpenAI-compatible API (streaming). The report gives the ratio of the
mean TTFTs and its range over the rounds, and writes ``throughput.json``,
``throughput.md`` and ``throughput.png`` (TTFT against images per request;
throughput against concurrency). Exits 1 if any request fails or the no-reuse
control's TTFT overhead exceeds ``--max-control-overhead``.

Without ``--model-path`` it builds (once) a random-weight Qwen2-VL large enough
that prefill compute dominates on a CPU: 8 layers, hidden 1024, 256 tokens per
448 x 448 image (``make_tiny_model --preset bench``). On a GPU pass a real
checkpoint and your own ``--server-args``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import torch

from harness.report import (
    control_overhead,
    failures,
    format_serving_block,
    format_table,
    summarise,
    write_outputs,
)
from harness.runner import BenchConfig, run_benchmark
from harness.servers import command_lines, prepare_bench
from harness.workloads import WORKLOADS
from sgl_mmkv.config import DEFAULT_KV_BUDGET, EVICTION_POLICIES, REUSE_MODES
from sgl_mmkv.refresh.flops import DecoderShape


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _known_mode(mode: str) -> bool:
    """``MODE``, ``MODE+EVICT`` or ``MODE+EVICT@R`` with a kept fraction R in (0, 1]."""
    name, _, kept = mode.partition("@")
    reuse, _, evict = name.partition("+")
    if reuse not in REUSE_MODES or evict not in ("", *EVICTION_POLICIES):
        return False
    if not kept:
        return True
    try:
        return bool(evict) and 0.0 < float(kept) <= 1.0
    except ValueError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument(
        "--modes",
        default="conduit",
        help="comma list of --mm-reuse modes, each optionally +EVICT (conduit+aircache) "
        "and a kept fraction @R (conduit+snapkv@0.25)",
    )
    parser.add_argument("--mm-refresh-budget", type=float, default=0.1)
    parser.add_argument(
        "--mm-kv-budget", type=float, default=DEFAULT_KV_BUDGET, help="of the +EVICT modes"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--images", type=_ints, default=(4, 8, 16), help="images per request")
    parser.add_argument("--concurrency", type=_ints, default=(1, 4))
    parser.add_argument("--requests-per-cell", type=int, default=4)
    parser.add_argument("--pool-size", type=int, default=24, help="doc_qa page pool")
    parser.add_argument("--image-size", type=int, default=448, help="pixels per side")
    parser.add_argument("--turns", type=int, default=4, help="multi_turn turns per session")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds, one server up at a time, sides alternating"
    )
    parser.add_argument(
        "--server-args",
        default=None,
        help="arguments given to every server (default: the CPU or GPU set in this file)",
    )
    parser.add_argument("--max-control-overhead", type=float, default=0.15)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/throughput"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if not _known_mode(m)]
    if unknown:
        parser.error(
            f"unknown mode(s) {unknown}; choose from {', '.join(REUSE_MODES)}, "
            f"optionally +{{{','.join(EVICTION_POLICIES)}}}[@R]"
        )
    args.modes = modes
    return args


def tokens_per_image(model_config: dict, image_size: int) -> int | None:
    """Placeholder tokens of a square ``image_size`` image for a Qwen2-VL-family
    config (patches merged ``spatial_merge_size`` x ``spatial_merge_size``); None for
    other configs."""
    vision = model_config.get("vision_config") or {}
    patch, merge = vision.get("patch_size"), vision.get("spatial_merge_size")
    if not patch or not merge:
        return None
    side = max(1, round(image_size / (patch * merge)))
    return side * side


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, shared, cuda = prepare_bench(args.model_path, args.server_args)
    commands = command_lines(model, args.modes, shared, args.mm_refresh_budget, args.mm_kv_budget)
    config = BenchConfig(
        workloads=tuple(w for w in args.workloads.split(",") if w),
        images=args.images,
        concurrency=args.concurrency,
        requests_per_cell=args.requests_per_cell,
        pool_size=args.pool_size,
        image_size=args.image_size,
        turns=args.turns,
        max_tokens=args.max_tokens,
        seed=args.seed,
        rounds=args.rounds,
    )
    run = run_benchmark(
        model,
        args.modes,
        shared,
        config,
        args.out_dir,
        args.mm_refresh_budget,
        kv_budget=args.mm_kv_budget,
    )
    model_config = json.loads((model / "config.json").read_text())
    shape = DecoderShape.from_config(model_config)
    rows = summarise(run, shape, tokens_per_image(model_config, args.image_size))
    meta = {
        "command": "python benchmarks/throughput.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model_path": str(model),
        "shared_server_args": shared,
        "command_lines": commands,
        "refresh_budget": args.mm_refresh_budget,
        "config": {k: getattr(config, k) for k in config.__slots__},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        + (torch.cuda.get_device_name() if cuda else "no GPU"),
    }
    write_outputs(run, rows, meta, args.out_dir)
    print(format_table(rows))
    for name, command in commands.items():
        print(f"{name}: {command}")
    overlap = run.settings_differences.get("disable_overlap_schedule", {})
    print(f"verified from /get_server_info: disable_overlap_schedule {overlap or 'equal'}")
    for side in run.sides:
        print(format_serving_block(rows, side))
    bound = args.max_control_overhead
    overhead = control_overhead(rows)
    print(f"no-reuse control: worst mean-TTFT overhead {overhead:+.1%} (bound {bound:.0%})")
    print(f"wrote {args.out_dir}/throughput.json, throughput.md, throughput.png")
    problems = failures(run, rows, bound)
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the time of one reusing doc-QA request goes, against stock at its defaults.

    python benchmarks/profile_reuse.py --images 8,16 --num-requests 4 \\
        --out-dir benchmarks/results/profile

One server up at a time (stock, then ``--mm-reuse conduit``), both with
``--enable-metrics`` so SGLang puts its own request timestamps in the meta info.
Each start reads the page pool once; then doc-QA requests (new system prompt and
page order over the pool) are sent one at a time, non-streaming, one output token.
Per request: SGLang's stages (tokenizer: image loading, processing and hashing;
queue; prefill forward; the rest until the first token) and, on the sgl_mmkv side,
the refresh executor's phases from its counters (plan, gather-and-rotate copy,
embedding build, scoring pass and selection, refresh pass, eviction ranking,
store fill). Prints a table of means in ms and writes ``profile.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import torch

from harness import workloads as wl
from harness.client import run_requests
from harness.meta_info import chat_with_meta, request_stages
from harness.servers import (
    STOCK,
    build_side,
    command_lines,
    prepare_bench,
)

EXECUTOR_PHASES = ("plan", "copy", "embedding", "scoring", "refresh", "ranking", "fill")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--mode", default="conduit")
    parser.add_argument("--mm-refresh-budget", type=float, default=0.1)
    parser.add_argument("--images", type=_ints, default=(8, 16))
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--pool-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--server-args", default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/profile"))
    return parser.parse_args(argv)


def stages(meta: dict, client_s: float) -> dict[str, float]:
    """SGLang's stages of one request in ms from its meta info (``--enable-metrics``),
    and the client's time to its one token."""
    server = request_stages(meta)
    kept = ("tokenizer", "queue", "prefill_forward", "after_prefill")
    return {"client_ttft": 1e3 * client_s} | {k: server[k] for k in kept}


def executor_phases(before: dict, after: dict) -> dict[str, float]:
    """The refresh executor's phase times in ms between two counter reads."""
    phases = {
        p: 1e3 * (after.get(f"{p}_seconds", 0.0) - before.get(f"{p}_seconds", 0.0))
        for p in EXECUTOR_PHASES
    }
    full = after.get("full_prefill_flops", 0) - before.get("full_prefill_flops", 0)
    done = after.get("executed_flops", 0) - before.get("executed_flops", 0)
    phases["flops_fraction"] = done / full if full else 1.0
    return phases


def one_token_meta(base_url: str, request: wl.BenchRequest) -> tuple[dict, float]:
    """One greedy output token of ``request``: its meta info and the client's seconds."""
    reply = chat_with_meta(base_url, request.messages, max_tokens=1)
    return reply.meta, reply.client_s


def profile_side(name: str, args, model: Path, shared: list[str]) -> dict[int, list[dict]]:
    """Per pages-per-request count, one row of stage and phase times per request."""
    side = build_side(
        name, model, [*shared, "--enable-metrics"], args.out_dir, args.mm_refresh_budget
    )
    rows: dict[int, list[dict]] = {}
    with side.process:
        warm = wl.pool_warmup(args.pool_size, args.image_size)
        run_requests(side.base_url, warm, 1, 1)
        for k in args.images:
            rows[k] = []
            for request in wl.doc_qa(args.num_requests, k, args.pool_size, args.image_size, 7):
                before = side.mmkv_stats().get("refresh", {})
                meta, seconds = one_token_meta(side.base_url, request)
                row = stages(meta, seconds)
                if name != STOCK:
                    row |= executor_phases(before, side.mmkv_stats().get("refresh", {}))
                rows[k].append(row)
                print(f"{name} {k} pages: " + ", ".join(f"{a} {b:.1f}" for a, b in row.items()))
    return rows


def format_table(means: dict[str, dict[int, dict[str, float]]], images: tuple[int, ...]) -> str:
    sides = list(means)
    header = "| stage (mean ms) | " + " | ".join(f"{s} {k}p" for k in images for s in sides) + " |"
    lines = [header, "|---|" + "---|" * (len(sides) * len(images))]
    keys = list(dict.fromkeys(key for s in sides for k in images for key in means[s][k]))
    for key in keys:
        cells = []
        for k in images:
            for s in sides:
                value = means[s][k].get(key)
                cells.append(
                    ""
                    if value is None
                    else f"{value:,.3f}"
                    if key == "flops_fraction"
                    else f"{value:,.0f}"
                )
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, shared, cuda = prepare_bench(args.model_path, args.server_args)
    results = {name: profile_side(name, args, model, shared) for name in (STOCK, args.mode)}
    means = {
        name: {
            k: {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}
            for k, rows in per_k.items()
        }
        for name, per_k in results.items()
    }
    table = format_table(means, args.images)
    commands = command_lines(
        model, [args.mode], [*shared, "--enable-metrics"], args.mm_refresh_budget
    )
    meta = {
        "command": "python benchmarks/profile_reuse.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "command_lines": commands,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        + (torch.cuda.get_device_name() if cuda else "no GPU"),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "profile.json").write_text(
        json.dumps({"meta": meta, "means": means, "requests": results}, indent=1)
    )
    (args.out_dir / "profile.md").write_text(table + "\n")
    print(table)
    for name, command in commands.items():
        print(f"{name}: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stock SGLang vs sgl_mmkv measured by SGLang's own client, ``sglang.benchmark.serving``.

    python benchmarks/bench_serving.py --modes conduit --images 8,16 --rounds 3 \\
        --out-dir benchmarks/results/bench-serving

Writes doc-QA traces in the ``openai`` JSONL format (a pool warm-up, then per round
requests over the pool with new system prompts and page orders; see
``harness/traces.py``) and runs the client against each side, one
server up at a time, the order of the sides alternating over ``--rounds`` rounds.
Each start reads the pool once (not measured), then runs every doc-QA trace of the
round, the no-reuse control (every page new) and the text-only controls (SGLang's
``random-ids`` dataset, decode-heavy, at each ``--text-concurrency``). Stock runs at
its defaults; only hardware and memory flags are shared
(``harness/servers.py``). Prints a table, both
command lines and the client's; writes ``bench_serving.json`` and ``.md``. Exits 1
if any request failed.
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

from harness.servers import (
    STOCK,
    build_side,
    command_lines,
    compare_settings,
    prepare_bench,
)
from harness.sglang_client import ClientRun, client_command, run_client
from harness.traces import doc_qa_traces, no_reuse_traces

METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput", "mean_tpot_ms")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--modes", default="conduit", help="comma list of --mm-reuse modes")
    parser.add_argument("--mm-refresh-budget", type=float, default=0.1)
    parser.add_argument("--images", type=_ints, default=(8, 16), help="pages per request")
    parser.add_argument("--num-prompts", type=int, default=6, help="doc-QA requests per trace")
    parser.add_argument("--pool-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=448, help="pixels per side")
    parser.add_argument("--max-tokens", type=int, default=8, help="doc-QA output tokens")
    parser.add_argument(
        "--no-reuse-images", type=_ints, default=(8,), help="control: every page new"
    )
    parser.add_argument("--text-concurrency", type=_ints, default=(1, 4, 16))
    parser.add_argument("--text-prompts", type=int, default=16)
    parser.add_argument("--text-input-len", type=int, default=512)
    parser.add_argument("--text-output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-args", default=None, help="given to every side")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/bench-serving"))
    return parser.parse_args(argv)


def planned_runs(args: argparse.Namespace, traces: dict[str, Path], r: int) -> list[ClientRun]:
    """Every client run of round ``r`` on one side, in order."""
    runs = [
        ClientRun(f"doc_qa-{k}img", 1, args.num_prompts, traces[f"{k}-round-{r}"])
        for k in args.images
    ]
    runs += [
        ClientRun(f"no_reuse-{k}img", 1, args.num_prompts, traces[f"new-{k}-round-{r}"])
        for k in args.no_reuse_images
    ]
    runs += [
        ClientRun(
            "text", c, max(args.text_prompts, c), None, args.text_input_len, args.text_output_len
        )
        for c in args.text_concurrency
    ]
    return runs


def summarise(records: list[dict], modes: list[str]) -> list[dict]:
    """Per cell and mode: stock's and the mode's mean of round means, the ratio of
    means (stock TTFT / mode TTFT; mode throughput / stock throughput) and its range
    over rounds (round r of one side paired with round r of the other)."""

    def series(cell: tuple[str, int], side: str, metric: str) -> list[float]:
        return [
            x["result"][metric]
            for x in sorted(records, key=lambda x: x["round"])
            if (x["label"], x["concurrency"], x["side"]) == (*cell, side)
        ]

    rows = []
    cells = sorted({(x["label"], x["concurrency"]) for x in records})
    for label, concurrency in cells:
        for mode in modes:
            row = {"cell": f"{label}/c{concurrency}", "mode": mode}
            for metric in ("mean_ttft_ms", "output_throughput"):
                stock, ours = (
                    series((label, concurrency), STOCK, metric),
                    series((label, concurrency), mode, metric),
                )
                if not stock or len(stock) != len(ours):
                    continue
                paired = [
                    (s / o if metric.endswith("_ms") else o / s) if min(s, o) > 0 else 0.0
                    for s, o in zip(stock, ours, strict=True)
                ]
                mean_s, mean_o = statistics.fmean(stock), statistics.fmean(ours)
                ratio = mean_s / mean_o if metric.endswith("_ms") else mean_o / mean_s
                row[metric] = {
                    STOCK: round(mean_s, 2),
                    mode: round(mean_o, 2),
                    "ratio": round(ratio, 3),
                    "range": [round(min(paired), 3), round(max(paired), 3)],
                    "rounds": {
                        STOCK: [round(v, 1) for v in stock],
                        mode: [round(v, 1) for v in ours],
                    },
                }
            rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| cell | mode | stock mean TTFT ms | mode mean TTFT ms | TTFT speedup (range) "
        "| stock out tok/s | mode out tok/s | throughput ratio (range) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t, o = row.get("mean_ttft_ms"), row.get("output_throughput")
        if not t or not o:
            continue
        mode = row["mode"]
        lines.append(
            f"| {row['cell']} | {mode} | {t[STOCK]:,.0f} | {t[mode]:,.0f} "
            f"| {t['ratio']:.2f}x ({t['range'][0]:.2f}-{t['range'][1]:.2f}) "
            f"| {o[STOCK]:.1f} | {o[mode]:.1f} "
            f"| {o['ratio']:.2f}x ({o['range'][0]:.2f}-{o['range'][1]:.2f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, shared, cuda = prepare_bench(args.model_path, args.server_args)
    modes = [m for m in args.modes.split(",") if m]
    traces: dict[str, Path] = {}
    for k in args.images:
        made = doc_qa_traces(
            args.out_dir / "traces",
            k,
            args.num_prompts,
            args.pool_size,
            args.rounds,
            image_size=args.image_size,
            max_tokens=args.max_tokens,
        )
        traces.update({f"{k}-{name}" if name != "warmup" else name: p for name, p in made.items()})
    for k in args.no_reuse_images:
        made = no_reuse_traces(
            args.out_dir / "traces",
            k,
            args.num_prompts,
            args.rounds,
            image_size=args.image_size,
            max_tokens=args.max_tokens,
        )
        traces.update({f"new-{k}-{name}": p for name, p in made.items()})
    records, infos, failed, counters = [], {}, [], {}
    for r in range(args.rounds):
        order = [STOCK, *modes]
        for name in order if r % 2 == 0 else order[::-1]:
            side = build_side(
                name, model, shared, args.out_dir, args.mm_refresh_budget, log_suffix=f"-r{r}"
            )
            with side.process:
                infos.setdefault(name, side.server_info())
                where = args.out_dir / "client" / f"{name}-r{r}"
                warm = ClientRun("warmup", 1, args.pool_size, traces["warmup"])
                run_client(side.base_url, model, warm, where)
                for run in planned_runs(args, traces, r):
                    try:
                        result = run_client(side.base_url, model, run, where)
                    except RuntimeError as exc:
                        failed.append(f"round {r} {name} {run.label}/c{run.concurrency}: {exc}")
                        print(f"FAILED: {failed[-1]}", file=sys.stderr)
                        continue
                    record = {"side": name, "round": r, "label": run.label}
                    record |= {"concurrency": run.concurrency, "result": result}
                    records.append(record)
                    shown = ", ".join(f"{m} {result[m]:.1f}" for m in METRICS)
                    print(
                        f"round {r} {name:<8} {run.label}/c{run.concurrency}: {shown}", flush=True
                    )
                counters[f"{name}-r{r}"] = side.mmkv_stats()
    differences = compare_settings(infos)
    rows = summarise(records, modes)
    commands = command_lines(model, modes, shared, args.mm_refresh_budget)
    client = shlex.join(
        client_command(
            "http://HOST:PORT", model, planned_runs(args, traces, 0)[0], Path("out.jsonl")
        )
    )
    meta = {
        "command": "python benchmarks/bench_serving.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "command_lines": commands,
        "client_command_example": client,
        "settings_differences": differences,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        + (torch.cuda.get_device_name() if cuda else "no GPU"),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_serving.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "records": records,
                "counters": counters,
                "failed": failed,
            },
            indent=1,
        )
    )
    table = format_rows(rows)
    (args.out_dir / "bench_serving.md").write_text(table + "\n")
    print(table)
    for name, command in commands.items():
        print(f"{name}: {command}")
    print(f"client: {client}")
    overlap = differences.get("disable_overlap_schedule", {})
    print(f"verified from /get_server_info: disable_overlap_schedule {overlap or 'equal'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

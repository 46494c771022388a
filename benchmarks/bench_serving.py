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

Mixed traffic (``--mixes 70/15/15,50/25/25``): per mix and load, one trace of
doc-QA over the pool, requests with pages nobody sent and text-only chat
(``harness/mixed_traces.py``; new requests per round, the same on every side),
sent closed loop at each ``--concurrency`` and with Poisson arrivals at each
``--request-rate`` (the client's own). Per side: request and output-token
throughput, TTFT and inter-token latency p50 / p99, TTFT p50 per kind, and the
trace's FLOPs bound (``harness/serving_report.py``). ``bench_serving.png``: TTFT
against pages (the doc-QA cells) and request throughput against concurrency (the
mixed cells), bounds drawn; ``--replot JSON`` summarises a result file's records
again with this checkout's summary and rewrites its tables, JSON rows and plot.

    python benchmarks/bench_serving.py --images 1,2,4,8,16 --no-reuse-images 4 \\
        --text-concurrency 1 --mixes 70/15/15,50/25/25 --concurrency 4,16 \\
        --request-rate 0.1 --mix-prompts 48 --rounds 2 --out-dir benchmarks/results/bench-mixed
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import torch

from harness.mixed_traces import Mix, mixed_requests, read_labels, write_mixed_trace
from harness.scheduler_profile import Sampler
from harness.servers import (
    STOCK,
    build_side,
    command_lines,
    compare_settings,
    prepare_bench,
)
from harness.serving_report import (
    flops_delta,
    format_mixed,
    format_time_split,
    per_request,
    plot,
    summarise_mixed,
    throughput_by_concurrency,
    ttft_by_pages,
)
from harness.sglang_client import ClientRun, client_command, run_client
from harness.traces import doc_qa_traces, no_reuse_traces

METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput", "mean_tpot_ms")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _mixes(text: str) -> tuple[Mix, ...]:
    return tuple(Mix.parse(x) for x in text.split(",") if x)


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
    parser.add_argument("--mixes", type=_mixes, default=(), help="doc-QA/new/text: 70/15/15,...")
    parser.add_argument("--concurrency", type=_ints, default=(4, 16), help="mixed, closed loop")
    parser.add_argument("--request-rate", type=_floats, default=(), help="mixed, Poisson req/s")
    parser.add_argument("--rate-concurrency", type=int, default=64, help="cap at a request rate")
    parser.add_argument("--mix-prompts", type=int, default=24, help="requests per mixed trace")
    parser.add_argument("--mix-doc-pages", type=int, default=8)
    parser.add_argument("--mix-new-pages", type=int, default=4)
    parser.add_argument("--mix-text-words", type=int, default=200)
    parser.add_argument("--mix-max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--profile-rate",
        type=int,
        default=0,
        help="py-spy samples per second of each side's processes over each trace (0: off)",
    )
    parser.add_argument(
        "--replot", type=Path, default=None, help="re-summarise and redraw this JSON"
    )
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


def mixed_loads(args: argparse.Namespace) -> list[tuple[str, int, float | None]]:
    """``(load, max concurrency, request rate)`` of each mixed cell: closed loop at
    each ``--concurrency``, then Poisson at each ``--request-rate``."""
    loads = [(f"c{c}", c, None) for c in args.concurrency]
    return loads + [(f"rate{r:g}", args.rate_concurrency, r) for r in args.request_rate]


MIXED_SEEDS = 500  # mixed traces' seeds: 500 + 1000 r + cell, apart from the doc cells' 1000 r


def mixed_traces(args: argparse.Namespace) -> dict[tuple[str, str, int], Path]:
    """One trace per mix, load and round, each from its own seed (no new page or
    prompt is sent twice; the same files for the same arguments)."""
    loads = mixed_loads(args)
    if len(args.mixes) * len(loads) > MIXED_SEEDS:
        raise ValueError(f"at most {MIXED_SEEDS} mixes times loads")
    traces = {}
    for r in range(args.rounds):
        for i, mix in enumerate(args.mixes):
            for j, (load, _, _) in enumerate(loads):
                requests = mixed_requests(
                    mix,
                    args.mix_prompts,
                    doc_pages=args.mix_doc_pages,
                    new_pages=args.mix_new_pages,
                    pool_size=args.pool_size,
                    image_size=args.image_size,
                    text_words=args.mix_text_words,
                    seed=MIXED_SEEDS + 1000 * r + len(loads) * i + j,
                )
                path = args.out_dir / "traces" / f"mix-{mix.label}-{load}-round{r}.jsonl"
                traces[(mix.label, load, r)] = write_mixed_trace(
                    requests, path, args.mix_max_tokens
                )
    return traces


def planned_mixed_runs(
    args: argparse.Namespace, traces: dict[tuple[str, str, int], Path], r: int
) -> list[tuple[ClientRun, str, str]]:
    """Every mixed client run of round ``r``: ``(run, mix label, load)``."""
    return [
        (
            ClientRun(
                f"mix-{mix.label}-{load}",
                concurrency,
                args.mix_prompts,
                traces[(mix.label, load, r)],
                request_rate=rate,
                details=True,
            ),
            mix.label,
            load,
        )
        for mix in args.mixes
        for load, concurrency, rate in mixed_loads(args)
    ]


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
    cells = sorted({(x["label"], x["concurrency"]) for x in records if "mix" not in x})
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


def _commit() -> str:
    """The checkout's commit, ``+dirty`` when the tree has changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (sha or "unknown") + ("+dirty" if dirty else "")


def _measure(
    side, model: Path, run: ClientRun, where: Path, profile_rate: int
) -> tuple[dict, dict, dict | None]:
    """One client run: ``(the client's record, the side's prefill FLOPs over it, where
    its processes spent it)``, the last None unless ``profile_rate``."""
    before = side.mmkv_stats()
    if not profile_rate:
        result = run_client(side.base_url, model, run, where)
        return result, flops_delta(before, side.mmkv_stats()), None
    prefix = where / f"py-spy-{run.label}-c{run.concurrency}"
    with Sampler(side.process.pid, profile_rate, prefix) as sampler:
        result = run_client(side.base_url, model, run, where)
    return result, flops_delta(before, side.mmkv_stats()), sampler.result()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_rounds(args, model: Path, shared: list[str], modes: list[str], traces, mixed):
    """Every round, the sides alternating, one server up at a time: returns
    ``(records, server infos, failures, counters, servers)``, ``servers`` holding
    each side's start and stop times (``time.time()``)."""
    records, infos, failed, counters, servers = [], {}, [], {}, []
    for r in range(args.rounds):
        order = [STOCK, *modes]
        for name in order if r % 2 == 0 else order[::-1]:
            side = build_side(
                name, model, shared, args.out_dir, args.mm_refresh_budget, log_suffix=f"-r{r}"
            )
            up = time.time()
            with side.process:
                infos.setdefault(name, side.server_info())
                where = args.out_dir / "client" / f"{name}-r{r}"
                warm = ClientRun("warmup", 1, args.pool_size, traces["warmup"])
                run_client(side.base_url, model, warm, where)
                cells = [(run, None, None) for run in planned_runs(args, traces, r)]
                for run, mix, load in cells + planned_mixed_runs(args, mixed, r):
                    load_average = [round(x, 2) for x in os.getloadavg()]
                    try:
                        result, flops, spent = _measure(side, model, run, where, args.profile_rate)
                    except RuntimeError as exc:
                        failed.append(f"round {r} {name} {run.label}/c{run.concurrency}: {exc}")
                        print(f"FAILED: {failed[-1]}", file=sys.stderr)
                        continue
                    record = {"side": name, "round": r, "label": run.label}
                    record |= {"concurrency": run.concurrency, "load_average": load_average}
                    if mix is not None:
                        record |= {"mix": mix, "load": load, "request_rate": run.request_rate}
                        record |= {"trace": str(run.trace), "trace_sha256": _sha256(run.trace)}
                        record["requests"] = per_request(result, read_labels(run.trace))
                    if spent is not None:
                        record["profile"] = spent
                    records.append(record | {"result": result, "flops": flops})
                    shown = ", ".join(f"{m} {result[m]:.1f}" for m in METRICS)
                    print(
                        f"round {r} {name:<8} {run.label}/c{run.concurrency}: {shown}", flush=True
                    )
                counters[f"{name}-r{r}"] = side.mmkv_stats()
            servers.append({"side": name, "round": r, "up": up, "down": time.time()})
    return records, infos, failed, counters, servers


def draw(report: dict, path: Path) -> Path:
    """``bench_serving.png`` from a result (this run's or ``--replot``'s)."""
    modes = [m for m in report["meta"].get("modes", []) if m != STOCK]
    meta = report["meta"]
    title = (
        f"{meta.get('machine', '')}; commit {meta.get('commit', '?')}; "
        f"load average {meta.get('load_average', {}).get('start', '?')} at start"
    )
    return plot(
        ttft_by_pages(report["records"], modes),
        throughput_by_concurrency(report.get("mixed_rows", [])),
        title,
        path,
    )


def write_report(report: dict, out_dir: Path) -> str:
    """``bench_serving.json`` / ``.md`` / ``.png`` of ``report`` in ``out_dir``; returns
    the tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_serving.json").write_text(json.dumps(report, indent=1))
    rows, mixed_rows = report["rows"], report["mixed_rows"]
    tables = [format_rows(rows) if rows else "", format_mixed(mixed_rows) if mixed_rows else ""]
    tables.append(format_time_split(mixed_rows))
    table = "\n\n".join(t for t in tables if t)
    meta = report["meta"]
    header = f"commit {meta['commit']}; {meta['machine']}; load average {meta['load_average']}\n\n"
    (out_dir / "bench_serving.md").write_text(header + table + "\n")
    draw(report, out_dir / "bench_serving.png")
    return table


def replot(path: Path) -> int:
    """Summarise ``path``'s records again and rewrite its files (``--replot``)."""
    report = json.loads(path.read_text())
    modes = [m for m in report["meta"].get("modes", []) if m != STOCK]
    records = report["records"]
    report["rows"] = summarise(records, modes)
    report["mixed_rows"] = summarise_mixed([x for x in records if "mix" in x], modes)
    print(write_report(report, path.parent))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    if args.profile_rate and shutil.which("py-spy") is None:
        raise SystemExit("--profile-rate needs py-spy (pip install py-spy)")
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
    if not args.images:
        traces["warmup"] = doc_qa_traces(
            args.out_dir / "traces", 1, 0, args.pool_size, 0, args.image_size, args.max_tokens
        )["warmup"]
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
    mixed = mixed_traces(args)
    started_load = [round(x, 2) for x in os.getloadavg()]
    records, infos, failed, counters, servers = run_rounds(
        args, model, shared, modes, traces, mixed
    )
    differences = compare_settings(infos)
    rows = summarise(records, modes)
    mixed_rows = summarise_mixed([x for x in records if "mix" in x], modes)
    commands = command_lines(model, modes, shared, args.mm_refresh_budget)
    examples = [run for run in planned_runs(args, traces, 0)[:1]]
    examples += [run for run, _, _ in planned_mixed_runs(args, mixed, 0)[-1:]]
    clients = [
        shlex.join(client_command("http://HOST:PORT", model, run, Path("out.jsonl")))
        for run in examples
    ]
    meta = {
        "command": "python benchmarks/bench_serving.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "command_lines": commands,
        "client_command_example": clients[0] if clients else "",
        "client_command_examples": clients,
        "settings_differences": differences,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} threads, "
        + (torch.cuda.get_device_name() if cuda else "no GPU"),
        "commit": _commit(),
        "modes": modes,
        "load_average": {
            "start": started_load,
            "end": [round(x, 2) for x in os.getloadavg()],
        },
    }
    report = {
        "meta": meta,
        "rows": rows,
        "mixed_rows": mixed_rows,
        "records": records,
        "counters": counters,
        "servers": servers,
        "failed": failed,
    }
    print(write_report(report, args.out_dir))
    for name, command in commands.items():
        print(f"{name}: {command}")
    for client in clients:
        print(f"client: {client}")
    overlap = differences.get("disable_overlap_schedule", {})
    print(f"verified from /get_server_info: disable_overlap_schedule {overlap or 'equal'}")
    print(f"commit {meta['commit']}; load average at start / end: {meta['load_average']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

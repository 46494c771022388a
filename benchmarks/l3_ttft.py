"""TTFT of an image loaded from the shared L3 segment storage vs computing it.

    python benchmarks/l3_ttft.py --num-requests 3 --images-per-request 4 \\
        --out-dir benchmarks/results/l3-storage

Instance A (``--mm-reuse conduit --mm-segment-storage file``, a fresh directory)
reads ``num_requests`` requests of new images and writes their segments through;
A is stopped. Instance B, started on the same directory, then sends one at a time,
streaming, one output token:

- ``B from L3``: A's images under a new system prompt (B never saw them: loaded
  from storage, then reused and refreshed);
- ``B from memory``: the same images under a third system prompt (store hits);
- ``B computes``: new images (a full prefill, written through).

Prints each request's TTFT and the medians, with what each group of requests spent
in the L3 tier (storage ``load_seconds`` / ``write_seconds``) and building image
embeddings (``embedding_seconds``: the vision tower, which a refresh needs), from the
server's counters; writes ``l3_ttft.json`` / ``.md``. Server logs go to a temporary
directory.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import torch

from harness.client import run_requests
from harness.servers import prepare_bench
from harness.workloads import BenchRequest, _image_url
from sgl_mmkv.testing.server import REPORT_REUSE, ServerProcess, mmkv_stats

QUESTION = "Summarise the pages."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--num-requests", type=int, default=3)
    parser.add_argument("--images-per-request", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--server-args", default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/l3-storage"))
    return parser.parse_args(argv)


def _request(label: str, system: str, seeds: list[int], size: int) -> BenchRequest:
    images = [{"type": "image_url", "image_url": {"url": _image_url(s, size)}} for s in seeds]
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": [*images, {"type": "text", "text": QUESTION}]},
    ]
    return BenchRequest(label, len(seeds), messages, uid=system)


SPENT = (
    ("storage", "load_seconds"),
    ("storage", "write_seconds"),
    ("refresh", "embedding_seconds"),
)


def _spent(server: ServerProcess) -> dict[str, float]:
    stats = mmkv_stats(server.base_url)
    return {name: float(stats.get(group, {}).get(name, 0.0)) for group, name in SPENT}


def _timed(
    server: ServerProcess,
    requests: list[BenchRequest],
    spent: dict[str, dict[str, float]],
    run: str,
) -> list[float]:
    """TTFT in ms of each request, sent one at a time; ``spent[run]``: the server's
    counter seconds (:data:`SPENT`) over these requests, in ms."""
    before = _spent(server)
    out = []
    for request in requests:
        (result,) = run_requests(server.base_url, [request], concurrency=1, max_tokens=1)
        if not result.ok:
            raise RuntimeError(f"{request.uid}: {result.error}")
        out.append(result.ttft_s * 1000)
    after = _spent(server)
    spent[run] = {name: (after[name] - before[name]) * 1000 for name in after}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, shared, _ = prepare_bench(args.model_path, args.server_args)
    storage = Path(tempfile.mkdtemp(prefix="sgl_mmkv_l3_")) / "segments"
    flags = [
        "--mm-reuse", "conduit", REPORT_REUSE,
        "--mm-segment-storage", "file", "--mm-segment-storage-dir", str(storage),
    ]  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    n, k, size = args.num_requests, args.images_per_request, args.image_size
    seeds = [[5000 + i * k + j for j in range(k)] for i in range(n)]
    new_seeds = [[6000 + i * k + j for j in range(k)] for i in range(n)]
    command = f"python -m sgl_mmkv.launch_server --model-path {model} " + shlex.join(
        [*shared, *flags]
    )
    runs: dict[str, list[float]] = {}
    spent: dict[str, dict[str, float]] = {}
    stats: dict[str, dict] = {}
    logs = storage.parent
    a = ServerProcess("sgl_mmkv.launch_server", model, [*flags, *shared], logs / "a.log")
    with a:
        a.start()
        runs["A computes (writes through)"] = _timed(
            a,
            [_request("a", f"A reads set {i}.", s, size) for i, s in enumerate(seeds)],
            spent,
            "A computes (writes through)",
        )
        stats["A"] = mmkv_stats(a.base_url)
    b = ServerProcess("sgl_mmkv.launch_server", model, [*flags, *shared], logs / "b.log")
    with b:
        b.start()
        before = mmkv_stats(b.base_url)
        for run, system, sets in (
            ("B from L3", "B asks about set {}.", seeds),
            ("B from memory", "C asks about set {}.", seeds),
            ("B computes (writes through)", "B reads new set {}.", new_seeds),
        ):
            requests = [_request(run, system.format(i), s, size) for i, s in enumerate(sets)]
            runs[run] = _timed(b, requests, spent, run)
        stats["B_before"], stats["B"] = before, mmkv_stats(b.base_url)
    report = {
        "command": command,
        "script": "python benchmarks/l3_ttft.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"cuda={torch.cuda.is_available()}",
        "requests": n,
        "images_per_request": k,
        "image_size": size,
        "ttft_ms": runs,
        "median_ttft_ms": {name: statistics.median(v) for name, v in runs.items()},
        "server_ms_per_run": spent,
        "logs": str(logs),
        "storage": {side: stats[side].get("storage") for side in ("A", "B_before", "B")},
        "refresh_B": stats["B"].get("refresh"),
    }
    (args.out_dir / "l3_ttft.json").write_text(json.dumps(report, indent=2))
    lines = [
        "| run | median TTFT ms | each request, ms | L3 load ms | L3 write ms | embeddings ms |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {statistics.median(v):.0f} | {', '.join(f'{x:.0f}' for x in v)} | "
            + " | ".join(f"{spent[name][n]:.0f}" for _, n in SPENT)
            + " |"
            for name, v in runs.items()
        ),
    ]
    (args.out_dir / "l3_ttft.md").write_text(
        "\n".join([f"Server: `{command}`", f"Script: `{report['script']}`", "", *lines]) + "\n"
    )
    print("\n".join(lines))
    print(json.dumps(report["storage"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

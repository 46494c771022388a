"""TTFT of an image loaded from the shared L3 segment storage, with and without its
stored vision-encoder output, against the same image in memory.

    python benchmarks/l3_ttft.py --num-requests 3 --images-per-request 4 --rounds 3 \\
        --out-dir benchmarks/results/l3-storage

Instance A (``--mm-reuse conduit --mm-segment-storage file``, a fresh directory)
reads ``rounds x num_requests`` requests of new images and writes their segments
through (each entry with its image's encoder output); A is stopped. Then, one server
at a time, for each variant of A's directory (a copy as A wrote it: ``with
embeddings``; a copy whose entries were rewritten with their KV alone: ``without
embeddings``, as before entries carried them) an instance B is started on it and, in
each round (a set of images of its own), sends one at a time, streaming, one output
token:

- ``B from L3``: the round's images under a new system prompt (B never saw them:
  loaded from storage, then reused and refreshed);
- ``B from memory``: the same images under a third system prompt (store hits).

Prints each round's median TTFT per run and the min / median / max over rounds, with
what the runs spent in the L3 tier (storage ``load_seconds``) and building image
embeddings for a refresh (``embedding_seconds``), and how many images the vision
tower encoded and how many took their embeddings from a segment instead (the store's
``vision_encoded`` / ``vision_skipped``), from the server's counters, summed over
rounds; writes ``l3_ttft.json`` / ``.md``. Server logs go to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
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
    parser.add_argument("--rounds", type=int, default=3)
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
COUNTED = (("store", "vision_encoded"), ("store", "vision_skipped"))


def _spent(server: ServerProcess) -> dict[str, float]:
    stats = mmkv_stats(server.base_url)
    return {name: float(stats.get(group, {}).get(name, 0.0)) for group, name in (*SPENT, *COUNTED)}


def _timed(
    server: ServerProcess,
    requests: list[BenchRequest],
    spent: dict[str, dict[str, float]],
    run: str,
) -> list[float]:
    """TTFT in ms of each request, sent one at a time; ``spent[run]``: the server's
    counter seconds (:data:`SPENT`) over these requests, in ms, and its counts
    (:data:`COUNTED`)."""
    before = _spent(server)
    out = []
    for request in requests:
        (result,) = run_requests(server.base_url, [request], concurrency=1, max_tokens=1)
        if not result.ok:
            raise RuntimeError(f"{request.uid}: {result.error}")
        out.append(result.ttft_s * 1000)
    after = _spent(server)
    spent[run] = {
        name: (after[name] - before[name]) * (1 if (g, name) in COUNTED else 1000)
        for g, name in (*SPENT, *COUNTED)
    }
    return out


VARIANTS = ("with embeddings", "without embeddings")
START_TIMEOUT_S = 900.0  # a busy shared machine
B_RUNS = (("B from L3", "B asks about set {}."), ("B from memory", "C asks about set {}."))


def _flags(storage: Path) -> list[str]:
    return [
        "--mm-reuse", "conduit", REPORT_REUSE,
        "--mm-segment-storage", "file", "--mm-segment-storage-dir", str(storage),
    ]  # fmt: skip


def _wait_writes(server: ServerProcess, writes: int, timeout_s: float = 120.0) -> None:
    """Until the server's writer thread has written ``writes`` entries in all."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = mmkv_stats(server.base_url)["storage"]
        if stats["writes"] + stats["write_failed"] >= writes:
            return
        time.sleep(0.5)
    raise RuntimeError(f"A wrote fewer than {writes} entries in {timeout_s} s")


def strip_embeddings(directory: Path) -> int:
    """Rewrite every entry of the ``file`` storage ``directory`` with its KV alone (the
    same names: the fingerprint is the instance's). Returns the entries rewritten."""
    from sgl_mmkv.segments.entry_format import KVFingerprint, decode_header, key_from_fields
    from sgl_mmkv.segments.storage import open_storage

    done = 0
    for header in sorted(directory.glob("*_h__0_1.bin")):
        fields = decode_header(header.read_bytes())
        if fields is None or fields.get("embeds") is None:
            continue
        key = key_from_fields(fields["key"])
        storage = open_storage("file", KVFingerprint(**fields["kv"]), str(directory))
        stored = storage.load(key)
        if stored is None:
            raise RuntimeError(f"{header.name}: not loadable")
        stored.embeddings = None
        stem = header.name[: -len("h__0_1.bin")]
        for part in directory.glob(stem + "*"):
            part.unlink()
        if not storage.save(key, stored):
            raise RuntimeError(f"{header.name}: not written again")
        done += 1
    return done


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, shared, _ = prepare_bench(args.model_path, args.server_args)
    work = Path(tempfile.mkdtemp(prefix="sgl_mmkv_l3_"))
    written = work / "a" / "segments"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    n, k, size = args.num_requests, args.images_per_request, args.image_size
    # one set of images per round: each round's B from L3 loads images it never saw
    seeds = [
        [[5000 + (r * n + i) * k + j for j in range(k)] for i in range(n)]
        for r in range(args.rounds)
    ]
    command = f"python -m sgl_mmkv.launch_server --model-path {model} " + shlex.join(
        [*shared, *_flags(Path("DIR"))]
    )
    spent: dict[str, dict[str, float]] = {}
    a_flags = [*_flags(written), *shared]
    with ServerProcess("sgl_mmkv.launch_server", model, a_flags, work / "a.log").start(
        timeout_s=START_TIMEOUT_S
    ) as a:
        writes = mmkv_stats(a.base_url)["storage"]["writes"]  # after SGLang's warm-up
        a_ttft = _timed(
            a,
            [
                _request("a", f"A reads set {r}.{i}.", s, size)
                for r, sets in enumerate(seeds)
                for i, s in enumerate(sets)
            ],
            spent,
            "A computes (writes through)",
        )
        _wait_writes(a, writes + args.rounds * n * k)
    # round -> run -> TTFT of each request, ms; counters summed over rounds
    rounds: list[dict[str, list[float]]] = [{} for _ in range(args.rounds)]
    counted: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        directory = work / variant.split()[0] / "segments"
        shutil.copytree(written, directory)
        # A's entries: the rounds' images and the image of SGLang's warm-up request
        if variant == "without embeddings" and strip_embeddings(directory) < args.rounds * n * k:
            raise RuntimeError("not every entry carried embeddings")
        b_flags = [*_flags(directory), *shared]
        log = directory.parent / "b.log"
        with ServerProcess("sgl_mmkv.launch_server", model, b_flags, log).start(
            timeout_s=START_TIMEOUT_S
        ) as b:
            for r, sets in enumerate(seeds):
                for run, system in B_RUNS:
                    name = f"{run}, {variant}"
                    requests = [
                        _request(run, system.format(f"{r}.{i}"), s, size)
                        for i, s in enumerate(sets)
                    ]
                    rounds[r][name] = _timed(b, requests, spent, name)
                    total = counted.setdefault(name, dict.fromkeys(spent[name], 0.0))
                    for counter, value in spent[name].items():
                        total[counter] += value
                print(f"round {r + 1} {variant}: " + ", ".join(
                    f"{run} {statistics.median(rounds[r][f'{run}, {variant}']):.0f} ms"
                    for run, _ in B_RUNS
                ), flush=True)  # fmt: skip
    medians = {name: [statistics.median(r[name]) for r in rounds] for name in rounds[0]}
    ratio = {
        variant: [
            statistics.median(r[f"B from L3, {variant}"])
            / statistics.median(r[f"B from memory, {variant}"])
            for r in rounds
        ]
        for variant in VARIANTS
    }
    report = {
        "command": command,
        "script": "python benchmarks/l3_ttft.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"cuda={torch.cuda.is_available()}",
        "requests": n,
        "images_per_request": k,
        "image_size": size,
        "rounds": args.rounds,
        "a_ttft_ms": a_ttft,
        "ttft_ms_per_round": rounds,
        "median_ttft_ms_per_round": medians,
        "median_ttft_ms_over_rounds": {name: _spread(v) for name, v in medians.items()},
        "storage_over_memory": {v: _spread(x) for v, x in ratio.items()},
        "server_counters_over_rounds": counted,
        "logs": str(work),
    }
    (args.out_dir / "l3_ttft.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"A computes (writes through): {', '.join(f'{x:.0f}' for x in a_ttft)} ms",
        "",
        "| run | median TTFT ms per round | min | median | max | L3 load ms | embeddings ms "
        "| images encoded | images from segments |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {', '.join(f'{x:.0f}' for x in v)} | "
            + " | ".join(f"{x:.0f}" for x in _spread(v).values())
            + " | "
            + " | ".join(
                f"{counted[name][c]:.0f}"
                for c in ("load_seconds", "embedding_seconds", "vision_encoded", "vision_skipped")
            )
            + " |"
            for name, v in medians.items()
        ),
        "",
        *(
            f"B from L3 / B from memory, {variant} (per round): "
            + ", ".join(f"{x:.2f}" for x in ratio[variant])
            for variant in VARIANTS
        ),
    ]
    (args.out_dir / "l3_ttft.md").write_text(
        "\n".join([f"Server: `{command}`", f"Script: `{report['script']}`", "", *lines]) + "\n"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hit rate and TTFT of doc-QA across two instances behind SGLang's router.

    python benchmarks/router_affinity.py --docs 4 --pages 2 --rounds 2 \\
        --out-dir benchmarks/results/router-affinity

Two ``--mm-reuse conduit`` instances behind ``python -m sglang_router.launch_router``.
Each configuration gets its own pool of ``docs`` documents of ``pages`` pages (images
no instance has seen). Read phase: each document is read once, one request at a
time, through the router (so the pool is spread over the two instances). Query
phase: ``rounds`` rounds, each asking about every document (seeded random order)
under a new system prompt with its pages in a new order. Streaming, one output token.

- ``round_robin``: ``--policy round_robin``, no routing key;
- ``affinity``: ``--policy manual --assignment-mode min_load`` behind the gateway
  (``python -m sgl_mmkv.gateway``), which sets ``X-SMG-Routing-Key`` from each
  request's images; the client sends no header (results before the gateway existed
  were measured with the same key sent by the client);
- ``round_robin + L3``: ``--policy round_robin`` over two instances that share
  ``--mm-segment-storage file`` (a fresh directory): a missed image is loaded.

Hit rate: reused image tokens / image tokens over the query phase, from each
instance's counters (``/get_server_info``, ``--mm-report-reuse``). Writes
``router_affinity.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import torch

from harness.doc_qa import doc_qa_trace, stream_ttft_ms
from harness.servers import prepare_bench
from sgl_mmkv.testing.router import GatewayProcess, RouterProcess
from sgl_mmkv.testing.server import REPORT_REUSE, ServerProcess, mmkv_stats

COUNTED = (
    ("segments", "image_tokens"),
    ("refresh", "reused_tokens"),
    ("store", "loaded"),
    ("segments", "requests"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--pages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/router-affinity"))
    return parser.parse_args(argv)


def _counts(servers: list[ServerProcess]) -> list[dict[str, float]]:
    out = []
    for server in servers:
        stats = mmkv_stats(server.base_url)
        out.append({name: float(stats.get(g, {}).get(name, 0)) for g, name in COUNTED})
    return out


def _phase(url: str, servers, requests_: list[list[dict]]) -> dict:
    """Send requests one at a time to ``url``; TTFTs, which instance served each,
    counter deltas."""
    ttft, served = [], []
    total = {name: 0.0 for _, name in COUNTED}
    for messages in requests_:
        before = _counts(servers)
        ttft.append(stream_ttft_ms(url, messages))
        after = _counts(servers)
        served.append(
            [i for i in range(len(servers)) if after[i]["requests"] > before[i]["requests"]]
        )
        for i in range(len(servers)):
            for name in total:
                total[name] += after[i][name] - before[i][name]
    return {"ttft_ms": ttft, "served_by": served, "counters": total}


def _run(config: str, router_args: list[str], servers, args, base_seed: int, logs: Path) -> dict:
    affinity = config == "affinity"
    reads, queries = doc_qa_trace(
        args.docs, args.pages, args.rounds, args.image_size, base_seed, random.Random(args.seed)
    )
    urls = [s.base_url for s in servers]
    log = logs / f"router-{config.replace(' ', '').replace('+', '-')}.log"
    with RouterProcess(urls, router_args[0], log, router_args[1:]) as router:
        gateway_log = log.with_suffix(".gateway.log")
        front = GatewayProcess(router.base_url, gateway_log) if affinity else None
        with front or contextlib.nullcontext(router) as entry:  # clients send no key
            read = _phase(entry.base_url, servers, reads)
            query = _phase(entry.base_url, servers, queries)
    c = query["counters"]
    return {
        "router": "python -m sglang_router.launch_router --policy " + shlex.join(router_args),
        "gateway": "python -m sgl_mmkv.gateway --router-url ROUTER" if affinity else None,
        "read": read,
        "query": query,
        "hit_rate": c["reused_tokens"] / c["image_tokens"] if c["image_tokens"] else 0.0,
        "mean_query_ttft_ms": statistics.mean(query["ttft_ms"]),
        "mean_read_ttft_ms": statistics.mean(read["ttft_ms"]),
        "segments_loaded_from_l3": c["loaded"],
    }


def _pair(model, flags: list[str], logs: Path, tag: str) -> list[ServerProcess]:
    servers = [
        ServerProcess("sgl_mmkv.launch_server", model, flags, logs / f"{tag}-{n}.log")
        for n in ("a", "b")
    ]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda s: s.start(timeout_s=600), servers))
    return servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, shared, _ = prepare_bench(args.model_path, args.server_args)
    logs = Path(tempfile.mkdtemp(prefix="sgl_mmkv_router_"))
    storage = logs / "segments"
    flags = [*shared, "--sleep-on-idle", "--mm-reuse", "conduit", REPORT_REUSE]
    l3 = ["--mm-segment-storage", "file", "--mm-segment-storage-dir", str(storage)]
    results: dict[str, dict] = {}
    plan = (
        ("round_robin", ["round_robin"], 10000, False),
        ("affinity", ["manual", "--assignment-mode", "min_load"], 20000, False),
        ("round_robin + L3", ["round_robin"], 30000, True),
    )
    servers: list[ServerProcess] = []
    try:
        for storage_on in (False, True):
            servers = _pair(model, [*flags, *l3] if storage_on else flags, logs, f"l3{storage_on}")
            for config, router_args, seed, on in plan:
                if on == storage_on:
                    results[config] = _run(config, router_args, servers, args, seed, logs)
                    r = results[config]
                    ttft = r["mean_query_ttft_ms"]
                    print(f"{config}: hit {r['hit_rate']:.3f}, query TTFT {ttft:.0f} ms")
            for server in servers:
                server.stop()
    finally:
        for server in servers:
            server.stop()
    command = f"python -m sgl_mmkv.launch_server --model-path {model} " + shlex.join(flags)
    report = {
        "script": "python benchmarks/router_affinity.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "server": command,
        "server_l3_extra": shlex.join(l3),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"cuda={torch.cuda.is_available()}",
        "docs": args.docs,
        "pages": args.pages,
        "rounds": args.rounds,
        "image_size": args.image_size,
        "logs": str(logs),
        "results": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "router_affinity.json").write_text(json.dumps(report, indent=2))
    lines = [
        "| routing | hit rate (reused / image tokens) | mean query TTFT ms | "
        "mean read TTFT ms | segments loaded from L3 |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {r['hit_rate']:.3f} ({r['query']['counters']['reused_tokens']:.0f} / "
            f"{r['query']['counters']['image_tokens']:.0f}) | {r['mean_query_ttft_ms']:.0f} | "
            f"{r['mean_read_ttft_ms']:.0f} | {r['segments_loaded_from_l3']:.0f} |"
            for name, r in results.items()
        ),
    ]
    header = [
        f"Script: `{report['script']}`",
        f"Servers: `{command}` (+ `{report['server_l3_extra']}` for L3)",
        f"Machine: {report['machine']}",
        "",
    ]
    (args.out_dir / "router_affinity.md").write_text("\n".join([*header, *lines]) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

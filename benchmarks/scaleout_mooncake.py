"""Two instances behind SGLang's router sharing a Mooncake store, against one instance
and against two that share nothing; then one of the two killed mid-run.

    python benchmarks/scaleout_mooncake.py --docs 12 --pages 2 --rounds 2 \\
        --concurrency 8 --max-total-tokens 4096 --out-dir benchmarks/results/scaleout-mooncake

Each instance is ``--mm-reuse conduit`` with its own memory (``--max-total-tokens``,
less than the pool of ``docs * pages`` pages), behind ``python -m
sglang_router.launch_router --policy round_robin`` (no affinity: where a page was read
is left to chance, the store is what finds it again). Configurations, each on pages
nobody has sent:

- ``one instance``: the router over one instance;
- ``two, no storage``: over two instances that share nothing;
- ``two + Mooncake``: over two instances sharing ``--mm-segment-storage mooncake``
  (a ``mooncake_master`` and a storage process on the loopback, started here);
- ``two + Mooncake, one killed``: the same instances on new pages; once half the
  queries are answered, instance A's process tree is killed by PID. The router's
  retries send A's new requests to B; a request cut off mid-stream is sent again
  by the client, once (``--client-retries``).

Read phase: each document read once; query phase: ``rounds`` rounds over every
document (a new system prompt, its pages in a new order), ``concurrency`` requests
in flight, streamed, one output token. Hit rate: reused image tokens / image tokens
of the query phase, from the instances' counters (a killed instance's as last read
before the kill). Writes ``scaleout.json`` / ``scaleout.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import torch

from harness.doc_qa import doc_qa_trace, stream_ttft_ms
from harness.mooncake_cluster import MooncakeCluster
from harness.servers import prepare_bench
from sgl_mmkv.testing.router import RouterProcess
from sgl_mmkv.testing.server import REPORT_REUSE, ServerProcess, mmkv_stats, start_together

COUNTED = (("segments", "image_tokens"), ("refresh", "reused_tokens"), ("store", "loaded"))
KILLED = "two + Mooncake, one killed"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--pages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument(
        "--max-total-tokens", type=int, default=4096, help="each instance's KV memory"
    )
    parser.add_argument("--store-mib", type=int, default=1024, help="the Mooncake store's memory")
    parser.add_argument("--client-retries", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default=None)
    parser.add_argument(
        "--out-dir", type=Path, default=Path("benchmarks/results/scaleout-mooncake")
    )
    return parser.parse_args(argv)


def _counts(server: ServerProcess) -> dict[str, float]:
    stats = mmkv_stats(server.base_url)
    return {name: float(stats.get(group, {}).get(name, 0)) for group, name in COUNTED}


class Counters:
    """The counters of instances, each read last while it was up."""

    def __init__(self, servers: list[ServerProcess]) -> None:
        self.servers = servers
        self.last = [_counts(s) for s in servers]
        self.lock = threading.Lock()

    def read(self, index: int) -> None:
        with self.lock:
            self.last[index] = _counts(self.servers[index])

    def total(self) -> dict[str, float]:
        return {name: sum(c[name] for c in self.last) for _, name in COUNTED}


def _send(url: str, messages: list[dict], retries: int) -> dict:
    """One request; on a failure, sent again up to ``retries`` times."""
    errors = []
    for _ in range(retries + 1):
        try:
            return {"ttft_ms": stream_ttft_ms(url, messages), "errors": errors}
        except Exception as error:  # a cut stream, a refused connection, a 5xx
            errors.append(str(error)[:200])
    return {"ttft_ms": None, "errors": errors}


def _phase(url: str, requests_: list[list[dict]], args, on_half=None) -> list[dict]:
    """Send ``requests_`` with ``args.concurrency`` in flight; ``on_half`` is called
    once half of them are answered."""
    done = []
    lock = threading.Lock()

    def one(messages):
        result = _send(url, messages, args.client_retries)
        with lock:
            done.append(result)
            half = len(done) == len(requests_) // 2
        if half and on_half is not None:
            on_half()
        return result

    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(one, requests_))


def _summary(results: list[dict]) -> dict:
    ttft = sorted(r["ttft_ms"] for r in results if r["ttft_ms"] is not None)
    p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))] if ttft else None
    return {
        "requests": len(results),
        "answered": len(ttft),
        "lost": len(results) - len(ttft),
        "sent_again": sum(1 for r in results if r["errors"] and r["ttft_ms"] is not None),
        "mean_ttft_ms": statistics.mean(ttft) if ttft else None,
        "p99_ttft_ms": p99,
    }


def run_config(name: str, servers: list[ServerProcess], args, base_seed: int, logs: Path) -> dict:
    rng = random.Random(args.seed + base_seed)
    reads, queries = doc_qa_trace(
        args.docs, args.pages, args.rounds, args.image_size, base_seed, rng
    )
    log = logs / f"router-{name.replace(' ', '_').replace(',', '').replace('+', 'and')}.log"
    counters = Counters(servers)
    killed_at = []

    survivor_at_kill: dict[str, float] = {}

    def kill_a():
        counters.read(0)
        survivor_at_kill.update(_counts(servers[1]))
        killed_at.append(time.monotonic())
        servers[0].stop()  # the process tree, by PID

    with RouterProcess([s.base_url for s in servers], "round_robin", log) as router:
        read = _phase(router.base_url, reads, args)
        for i in range(len(servers)):
            counters.read(i)
        before = counters.total()
        query = _phase(router.base_url, queries, args, kill_a if name == KILLED else None)
        for i, server in enumerate(servers):
            if server.process is not None and server.process.poll() is None:
                counters.read(i)
    after = counters.total()
    delta = {key: after[key] - before[key] for key in after}
    survivor = {}
    if survivor_at_kill:  # what B did once A was gone
        survivor = {key: counters.last[1][key] - survivor_at_kill[key] for key in survivor_at_kill}
    return {
        "read": _summary(read),
        "query": _summary(query),
        "query_errors": [e for r in query for e in r["errors"]],
        "hit_rate": delta["reused_tokens"] / delta["image_tokens"]
        if delta["image_tokens"]
        else 0.0,
        "counters": delta,
        "killed_instance_a": bool(killed_at),
        "survivor_after_kill": survivor,
    }


def _instances(model, flags: list[str], count: int, logs: Path, tag: str) -> list[ServerProcess]:
    servers = [
        ServerProcess("sgl_mmkv.launch_server", model, flags, logs / f"{tag}-{n}.log")
        for n in "ab"[:count]
    ]
    start_together(servers, timeout_s=600)
    return servers


def markdown(report: dict) -> str:
    lines = [
        f"Script: `{report['script']}`",
        f"Instances: `{report['server']}` (+ `{report['mooncake_extra']}` where shared)",
        f"Router: `{report['router']}`; machine: {report['machine']}",
        "",
        "| configuration | query hit rate | mean TTFT ms | p99 TTFT ms | answered / sent | "
        "sent again | loaded from the store |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        q = r["query"]
        lines.append(
            f"| {name} | {r['hit_rate']:.3f} | {q['mean_ttft_ms']:.0f} | {q['p99_ttft_ms']:.0f} | "
            f"{q['answered']} / {q['requests']} | {q['sent_again']} | "
            f"{r['counters']['loaded']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, shared, _ = prepare_bench(args.model_path, args.server_args)
    logs = Path(tempfile.mkdtemp(prefix="sgl_mmkv_scaleout_"))
    flags = [
        *shared,
        *("--max-total-tokens", str(args.max_total_tokens)),
        *("--sleep-on-idle", "--mm-reuse", "conduit", REPORT_REUSE),
    ]
    results: dict[str, dict] = {}
    servers: list[ServerProcess] = []
    cluster = MooncakeCluster(logs, storage_bytes=args.store_mib * 2**20)
    mooncake = [
        *("--mm-segment-storage", "mooncake"),
        *("--mm-segment-storage-config", cluster.config_json(local_buffer_size=256 * 2**20)),
    ]
    started = time.monotonic()
    try:
        for name, count, seed in (("one instance", 1, 10_000), ("two, no storage", 2, 20_000)):
            servers = _instances(model, flags, count, logs, name.split(",")[0].replace(" ", "_"))
            results[name] = run_config(name, servers, args, seed, logs)
            for server in servers:
                server.stop()
            print(f"[scaleout] {name}: {results[name]['query']}", flush=True)
        cluster.start()
        servers = _instances(model, [*flags, *mooncake], 2, logs, "mooncake")
        for name, seed in (("two + Mooncake", 30_000), (KILLED, 40_000)):
            results[name] = run_config(name, servers, args, seed, logs)
            print(f"[scaleout] {name}: {results[name]['query']}", flush=True)
    finally:
        for server in servers:
            server.stop()
        cluster.stop()
    report = {
        "script": "python benchmarks/scaleout_mooncake.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "server": f"python -m sgl_mmkv.launch_server --model-path {model} " + shlex.join(flags),
        "mooncake_extra": "--mm-segment-storage mooncake --mm-segment-storage-config JSON",
        "router": "python -m sglang_router.launch_router --policy round_robin",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"cuda={torch.cuda.is_available()}",
        "seconds": round(time.monotonic() - started, 1),
        "logs": str(logs),
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "scaleout.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out_dir / "scaleout.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

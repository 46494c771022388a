"""KV memory held by running requests, with and without decode-time compression.

    python benchmarks/decode_memory.py --out-dir benchmarks/results/decode-memory

Starts two ``conduit`` servers with identical settings, one plain and one with
``--mm-evict EVICT --mm-kv-budget R --mm-compress-at decode``, and sends each the
same multi-image prompts of the fidelity test split (the committed trained model)
at a fixed concurrency, every request decoding ``--max-tokens`` tokens. While the
requests run, the server's slot ledger (``/get_server_info``) is sampled: the
slots held by running requests (their rows outside the tree, ``in_use``, plus
the tree nodes they lock, ``tree_protected``) are the figure decode-time
compression lowers: a compressed row stays out of the tree, an uncompressed one
is checkpointed into it after prefill and locked there. Writes
``decode_memory.json`` and ``decode_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import openai

from harness.fidelity import FidelityClient
from harness.fidelity_task import chat_messages, make_split, model_image_side, model_style
from sgl_mmkv.cpu_support import prepare_cpu_process
from sgl_mmkv.testing.images import image_part
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "fidelity-qwen2-vl-marked"


class LedgerSampler:
    """Samples the slots held by running requests every ``interval_s`` in a thread."""

    def __init__(self, base_url: str, interval_s: float = 0.05) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pool = mmkv_stats(self.base_url)["pool"]
            self.samples.append(int(pool["in_use"] + pool["tree_protected"]))
            time.sleep(self.interval_s)

    def __enter__(self) -> LedgerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_side(name: str, flags: list[str], args, prompts: list[list[dict]]) -> dict:
    server = ServerProcess(
        "sgl_mmkv.launch_server",
        args.model_path,
        [*flags, REPORT_REUSE, *CPU_SERVER_ARGS],
        log_path=args.out_dir / f"{name}.log",
    )
    with server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)

        def send(messages: list[dict]) -> tuple[int, float]:
            started = time.monotonic()
            r = client.chat.completions.create(
                model="default",
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens, time.monotonic() - started

        send(prompts[0])  # warm-up
        FidelityClient(server.base_url).flush()
        started = time.monotonic()
        with (
            LedgerSampler(server.base_url) as sampler,
            ThreadPoolExecutor(args.concurrency) as pool,
        ):
            replies = list(pool.map(send, prompts))
        seconds = time.monotonic() - started
        stats = mmkv_stats(server.base_url)
    samples = sampler.samples
    tokens = sum(n for n, _ in replies)
    return {
        "side": name,
        "flags": flags,
        "requests": len(prompts),
        "served": sum(1 for n, _ in replies if n == args.max_tokens),
        "peak_running_slots": max(samples),
        "mean_running_slots": sum(samples) / len(samples),
        "ledger_samples": len(samples),
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "mean_latency_s": round(sum(t for _, t in replies) / len(replies), 3),
        "row_compaction": stats.get("row_compaction"),
        "final_pool": stats["pool"],
    }


def format_table(rows: list[dict]) -> str:
    lines = [
        "| side | served | peak slots of running requests | mean | freed by compression "
        "| output tok/s | mean latency s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        freed = (r["row_compaction"] or {}).get("freed_tokens", 0)
        lines.append(
            f"| {r['side']} | {r['served']} / {r['requests']} | {r['peak_running_slots']} "
            f"| {r['mean_running_slots']:.0f} | {freed} | {r['output_tokens_per_s']} "
            f"| {r['mean_latency_s']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--evict", default="snapkv")
    parser.add_argument("--kv-budget", type=float, default=0.25)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/decode-memory"))
    args = parser.parse_args(argv)
    prepare_cpu_process()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    examples = make_split(
        "test",
        args.num_requests,
        style=model_style(args.model_path),
        image_side=model_image_side(args.model_path),
    )
    prompts = [chat_messages(e, image_part) for e in examples]
    decode = ["--mm-evict", args.evict, "--mm-kv-budget", str(args.kv_budget)]
    sides = [
        ("conduit", ["--mm-reuse", "conduit"]),
        (
            f"conduit + {args.evict} decode @ {args.kv_budget}",
            ["--mm-reuse", "conduit", *decode, "--mm-compress-at", "decode"],
        ),
    ]
    rows = [run_side(name, flags, args, prompts) for name, flags in sides]
    table = format_table(rows)
    print(table)
    result = {
        "command": "python benchmarks/decode_memory.py " + " ".join(argv or sys.argv[1:]),
        "model_path": str(args.model_path),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    (args.out_dir / "decode_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / "decode_memory.md").write_text(table + "\n")
    failed = [r["side"] for r in rows if r["served"] != r["requests"]]
    if failed:
        print(f"[decode_memory] requests not fully served on: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

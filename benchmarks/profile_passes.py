"""What the forward passes of a reusing request spend their time on, sampled by py-spy.

    python benchmarks/profile_passes.py --images 8 --num-requests 3 \\
        --out-dir benchmarks/results/profile-passes

One server up at a time (stock, then ``--mode``), each reads the page pool once and
answers one doc-QA request unmeasured; then py-spy (``pip install py-spy``) samples
the scheduler process (``--rate`` per second, ``--nonblocking``) while
``--num-requests`` more doc-QA requests are sent one at a time. Each sampled stack is
put in a **pass** (stock's forward; sgl_mmkv's scoring pass, its refresh pass, the
rest of the extend) and an **operation** (the linear layers, attention, the scoring
reduction, norms and rotary, other), by the names of its frames. Prints per pass the
milliseconds per request by operation and writes ``profile_passes.json`` / ``.md``
with the requests' token counts (their meta info). py-spy slows the process it
samples by a few per cent; the shares, not the absolute times, are the result.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

import psutil
from profile_reuse import one_token_meta

from harness import workloads as wl
from harness.client import run_requests
from harness.scheduler_profile import Sampler, samples
from harness.servers import STOCK, build_side, command_lines, prepare_bench

# Frame name (a substring of py-spy's "function (file:line)") -> operation; the
# first match from the leaf upwards wins.
OPERATIONS: tuple[tuple[str, str], ...] = (
    ("LayerStatistics.reduce", "scoring reduction"),
    ("refresh_attention", "attention"),
    ("scattered_attention", "attention"),
    ("TorchNativeAttnBackend", "attention"),
    ("scaled_dot_product_attention", "attention"),
    ("ParallelLinear.forward", "linear"),
    ("ReplicatedLinear.forward", "linear"),
    ("SiluAndMul", "linear"),
    ("RMSNorm", "norm, rotary"),
    ("RotaryEmbedding", "norm, rotary"),
    ("gather_rotate", "segment copy"),
)
# Pass of a stack: the first entry whose frames are all in it.
PASSES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("TokenSelector.select",), "scoring pass"),
    (("RefreshExecutor._reuse", "run_pass"), "refresh pass"),
    (("RefreshExecutor.execute_extend",), "rest of the extend"),
    (("ModelRunner.forward",), "forward"),
)


def classify(stack: str, table: tuple[tuple[str, str], ...], default: str) -> str:
    """The label of the deepest frame of ``stack`` (``;``-joined, root first) that
    names an entry of ``table``."""
    for frame in reversed(stack.split(";")):
        for needle, label in table:
            if needle in frame:
                return label
    return default


def pass_of(stack: str) -> str | None:
    """The pass ``stack`` was sampled in, or None (the scheduler's own loop)."""
    for needles, label in PASSES:
        if all(needle in stack for needle in needles):
            return label
    return None


def breakdown(raw: Path, rate: int, num_requests: int) -> dict[str, dict[str, float]]:
    """``pass -> operation -> ms per request`` from py-spy's raw (collapsed) output."""
    ms: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.Counter())
    for stack, count in samples(raw):
        passed = pass_of(stack)
        if passed is None:
            continue  # the scheduler's own loop, idle polling
        operation = classify(stack, OPERATIONS, "other")
        ms[passed][operation] += 1e3 * count / rate / num_requests
    return {p: dict(sorted(ops.items())) for p, ops in ms.items()}


def reuse_tokens(meta: dict) -> dict[str, int]:
    """A request's token counts from its meta info: prompt and cached tokens, and the
    ``*_tokens`` reuse facts of its ``sgl_mmkv`` entries, summed (``--mm-report-reuse``
    gives one entry, already summed over a chunked prefill's chunks by the reporter)."""
    counts = {"prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"]}
    for entry in meta.get("sgl_mmkv") or []:
        for key, value in entry.items():
            if key.endswith("_tokens"):
                counts[key] = counts.get(key, 0) + value
    return counts


def _tokens(base_url: str, request: wl.BenchRequest) -> dict:
    """Send ``request`` (one output token); its token counts from the meta info."""
    meta, _ = one_token_meta(base_url, request)
    return reuse_tokens(meta)


def profile_side(name: str, args, model: Path, shared: list[str]) -> dict:
    side = build_side(name, model, shared, args.out_dir, args.mm_refresh_budget)
    with side.process:
        run_requests(side.base_url, wl.pool_warmup(args.pool_size, args.image_size), 1, 1)
        batch = wl.doc_qa(args.num_requests + 1, args.images, args.pool_size, args.image_size, 7)
        one_token_meta(side.base_url, batch[0])
        with Sampler(side.process.pid, args.rate, args.out_dir / f"py-spy-{name}") as sampler:
            tokens = [_tokens(side.base_url, request) for request in batch[1:]]
        seconds = sampler.result()["wall_s"] / args.num_requests
    passes = breakdown(sampler.raw["scheduler"], args.rate, args.num_requests)
    print(f"{name}: {1e3 * seconds:,.0f} ms per request; {json.dumps(passes)}", flush=True)
    return {"ms_per_request": 1e3 * seconds, "passes": passes, "tokens": tokens}


def format_table(results: dict[str, dict]) -> str:
    operations = sorted({op for r in results.values() for p in r["passes"].values() for op in p})
    lines = [
        "| side, pass (ms per request) | " + " | ".join(operations) + " | total |",
        "|---|" + "---|" * (len(operations) + 1),
    ]
    for name, result in results.items():
        for passed, ops in result["passes"].items():
            cells = [f"{ops.get(op, 0.0):,.0f}" for op in operations]
            total = sum(ops.values())
            lines.append(f"| {name}, {passed} | " + " | ".join(cells) + f" | {total:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--mode", default="conduit")
    parser.add_argument("--mm-refresh-budget", type=float, default=0.1)
    parser.add_argument("--images", type=int, default=8, help="pages per request")
    parser.add_argument("--num-requests", type=int, default=3)
    parser.add_argument("--pool-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--server-args", default=None)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/profile-passes"))
    args = parser.parse_args(argv)
    if shutil.which("py-spy") is None:
        parser.error("py-spy is not installed (pip install py-spy)")
    model, shared, cuda = prepare_bench(args.model_path, args.server_args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: profile_side(name, args, model, shared) for name in (STOCK, args.mode)}
    table = format_table(results)
    meta = {
        "command": "python benchmarks/profile_passes.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "command_lines": command_lines(model, [args.mode], shared, args.mm_refresh_budget),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, "
        + ("CUDA" if cuda else "no GPU"),
    }
    (args.out_dir / "profile_passes.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )
    (args.out_dir / "profile_passes.md").write_text(table + "\n")
    print(table)
    for name, command in meta["command_lines"].items():
        print(f"{name}: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

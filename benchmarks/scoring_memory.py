"""Peak extra memory of a CONDUIT scoring pass: per-layer statistics against row copies.

    python benchmarks/scoring_memory.py --out benchmarks/results/scoring-memory/scoring_memory.json

One request reusing two images in a long row runs the refresh selector's real
scoring pass (``TokenSelector.select``: ``run_pass``, the refresh attention backend,
the scorer) over a synthetic KV pool; a stand-in model plays the layers (random
q / k / v for the fresh tokens, the same in every run). It runs twice from the same
pool: **streamed** (today: each layer reduced to CONDUIT's ``(N_v,)`` statistic in
the pass) and **copies** (the path a scorer without a per-layer reduction takes:
every layer's queries kept and every layer's K and V of the row copied after the
pass); a third run, **pass only**, is the same pass with nothing captured (what
any scoring adds to). Reported per shape: the peak of the memory allocated on top
of the pool while ``select`` (or the bare pass) runs (CUDA: ``max_memory_allocated``;
CPU: the torch profiler's allocation events), the size of one copy of the row, the
wall time, and whether both scorings selected the same tokens. Prints a table,
writes JSON.

    python benchmarks/scoring_memory.py --sweep-tokens 256,1024,4096,16384 \\
        --out benchmarks/results/reuse-memory/reuse_memory.json

``--sweep-tokens``: the peak extra memory of one reusing request against the image
tokens it reuses (two images sharing them), at ``--sweep-shape``, phase by phase as
the executor runs them: the **copy** (gather-and-rotate of the reused spans into
the request's own slots, every layer), the **scoring** pass with CONDUIT's
selection (streamed), the **refresh** pass (the text and the selected tokens).
The phases run one after another, so a request's extra peak is the largest of
them; a line ``bytes per image token * N + constant`` is fitted above every point.
The request's own KV slots are not extra (stock fills the same ones); the stand-in
model's q / k / v stand for a layer's inputs, and a real model's MLP activations
of the refresh pass are those of a prefill of its active tokens, fewer than stock's
prefill of the same request computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root

from sglang.srt.model_executor.forward_context import get_forward_context  # noqa: E402

from sgl_mmkv.kernels.gather_rotate import rope_inv_freq  # noqa: E402
from sgl_mmkv.refresh.context import ExtendContext  # noqa: E402
from sgl_mmkv.refresh.cost import scoring_rows  # noqa: E402
from sgl_mmkv.refresh.embedding_pass import EmbeddingPass, EmbeddingSlot  # noqa: E402
from sgl_mmkv.refresh.flops import DecoderShape  # noqa: E402
from sgl_mmkv.refresh.kv_copy import SegmentCopier  # noqa: E402
from sgl_mmkv.refresh.passes import run_pass  # noqa: E402
from sgl_mmkv.refresh.plan import RequestPlan, ReuseSpan  # noqa: E402
from sgl_mmkv.refresh.row_view import RowView  # noqa: E402
from sgl_mmkv.refresh.selection import TokenSelector  # noqa: E402
from sgl_mmkv.scoring import make_refresh_scorer  # noqa: E402
from sgl_mmkv.segments.store import Segment  # noqa: E402
from sgl_mmkv.testing.stand_ins import StandInPool, extend_batch, model_runner  # noqa: E402

MIB = 1 << 20


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    row: int = 8192
    text: int = 32  # text tokens before, between and after the two images


SHAPES = {
    "qwen2-vl-7b-4-layers": Shape("qwen2-vl-7b-4-layers", 4, 28, 4, 128),
    "qwen2-vl-7b-28-layers": Shape("qwen2-vl-7b-28-layers", 28, 28, 4, 128),
    "28-layers-small-heads": Shape("28-layers-small-heads", 28, 8, 2, 32),
}


def stand_in_pool(shape: Shape, dtype: torch.dtype, device: str) -> StandInPool:
    """``token_to_kv_pool``: per layer ``(row, H_kv, d)`` K and V."""
    g = torch.Generator(device=device).manual_seed(0)
    return StandInPool(shape.layers, shape.row, shape.kv_heads, shape.head_dim, g, dtype, device)


class StandInModel:
    """The layers of a pass: random q / k / v for its tokens, seeded by layer."""

    def __init__(self, shape: Shape, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.layers = [
            SimpleNamespace(
                layer_id=i,
                tp_q_head_num=shape.heads,
                tp_k_head_num=shape.kv_heads,
                qk_head_dim=shape.head_dim,
                v_head_dim=shape.head_dim,
                scaling=shape.head_dim**-0.5,
            )
            for i in range(shape.layers)
        ]

    def run_extend(self, sub):
        backend = get_forward_context().attn_backend
        n, s = sub.out_cache_loc.numel(), self.shape
        device = sub.out_cache_loc.device
        for layer in self.layers:
            g = torch.Generator(device=device).manual_seed(1000 + layer.layer_id)
            q, k, v = (
                torch.randn(n, heads * s.head_dim, generator=g, device=device, dtype=self.dtype)
                for heads in (s.heads, s.kv_heads, s.kv_heads)
            )
            backend.forward_extend(q, k, v, layer, sub)
        return None


def _plan(shape: Shape) -> RequestPlan:
    """Text, an image, text, an image, a text tail: the images fill the row."""
    t = shape.text
    image = (shape.row - 3 * t) // 2
    first, second = (t, t + image), (2 * t + image, 2 * t + 2 * image)
    segment = Segment(("s", image), torch.arange(image), torch.arange(image)[None])
    spans = (ReuseSpan(*first, segment, 0), ReuseSpan(*second, segment, 0))
    seq_len = second[1] + t
    visual = torch.zeros(seq_len, dtype=torch.bool)
    visual[first[0] : first[1]] = visual[second[0] : second[1]] = True
    return RequestPlan(0, 0, seq_len, spans, (), visual, (first, second))


def _context(shape: Shape, pool: StandInPool, dtype: torch.dtype, device: str) -> ExtendContext:
    plan = _plan(shape)
    n = plan.seq_len
    table = torch.arange(n, dtype=torch.int32, device=device)[None]
    batch = extend_batch([n], [n], [0], torch.arange(n, device=device))
    runner = model_runner(pool, table)
    s = shape
    return ExtendContext(
        run_extend=StandInModel(shape, dtype).run_extend,
        model_runner=runner,
        forward_batch=batch,
        plans=(plan,),
        views=(RowView.of(plan),),
        shape=DecoderShape(s.layers, s.heads * s.head_dim, 1, s.heads, s.kv_heads, s.head_dim, 1),
        embeddings=EmbeddingPass(full_batch=batch),
        embedding_slot=EmbeddingSlot(),
    )


def _peak_cpu(fn):
    """``(result, peak bytes allocated while fn ran)`` from the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak


def _peak_cuda(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


PATHS = ("pass only", "copies", "streamed")


def measure(shape: Shape, path: str, dtype: torch.dtype, device: str, budget: float) -> dict:
    pool = stand_in_pool(shape, dtype, device)
    ctx = _context(shape, pool, dtype, device)
    scorer = make_refresh_scorer("conduit")
    if path == "copies":
        scorer.layer_reduction = lambda: None  # every layer's queries and row copied
    selector = TokenSelector(scorer, budget, None, SimpleNamespace(executed_flops=0))
    if path == "pass only":
        active = [scoring_rows(p.fresh_mask()) for p in ctx.plans]
        run = lambda: run_pass(ctx, active) and None  # noqa: E731
    else:
        run = lambda: selector.select(ctx).tokens[0]  # noqa: E731
    peak_of = _peak_cuda if device == "cuda" else _peak_cpu
    started = time.perf_counter()
    selected, peak = peak_of(run)
    seconds = time.perf_counter() - started
    row_copy = 2 * shape.layers * ctx.plans[0].seq_len * shape.kv_heads * shape.head_dim
    return {
        "shape": shape.name,
        "path": path,
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "row": ctx.plans[0].seq_len,
        "visual_tokens": int(ctx.plans[0].visual.sum()),
        "text_tokens_each": shape.text,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "peak_extra_mib": round(peak / MIB, 1),
        "row_copy_mib": round(row_copy * pool.k[0].element_size() / MIB, 1),
        "seconds": round(seconds, 2),
        "selected": None if selected is None else selected.cpu().tolist(),
    }


PHASES = ("copy", "scoring", "refresh")


def measure_request(shape: Shape, dtype: torch.dtype, device: str, budget: float) -> dict:
    """Peak extra bytes of each phase of one reusing request (:data:`PHASES`)."""
    pool = stand_in_pool(shape, dtype, device)
    ctx = _context(shape, pool, dtype, device)
    plan = ctx.plans[0]
    copier = SegmentCopier()
    copier._rates = rope_inv_freq(shape.head_dim, 1_000_000.0)  # no model to read them from
    counters = SimpleNamespace(executed_flops=0)
    selector = TokenSelector(make_refresh_scorer("conduit"), budget, copier, counters)
    peak_of = _peak_cuda if device == "cuda" else _peak_cpu
    peaks = {}
    started = time.perf_counter()
    _, peaks["copy"] = peak_of(lambda: copier.copy(ctx.model_runner, ctx.forward_batch, [plan]))
    selected, peaks["scoring"] = peak_of(lambda: selector.select(ctx).tokens[0])
    active = plan.fresh_mask()
    active[selected.cpu() - plan.prefix_len] = True
    _, peaks["refresh"] = peak_of(lambda: run_pass(ctx, [active]) and None)
    n_v = int(plan.visual.sum())
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * pool.k[0].element_size()
    return {
        "shape": shape.name,
        "image_tokens": n_v,
        "row": plan.seq_len,
        "refreshed": int(selected.numel()),
        **{f"{p}_mib": round(peaks[p] / MIB, 2) for p in PHASES},
        "peak_extra_mib": round(max(peaks.values()) / MIB, 2),
        "request_kv_mib": round(plan.seq_len * kv_per_token / MIB, 1),
        "seconds": round(time.perf_counter() - started, 2),
    }


def fit_bound(rows: list[dict]) -> dict:
    """``peak <= bytes_per_token * N + constant`` over every row: the least-squares
    slope, the constant raised until no point lies above the line."""
    xs = [r["image_tokens"] for r in rows]
    ys = [r["peak_extra_mib"] * MIB for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    constant = max(y - slope * x for x, y in zip(xs, ys, strict=True))
    return {"bytes_per_image_token": round(slope), "constant_mib": round(constant / MIB, 2)}


def sweep(args: argparse.Namespace, dtype: torch.dtype) -> int:
    base = SHAPES[args.sweep_shape]
    rows = []
    for n in args.sweep_tokens:
        shape = dataclasses.replace(base, row=n + 3 * base.text)
        rows.append(measure_request(shape, dtype, args.device, args.budget))
        print(rows[-1], flush=True)
    bound = fit_bound(rows)
    columns = ("image_tokens", "row", "refreshed", "copy_mib", "scoring_mib", "refresh_mib")
    columns += ("peak_extra_mib", "request_kv_mib", "seconds")
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    line = (
        f"peak extra <= {bound['bytes_per_image_token']} B per image token "
        f"+ {bound['constant_mib']} MiB"
    )
    print("\n".join(table) + "\n" + line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        machine = f"{args.device}, {args.dtype}, budget {args.budget}, {args.sweep_shape}"
        result = {"machine": machine, "load_average": os.getloadavg(), "bound": bound}
        args.out.write_text(json.dumps(result | {"rows": rows}, indent=2) + "\n")
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        text = f"{machine}; load average {load}\n\n" + "\n".join(table) + f"\n\n{line}\n"
        args.out.with_suffix(".md").write_text(text)
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")
    parser.add_argument("--sweep-tokens", type=_ints, default=(), help="reused image tokens")
    parser.add_argument("--sweep-shape", choices=sorted(SHAPES), default="qwen2-vl-7b-28-layers")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.sweep_tokens:
        return sweep(args, dtype)
    rows = []
    for name in args.shapes:
        runs = [measure(SHAPES[name], path, dtype, args.device, args.budget) for path in PATHS]
        same = runs[1]["selected"] == runs[2]["selected"]
        for row in runs:
            row["same_selection"] = same if row["selected"] is not None else ""
            rows.append(row)
    columns = ("shape", "path", "layers", "row", "visual_tokens", "peak_extra_mib")
    columns += ("row_copy_mib", "seconds", "same_selection")
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    print("\n".join(table))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        summary = [{k: v for k, v in r.items() if k != "selected"} for r in rows]
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        machine = f"{args.device}, {args.dtype}, budget {args.budget}"
        args.out.with_suffix(".md").write_text(f"{machine}\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

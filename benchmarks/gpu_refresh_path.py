"""The refresh path end to end on a GPU, without SGLang: each stage on the device
against the same stage on the CPU in float32.

    python benchmarks/gpu_refresh_path.py --out-dir gpu-check
    python benchmarks/gpu_refresh_path.py --dry-run --out-dir /tmp/gpu-dry   # the CPU

Two requests over a pool of shuffled slots, as SGLang lays them out (the project's
stand-ins: ``sgl_mmkv/testing/stand_ins.py``): request 0 reuses two whole images,
request 1 a compressed image whose dropped tokens are holes and a whole one. The
stages a reusing forward runs, each on the device's tensors:

1. plan: each plan's masks and its ``RowView`` (the row without holes: its compacted
   positions, moved to the device once);
2. copy: ``SegmentCopier`` gathers each reused span's stored KV into the request's
   slots and rotates K by the span's position delta (``gather_rotate_kv``: Triton on
   CUDA);
3. selection: CONDUIT and staleprobe select the tokens to refresh from the row's K/V
   and the text queries (the scorers' device path: no host sync);
4. refresh attention: the selected tokens and the text as queries over each row
   without holes (``refresh_attention``: the Triton kernel on CUDA, and the SDPA path).

A stage passes when its device result equals the CPU's (indices exactly, tensors
within a tolerance per dtype). The fp8 run keeps the pool as SGLang's fp8 pool does
(``value / scale`` in ``float8_e4m3fn``, per-tensor K and V scales 0.37 and 2.5):
the copy rotates the fp8 bytes (compared dequantized, within one fp8 rounding of
the CPU's), the scorers read the row dequantized, the refresh attention descales;
its reference is the CPU's run over the same fp8 pool (the selection is reported,
not required equal: a copy one fp8 rounding apart can move a near tie). Writes
``gpu_refresh_path.json``; exit 1 if a stage fails. The row compaction after a
forward (``RowCompactor``) edits SGLang's own request objects and is not reproduced
here; its index logic is the ``RowView`` of stage 1. Needs no sglang.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv or os.environ.get("GPU_CHECK_DRY") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sgl_mmkv.kernels.gather_rotate import rope_inv_freq  # noqa: E402
from sgl_mmkv.kernels.kv_dtype import dequantize, is_fp8  # noqa: E402
from sgl_mmkv.kernels.refresh_attention import (  # noqa: E402
    plan_refresh_attention,
    refresh_attention,
)
from sgl_mmkv.refresh.kv_copy import SegmentCopier  # noqa: E402
from sgl_mmkv.refresh.plan import RequestPlan, ReuseSpan  # noqa: E402
from sgl_mmkv.refresh.row_view import RowView  # noqa: E402
from sgl_mmkv.scoring import make_refresh_scorer  # noqa: E402
from sgl_mmkv.scoring.base import ScoringInputs  # noqa: E402
from sgl_mmkv.segments.store import Segment  # noqa: E402
from sgl_mmkv.testing.stand_ins import StandInPool, extend_batch, model_runner  # noqa: E402

# fp8: float32 queries over KV whose device copy may sit one fp8 rounding from the
# CPU's at a few tokens (a scale left out would be off by about 1)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float8_e4m3fn: 2e-2}
LAYERS, H_Q, H_KV, D, SLOTS = 4, 8, 2, 64, 4096
FP8_SCALES = (0.37, 2.5)  # per-tensor K and V scales of the fp8 run


def _segment(n: int, slots: torch.Tensor, kept: list[int] | None = None) -> Segment:
    kept_t = None if kept is None else torch.tensor(kept)
    return Segment(("s", n), slots, torch.arange(n)[None], kept=kept_t)


def build(image: int) -> tuple[list[RequestPlan], list[int], torch.Tensor]:
    """The two requests' plans (images of ``image`` tokens), their pool rows and the
    stored segments' slots laid out in a shuffled pool (host tensors)."""
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(SLOTS, generator=g)
    stored = iter(order[: 4 * image].split(image))
    kept = [i for i in range(image) if i % 3]  # a compressed image: every third dropped
    spans0 = (
        ReuseSpan(8, 8 + image, _segment(image, next(stored)), 5),
        ReuseSpan(12 + image, 12 + 2 * image, _segment(image, next(stored)), -3),
    )
    seg_c = _segment(image, next(stored)[: len(kept)], kept)
    spans1 = (
        ReuseSpan(6, 6 + image, seg_c, 7),
        ReuseSpan(10 + image, 10 + 2 * image, _segment(image, next(stored)), 2),
    )
    plans = []
    for index, (prefix, spans, tail) in enumerate(((4, spans0, 24), (2, spans1, 30))):
        seq_len = spans[-1].end + tail
        visual = torch.zeros(seq_len - prefix, dtype=torch.bool)
        for s in spans:
            visual[s.start - prefix : s.end - prefix] = True
        images = tuple((s.start, s.end) for s in spans)
        plan = RequestPlan(index, prefix, seq_len, spans, (), visual, images)
        plans.append(plan if index == 0 else _with_holes(plan))
    return plans, [3, 1], order[4 * image :]


def _with_holes(plan: RequestPlan) -> RequestPlan:
    from dataclasses import replace

    return replace(plan, holes=True)


class Side:
    """One run of the stages on ``device`` in ``dtype``: every result kept on the host."""

    def __init__(
        self, device: str, dtype: torch.dtype, image: int, kv_dtype: torch.dtype | None = None
    ) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.kv_dtype = kv_dtype or dtype
        self.scales = FP8_SCALES if is_fp8(self.kv_dtype) else (1.0, 1.0)
        g = torch.Generator().manual_seed(1)
        self.pool = StandInPool(LAYERS, SLOTS, H_KV, D, g, dtype=torch.float32)
        for buffers, scale in ((self.pool.k, self.scales[0]), (self.pool.v, self.scales[1])):
            for i, t in enumerate(buffers):
                buffers[i] = (t / scale).to(self.device, self.kv_dtype)
        self.plans, rows, free = build(image)
        max_len = max(p.seq_len for p in self.plans)
        table = torch.zeros(4, max_len, dtype=torch.int32)
        start = 0
        for row, plan in zip(rows, self.plans, strict=True):
            table[row, : plan.seq_len] = free[start : start + plan.seq_len].to(torch.int32)
            start += plan.seq_len
        self.table = table.to(self.device)
        extend = [p.seq_len - p.prefix_len for p in self.plans]
        out = torch.cat(
            [
                table[row, p.prefix_len : p.seq_len].long()
                for row, p in zip(rows, self.plans, strict=True)
            ]
        )
        self.batch = extend_batch(
            [p.seq_len for p in self.plans], extend, rows, out.to(self.device)
        )
        self.runner = model_runner(self.pool, self.table)
        self.results: dict[str, object] = {}

    def run(self) -> dict[str, object]:
        views = [RowView.of(p) for p in self.plans]
        self.results["plan"] = [
            None if v is None else v.compact(torch.arange(p.seq_len)[~_holes(p)]).tolist()
            for v, p in zip(views, self.plans, strict=True)
        ]
        copier = SegmentCopier()
        copier._rates = rope_inv_freq(D, 1e6)
        copier.copy(self.runner, self.batch, self.plans)
        rows = [self._row(p, v) for p, v in zip(self.plans, views, strict=True)]
        self.results["copy"] = [[k.float().cpu() for k in keys] for keys, _ in rows]
        selected = {}
        for name in ("conduit", "staleprobe"):
            scorer = make_refresh_scorer(name)
            picks = []
            for plan, view, (keys, values) in zip(self.plans, views, rows, strict=True):
                picks.append(scorer.select(self._inputs(plan, view, keys, values), 0.2).cpu())
            selected[name] = [p.tolist() for p in picks]
        self.results["selection"] = selected
        self.results["attention"] = self._attention(selected["conduit"], rows, views)
        return self.results

    def _row(self, plan: RequestPlan, view):
        row = self.table[self.batch.req_pool_indices[plan.index], : plan.seq_len].long()
        if view is not None:
            row = row[view.kept.to(row.device)]
        keys = tuple(dequantize(self.pool.k[i][row], self.scales[0]) for i in range(LAYERS))
        values = tuple(dequantize(self.pool.v[i][row], self.scales[1]) for i in range(LAYERS))
        return keys, values

    def _inputs(self, plan: RequestPlan, view, keys, values) -> ScoringInputs:
        n = keys[0].shape[0]
        spans = [(s.start, s.end) for s in plan.spans]
        if view is not None:
            spans = [view.span(s, e) for s, e in spans]
        visual = torch.zeros(n, dtype=torch.bool)
        for s, e in spans:
            visual[s:e] = True
        query_positions = (~visual).nonzero().flatten()
        g = torch.Generator().manual_seed(plan.index)
        queries = tuple(
            torch.randn(len(query_positions), H_Q, D, generator=g).to(self.device, self.dtype)
            for _ in range(LAYERS)
        )
        return ScoringInputs(queries, keys, values, query_positions, tuple(spans))

    def _attention(self, selected, rows, views) -> dict[str, torch.Tensor]:
        positions, lens, slots = [], [], []
        for plan, view, picks in zip(self.plans, views, selected, strict=True):
            row = self.table[self.batch.req_pool_indices[plan.index], : plan.seq_len].long()
            if view is not None:
                row = row[view.kept.to(row.device)]
            n = row.numel()
            text = torch.ones(n, dtype=torch.bool)
            for s in plan.spans:
                s0, e0 = (s.start, s.end) if view is None else view.span(s.start, s.end)
                text[s0:e0] = False
            queries = torch.cat([torch.tensor(picks, dtype=torch.long), text.nonzero().flatten()])
            positions.append(queries.sort().values)
            lens.append(n)
            slots.append(row)
        kv = torch.cat(slots)
        g = torch.Generator().manual_seed(9)
        q = torch.randn(sum(int(p.numel()) for p in positions), H_Q, D, generator=g)
        q = q.to(self.device, self.dtype)
        out = {}
        kernels = ("triton", "sdpa") if self.device.type == "cuda" else ("sdpa",)
        if os.environ.get("TRITON_INTERPRET") == "1":
            kernels = ("triton", "sdpa")
        for kernel in kernels:
            plan = plan_refresh_attention(positions, kv, lens, kernel=kernel)
            layer = LAYERS - 1
            k, v = self.pool.k[layer], self.pool.v[layer]
            got = refresh_attention(q, k, v, plan, None, *self.scales)
            out[kernel] = got.float().cpu()
        return out


def _holes(plan: RequestPlan) -> torch.Tensor:
    mask = torch.zeros(plan.seq_len, dtype=torch.bool)
    mask[plan.prefix_len :] = plan.hole_mask()
    return mask


def compare(device: dict, host: dict, dtype: torch.dtype, fp8: bool = False) -> dict[str, dict]:
    """Per stage: whether the device result equals the host's, and its error. ``fp8``:
    the copies may differ by one e4m3 rounding (relative 2^-3 at most, one step)."""
    tol = TOL[dtype]
    report = {"plan": {"ok": device["plan"] == host["plan"]}}
    errors = [
        float((a - b).abs().max() if not fp8 else ((a - b).abs() / b.abs().clamp_min(1e-2)).max())
        for dev, ref in zip(device["copy"], host["copy"], strict=True)
        for a, b in zip(dev, ref, strict=True)
    ]
    report["copy"] = {"ok": max(errors) <= (0.125 if fp8 else tol), "max_error": max(errors)}
    same = device["selection"] == host["selection"]
    report["selection"] = {
        "ok": same,
        "selected": sum(len(p) for p in host["selection"]["conduit"]),
    }
    reference = host["attention"]["sdpa"]
    for kernel, got in device["attention"].items():
        error = float((got - reference).abs().max())
        report[f"attention_{kernel}"] = {"ok": error <= tol, "max_error": error}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("gpu-check"))
    parser.add_argument("--dry-run", action="store_true", help="the CPU, tiny images")
    parser.add_argument("--image-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    dry = args.dry_run or os.environ.get("GPU_CHECK_DRY") == "1"
    device = "cpu" if dry or not torch.cuda.is_available() else "cuda"
    image = 24 if dry else args.image_tokens
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # The reference: the CPU in float32, the selection taken from the same inputs.
    host = Side("cpu", torch.float32, image).run()
    reports = {}
    for dtype in dtypes:
        # bf16 selections may pick other near-tied tokens: compared in float32 only
        side = Side(device, dtype, image).run()
        report = compare(side, host, dtype)
        if dtype != torch.float32:
            report["selection"] = {"ok": True, "not compared": "near ties differ in bf16"}
        reports[str(dtype)] = report
        for stage, result in report.items():
            print(f"refresh path {device} {dtype} {stage}: {result}", flush=True)
    # fp8 KV with per-tensor scales: float32 queries, against the CPU over the same pool
    fp8 = torch.float8_e4m3fn
    host_fp8 = Side("cpu", torch.float32, image, kv_dtype=fp8).run()
    report = compare(Side(device, torch.float32, image, kv_dtype=fp8).run(), host_fp8, fp8, True)
    if device != "cpu":
        same = report["selection"]["ok"]
        report["selection"] = {"ok": True, "equal": same, "required": False}
    reports[str(fp8)] = report
    for stage, result in report.items():
        print(f"refresh path {device} {fp8} {stage}: {result}", flush=True)
    (args.out_dir / "gpu_refresh_path.json").write_text(
        json.dumps({"device": device, "image_tokens": image, "stages": reports}, indent=1)
    )
    failed = [(d, s) for d, r in reports.items() for s, x in r.items() if not x["ok"]]
    if failed:
        print(f"refresh path FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

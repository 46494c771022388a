"""sgl_mmkv's Triton kernels on a GPU: error against the torch references, and timings.

    python benchmarks/gpu_kernels.py --out-dir benchmarks/results/gpu-kernels

One decoder layer of a Qwen2-VL-7B-sized model (28 query heads, 4 KV heads, head
dim 128) over request rows of ``--rows`` tokens, in bf16 and fp16:

- ``scattered_attention``: the refresh pass's attention, ``--query-fraction`` of the
  row's positions as queries (text + refreshed image tokens), against the masked
  SDPA path (``scattered_attention_sdpa``, gathering the row) and against the whole
  row's causal SDPA (what a full prefill's attention costs at that layer);
- ``attention_mass``: the CONDUIT / ProphetKV scoring reduction, against its torch
  reference (chunked over queries, what the server runs);
- ``gather_rotate_kv``: copying and re-positioning one image span of the row
  (K rotated), against the torch reference.

Errors are max |kernel - float32 reference|; times are medians of
``triton.testing.do_bench``. Needs CUDA. Writes ``gpu_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from sgl_mmkv.kernels.gather_rotate import gather_rotate_kv_reference, rope_inv_freq
from sgl_mmkv.kernels.gather_rotate_triton import gather_rotate_kv_triton
from sgl_mmkv.kernels.reference import attention_mass_reference, scattered_attention_reference
from sgl_mmkv.kernels.scattered_attention import scattered_attention_sdpa
from sgl_mmkv.kernels.scattered_attention_triton import (
    attention_mass_triton,
    scattered_attention_triton,
)

H_Q, H_KV, HEAD_DIM = 28, 4, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _row(n: int, dtype, n_q: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = 2 * n
    k = torch.randn(slots, H_KV, HEAD_DIM, device="cuda", generator=g).to(dtype)
    v = torch.randn(slots, H_KV, HEAD_DIM, device="cuda", generator=g).to(dtype)
    row_slots = torch.randperm(slots, device="cuda", generator=g)[:n]
    positions = torch.randperm(n, device="cuda", generator=g)[:n_q].sort().values
    positions[-1] = n - 1  # the last prompt token always runs
    q = torch.randn(n_q, H_Q, HEAD_DIM, device="cuda", generator=g).to(dtype)
    return q, k, v, row_slots, positions


def _full_causal(q_all, k, v, row_slots):
    """The whole row's causal attention (a full prefill's, at this layer): flash SDPA."""
    kk = k[row_slots].transpose(0, 1)[None]
    vv = v[row_slots].transpose(0, 1)[None]
    return torch.nn.functional.scaled_dot_product_attention(
        q_all.transpose(0, 1)[None], kk, vv, is_causal=True, enable_gqa=True
    )


def attention_rows(n: int, dtype_name: str, fraction: float) -> dict:
    dtype = DTYPES[dtype_name]
    n_q = max(2, int(fraction * n))
    q, k, v, row_slots, pos = _row(n, dtype, n_q, seed=n)
    want = scattered_attention_reference(q.float(), k.float(), v.float(), row_slots, pos)
    got = scattered_attention_triton(q, k, v, row_slots, pos)
    sdpa = scattered_attention_sdpa(q, k, v, row_slots, pos)
    mass_want = attention_mass_reference(q.float(), k[row_slots].float(), pos)
    mass_got = attention_mass_triton(q, k, row_slots, pos)
    q_all = torch.randn(n, H_Q, HEAD_DIM, device="cuda", dtype=dtype)
    errors = {
        "max_abs_err": float((got.float() - want).abs().max()),
        "sdpa_path_max_abs_err": float((sdpa.float() - want).abs().max()),
        "attention_mass_max_abs_err": float((mass_got - mass_want).abs().max()),
    }
    del want, got, sdpa, mass_want, mass_got
    torch.cuda.empty_cache()
    return {
        "kernel": "scattered_attention",
        "dtype": dtype_name,
        "row_tokens": n,
        "queries": n_q,
        **errors,
        "triton_ms": _bench(lambda: scattered_attention_triton(q, k, v, row_slots, pos)),
        "sdpa_masked_ms": _bench(lambda: scattered_attention_sdpa(q, k, v, row_slots, pos)),
        "full_row_causal_sdpa_ms": _bench(lambda: _full_causal(q_all, k, v, row_slots)),
        "attention_mass_triton_ms": _bench(lambda: attention_mass_triton(q, k, row_slots, pos)),
        "attention_mass_torch_ms": _bench(lambda: attention_mass_reference(q, k[row_slots], pos)),
    }


def gather_rows(n: int, dtype_name: str) -> dict:
    dtype = DTYPES[dtype_name]
    g = torch.Generator(device="cuda").manual_seed(n)
    k = torch.randn(3 * n, H_KV, HEAD_DIM, device="cuda", generator=g).to(dtype)
    v = torch.randn(3 * n, H_KV, HEAD_DIM, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(3 * n, device="cuda", generator=g)
    src, dst = perm[:n], perm[n : 2 * n]
    delta = torch.randint(-4000, 4000, (n,), device="cuda", generator=g)
    inv_freq = rope_inv_freq(HEAD_DIM, 1e6, "cuda")
    k_ref, v_ref = k.float(), v.float()
    gather_rotate_kv_reference(k_ref, v_ref, src, dst, delta, inv_freq)
    k_got, v_got = k.clone(), v.clone()
    gather_rotate_kv_triton(k_got, v_got, src, dst, delta, inv_freq)
    k_ref_copy, v_ref_copy = k.clone(), v.clone()
    return {
        "kernel": "gather_rotate_kv",
        "dtype": dtype_name,
        "tokens": n,
        "k_max_abs_err": float((k_got[dst].float() - k_ref[dst]).abs().max()),
        "v_exact": bool(torch.equal(v_got[dst], v[src])),
        "triton_ms": _bench(
            lambda: gather_rotate_kv_triton(k_got, v_got, src, dst, delta, inv_freq)
        ),
        "torch_ms": _bench(
            lambda: gather_rotate_kv_reference(k_ref_copy, v_ref_copy, src, dst, delta, inv_freq)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="2048,8192,32768")
    parser.add_argument("--query-fraction", type=float, default=0.15)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/gpu-kernels"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels.py needs CUDA", file=sys.stderr)
        return 2
    rows = [int(x) for x in args.rows.split(",")]
    results = []
    for dtype_name in DTYPES:
        for n in rows:
            for entry in (
                attention_rows(n, dtype_name, args.query_fraction),
                gather_rows(n, dtype_name),
            ):
                results.append(entry)
                print(json.dumps(entry), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python benchmarks/gpu_kernels.py " + " ".join(argv or sys.argv[1:]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"q_heads": H_Q, "kv_heads": H_KV, "head_dim": HEAD_DIM},
        "query_fraction": args.query_fraction,
        "results": results,
    }
    (args.out_dir / "gpu_kernels.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

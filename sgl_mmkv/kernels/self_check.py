"""A start-up proof of the refresh attention kernel on the device it will serve on.

On CUDA the refresh passes run the Triton kernel of ``refresh_attention_triton.py``,
which this project otherwise tests under the Triton interpreter only. Before the
first request, :func:`check_refresh_kernel` runs one small batch through it (two
requests, scattered and whole-row queries, grouped-query heads of the pool's shape)
and compares it with the SDPA reference path on the same device. An fp8 pool's
check runs bf16 queries over fp8 KV with K and V scales other than 1, as its
passes do.
"""

from __future__ import annotations

import torch

from sgl_mmkv.kernels.kv_dtype import is_fp8
from sgl_mmkv.kernels.refresh_attention import plan_refresh_attention, refresh_attention

# max |kernel - reference| allowed, by KV dtype (the kernel accumulates in float32)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def check_refresh_kernel(
    device: torch.device | str,
    dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    group: int = 2,
    q_dtype: torch.dtype | None = None,
) -> str | None:
    """Run the Triton refresh attention and the SDPA reference on one small batch.

    Args:
        device, dtype: the KV pool's (an fp8 ``dtype``: bf16 queries, scaled KV).
        num_kv_heads, head_dim, v_head_dim: one layer's KV shape ``(slots, H_kv, d)``.
        group: query heads per KV head.
        q_dtype: the queries' dtype; default the KV dtype, bf16 for fp8 KV (the
            model dtype the passes run in).
    Returns:
        None when they agree within :data:`TOLERANCE`, else a one-line reason.
        An error of the kernel is raised (the caller decides).
    """
    v_head_dim = v_head_dim or head_dim
    g = torch.Generator().manual_seed(0)
    lens = [70, 33]
    slots = 2 * sum(lens)
    k = torch.randn(slots, num_kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(slots, num_kv_heads, v_head_dim, generator=g).to(device, dtype)
    kv = torch.randperm(slots, generator=g)[: sum(lens)].to(device)
    positions = [torch.tensor([0, 5, 17, 40, 41, 69]), torch.arange(33)]
    n_q = sum(int(p.numel()) for p in positions)
    q_dtype = q_dtype or (torch.bfloat16 if is_fp8(dtype) else dtype)
    q = torch.randn(n_q, num_kv_heads * group, head_dim, generator=g).to(device, q_dtype)
    scales = (0.5, 2.0) if is_fp8(dtype) else (1.0, 1.0)
    outs = {}
    for kernel in ("triton", "sdpa"):
        plan = plan_refresh_attention(positions, kv, lens, kernel=kernel, block_m=16)
        outs[kernel] = refresh_attention(q, k, v, plan, None, *scales).float()
    error = float((outs["triton"] - outs["sdpa"]).abs().max())
    bound = TOLERANCE.get(q_dtype, 3e-2) * scales[1]
    if not error <= bound:  # NaN included
        return f"the Triton refresh kernel differs from the reference by {error:.3g} (> {bound})"
    return None

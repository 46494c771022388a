"""A start-up proof of the refresh attention kernel on the device it will serve on.

On CUDA the refresh passes run the Triton kernel of ``refresh_attention_triton.py``,
which this project otherwise tests under the Triton interpreter only. Before the
first request, :func:`check_refresh_kernel` runs one small batch through it (two
requests, scattered and whole-row queries, grouped-query heads of the pool's shape)
and compares it with the SDPA reference path on the same device.
"""

from __future__ import annotations

import torch

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
) -> str | None:
    """Run the Triton refresh attention and the SDPA reference on one small batch.

    Args:
        device, dtype: the KV pool's.
        num_kv_heads, head_dim, v_head_dim: one layer's KV shape ``(slots, H_kv, d)``.
        group: query heads per KV head.
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
    q = torch.randn(n_q, num_kv_heads * group, head_dim, generator=g).to(device, dtype)
    outs = {}
    for kernel in ("triton", "sdpa"):
        plan = plan_refresh_attention(positions, kv, lens, kernel=kernel, block_m=16)
        outs[kernel] = refresh_attention(q, k, v, plan).float()
    error = float((outs["triton"] - outs["sdpa"]).abs().max())
    bound = TOLERANCE.get(dtype, 3e-2)
    if not error <= bound:  # NaN included
        return f"the Triton refresh kernel differs from the reference by {error:.3g} (> {bound})"
    return None

"""CPU stand-in for ``sgl_kernel``, put on ``sys.path`` by sgl_mmkv only when the
real package is absent and the engine runs on the CPU.

SGLang 0.5.23 imports ``sgl_kernel`` at module load on its CPU path. The ops its
CPU code calls for what sgl_mmkv uses are implemented here in torch, with the
semantics of the original kernels; every other name resolves to a function that
raises ``NotImplementedError`` naming the op. Nothing here returns fake data.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__version__ = "0.0.0+sgl_mmkv.cpu_shim"
IS_SGL_MMKV_CPU_SHIM = True


def _byte_rows(base_ptr: int, row_bytes: int, num_rows: int) -> np.ndarray:
    """A ``(num_rows, row_bytes)`` uint8 view of the memory at ``base_ptr``."""
    buffer = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(base_ptr)
    return np.ctypeslib.as_array(buffer).reshape(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy token rows ``src_loc -> tgt_loc`` in every KV buffer, in place.

    Args:
        data_ptrs: ``(num_buffers,)`` uint64 base addresses of the per-layer K and V
            buffers (``MHATokenToKVPool.data_ptrs``).
        strides: ``(num_buffers,)`` bytes per token row of each buffer.
        tgt_loc, src_loc: ``(num_locs,)`` int64 token slot indices.

    Like the Triton kernel, all source rows are read before any target row is
    written, so overlapping ``src`` / ``tgt`` sets are safe.
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} slots, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64).cpu().numpy()
    src = src_loc.to(torch.int64).cpu().numpy()
    if min(tgt.min(), src.min()) < 0:
        raise ValueError("negative KV slot index")
    num_rows = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _byte_rows(int(ptr), int(stride), num_rows)
        rows[tgt] = rows[src]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = next (end[i]-start[i]) slots``.

    ``out_cache_loc`` holds the slots of all requests back to back, in batch order.
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token width {req_to_token.shape[1]}")
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + length]
        offset += length


def _not_implemented(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on the CPU: sgl_mmkv's sgl_kernel shim "
            "implements only the ops its CPU path uses. Install the real sgl_kernel "
            "(GPU) or avoid the feature that needs this op."
        )

    op.__name__ = name
    op.__qualname__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_implemented(name)


# ``torch.ops.sgl_kernel.<op>`` names that SGLang modules bind at import time on
# the CPU path (e.g. models/qwen3_5.py, pulled in by the Qwen-VL processors).
# They resolve to raising stubs; any other name stays absent, so SGLang's
# ``hasattr(torch.ops.sgl_kernel, ...)`` feature probes keep answering False.
_IMPORT_TIME_TORCH_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


class _TorchOpsNamespace:
    """``torch.ops.sgl_kernel``: registered ops first, then the import-time stubs."""

    def __init__(self, registered) -> None:
        self._registered = registered

    def __getattr__(self, name: str):
        try:
            return getattr(self._registered, name)
        except (AttributeError, RuntimeError):
            if name in _IMPORT_TIME_TORCH_OPS:
                return _not_implemented(name)
            raise AttributeError(f"torch.ops.sgl_kernel has no op {name!r}") from None


torch.ops.sgl_kernel = _TorchOpsNamespace(torch.ops.sgl_kernel)

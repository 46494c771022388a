"""Read one request's row of KV out of SGLang's pool, on the pool's device.

The copies are values: an fp8 pool's rows come back dequantized (float32,
``stored * scale`` with the layer's per-tensor scale, :mod:`sgl_mmkv.refresh.kv_scales`);
a plain pool's rows as stored."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgl_mmkv.kernels.kv_dtype import dequantize
from sgl_mmkv.refresh.kv_scales import KVScales, scales_of


def row_slots(
    req_to_token_pool, forward_batch, index: int, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """``(seq_len,)`` KV slot indices of request ``index``'s row, on the device of
    ``req_to_token``; with ``kept`` ``(m,)`` (host row positions holding KV) only
    those. With the batch's ``seq_lens_cpu`` no host sync (its pool row is picked by
    a device index, never read as a number)."""
    seq_lens = forward_batch.seq_lens_cpu
    if seq_lens is None:
        seq_lens = forward_batch.seq_lens
    seq_len = int(seq_lens[index])
    pool_row = forward_batch.req_pool_indices[index : index + 1]
    row = req_to_token_pool.req_to_token[pool_row, :seq_len][0]
    return row if kept is None else row[kept.to(row.device)]


def _row(model_runner, forward_batch, index: int) -> torch.Tensor:
    return row_slots(model_runner.req_to_token_pool, forward_batch, index)


def row_keys(
    model_runner, forward_batch, index: int, layers: Sequence[int] | None = None
) -> tuple[torch.Tensor, ...]:
    """Per layer of ``layers`` (default: all) ``(seq_len, H_kv, d)`` copies of K of
    request ``index``'s row."""
    pool, scales = model_runner.token_to_kv_pool, scales_of(model_runner)
    row = _row(model_runner, forward_batch, index)
    layers = range(pool.layer_num) if layers is None else layers
    return tuple(dequantize(pool.get_key_buffer(layer)[row], scales.k(layer)) for layer in layers)


def row_kv(
    model_runner, forward_batch, index: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per layer ``(seq_len, H_kv, d)`` copies of K and V of request ``index``'s row."""
    pool, scales = model_runner.token_to_kv_pool, scales_of(model_runner)
    row = _row(model_runner, forward_batch, index)
    layers = range(pool.layer_num)
    keys = tuple(dequantize(pool.get_key_buffer(i)[row], scales.k(i)) for i in layers)
    values = tuple(dequantize(pool.get_value_buffer(i)[row], scales.v(i)) for i in layers)
    return keys, values


def row_slots_at(model_runner, forward_batch, index: int, positions: torch.Tensor) -> torch.Tensor:
    """``(m,)`` pool slots of request ``index``'s row ``positions`` ``(m,)`` int64
    (host): one host-to-device copy, made once per request, never per layer."""
    row = _row(model_runner, forward_batch, index)
    return row[positions.to(row.device)]


def kv_at(
    pool, layer: int, slots: torch.Tensor, scales: KVScales | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, H_kv, d)`` copies of K and V at ``layer`` of ``slots`` (on the pool's
    device); an fp8 pool's dequantized with ``scales`` (None: scales of 1)."""
    k, v = pool.get_key_buffer(layer)[slots], pool.get_value_buffer(layer)[slots]
    if scales is None:
        return dequantize(k, 1.0), dequantize(v, 1.0)
    return dequantize(k, scales.k(layer)), dequantize(v, scales.v(layer))

"""Read one request's row of KV out of SGLang's pool."""

from __future__ import annotations

import torch


def _row(model_runner, forward_batch, index: int) -> torch.Tensor:
    """``(seq_len,)`` KV slot indices of request ``index``'s row."""
    seq_len = int(forward_batch.seq_lens[index])
    return model_runner.req_to_token_pool.req_to_token[
        forward_batch.req_pool_indices[index], :seq_len
    ]


def row_keys(model_runner, forward_batch, index: int) -> tuple[torch.Tensor, ...]:
    """Per layer ``(seq_len, H_kv, d)`` copies of K of request ``index``'s row."""
    pool = model_runner.token_to_kv_pool
    row = _row(model_runner, forward_batch, index)
    return tuple(pool.get_key_buffer(layer)[row].clone() for layer in range(pool.layer_num))


def row_kv(
    model_runner, forward_batch, index: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per layer ``(seq_len, H_kv, d)`` copies of K and V of request ``index``'s row."""
    pool = model_runner.token_to_kv_pool
    row = _row(model_runner, forward_batch, index)
    values = tuple(pool.get_value_buffer(layer)[row].clone() for layer in range(pool.layer_num))
    return row_keys(model_runner, forward_batch, index), values

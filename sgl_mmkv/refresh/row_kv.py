"""Read one request's row of KV out of SGLang's pool."""

from __future__ import annotations

import torch


def row_kv(
    model_runner, forward_batch, index: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per layer ``(seq_len, H_kv, d)`` copies of K and V of request ``index``'s row."""
    pool = model_runner.token_to_kv_pool
    seq_len = int(forward_batch.seq_lens[index])
    row = model_runner.req_to_token_pool.req_to_token[
        forward_batch.req_pool_indices[index], :seq_len
    ]
    layers = range(pool.layer_num)
    keys = tuple(pool.get_key_buffer(layer)[row].clone() for layer in layers)
    values = tuple(pool.get_value_buffer(layer)[row].clone() for layer in layers)
    return keys, values

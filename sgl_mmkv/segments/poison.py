"""Test aid: overwrite KV slots with NaN when they stop holding KV.

A server started with ``SGL_MMKV_POISON_FREED=1`` writes NaN into every layer's K
and V at slots the segment store frees and at the holes of reused rows, so a test
can require finite outputs: any read of such a slot would spread NaN into them.
``SGL_MMKV_POISON_FREED=@<file>`` poisons while the file holds ``1``, so one server
can answer a sequence poisoned and then (flushed) plain. Without the variable
(every real deployment) a call costs one environment lookup.
"""

from __future__ import annotations

import os

import torch

from sgl_mmkv.kernels.kv_dtype import put_rows

POISON_ENV = "SGL_MMKV_POISON_FREED"


def poison_slots(kv_pool, slots: torch.Tensor) -> None:
    """Write NaN into K and V of ``slots`` ``(n,)`` in every layer, if asked for
    (fp8 pools: the format's NaN bytes)."""
    if slots.numel() == 0 or not poisoning():
        return
    for layer in range(kv_pool.layer_num):
        for buffer in (kv_pool.get_key_buffer(layer), kv_pool.get_value_buffer(layer)):
            index = slots.to(buffer.device, torch.long)
            nan = torch.full((), float("nan"), device=buffer.device).to(buffer.dtype)
            put_rows(buffer, index, nan.expand(index.numel(), *buffer.shape[1:]))


def poisoning() -> bool:
    """Whether freed slots are poisoned now (:data:`POISON_ENV`: ``1``, or ``@file``
    holding ``1``)."""
    value = os.environ.get(POISON_ENV)
    if value is None or not value.startswith("@"):
        return value == "1"
    try:
        with open(value[1:]) as f:
            return f.read().strip() == "1"
    except OSError:
        return False

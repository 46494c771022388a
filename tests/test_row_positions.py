"""Positions of rows that holes shortened: the offset a 1-D RoPE request carries."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_mmkv.patches.forward_batch_positions import after_init_new
from sgl_mmkv.refresh.row_positions import (
    POSITION_OFFSET,
    position_offset,
    positions_after_holes,
)


def test_each_request_moves_by_its_own_offset():
    decode = torch.tensor([9, 20, 31], dtype=torch.int32)
    moved = positions_after_holes(decode, [0, 16, 3])
    assert moved.tolist() == [9, 36, 34] and moved.dtype == torch.int32


def _req(prompt: int, outputs: int = 0, offset: int | None = None):
    req = SimpleNamespace(origin_input_ids=[0] * prompt, output_ids=[0] * outputs)
    if offset is not None:
        setattr(req, POSITION_OFFSET, offset)
    return req


def _batch(mode: ForwardMode, positions: list[int], extend_lens=None, mrope=None):
    return SimpleNamespace(
        forward_mode=mode,
        positions=torch.tensor(positions),
        extend_seq_lens_cpu=extend_lens,
        mrope_positions=mrope,
    )


def test_decode_positions_of_a_1d_model_follow_the_sequence():
    reqs = [_req(40, 3, offset=16), _req(12, 1)]
    assert [position_offset(r) for r in reqs] == [16, 0]
    out = after_init_new(_batch(ForwardMode.DECODE, [26, 12]), None, SimpleNamespace(reqs=reqs))
    assert out.positions.tolist() == [42, 12]


def test_extends_keep_their_positions():
    reqs = [_req(40, 0), _req(12, 2, offset=4)]  # an offset never moves an extend
    batch = _batch(ForwardMode.EXTEND, [0, 1, 2, 9], extend_lens=[3, 1])
    out = after_init_new(batch, None, SimpleNamespace(reqs=reqs))
    assert out.positions.tolist() == [0, 1, 2, 9]


def test_mrope_batches_keep_their_positions():
    reqs = [_req(40, 3, offset=16)]
    mrope = torch.zeros(3, 1)
    batch = _batch(ForwardMode.DECODE, [26], mrope=mrope)
    out = after_init_new(batch, None, SimpleNamespace(reqs=reqs))
    assert out.positions.tolist() == [26]
    idle = _batch(ForwardMode.IDLE, [])
    assert after_init_new(idle, None, SimpleNamespace(reqs=[])) is idle

"""Positions of rows that holes shortened: the offset a 1-D RoPE request carries, kept
by the row compactor and added to its decode positions by the ``init_new`` patch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_mmkv.patches.forward_batch_positions import after_init_new, positions_after_holes
from sgl_mmkv.refresh import runtime
from sgl_mmkv.refresh.row_compaction import RowCompactor


def test_each_request_moves_by_its_own_offset():
    decode = torch.tensor([9, 20, 31], dtype=torch.int32)
    moved = positions_after_holes(decode, [0, 16, 3])
    assert moved.tolist() == [9, 36, 34] and moved.dtype == torch.int32


@pytest.fixture
def compactor(monkeypatch) -> RowCompactor:
    """A compactor whose request ``r0`` lost 16 positions and ``r2`` 4, published as
    the process's runtime would be."""
    compactor = RowCompactor(None, holes=True)
    compactor._offsets.update({"r0": 16, "r2": 4})
    monkeypatch.setattr(runtime, "_published", SimpleNamespace(compactor=compactor))
    return compactor


def _batch(mode: ForwardMode, positions: list[int], mrope=None):
    return SimpleNamespace(
        forward_mode=mode, positions=torch.tensor(positions), mrope_positions=mrope
    )


def _reqs(*rids: str) -> SimpleNamespace:
    return SimpleNamespace(reqs=[SimpleNamespace(rid=rid) for rid in rids])


def test_decode_positions_of_a_1d_model_follow_the_sequence(compactor):
    assert [compactor.position_offset(r) for r in ("r0", "r1")] == [16, 0]
    out = after_init_new(_batch(ForwardMode.DECODE, [26, 12]), None, _reqs("r0", "r1"))
    assert out.positions.tolist() == [42, 12]


def test_extends_keep_their_positions(compactor):
    batch = _batch(ForwardMode.EXTEND, [0, 1, 2, 9])  # an offset never moves an extend
    out = after_init_new(batch, None, _reqs("r1", "r2"))
    assert out.positions.tolist() == [0, 1, 2, 9]


def test_mrope_batches_keep_their_positions(compactor):
    batch = _batch(ForwardMode.DECODE, [26], mrope=torch.zeros(3, 1))
    assert after_init_new(batch, None, _reqs("r0")).positions.tolist() == [26]
    idle = _batch(ForwardMode.IDLE, [])
    assert after_init_new(idle, None, _reqs()) is idle


def test_reading_the_runtime_before_it_is_published_fails_loudly(monkeypatch):
    monkeypatch.setattr(runtime, "_published", None)
    with pytest.raises(RuntimeError, match="before its radix cache published it"):
        runtime.current()
    first = SimpleNamespace()
    runtime.publish(first)
    runtime.publish(first)  # the same one again is fine
    with pytest.raises(RuntimeError, match="published once"):
        runtime.publish(SimpleNamespace())

"""Decode-time compression of one request's row, on SGLang's own data structures.

The row shrinks by the dropped count, keeps the kept slots in order, frees exactly
the dropped ones, and SGLang's decode positions (``ForwardBatch``'s M-RoPE decode
path) are the same before and after: the position delta absorbs the shift.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sgl_mmkv.refresh.decode_compression import DecodeCompressor, dropped_positions

PROMPT = 40
IMAGES = ((5, 21), (24, 32))  # [start, end) row positions of two images


class RecordingAllocator:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()


def _request(row: int, delta: int, max_new_tokens: int = 8):
    mm = SimpleNamespace(
        mrope_positions=torch.arange(PROMPT).expand(3, -1).clone(),
        mrope_position_delta=torch.tensor([[delta]]),
        mrope_position_delta_repeated_cache=None,
    )
    return SimpleNamespace(
        rid=f"r{row}",
        kv=SimpleNamespace(req_pool_idx=row, kv_committed_len=PROMPT, kv_allocated_len=PROMPT),
        multimodal_inputs=mm,
        inflight_middle_chunks=0,
        sampling_params=SimpleNamespace(max_new_tokens=max_new_tokens),
        skip_radix_cache_insert=False,
        finished=lambda: False,
        is_retracted=False,
    )


def _rankings(seed: int) -> dict[tuple[int, int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {span: torch.rand(span[1] - span[0], generator=g) for span in IMAGES}


def _decode_positions(batch, seq_lens: torch.Tensor) -> torch.Tensor:
    """SGLang's M-RoPE positions of the next decode token of each request."""
    fb = SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=seq_lens, forward_mode=ForwardMode.DECODE)
    runner = SimpleNamespace(device="cpu")
    ForwardBatch._compute_mrope_positions_decode(fb, runner, batch)
    return fb.mrope_positions


@pytest.fixture
def no_server_context(monkeypatch):
    """The decode position path reads one execution flag from the server's context."""
    flags = SimpleNamespace(deterministic=SimpleNamespace(rl_on_policy_target=None))
    monkeypatch.setattr(forward_batch_info, "get_exec", lambda: flags)


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.9])
def test_the_rows_shrink_by_the_dropped_tokens_and_decode_positions_hold(budget, no_server_context):
    table = torch.arange(3 * 64, dtype=torch.int32).reshape(3, 64) + 1000
    original = table.clone()
    reqs = [_request(row=1, delta=-7), _request(row=2, delta=-3)]
    batch = SimpleNamespace(
        reqs=reqs,
        seq_lens=torch.tensor([PROMPT, PROMPT]),
        seq_lens_cpu=torch.tensor([PROMPT, PROMPT]),
        orig_seq_lens=torch.tensor([PROMPT, PROMPT], dtype=torch.int32),
        seq_lens_sum=2 * PROMPT,
        multimodal_inputs=[r.multimodal_inputs for r in reqs],
    )
    # After the prefill, the next token sits at seq_len (it is decoded with seq_len + 1).
    before = _decode_positions(batch, batch.seq_lens + 1)
    forward_batch = SimpleNamespace(req_pool_indices=torch.tensor([1, 2]))
    plans = [SimpleNamespace(index=i, seq_len=PROMPT) for i in range(2)]
    ranked = {i: _rankings(i) for i in range(2)}
    compressor = DecodeCompressor(budget)
    compressor.plan(forward_batch, plans, ranked)
    compressor.before(batch)
    assert all(r.skip_radix_cache_insert for r in reqs)
    allocator = RecordingAllocator()
    compressor.after(batch, SimpleNamespace(req_to_token=table), allocator)

    dropped = sum((e - s) - math.ceil(budget * (e - s) - 1e-9) for s, e in IMAGES)
    assert compressor.counters.freed_tokens == 2 * dropped
    assert batch.seq_lens.tolist() == [PROMPT - dropped] * 2
    assert batch.orig_seq_lens.tolist() == [PROMPT - dropped] * 2
    assert batch.seq_lens_sum is None
    expected_freed = []
    for i, req in enumerate(reqs):
        drop = dropped_positions(budget, ranked[i])
        keep = torch.ones(PROMPT, dtype=torch.bool)
        keep[drop] = False
        row = req.kv.req_pool_idx
        assert torch.equal(table[row, : PROMPT - dropped], original[row, :PROMPT][keep])
        assert req.kv.kv_committed_len == req.kv.kv_allocated_len == PROMPT - dropped
        # The kept tokens of each image are its top-ranked ones.
        for (start, end), ranking in ranked[i].items():
            kept = keep[start:end].nonzero().flatten()
            k = math.ceil(budget * (end - start) - 1e-9)
            assert set(kept.tolist()) == set(torch.topk(ranking, k).indices.tolist())
        expected_freed += original[row, :PROMPT][~keep].tolist()
    assert sorted(allocator.freed) == sorted(expected_freed)
    assert len(set(allocator.freed)) == len(allocator.freed)
    after = _decode_positions(batch, batch.seq_lens + 1)
    assert torch.equal(after, before)
    # Release puts the request's M-RoPE state back (a retraction prefills again).
    for req in reqs:
        compressor.restore(req)
        assert req.multimodal_inputs.mrope_positions.shape == (3, PROMPT)
        assert not req.skip_radix_cache_insert
    assert _decode_positions(batch, torch.tensor([PROMPT + 1] * 2)).equal(before)


def test_requests_that_finish_in_prefill_or_are_chunked_keep_their_rows():
    table = torch.arange(2 * 64, dtype=torch.int32).reshape(2, 64)
    original = table.clone()
    one_token = _request(row=0, delta=0, max_new_tokens=1)
    chunked = _request(row=1, delta=0)
    chunked.inflight_middle_chunks = 1
    batch = SimpleNamespace(reqs=[one_token, chunked], seq_lens=torch.tensor([PROMPT, PROMPT]))
    compressor = DecodeCompressor(0.5)
    forward_batch = SimpleNamespace(req_pool_indices=torch.tensor([0, 1]))
    plans = [SimpleNamespace(index=i, seq_len=PROMPT) for i in range(2)]
    compressor.plan(forward_batch, plans, {0: _rankings(0), 1: _rankings(1)})
    compressor.before(batch)
    assert not one_token.skip_radix_cache_insert and not chunked.skip_radix_cache_insert
    allocator = RecordingAllocator()
    compressor.after(batch, SimpleNamespace(req_to_token=table), allocator)
    assert allocator.freed == [] and torch.equal(table, original)
    assert compressor.counters.compressed_requests == 0

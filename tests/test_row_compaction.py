"""Row compaction (decode-time compression, reuse holes) on SGLang's own data structures.

The row shrinks by the dropped count, keeps the kept slots in order, frees exactly
the dropped ones, and SGLang's decode positions (``ForwardBatch``'s M-RoPE decode
path) are the same before and after: the position delta absorbs the shift. Only
requests whose prefill the forward completes, in no session, may shrink. A row with
holes that is not shrunk, for whatever reason, is kept out of the tree and aborted
while live: never decoded.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from sgl_mmkv.refresh.row_compaction import RowCompactor, dropped_positions

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
        session=None,
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
    forward_batch = _forward_batch(reqs)
    plans = [SimpleNamespace(index=i, seq_len=PROMPT) for i in range(2)]
    ranked = {i: _rankings(i) for i in range(2)}
    compressor = RowCompactor(budget)
    compressor.admit(batch)
    compressor.plan(forward_batch, plans, ranked)
    allocator = RecordingAllocator()
    compressor.compact(batch, SimpleNamespace(req_to_token=table), allocator)
    assert all(r.skip_radix_cache_insert for r in reqs)

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


def _forward_batch(reqs):
    return SimpleNamespace(
        req_pool_indices=torch.tensor([r.kv.req_pool_idx for r in reqs]),
        rids=[r.rid for r in reqs],
    )


def test_requests_that_finish_in_prefill_chunk_or_sit_in_a_session_keep_their_rows():
    table = torch.arange(3 * 64, dtype=torch.int32).reshape(3, 64)
    original = table.clone()
    one_token = _request(row=0, delta=0, max_new_tokens=1)
    chunked = _request(row=1, delta=0)
    in_session = _request(row=2, delta=0)
    in_session.session = SimpleNamespace(streaming=True)
    reqs = [one_token, chunked, in_session]
    batch = SimpleNamespace(reqs=reqs, seq_lens=torch.tensor([PROMPT] * 3), chunked_req=chunked)
    compressor = RowCompactor(0.5)
    compressor.admit(batch)
    assert [compressor.may_shrink(r.rid) for r in reqs] == [True, False, False]
    plans = [SimpleNamespace(index=i, seq_len=PROMPT) for i in range(3)]
    compressor.plan(_forward_batch(reqs), plans, {i: _rankings(i) for i in range(3)})
    allocator = RecordingAllocator()
    compressor.compact(batch, SimpleNamespace(req_to_token=table), allocator)
    assert not any(r.skip_radix_cache_insert for r in reqs)
    assert allocator.freed == [] and torch.equal(table, original)
    assert compressor.counters.compressed_requests == 0
    assert compressor.counters.skipped_requests == 1  # the chunk and the session: not planned
    assert not compressor.may_shrink(one_token.rid)  # admission lasts one forward


def _holed_plan(index: int, holes: list[int]):
    mask = torch.zeros(PROMPT, dtype=torch.bool)
    mask[holes] = True
    return SimpleNamespace(
        index=index,
        prefix_len=0,
        seq_len=PROMPT,
        hole_mask=lambda: mask,
        rows=lambda m: m.nonzero().flatten(),
    )


def _batch(reqs):
    n = len(reqs)
    return SimpleNamespace(
        reqs=reqs,
        seq_lens=torch.tensor([PROMPT] * n),
        seq_lens_cpu=torch.tensor([PROMPT] * n),
        orig_seq_lens=None,
        seq_lens_sum=n * PROMPT,
        multimodal_inputs=[r.multimodal_inputs for r in reqs],
    )


def test_holes_and_decode_drops_leave_the_row_once_each_even_for_one_token():
    table = torch.arange(2 * 64, dtype=torch.int32).reshape(2, 64)
    original = table.clone()
    one_token = _request(row=0, delta=2, max_new_tokens=1)
    decoding = _request(row=1, delta=0)
    batch = _batch([one_token, decoding])
    forward_batch = _forward_batch([one_token, decoding])
    compactor = RowCompactor(0.5, holes=True)
    compactor.admit(batch)
    holes = [7, 8, 9, 30]
    compactor.plan_holes(forward_batch, [_holed_plan(0, holes), _holed_plan(1, holes)])
    plans = [SimpleNamespace(index=1, seq_len=PROMPT)]
    ranked = {1: {(5, 21): torch.arange(16, dtype=torch.float32)}}  # keeps 13..20
    compactor.plan(forward_batch, plans, ranked)
    allocator = RecordingAllocator()
    compactor.compact(batch, SimpleNamespace(req_to_token=table), allocator)
    removed_1 = sorted({*holes, *range(5, 13)})
    assert sorted(allocator.freed) == sorted(
        original[0, holes].tolist() + original[1, removed_1].tolist()
    )
    assert batch.seq_lens.tolist() == [PROMPT - 4, PROMPT - len(removed_1)]
    assert one_token.skip_radix_cache_insert and decoding.skip_radix_cache_insert
    assert int(one_token.multimodal_inputs.mrope_position_delta) == 2 + 4
    keep = torch.ones(PROMPT, dtype=torch.bool)
    keep[holes] = False
    assert torch.equal(table[0, : PROMPT - 4], original[0, :PROMPT][keep])
    c = compactor.counters
    assert (c.holed_requests, c.hole_tokens) == (2, 8)
    assert (c.compressed_requests, c.freed_tokens) == (1, len(removed_1) - 4)


def test_a_failed_compaction_aborts_rows_with_holes_and_leaves_the_others_whole(monkeypatch):
    from sgl_mmkv.refresh import row_compaction

    table = torch.arange(2 * 64, dtype=torch.int32).reshape(2, 64)
    original = table.clone()
    holed, decoding = _request(row=0, delta=0), _request(row=1, delta=0)
    aborted = []
    holed.set_finish_with_abort = aborted.append
    decoding.set_finish_with_abort = aborted.append
    forward_batch = _forward_batch([holed, decoding])
    compactor = RowCompactor(0.5, holes=True)
    compactor.admit(_batch([holed, decoding]))
    compactor.plan_holes(forward_batch, [_holed_plan(0, [7, 8])])
    compactor.plan(forward_batch, [SimpleNamespace(index=1, seq_len=PROMPT)], {1: _rankings(1)})

    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(row_compaction.RowCompactor, "_shrink", broken)
    with pytest.raises(RuntimeError):
        compactor.compact(_batch([holed, decoding]), SimpleNamespace(req_to_token=table), None)
    assert len(aborted) == 1 and compactor.counters.aborted_requests == 1
    assert holed.skip_radix_cache_insert and not decoding.skip_radix_cache_insert
    assert torch.equal(table, original)


def test_a_fault_at_the_compaction_point_aborts_rows_with_holes(monkeypatch, tmp_path):
    from sgl_mmkv.refresh.faults import FAULT_FILE_ENV, InjectedFault

    fault = tmp_path / "stage"
    fault.write_text("row_compaction")
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    table = torch.arange(64, dtype=torch.int32).reshape(1, 64)
    holed = _request(row=0, delta=0)
    aborted = []
    holed.set_finish_with_abort = aborted.append
    compactor = RowCompactor(None, holes=True)
    compactor.admit(_batch([holed]))
    compactor.plan_holes(_forward_batch([holed]), [_holed_plan(0, [7, 8])])
    with pytest.raises(InjectedFault):
        compactor.compact(_batch([holed]), SimpleNamespace(req_to_token=table), None)
    assert len(aborted) == 1 and holed.skip_radix_cache_insert


def test_rows_with_holes_that_cannot_shrink_never_decode_nor_enter_the_tree():
    table = torch.arange(3 * 64, dtype=torch.int32).reshape(3, 64)
    original = table.clone()
    finished, retracted, behind = (_request(row=r, delta=0) for r in range(3))
    finished.finished = lambda: True  # aborted by its client during the forward
    retracted.is_retracted = True
    behind.kv.kv_committed_len = PROMPT - 8  # its row is not the planned one
    reqs = [finished, retracted, behind]
    aborted = []
    for req in reqs:
        req.set_finish_with_abort = lambda reason, req=req: aborted.append(req.rid)
    compactor = RowCompactor(None, holes=True)
    compactor.admit(_batch(reqs))
    compactor.plan_holes(_forward_batch(reqs), [_holed_plan(i, [7, 8]) for i in range(3)])
    allocator = RecordingAllocator()
    compactor.compact(_batch(reqs), SimpleNamespace(req_to_token=table), allocator)
    assert all(r.skip_radix_cache_insert for r in reqs)
    assert aborted == ["r2"] and compactor.counters.aborted_requests == 1
    assert allocator.freed == [] and torch.equal(table, original)
    for req in reqs:  # release puts the tree flag back once the row is gone
        compactor.restore(req)
        assert not req.skip_radix_cache_insert


def test_compaction_waits_for_the_forward_stream_under_overlap_on_a_gpu(monkeypatch):
    """The scheduler's stream waits (device-side) for the forward stream before a row
    is edited; nothing to wait for without overlap or on the CPU."""
    from sgl_mmkv.patches import scheduler_run_batch

    waited = []
    current = SimpleNamespace(wait_stream=waited.append)
    monkeypatch.setattr(
        torch, "get_device_module", lambda device: SimpleNamespace(current_stream=lambda: current)
    )
    gpu_stream = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    for overlap, stream, expected in [
        (True, gpu_stream, [gpu_stream]),
        (False, gpu_stream, []),
        (True, SimpleNamespace(device=None), []),  # torch.cpu.Stream has no device
    ]:
        waited.clear()
        scheduler = SimpleNamespace(enable_overlap=overlap, forward_stream=stream)
        scheduler_run_batch.wait_for_forward(scheduler)
        assert waited == expected


class _OtherRankFailed:
    """A TP-2 agreement whose other rank reports ``peer_failed``."""

    active = True

    def __init__(self, peer_failed: bool) -> None:
        self.peer_failed, self.flags = peer_failed, []

    def any_failed(self, failed: bool) -> bool:
        self.flags.append(failed)
        return failed or self.peer_failed


def _extend(reqs):
    return SimpleNamespace(**vars(_batch(reqs)), forward_mode=ForwardMode.EXTEND)


@pytest.mark.parametrize("peer_failed", [False, True])
def test_at_tp2_another_rank_s_failure_cancels_the_compaction_here(peer_failed):
    """The ranks agree before any row shrinks: when rank 1 failed before compacting,
    rank 0 shrinks nothing either (equal rows and free memory on both) and keeps its
    holed row from decoding, as rank 1 does; the rest decode whole. Once per extend
    batch with images, never on a decode."""
    table = torch.arange(2 * 64, dtype=torch.int32).reshape(2, 64)
    original = table.clone()
    holed, plain = _request(row=0, delta=0), _request(row=1, delta=0)
    aborted = []
    holed.set_finish_with_abort = plain.set_finish_with_abort = aborted.append
    agreement = _OtherRankFailed(peer_failed)
    compactor = RowCompactor(None, holes=True, agreement=agreement)
    compactor.admit(_batch([holed, plain]))
    compactor.plan_holes(_forward_batch([holed, plain]), [_holed_plan(0, [7, 8])])
    batch = _extend([holed, plain])
    allocator = RecordingAllocator()
    compactor.compact(batch, SimpleNamespace(req_to_token=table), allocator)
    assert agreement.flags == [False]
    if peer_failed:
        assert batch.seq_lens.tolist() == [PROMPT, PROMPT] and allocator.freed == []
        assert torch.equal(table, original)
        assert len(aborted) == 1 and holed.skip_radix_cache_insert
        assert not plain.skip_radix_cache_insert
    else:
        assert batch.seq_lens.tolist() == [PROMPT - 2, PROMPT] and aborted == []
    assert compactor.counters.rank_cancelled == int(peer_failed)
    decode = SimpleNamespace(**vars(_batch([holed, plain])), forward_mode=ForwardMode.DECODE)
    compactor.compact(decode, SimpleNamespace(req_to_token=table), RecordingAllocator())
    assert agreement.flags == [False]  # no collective on a decode batch


def test_at_tp2_the_failing_rank_agrees_before_it_aborts_anything(tmp_path, monkeypatch):
    """Rank 1's compaction fails at its start: it runs the batch's agreement (which
    rank 0 waits in) before aborting its holed request, whose abort in SGLang drops
    the request's images, and raises."""
    from sgl_mmkv.refresh.faults import FAULT_FILE_ENV, InjectedFault

    fault = tmp_path / "stage"
    fault.write_text("row_compaction")
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    holed, plain = _request(row=0, delta=0), _request(row=1, delta=0)
    aborted = []

    def abort(reason):  # as SGLang's Req.set_finish_with_abort: images released
        aborted.append(reason)
        holed.multimodal_inputs = None

    holed.set_finish_with_abort = abort
    agreement = _OtherRankFailed(peer_failed=False)
    compactor = RowCompactor(None, holes=True, agreement=agreement)
    compactor.admit(_batch([holed, plain]))
    compactor.plan_holes(_forward_batch([holed, plain]), [_holed_plan(0, [7, 8])])
    with pytest.raises(InjectedFault):
        compactor.compact(_extend([holed, plain]), SimpleNamespace(req_to_token=None), None)
    assert agreement.flags == [True] and len(aborted) == 1
    assert compactor.counters.rank_cancelled == 1


def test_at_tp2_a_rank_whose_admission_failed_reports_it():
    agreement = _OtherRankFailed(peer_failed=False)
    compactor = RowCompactor(None, holes=True, agreement=agreement)
    compactor.diverge()
    req = _request(row=0, delta=0)
    compactor.compact(_extend([req]), SimpleNamespace(req_to_token=None), None)
    assert agreement.flags == [True] and compactor.counters.rank_cancelled == 1
    compactor.compact(_extend([req]), SimpleNamespace(req_to_token=None), None)
    assert agreement.flags == [True, False]  # reported once

"""Segment store and reuse plans on a stand-in pool: ownership, LRU, plans, deltas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_mmkv.refresh.plan import constant_delta, plan_request
from sgl_mmkv.segments.key import NAMESPACE_ATTR, Namespace, item_key
from sgl_mmkv.segments.store import SegmentStore


class Allocator:
    """SGLang's token allocator contract (page size 1), with a double-free check."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out)

    def free(self, slots: torch.Tensor) -> None:
        for s in slots.tolist():
            assert s not in self.free_slots, f"slot {s} freed twice"
            self.free_slots.append(s)


class Pool:
    def __init__(self, size: int, layers: int = 2) -> None:
        self.layer_num = layers
        self.k = [torch.randn(size + 1, 2, 4) for _ in range(layers)]
        self.v = [torch.randn(size + 1, 2, 4) for _ in range(layers)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


@pytest.fixture
def store():
    return SegmentStore(Allocator(64), Pool(64))


def test_fill_copies_every_layer_into_slots_the_store_owns(store):
    src = store.allocator.alloc(5)
    assert store.fill((7, 5), src, torch.arange(5)[None])
    segment = store.lookup((7, 5))
    assert set(segment.slots.tolist()).isdisjoint(src.tolist())
    for layer in range(2):
        torch.testing.assert_close(
            store.kv_pool.k[layer][segment.slots], store.kv_pool.k[layer][src]
        )
        torch.testing.assert_close(
            store.kv_pool.v[layer][segment.slots], store.kv_pool.v[layer][src]
        )
    assert store.num_tokens == 5 and store.allocator.available_size() == 64 - 10
    assert not store.fill((7, 5), src, torch.arange(5)[None])  # one entry per key


def test_lru_eviction_frees_oldest_first_and_marks_dead(store):
    for key in range(3):
        store.fill((key, 4), store.allocator.alloc(4), torch.arange(4)[None])
    first = store.lookup((0, 4))  # 0 becomes most recent; 1 is now the oldest
    freed = store.evict_lru(5)
    assert freed == 8
    assert (1, 4) not in store and (2, 4) not in store and first.alive
    assert store.counters.evictions == 2 and store.counters.evicted_tokens == 8
    store.clear(free_slots=True)
    assert not first.alive and store.num_tokens == 0
    assert store.allocator.available_size() == 64 - 12  # the three request rows remain


def test_fill_is_skipped_when_the_pool_is_full(store):
    store.allocator.alloc(62)
    assert not store.fill((1, 4), torch.tensor([1, 2, 3, 4]), torch.arange(4)[None])
    assert store.counters.fill_skipped == 1 and store.num_tokens == 0


def test_a_new_segment_takes_the_room_of_the_least_recently_used(store):
    for key in range(3):
        store.fill((key, 8), store.allocator.alloc(8), torch.arange(8)[None])
    store.allocator.alloc(store.allocator.available_size() - 4)  # running requests
    store.lookup((0, 8))
    assert store.fill((9, 8), store.allocator.alloc(0), torch.arange(8)[None]) is None
    assert store.reserve((9, 8), 8, torch.arange(8)[None]) is not None
    assert (1, 8) not in store and (0, 8) in store and (2, 8) in store
    assert store.counters.evictions == 1 and store.allocator.available_size() == 4


def test_with_scored_eviction_a_new_segment_first_compresses_the_others():
    store = SegmentStore(Allocator(64), Pool(64), compress_budget=0.5)
    for key in range(2):
        store.fill((key, 8), store.allocator.alloc(8), torch.arange(8)[None], torch.rand(8))
    store.allocator.alloc(store.allocator.available_size() - 2)
    assert store.reserve((9, 6), 6, torch.arange(6)[None]) is not None
    assert store.counters.compressions == 1 and store.counters.evictions == 0
    assert store.num_tokens == 8 + 4 + 6 and store.allocator.available_size() == 0


def test_constant_delta_for_a_moved_mrope_image():
    old = torch.tensor([[5, 5, 5, 5], [5, 5, 6, 6], [5, 6, 5, 6]])
    assert constant_delta(old + 9, old) == 9
    moved_rows = old.clone()
    moved_rows[1] += 1
    assert constant_delta(moved_rows, old) is None


SHARED = Namespace(None, None)  # no salt, no extra key, no adapter


def _mm(items, mrope, namespace=SHARED):
    mm = SimpleNamespace(mm_items=items, mrope_positions=mrope)
    if namespace is not None:
        setattr(mm, NAMESPACE_ATTR, namespace)
    return mm


def _item(h, start, end):
    return SimpleNamespace(hash=h, offsets=[(start, end)], modality=SimpleNamespace(name="IMAGE"))


def _key(h, n, namespace=SHARED):
    return item_key(_item(h, 0, n - 1), namespace, n)


def test_plan_reuses_stored_images_outside_the_prefix_and_fills_new_ones(store):
    # Row: 0-2 text, 3-6 image A, 7 text, 8-11 image B, 12-13 text.
    mrope = torch.arange(14).repeat(3, 1)
    store.fill(_key(11, 4), store.allocator.alloc(4), (mrope[:, 3:7] - 2))
    plan = plan_request(store, 0, _mm([_item(11, 3, 6), _item(22, 8, 11)], mrope), 2, 12)
    assert [(s.start, s.end, s.delta) for s in plan.spans] == [(3, 7, 2)]
    assert [(f.key, f.start, f.end) for f in plan.fills] == [(_key(22, 4), 8, 12)]
    assert plan.reused_tokens == 4
    assert plan.reused_mask().tolist() == [False] + [True] * 4 + [False] * 7


def test_plan_leaves_prefix_and_partial_images_alone(store):
    mrope = torch.arange(14).repeat(3, 1)
    store.fill(_key(11, 4), store.allocator.alloc(4), mrope[:, 3:7])
    # Image A inside the exact-prefix match: stock reuse; image B past this chunk.
    plan = plan_request(store, 0, _mm([_item(11, 3, 6), _item(22, 8, 11)], mrope), 8, 2)
    assert plan.spans == () and plan.fills == ()


def test_an_image_shown_again_after_the_prefix_is_reused_only_where_it_is_extended(store):
    # Row: 0-3 image A (turn 1, in the cached prefix), 4-5 text, 6-9 image A again.
    mrope = torch.arange(12).repeat(3, 1)
    store.fill(_key(11, 4), store.allocator.alloc(4), mrope[:, 0:4])
    plan = plan_request(store, 0, _mm([_item(11, 0, 3), _item(11, 6, 9)], mrope), 6, 6)
    assert [(s.start, s.end, s.delta) for s in plan.spans] == [(6, 10, 6)]
    assert plan.fills == () and plan.reused_tokens == 4
    assert plan.reused_mask().tolist() == [True] * 4 + [False] * 2


def test_an_image_cut_by_a_chunk_boundary_is_reused_part_by_part(store):
    # Row: 0-7 text, 8-11 image B (stored 3 positions earlier); chunks [0, 10), [10, 14).
    mrope = torch.arange(14).repeat(3, 1)
    segment = store.fill(_key(22, 4), store.allocator.alloc(4), mrope[:, 8:12] - 3)
    items = [_item(22, 8, 11)]
    first = plan_request(store, 0, _mm(items, mrope), 0, 10)
    second = plan_request(store, 0, _mm(items, mrope), 10, 4)
    (a,), (b,) = first.spans, second.spans
    assert (a.start, a.end, a.delta, b.start, b.end, b.delta) == (8, 10, 3, 10, 12, 3)
    assert a.reused_positions().tolist() == [8, 9] and b.reused_positions().tolist() == [10, 11]
    assert torch.equal(torch.cat([a.source_slots(), b.source_slots()]), segment.slots)
    assert first.reused_mask().tolist() == [False] * 8 + [True] * 2
    assert second.reused_mask().tolist() == [True, True, False, False]
    assert first.fills == () and second.fills == () and first.images == second.images == ()
    # a compressed segment: each part serves only its kept tokens
    segment.kept, segment.slots = torch.tensor([1, 2]), segment.slots[[1, 2]]
    (a,), (b,) = (
        plan_request(store, 0, _mm(items, mrope), p, n).spans for p, n in [(0, 10), (10, 4)]
    )
    assert a.reused_positions().tolist() == [9] and b.reused_positions().tolist() == [10]
    assert (a.num_reused, b.num_reused) == (1, 1)
    assert torch.equal(torch.cat([a.source_slots(), b.source_slots()]), segment.slots)


def test_reserve_then_discard_returns_every_slot(store):
    before = store.allocator.available_size()
    segment = store.reserve((5, 6), 6, torch.arange(6)[None])
    assert segment is not None and segment.slots.numel() == 6
    assert store.num_tokens == 6 and store.counters.fills == 1 and (5, 6) in store
    assert store.allocator.available_size() == before - 6
    assert store.reserve((5, 6), 6, torch.arange(6)[None]) is None  # one entry per key
    store.discard((5, 6))
    assert (5, 6) not in store and store.num_tokens == 0 and store.counters.fills == 0
    assert store.allocator.available_size() == before
    store.discard((5, 6))  # discarding twice frees nothing twice
    assert store.allocator.available_size() == before


def test_compression_keeps_the_top_ranked_tokens_and_frees_the_rest(store):
    src = store.allocator.alloc(8)
    ranking = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6])
    segment = store.fill((3, 8), src, torch.arange(8)[None] + 10, ranking=ranking)
    slots_before = segment.slots.clone()
    k_before = store.kv_pool.k[1][slots_before].clone()
    available = store.allocator.available_size()
    assert store.compress(segment, 0.5) == 4
    assert segment.kept.tolist() == [1, 3, 5, 7] and segment.compressed
    assert torch.equal(segment.slots, slots_before[[1, 3, 5, 7]])
    torch.testing.assert_close(store.kv_pool.k[1][segment.slots], k_before[[1, 3, 5, 7]])
    assert store.allocator.available_size() == available + 4 and store.num_tokens == 4
    assert store.compress(segment, 0.25) == 0  # compressed once only
    assert store.counters.compressions == 1 and store.counters.compressed_tokens == 4
    store.evict_lru(1)
    assert store.num_tokens == 0 and store.allocator.available_size() == available + 8


def test_compress_lru_goes_oldest_first_and_skips_unranked(store):
    ranked = [
        store.fill((key, 6), store.allocator.alloc(6), torch.arange(6)[None], torch.rand(6))
        for key in range(3)
    ]
    unranked = store.fill((9, 6), store.allocator.alloc(6), torch.arange(6)[None])
    store.lookup((0, 6))  # 0 becomes the most recent
    assert store.compress_lru(4, 0.5) == 6  # segments 1 and 2, 3 slots each
    assert [s.compressed for s in ranked] == [False, True, True]
    assert store.compress_lru(100, 0.5) == 3 and not unranked.compressed
    assert store.num_tokens == 3 * 3 + 6


def test_plan_of_a_compressed_segment_reuses_only_its_kept_tokens(store):
    mrope = torch.arange(14).repeat(3, 1)
    segment = store.fill(
        _key(11, 4), store.allocator.alloc(4), mrope[:, 3:7], torch.tensor([4.0, 1.0, 3.0, 2.0])
    )
    store.compress(segment, 0.5)
    plan = plan_request(store, 0, _mm([_item(11, 3, 6)], mrope), 2, 12)
    assert plan.reused_tokens == 2
    assert plan.spans[0].reused_positions().tolist() == [3, 5]
    assert plan.reused_mask().tolist() == [False, True, False, True] + [False] * 8
    assert plan.dropped_mask().tolist() == [False, False, True, False, True] + [False] * 7


def test_a_pinned_segment_is_neither_evicted_nor_compressed():
    store = SegmentStore(Allocator(64), Pool(64), compress_budget=0.5)
    pinned = store.reserve((1, 8), 8, torch.arange(8)[None], torch.rand(8))
    pinned.pinned = True
    other = store.fill((2, 8), store.allocator.alloc(8), torch.arange(8)[None], torch.rand(8))
    assert store.compress_lru(100, 0.5) == 4 and not pinned.compressed and other.compressed
    assert store.evict_lru(100) == 4 and (1, 8) in store and (2, 8) not in store
    pinned.pinned = False
    assert store.evict_lru(100) == 8 and len(store) == 0


def test_plans_look_up_and_fill_in_their_own_namespace_only(store):
    mrope = torch.arange(14).repeat(3, 1)
    tenant_a, tenant_b = Namespace("seed-a", None), Namespace("seed-b", None)
    store.fill(_key(11, 4, tenant_a), store.allocator.alloc(4), mrope[:, 3:7])
    items = [_item(11, 3, 6)]
    same = plan_request(store, 0, _mm(items, mrope, tenant_a), 2, 12)
    assert len(same.spans) == 1 and same.fills == ()  # the paired hit
    other = plan_request(store, 0, _mm(items, mrope, tenant_b), 2, 12)
    assert other.spans == () and [f.key for f in other.fills] == [_key(11, 4, tenant_b)]
    shared = plan_request(store, 0, _mm(items, mrope, SHARED), 2, 12)
    assert shared.spans == () and [f.key for f in shared.fills] == [_key(11, 4)]


def test_an_untagged_request_reuses_and_fills_nothing(store):
    mrope = torch.arange(14).repeat(3, 1)
    store.fill(_key(11, 4), store.allocator.alloc(4), mrope[:, 3:7])
    plan = plan_request(store, 0, _mm([_item(11, 3, 6), _item(22, 8, 11)], mrope, None), 2, 12)
    assert plan.spans == () and plan.fills == ()
    assert plan.images == ((3, 7), (8, 12))  # still known as images of the extend

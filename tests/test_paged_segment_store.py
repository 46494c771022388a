"""The segment store over a paged allocator (``--page-size`` above 1).

:class:`PagedAllocator` keeps SGLang's ``PagedTokenToKVPoolAllocator`` contract:
``alloc(n)`` hands out ``n // page`` whole pages (``n`` must be a multiple of the
page size), ``free(idx)`` releases every page an index touches. It also asserts
what a correct caller guarantees: no page is freed twice, and no page is freed
while part of it is still in use (every slot of a freed page is in the freed set).
A segment owns whole pages, the store counts the slots it holds, and the ledger
(free + store + requests = size) stays exact through fill, compression, eviction
and an L3 load.
"""

from __future__ import annotations

import torch

from sgl_mmkv.refresh.plan import plan_request
from sgl_mmkv.segments.storage import KVFingerprint, open_storage
from sgl_mmkv.segments.store import SegmentStore
from tests.test_segment_store import Pool, _item, _key, _mm

PAGE = 4
SIZE = 64  # slots 1..64 as pages 1..16; page 0 (slots 0..3) is SGLang's padding page


class PagedAllocator:
    """SGLang's paged token allocator contract, with page ledger checks."""

    def __init__(self, size: int, page_size: int = PAGE) -> None:
        self.size, self.page_size = size, page_size
        self.free_pages = list(range(1, size // page_size + 1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int):
        assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        pages = torch.tensor(out, dtype=torch.int64)
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        slots = free_index.tolist()
        assert len(set(slots)) == len(slots), "a slot freed twice in one call"
        for page in sorted({s // self.page_size for s in slots}):
            assert page not in self.free_pages, f"page {page} freed twice"
            whole = set(range(page * self.page_size, (page + 1) * self.page_size))
            assert whole <= set(slots), f"page {page} freed while part of it is in use"
            self.free_pages.append(page)

    def held(self, slots: torch.Tensor) -> set[int]:
        """The pages ``slots`` lie in."""
        return {s // self.page_size for s in slots.tolist()}


def paged_store(compress_budget: float | None = None, storage=None) -> SegmentStore:
    return SegmentStore(PagedAllocator(SIZE), Pool(SIZE + PAGE), compress_budget, storage)


def ledger(store: SegmentStore, requests: int) -> int:
    """Free slots + store slots + request slots: the pool's size when nothing leaked."""
    return store.allocator.available_size() + store.num_tokens + requests


def test_a_segment_owns_whole_pages_and_its_tokens_are_the_first_of_them():
    store = paged_store()
    src = store.allocator.alloc(8)  # a request row: two pages
    segment = store.fill((7, 5), src[:5], torch.arange(5)[None])
    assert segment.slots.numel() == 5 and segment.pages.numel() == 8
    assert torch.equal(segment.slots, segment.pages[:5])
    assert store.num_tokens == 8 and segment.num_tokens == 8
    assert store.allocator.available_size() == SIZE - 16 and ledger(store, 8) == SIZE
    assert store.allocator.held(segment.pages).isdisjoint(store.allocator.held(src))
    for layer in range(2):
        assert torch.equal(store.kv_pool.k[layer][segment.slots], store.kv_pool.k[layer][src[:5]])
        assert torch.equal(store.kv_pool.v[layer][segment.slots], store.kv_pool.v[layer][src[:5]])
    # a segment of exactly one page holds one page
    assert store.fill((8, 4), src[:4], torch.arange(4)[None]).num_tokens == 4
    assert store.num_tokens == 12 and ledger(store, 8) == SIZE


def test_eviction_frees_whole_pages_each_once_and_the_ledger_is_exact():
    store = paged_store()
    src = store.allocator.alloc(20)
    for key, n in enumerate((5, 9, 3)):  # 8 + 12 + 4 slots
        store.fill((key, n), src[:n], torch.arange(n)[None])
    assert store.num_tokens == 24 and ledger(store, 20) == SIZE
    assert store.evict_lru(1) == 8  # the oldest, all its pages
    assert store.counters.evicted_tokens == 8 and store.num_tokens == 16
    assert ledger(store, 20) == SIZE
    assert store.evict_lru(100) == 16 and store.num_tokens == 0
    store.allocator.free(src)
    assert store.allocator.available_size() == SIZE
    assert sorted(store.allocator.free_pages) == list(range(1, SIZE // PAGE + 1))


def test_a_new_segment_makes_room_in_whole_pages():
    store = paged_store()
    for key in range(3):
        store.reserve((key, 6), 6, torch.arange(6)[None])  # 8 slots each
    running = store.allocator.alloc(store.allocator.available_size() - 4)
    assert store.allocator.available_size() == 4
    segment = store.reserve((9, 5), 5, torch.arange(5)[None])  # needs 8: one page short
    assert segment is not None and segment.num_tokens == 8
    assert (0, 6) not in store and len(store) == 3 and store.counters.evictions == 1
    assert store.allocator.available_size() == 4 and ledger(store, running.numel()) == SIZE
    store.discard((9, 5))
    assert store.num_tokens == 16 and store.allocator.available_size() == 12


def test_compression_moves_the_kept_tokens_into_the_first_pages_and_frees_the_rest():
    store = paged_store()
    src = store.allocator.alloc(16)
    ranking = torch.arange(16, dtype=torch.float32).flip(0)  # token 0 ranks highest
    ranking[[3, 9, 14]] = 100.0
    segment = store.fill((3, 16), src, torch.arange(16)[None], ranking=ranking)
    pages_before = segment.pages.clone()
    k_before = [store.kv_pool.k[layer][segment.slots].clone() for layer in range(2)]
    v_before = [store.kv_pool.v[layer][segment.slots].clone() for layer in range(2)]
    # budget 0.3 of 16: the top 5 tokens, in two pages; the two pages keep the top 8
    assert store.compress(segment, 0.3) == 8
    assert segment.kept.tolist() == [0, 1, 2, 3, 4, 5, 9, 14]
    assert torch.equal(segment.pages, pages_before[:8])
    assert torch.equal(segment.slots, pages_before[:8])
    for layer in range(2):
        assert torch.equal(store.kv_pool.k[layer][segment.slots], k_before[layer][segment.kept])
        assert torch.equal(store.kv_pool.v[layer][segment.slots], v_before[layer][segment.kept])
    assert store.num_tokens == 8 and ledger(store, 16) == SIZE
    assert store.counters.compressions == 1 and store.counters.compressed_tokens == 8
    assert store.compress(segment, 0.1) == 0  # compressed once only
    # a plan reuses the kept tokens from the moved slots
    mrope = torch.arange(20).repeat(3, 1)
    store._segments[_key(11, 16)] = store._segments.pop((3, 16))
    segment.key = _key(11, 16)
    segment.positions = mrope[:, 2:18]
    plan = plan_request(store, 0, _mm([_item(11, 2, 17)], mrope), 0, 20)
    (span,) = plan.spans
    assert span.reused_positions().tolist() == [2, 3, 4, 5, 6, 7, 11, 16]
    assert torch.equal(span.source_slots(), segment.slots)
    assert store.evict_lru(1) == 8 and ledger(store, 16) == SIZE


def test_compression_that_would_free_no_page_leaves_the_segment_whole():
    store = paged_store(compress_budget=0.9)
    segment = store.fill((1, 5), store.allocator.alloc(8)[:5], torch.arange(5)[None], torch.rand(5))
    assert store.compress(segment, 0.9) == 0 and not segment.compressed
    assert store.compress_for(100) == 0 and segment.num_tokens == 8


def test_pressure_compresses_in_whole_pages_before_evicting():
    store = paged_store(compress_budget=0.5)
    src = store.allocator.alloc(16)
    first = store.fill((1, 16), src, torch.arange(16)[None], torch.rand(16))
    second = store.fill((2, 16), src, torch.arange(16)[None], torch.rand(16))
    running = store.allocator.alloc(store.allocator.available_size())
    assert store.allocator.available_size() == 0
    assert store.reserve((3, 6), 6, torch.arange(6)[None]) is not None  # 8 slots
    assert first.compressed and not second.compressed and first.num_tokens == 8
    assert store.counters.evictions == 0 and store.num_tokens == 8 + 16 + 8
    assert ledger(store, 16 + running.numel()) == SIZE


def test_a_segment_loaded_from_storage_gets_whole_pages(tmp_path):
    pool = Pool(SIZE + PAGE)
    fingerprint = KVFingerprint.of_pool(pool, "models/m")
    a = SegmentStore(
        PagedAllocator(SIZE), pool, None, open_storage("file", fingerprint, str(tmp_path))
    )
    src = a.allocator.alloc(8)
    key = _key(5, 6)
    written = a.fill(key, src[:6], torch.arange(18).reshape(3, 6))
    assert a.storage.drain() and written.persisted
    b = SegmentStore(
        PagedAllocator(SIZE),
        Pool(SIZE + PAGE),
        None,
        open_storage("file", fingerprint, str(tmp_path)),
    )
    loaded = b.lookup(key)
    assert loaded is not None and b.counters.loaded == 1
    assert loaded.slots.numel() == 6 and loaded.num_tokens == 8 and b.num_tokens == 8
    assert b.allocator.available_size() == SIZE - 8
    for layer in range(2):
        assert torch.equal(b.kv_pool.k[layer][loaded.slots], a.kv_pool.k[layer][src[:6]])
    assert b.evict_lru(1) == 8 and b.allocator.available_size() == SIZE


def test_a_prefix_that_ends_inside_an_image_at_a_page_boundary_reuses_the_rest():
    # Row: 0-5 text, 6-11 image (stored 4 positions earlier), 12-19 text. The radix
    # match is page-granular: it ends at 8, inside the image.
    store = paged_store()
    mrope = torch.arange(20).repeat(3, 1)
    segment = store.fill(_key(22, 6), store.allocator.alloc(8)[:6], mrope[:, 6:12] - 4)
    assert segment.num_tokens == 8
    plan = plan_request(store, 0, _mm([_item(22, 6, 11)], mrope), 8, 12)
    (span,) = plan.spans
    assert (span.start, span.end, span.delta, span.image_start) == (8, 12, 4, 6)
    assert span.reused_positions().tolist() == [8, 9, 10, 11]
    assert torch.equal(span.source_slots(), segment.slots[2:])
    assert plan.fills == () and plan.reused_tokens == 4


def test_reserve_then_discard_returns_exactly_the_pages_taken():
    store = paged_store()
    for n in (1, 3, 4, 5, 16, 17):
        segment = store.reserve((1, n), n, torch.arange(n)[None])
        size = -(-n // PAGE) * PAGE
        assert segment.num_tokens == size and store.num_tokens == size, n
        assert segment.slots.numel() == n and store.allocator.available_size() == SIZE - size
        store.discard((1, n))
        assert store.allocator.available_size() == SIZE and store.num_tokens == 0, n

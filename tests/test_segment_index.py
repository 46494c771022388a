"""SegmentIndex: each image item of a request classed once as prefix / reusable / new."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_mmkv.segments.index import SegmentIndex

IMAGE = SimpleNamespace(name="IMAGE")


def _item(h: int, start: int, end: int, grid: tuple[int, ...] = (1, 4, 4)):
    return SimpleNamespace(
        hash=h, offsets=[(start, end)], modality=IMAGE, image_grid_thw=torch.tensor(grid)
    )


def _req(rid: str, items: list[tuple[int, int, int]], **request):
    """items: (hash, start, end) with inclusive end, as SGLang's offsets."""
    mm_items = [_item(h, s, e) for h, s, e in items]
    return SimpleNamespace(rid=rid, multimodal_inputs=SimpleNamespace(mm_items=mm_items), **request)


def test_classes_prefix_reusable_and_new():
    index = SegmentIndex()
    assert index.observe(_req("a", [(1, 10, 25), (2, 30, 45)]), matched_len=5) == {
        "prefix": 0,
        "reusable": 0,
        "new": 2,
    }
    # Same images after another prefix: no prefix hit, both reusable.
    assert index.observe(_req("b", [(2, 12, 27), (1, 31, 46)]), matched_len=4) == {
        "prefix": 0,
        "reusable": 2,
        "new": 0,
    }
    # Exact repeat of "a": both inside the matched prefix.
    assert index.observe(_req("c", [(1, 10, 25), (2, 30, 45)]), matched_len=60) == {
        "prefix": 2,
        "reusable": 0,
        "new": 0,
    }
    c = index.counters
    assert (c.requests, c.image_items, c.prefix_items, c.reusable_items, c.new_items) == (
        3,
        6,
        2,
        2,
        2,
    )
    assert (c.image_tokens, c.prefix_tokens, c.reusable_tokens, c.new_tokens) == (96, 32, 32, 32)


def test_a_request_is_counted_once_and_text_only_not_at_all():
    index = SegmentIndex()
    req = _req("a", [(7, 3, 18)])
    assert index.observe(req, 0) is not None
    assert index.observe(req, 0) is None  # rematched on a later scheduling round
    assert index.observe(_req("t", []), 0) is None
    assert index.counters.requests == 1


def test_an_item_ending_exactly_at_the_match_is_not_a_prefix_hit():
    index = SegmentIndex()
    assert index.observe(_req("a", [(1, 10, 25)]), matched_len=25)["new"] == 1
    assert index.observe(_req("b", [(1, 10, 25)]), matched_len=26)["prefix"] == 1


def test_lru_forgets_old_contents():
    index = SegmentIndex(capacity=2)
    for i, h in enumerate((1, 2, 3)):
        index.observe(_req(f"r{i}", [(h, 0, 15)]), 0)
    assert index.observe(_req("x", [(1, 0, 15)]), 0)["new"] == 1  # 1 was evicted
    assert index.observe(_req("y", [(3, 0, 15)]), 0)["reusable"] == 1


def test_the_same_image_is_what_the_segment_store_calls_the_same():
    """One definition of "the same image" (its segment key): another tenant, grid or
    length is another image even with the same content hash."""
    index = SegmentIndex()
    index.observe(_req("a", [(5, 10, 25)]), matched_len=0)
    assert index.observe(_req("b", [(5, 40, 55)], cache_salt="other"), 0)["new"] == 1
    other_grid = _req("c", [])
    other_grid.multimodal_inputs.mm_items = [_item(5, 40, 55, grid=(1, 2, 8))]
    assert index.observe(other_grid, 0)["new"] == 1
    assert index.observe(_req("d", [(5, 40, 63)]), 0)["new"] == 1  # 24 tokens, not 16
    assert index.observe(_req("e", [(5, 70, 85)]), 0)["reusable"] == 1  # the paired hit

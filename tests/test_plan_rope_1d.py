"""Reuse plans for a 1-D RoPE model (no ``mrope_positions``) whose image item is laid
out in several placeholder runs (LLaVA / Pixtral rows separated by ``[IMG_BREAK]``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sgl_mmkv.refresh.plan import plan_request, row_positions
from sgl_mmkv.segments.key import NAMESPACE_ATTR, Namespace, item_key, item_span
from sgl_mmkv.segments.store import SegmentStore
from tests.test_segment_store import Allocator, Pool

SHARED = Namespace(None, None)


def _item(h, runs):
    return SimpleNamespace(hash=h, offsets=runs, modality=SimpleNamespace(name="IMAGE"))


def _mm(items):
    mm = SimpleNamespace(mm_items=items, mrope_positions=None)
    setattr(mm, NAMESPACE_ATTR, SHARED)
    return mm


def test_rows_of_one_image_make_one_span_with_their_separators():
    # 3 rows of 2 [IMG] at 4-5, 7-8, 10-11; [IMG_BREAK] at 6 and 9.
    assert item_span(_item(1, [(4, 5), (7, 8), (10, 11)])) == (4, 12)
    assert item_span(_item(1, [(10, 11), (4, 5)])) == (4, 12)  # order-free
    assert item_span(_item(1, [(4, 6), (6, 8)])) is None  # overlapping runs
    assert item_span(_item(None, [(4, 5)])) is None  # no content hash
    assert item_span(_item(1, [])) is None


def test_1d_positions_give_one_delta_for_an_image_moved_as_a_whole():
    assert row_positions(_mm([]), 3, 6).tolist() == [[3, 4, 5]]
    store = SegmentStore(Allocator(64), Pool(64))
    runs = [(4, 5), (7, 8), (10, 11)]
    key = item_key(_item(7, runs), SHARED, 8)
    # First seen at row positions 2..9 (a shorter system prompt).
    store.fill(key, store.allocator.alloc(8), torch.arange(2, 10)[None])
    plan = plan_request(store, 0, _mm([_item(7, runs)]), 0, 14)
    assert [(s.start, s.end, s.delta) for s in plan.spans] == [(4, 12, 2)]
    assert plan.reused_tokens == 8
    assert plan.visual.nonzero().flatten().tolist() == list(range(4, 12))

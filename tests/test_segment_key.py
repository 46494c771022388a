"""Segment keys: SGLang's namespace of the request plus the image's full identity."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.utils import storage_namespace_seed

from sgl_mmkv.segments.index import SegmentIndex
from sgl_mmkv.segments.key import (
    NAMESPACE_ATTR,
    UNTAGGED,
    Namespace,
    item_key,
    read_namespace,
    request_namespace,
    tag_namespace,
)

IMAGE = SimpleNamespace(name="IMAGE")
_RIDS = itertools.count()  # id() of a freed list is reused, so rids come from a counter


def _req(extra_key=None, cache_salt=None, lora_id=None, items=()):
    """A scheduler ``Req`` as SGLang builds it: the LoRA id is appended to extra_key."""
    if lora_id is not None:
        extra_key = (extra_key or "") + lora_id
    mm = SimpleNamespace(mm_items=list(items)) if items else None
    return SimpleNamespace(
        rid=f"r{next(_RIDS)}",
        extra_key=extra_key,
        cache_salt=cache_salt,
        lora_id=lora_id,
        multimodal_inputs=mm,
    )


def _item(h=7, identity=None, grid=None, start=0, end=15):
    item = SimpleNamespace(hash=h, identity=identity, modality=IMAGE, offsets=[(start, end)])
    if grid is not None:
        item.image_grid_thw = torch.tensor([grid])
    return item


def test_the_namespace_is_sglangs_storage_seed():
    ns = request_namespace(_req(extra_key="k", cache_salt="s"))
    assert ns.seed == storage_namespace_seed("k", "s") and ns.lora_id is None
    assert request_namespace(_req()) == Namespace(None, None)  # unsalted requests share


def test_salts_extra_keys_and_adapters_never_share_a_key():
    namespaces = [
        request_namespace(_req()),
        request_namespace(_req(cache_salt="a")),
        request_namespace(_req(cache_salt="b")),
        request_namespace(_req(extra_key="a")),
        request_namespace(_req(lora_id="adapter-1")),
        request_namespace(_req(lora_id="adapter-2")),
        # stock concatenates extra_key and the LoRA id; the id is kept apart here
        request_namespace(_req(extra_key="adapter-1")),
    ]
    keys = {item_key(_item(), ns, 16) for ns in namespaces}
    assert len(keys) == len(namespaces)
    # the paired hit: the same request twice gives the same key
    twice = {item_key(_item(), request_namespace(_req(lora_id="adapter-1")), 16) for _ in "ab"}
    assert len(twice) == 1


def test_the_content_part_is_the_full_identity_grid_and_length():
    ns = Namespace(None, None)
    full = bytes(range(32))
    assert item_key(_item(identity=full), ns, 16).content == full
    assert item_key(_item(h=7), ns, 16).content == (7).to_bytes(8, "big")
    assert item_key(_item(grid=(1, 4, 4)), ns, 16) != item_key(_item(grid=(1, 2, 8)), ns, 16)
    assert item_key(_item(), ns, 16) != item_key(_item(), ns, 8)


def test_tagging_records_the_namespace_on_the_inputs():
    req = _req(cache_salt="s", items=[_item()])
    assert read_namespace(req.multimodal_inputs) is UNTAGGED
    tag_namespace(req)
    assert getattr(req.multimodal_inputs, NAMESPACE_ATTR) == request_namespace(req)
    tag_namespace(_req())  # text-only: nothing to tag, no error


def test_the_index_calls_an_image_reusable_only_within_its_namespace():
    index = SegmentIndex()
    assert index.observe(_req(cache_salt="a", items=[_item(start=10, end=25)]), 0)["new"] == 1
    other = index.observe(_req(cache_salt="b", items=[_item(start=12, end=27)]), 0)
    assert other == {"prefix": 0, "reusable": 0, "new": 1}
    same = index.observe(_req(cache_salt="a", items=[_item(start=14, end=29)]), 0)
    assert same == {"prefix": 0, "reusable": 1, "new": 0}
    index.forget_contents()
    again = index.observe(_req(cache_salt="a", items=[_item(start=16, end=31)]), 0)
    assert again == {"prefix": 0, "reusable": 0, "new": 1}

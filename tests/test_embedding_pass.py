"""A refresh pass's language-model inputs are the full extend's, at its active rows;
Qwen3-VL, whose DeepStack inputs need that, is on the refresh allow-list. An image
whose segment holds its vision-encoder output is not encoded again, and the input
embeddings are bit for bit stock's."""

from __future__ import annotations

import pytest
import torch

from sgl_mmkv.refresh.embedding_pass import EmbeddingPass
from sgl_mmkv.segments.store import SegmentStore


def test_active_inputs_gathers_every_token_input_at_the_pass_rows():
    embeds = torch.arange(12.0).reshape(6, 2)
    deepstack = torch.arange(24.0).reshape(6, 4)  # (n_extend, hidden * 2 DeepStack layers)
    state = EmbeddingPass(full_batch=None, embeds=embeds)
    state.token_inputs = {"input_deepstack_embeds": deepstack}
    state.index = torch.tensor([1, 4, 5])
    rows = state.active_inputs()
    assert list(rows) == ["input_deepstack_embeds"]
    assert torch.equal(rows["input_deepstack_embeds"], deepstack[[1, 4, 5]])
    assert rows["input_deepstack_embeds"].shape == (3, 4)


def test_no_token_inputs_for_a_model_without_deepstack():
    state = EmbeddingPass(full_batch=None, embeds=torch.zeros(3, 2))
    state.index = torch.tensor([0, 2])
    assert state.active_inputs() == {}


def test_qwen3_vl_passes_the_refresh_allow_list(tiny_qwen3_vl):
    import json

    from sgl_mmkv.support import check_model, rope_type

    check_model("--mm-reuse conduit", str(tiny_qwen3_vl))  # raises ConfigError if refused
    # Interleaved M-RoPE is a plain rotary: no scaling for re-positioning to miss.
    assert rope_type(json.loads((tiny_qwen3_vl / "config.json").read_text())) is None


def test_the_stored_embedding_layout_of_qwen3_vl_holds_its_deepstack_features(tiny_qwen3_vl):
    """What a segment stores per image token is the width SGLang's Qwen3-VL encoder
    returns (``out_hidden_size x (1 + DeepStack layers)``), in the model dtype."""
    from sglang.srt.configs.model_config import ModelConfig

    from sgl_mmkv.segments.fingerprint import embedding_layout

    config = ModelConfig(str(tiny_qwen3_vl), dtype="bfloat16")
    vision = config.hf_config.vision_config
    assert len(vision.deepstack_visual_indexes) == 2
    width = vision.out_hidden_size * (1 + len(vision.deepstack_visual_indexes))
    assert embedding_layout(config) == (width, "torch.bfloat16") == (3 * 128, "torch.bfloat16")


# -- image embeddings that travel with segments (refresh/segment_embeddings.py) -------
# Through SGLang 0.5.23's own embed_mm_inputs: its ViT cache, per-image batching, and
# the per-request path of images laid out in several runs.

WIDTH = 8
SEQ = 16


class Tower:
    """A vision tower: each image's output depends on the image alone."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def get_image_feature(self, items):
        self.calls.append([item.hash for item in items])
        return torch.cat([features(item) for item in items])


def features(item) -> torch.Tensor:
    from sgl_mmkv.refresh.segment_embeddings import item_rows

    generator = torch.Generator().manual_seed(item.hash % 2**31)
    return torch.randn(item_rows(item), WIDTH, generator=generator)


def image(h: int, *runs: tuple[int, int]):
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    item = MultimodalDataItem(modality=Modality.IMAGE, offsets=list(runs))
    item.set_hash(h)
    return item


def request(items, namespace):
    from sglang.srt.managers.schedule_batch import MultimodalInputs

    from sgl_mmkv.segments.key import NAMESPACE_ATTR

    mm = MultimodalInputs(mm_items=items)
    setattr(mm, NAMESPACE_ATTR, namespace)
    return mm


def batch(requests):
    from types import SimpleNamespace

    ids = []
    for mm in requests:
        row = torch.arange(SEQ) % 7
        for item in mm.mm_items:
            for start, end in item.offsets:
                n = end - start + 1
                row[start : end + 1] = torch.tensor(item.padding_sequence(n))
        ids.append(row)
    mode = SimpleNamespace(is_decode=lambda: False, is_target_verify=lambda: False)
    return SimpleNamespace(
        forward_mode=mode,
        contains_mm_inputs=lambda: True,
        mm_inputs=requests,
        extend_prefix_lens_cpu=[0] * len(requests),
        extend_seq_lens_cpu=[SEQ] * len(requests),
        input_ids=torch.cat(ids),
    )


def stored_segment(store, item, namespace):
    """``item``'s segment in ``store``, holding what the tower returns for it."""
    from sgl_mmkv.segments.key import item_key, item_span

    start, end = item_span(item)
    key = item_key(item, namespace, end - start)
    store.fill(key, store.allocator.alloc(end - start), torch.arange(end - start)[None])
    assert store.attach_embeddings(store.peek(key), features(item))
    return key


@pytest.fixture
def vit_cache(monkeypatch):
    from sglang.srt.managers import mm_schedule
    from sglang.srt.mem_cache.multimodal_cache import MultiModalStaticCache

    cache = MultiModalStaticCache(2**26)
    monkeypatch.setattr(mm_schedule, "embedding_cache", cache)
    return cache


def embed(forward_batch, tower, funcs=None) -> torch.Tensor:
    """SGLang's input embeddings of the batch: ``(n_tokens, WIDTH)``."""
    from sglang.srt.managers.mm_utils import embed_mm_inputs

    torch.manual_seed(0)
    table = torch.nn.Embedding(7, WIDTH)
    n = len(forward_batch.mm_inputs)
    embeds, _ = embed_mm_inputs(
        forward_batch.mm_inputs, [0] * n, [SEQ] * n, forward_batch.input_ids.clone(), table,
        tower, funcs,
    )  # fmt: skip
    return embeds


def run(store, forward_batch, tower):
    """The embeddings built with the segment encoders, and what they captured."""
    from sgl_mmkv.refresh.segment_embeddings import SegmentEncoders

    build = SegmentEncoders.of_batch(store, forward_batch)
    embeds = embed(forward_batch, tower, build.encoders(tower, None))
    return embeds, build.finish()


def test_an_image_a_segment_holds_skips_the_tower_and_the_embeddings_equal_stock(vit_cache):
    from sgl_mmkv.segments.key import Namespace, item_key
    from tests.test_segment_store import Allocator, Pool

    shared = Namespace(None, None)
    a, b, c = image(101, (1, 4)), image(102, (6, 9)), image(103, (11, 14))
    stock_tower = Tower()
    want = embed(batch([request([a, b, c], shared)]), stock_tower)
    assert stock_tower.calls == [[a.hash, b.hash, c.hash]]
    vit_cache.clear()
    store = SegmentStore(Allocator(64), Pool(64))
    stored_key = stored_segment(store, b, shared)
    tower = Tower()
    got, captured = run(store, batch([request([a, b, c], shared)]), tower)
    assert torch.equal(got, want)  # bit for bit
    assert tower.calls == [[a.hash, c.hash]]
    assert (store.counters.vision_skipped, store.counters.vision_encoded) == (1, 2)
    # SGLang's ViT cache keeps what this server computed, not the segment's copy
    assert vit_cache.has(a.hash) and vit_cache.has(c.hash) and not vit_cache.has(b.hash)
    assert set(captured) == {item_key(a, shared, 4), item_key(c, shared, 4)}
    assert stored_key not in captured
    assert torch.equal(captured[item_key(c, shared, 4)], features(c))


def test_another_namespace_showing_the_image_in_the_batch_keeps_the_tower(vit_cache):
    from sgl_mmkv.segments.key import Namespace
    from tests.test_segment_store import Allocator, Pool

    mine, theirs = Namespace("tenant-a", None), Namespace("tenant-b", None)
    store = SegmentStore(Allocator(64), Pool(64))
    stored_segment(store, image(102, (6, 9)), mine)
    both = [request([image(102, (6, 9))], mine), request([image(102, (6, 9))], theirs)]
    tower = Tower()
    run(store, batch(both), tower)
    assert tower.calls == [[102]] and store.counters.vision_skipped == 0
    vit_cache.clear()
    alone = [request([image(102, (6, 9))], mine), request([image(102, (6, 9))], mine)]
    tower = Tower()
    run(store, batch(alone), tower)
    assert tower.calls == [] and store.counters.vision_skipped == 1
    assert not vit_cache.has(102)


def test_an_image_in_several_runs_is_supplied_and_its_combined_entry_removed(vit_cache):
    """Pixtral lays an image out in rows: SGLang encodes such a request's images together
    and caches them under their combined hash."""
    from sglang.srt.mem_cache.multimodal_cache import MultimodalCache

    from sgl_mmkv.segments.key import Namespace
    from tests.test_segment_store import Allocator, Pool

    shared = Namespace(None, None)
    rows, other = image(201, (1, 3), (5, 7)), image(202, (9, 12))
    stock_tower = Tower()
    want = embed(batch([request([rows, other], shared)]), stock_tower)
    combined = MultimodalCache.combine_hashes([201, 202])
    assert stock_tower.calls == [[201, 202]] and vit_cache.has(combined)
    vit_cache.clear()
    store = SegmentStore(Allocator(64), Pool(64))
    stored_segment(store, rows, shared)
    tower = Tower()
    got, captured = run(store, batch([request([rows, other], shared)]), tower)
    assert torch.equal(got, want) and tower.calls == [[202]]
    assert not vit_cache.has(combined) and len(captured) == 1


def test_an_encoder_result_that_cannot_be_split_is_left_to_sglang(vit_cache):
    from types import SimpleNamespace

    from sgl_mmkv.refresh.segment_embeddings import SegmentEncoders
    from sgl_mmkv.segments.key import Namespace
    from tests.test_segment_store import Allocator, Pool

    shared = Namespace(None, None)
    a, b = image(101, (1, 4)), image(102, (6, 9))
    store = SegmentStore(Allocator(64), Pool(64))
    stored_segment(store, b, shared)
    build = SegmentEncoders.of_batch(store, batch([request([a, b], shared)]))
    calls, pruned = [], SimpleNamespace(embedding=None)  # an EVS result, say
    out = build.encode(lambda items: calls.append(len(items)) or pruned, [a, b])
    assert out is pruned and calls == [1, 2]  # then every image, as stock
    assert build.finish() == {} and store.counters.vision_skipped == 0


def test_a_failure_with_stored_embeddings_encodes_every_image_as_stock(vit_cache):
    from sgl_mmkv.refresh.segment_embeddings import SegmentEncoders
    from sgl_mmkv.segments.key import Namespace
    from tests.test_segment_store import Allocator, Pool

    shared = Namespace(None, None)
    a, b = image(101, (1, 4)), image(102, (6, 9))
    store = SegmentStore(Allocator(64), Pool(64))
    stored_segment(store, b, shared)
    build = SegmentEncoders.of_batch(store, batch([request([a, b], shared)]))
    build.supply[b.hash] = "not a tensor"  # whatever goes wrong placing it
    tower = Tower()
    out = build.encode(tower.get_image_feature, [a, b])
    assert tower.calls == [[a.hash], [a.hash, b.hash]]
    assert torch.equal(out, torch.cat([features(a), features(b)]))
    assert store.counters.vision_skipped == 0


def test_no_build_without_images_in_an_extend():
    from types import SimpleNamespace

    from sgl_mmkv.refresh.segment_embeddings import SegmentEncoders

    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True))
    text = batch([request([], None)])
    text.contains_mm_inputs = lambda: False
    for forward_batch in (decode, text):
        assert SegmentEncoders.of_batch(None, forward_batch) is None


def test_the_slot_hands_captured_embeddings_over_once():
    from sgl_mmkv.refresh.embedding_pass import EmbeddingSlot

    slot = EmbeddingSlot()
    slot.captured = {"key": torch.zeros(2, 3)}
    assert list(slot.take_captured()) == ["key"] and slot.take_captured() == {}

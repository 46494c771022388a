"""Segments in SGLang's L3 storage: round trips through the real ``file`` backend,
corrupt / truncated / foreign entries are misses, a failing backend is a miss."""

from __future__ import annotations

import os

import pytest
import torch

from sgl_mmkv.segments.key import Namespace, SegmentKey
from sgl_mmkv.segments.storage import (
    HEADER_BYTES,
    KVFingerprint,
    SegmentStorage,
    StorageError,
    StoredSegment,
    open_storage,
    storage_backends,
)
from sgl_mmkv.segments.store import SegmentStore
from tests.test_segment_store import Allocator, Pool

SHARED = Namespace(None, None)
FINGERPRINT = KVFingerprint("models/m", "torch.float32", 2, 2, 4, 4)


def key(content: int = 7, namespace: Namespace = SHARED, n: int = 5) -> SegmentKey:
    return SegmentKey(namespace, content.to_bytes(32, "big"), "IMAGE", (1, 4, 4), n)


def stored(n: int = 5, compressed: bool = False, dtype=torch.float32) -> StoredSegment:
    torch.manual_seed(n)
    kept = torch.tensor([0, 2, 3]) if compressed else None
    m = 3 if compressed else n
    return StoredSegment(
        positions=torch.arange(3 * n).reshape(3, n),
        kept=kept,
        ranking=torch.rand(n) if compressed else None,
        keys=torch.randn(2, m, 2, 4).to(dtype),
        values=torch.randn(2, m, 2, 4).to(dtype),
    )


@pytest.fixture
def storage(tmp_path) -> SegmentStorage:
    return open_storage("file", FINGERPRINT, directory=str(tmp_path))


def files(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".bin"))


def assert_same(a: StoredSegment, b: StoredSegment) -> None:
    for name in ("positions", "kept", "ranking", "keys", "values"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name  # bit for bit


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_through_sglang_file_backend_is_bit_exact(storage, tmp_path, compressed, dtype):
    original = stored(compressed=compressed, dtype=dtype)
    assert storage.save(key(), original)
    assert len(files(tmp_path)) == 3  # the start-up probe, header and payload
    loaded = storage.load(key())
    assert_same(original, loaded)
    c = storage.counters
    assert (c.writes, c.lookups, c.hits, c.misses, c.corrupt) == (1, 1, 1, 0, 0)
    # a second instance on the same directory reads it, and does not write it again
    other = open_storage("file", FINGERPRINT, directory=str(tmp_path))
    assert_same(original, other.load(key()))
    assert other.save(key(), original) and other.counters.write_skipped == 1
    assert other.counters.writes == 0


def test_other_namespace_or_fingerprint_is_a_miss(storage, tmp_path):
    assert storage.save(key(), stored())
    salted = Namespace("salt-seed", None)
    assert storage.load(key(namespace=salted)) is None
    assert storage.load(key(namespace=Namespace(None, "adapter"))) is None
    assert storage.load(key(content=8)) is None
    assert storage.load(key(n=6)) is None
    for changed in (
        KVFingerprint("models/other", "torch.float32", 2, 2, 4, 4),
        KVFingerprint("models/m", "torch.bfloat16", 2, 2, 4, 4),
        KVFingerprint("models/m", "torch.float32", 3, 2, 4, 4),
        KVFingerprint("models/m", "torch.float32", 2, 1, 4, 4),
        KVFingerprint("models/m", "torch.float32", 2, 2, 8, 8),
    ):
        assert open_storage("file", changed, directory=str(tmp_path)).load(key()) is None
    assert storage.counters.misses == 4 and storage.counters.hits == 0


def test_entry_under_a_foreign_header_is_a_miss(storage, tmp_path):
    """An intact entry whose header names another key (a renamed file) is not used."""
    assert storage.save(key(1), stored())
    assert storage.save(key(2), stored(n=6))
    stem1, stem2 = storage.entry_name(key(1)), storage.entry_name(key(2))
    for part in ("_h", "_p"):
        src = [f for f in files(tmp_path) if f.startswith(stem2 + part)][0]
        dst = src.replace(stem2, stem1)
        os.replace(tmp_path / src, tmp_path / dst)
    assert storage.load(key(1)) is None
    assert storage.counters.mismatched == 1 and storage.counters.corrupt == 0


@pytest.mark.parametrize(
    "damage", ["flip_payload", "flip_header", "truncate_payload", "truncate_header", "empty"]
)
def test_corrupt_or_partial_entries_are_misses(storage, tmp_path, damage):
    assert storage.save(key(), stored())
    stem = storage.entry_name(key())
    header = tmp_path / [f for f in files(tmp_path) if f.startswith(stem + "_h")][0]
    payload = tmp_path / [f for f in files(tmp_path) if f.startswith(stem + "_p")][0]
    target = header if "header" in damage else payload
    data = bytearray(target.read_bytes())
    if damage.startswith("flip"):
        data[60 if target == header else len(data) // 2] ^= 0x10
    elif damage.startswith("truncate"):
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    target.write_bytes(bytes(data))
    assert storage.load(key()) is None
    c = storage.counters
    assert (c.hits, c.misses, c.corrupt, c.errors) == (0, 1, 1, 0)


def test_missing_payload_or_directory_is_a_miss(storage, tmp_path):
    assert storage.save(key(), stored())
    stem = storage.entry_name(key())
    os.remove(tmp_path / [f for f in files(tmp_path) if f.startswith(stem + "_p")][0])
    assert storage.load(key()) is None and storage.counters.corrupt == 1
    for f in os.listdir(tmp_path):
        os.remove(tmp_path / f)
    os.rmdir(tmp_path)
    assert storage.load(key()) is None
    assert not storage.save(key(3), stored())  # the write fails quietly
    assert storage.counters.write_failed == 1 and storage.counters.misses == 2


class Raising:
    def exists(self, name):
        raise ConnectionError("backend down")

    def get(self, name, target):
        raise ConnectionError("backend down")

    def set(self, name, value):
        raise ConnectionError("backend down")


class Garbage:
    present = True

    def exists(self, name):
        return self.present

    def get(self, name, target):
        return "not a tensor"

    def set(self, name, value):
        return False


def test_a_raising_or_lying_backend_is_a_miss_never_an_error():
    down = SegmentStorage(Raising(), FINGERPRINT)
    assert down.load(key()) is None and not down.save(key(), stored())
    assert (down.counters.errors, down.counters.misses, down.counters.write_failed) == (2, 1, 1)
    liar = SegmentStorage(Garbage(), FINGERPRINT)
    assert liar.load(key()) is None
    liar.backend.present = False
    assert not liar.save(key(), stored())
    assert (liar.counters.corrupt, liar.counters.write_failed) == (1, 1)


def test_unknown_backend_is_a_clear_start_up_error():
    assert {"file", "mooncake", "hf3fs", "nixl"} <= set(storage_backends())
    with pytest.raises(StorageError, match="--mm-segment-storage nosuch"):
        open_storage("nosuch", FINGERPRINT)


@pytest.mark.parametrize("backend", ["sim", "hf3fs", "nixl", "mooncake"])
def test_a_backend_without_tensor_get_set_is_refused_at_start(tmp_path, backend):
    """SGLang 0.5.23's sim keeps no data; mooncake, hf3fs and nixl cannot be created
    here or lack the tensor API: each is one clear error, never a server that drops
    every write."""
    with pytest.raises(StorageError, match=f"--mm-segment-storage {backend}: "):
        open_storage(backend, FINGERPRINT, directory=str(tmp_path))


def test_probe_is_written_once_and_checked_again(tmp_path):
    open_storage("file", FINGERPRINT, directory=str(tmp_path))
    open_storage("file", FINGERPRINT, directory=str(tmp_path))
    assert len(files(tmp_path)) == 1
    probe = tmp_path / files(tmp_path)[0]
    probe.write_bytes(b"\0" * 64)
    with pytest.raises(StorageError, match="other bytes than were stored"):
        open_storage("file", FINGERPRINT, directory=str(tmp_path))


def test_header_is_fixed_size(storage, tmp_path):
    assert storage.save(key(), stored())
    stem = storage.entry_name(key())
    header = [f for f in files(tmp_path) if f.startswith(stem + "_h")][0]
    assert os.path.getsize(tmp_path / header) == HEADER_BYTES


# -- the store over the storage: write-through on fill, load on a memory miss ----------


def make_store(tmp_path, size: int = 64) -> SegmentStore:
    pool = Pool(size)
    fingerprint = KVFingerprint.of_pool(pool, "models/m")
    return SegmentStore(
        Allocator(size), pool, storage=open_storage("file", fingerprint, str(tmp_path))
    )


def test_fill_writes_through_and_another_store_loads_it_bit_exact(tmp_path):
    a = make_store(tmp_path)
    src = a.allocator.alloc(5)
    positions = torch.arange(15).reshape(3, 5)
    segment = a.fill(key(), src, positions)
    assert segment.persisted and a.storage.counters.writes == 1
    b = make_store(tmp_path)  # a fresh instance: other random pool contents
    loaded = b.lookup(key())
    assert loaded is not None and loaded.persisted and torch.equal(loaded.positions, positions)
    assert b.counters.loaded == 1 and b.counters.fills == 0 and b.num_tokens == 5
    for layer in range(2):
        for get in ("get_key_buffer", "get_value_buffer"):
            want = getattr(a.kv_pool, get)(layer)[src]
            got = getattr(b.kv_pool, get)(layer)[loaded.slots]
            assert torch.equal(want, got)
    assert b.lookup(key()) is loaded  # now a memory hit, no second L3 read
    assert b.storage.counters.lookups == 1 and b.counters.hits == 1
    b.evict_lru(5)
    assert b.lookup(key()) is not None and b.storage.counters.hits == 2
    assert b.storage.counters.writes == 0  # loaded segments are not written back


def test_compressed_segment_loads_with_its_kept_tokens(tmp_path):
    a = make_store(tmp_path)
    ranking = torch.tensor([5.0, 1.0, 4.0, 3.0, 0.0])
    segment = a.reserve(key(), 5, torch.arange(15).reshape(3, 5), ranking)
    a.compress(segment, 0.6)  # keeps tokens 0, 2, 3
    a.write_through(segment)
    b = make_store(tmp_path)
    loaded = b.lookup(key())
    assert loaded.kept.tolist() == [0, 2, 3] and loaded.num_tokens == 3
    assert torch.equal(loaded.ranking, ranking)
    assert torch.equal(b.kv_pool.get_key_buffer(1)[loaded.slots], a.kv_pool.k[1][segment.slots])


def test_no_room_and_shape_mismatch_are_misses(tmp_path):
    a = make_store(tmp_path)
    a.fill(key(), a.allocator.alloc(5), torch.arange(15).reshape(3, 5))
    full = make_store(tmp_path, size=4)  # pool too small for 5 tokens
    assert full.lookup(key()) is None and full.storage.counters.load_skipped == 1
    wrong = SegmentStore(Allocator(64), Pool(64, layers=3), storage=a.storage)
    assert wrong.lookup(key()) is None and a.storage.counters.mismatched == 1


def test_store_without_storage_is_unchanged(tmp_path):
    store = SegmentStore(Allocator(64), Pool(64))
    segment = store.fill(key(), store.allocator.alloc(5), torch.arange(5)[None])
    assert not segment.persisted and store.lookup(key(8)) is None and os.listdir(tmp_path) == []


def test_a_load_that_evicts_a_segment_planned_earlier_in_the_batch_drops_that_span(tmp_path):
    """Request 1's L3 load needs the slots of request 0's planned segment: request 0
    then computes its image fresh instead of copying freed slots."""
    from types import SimpleNamespace

    from sgl_mmkv.refresh.plan import plan_batch
    from tests.test_segment_store import _item, _key, _mm

    mrope = torch.arange(14).repeat(3, 1)
    writer = make_store(tmp_path)
    writer.fill(_key(22, 4), writer.allocator.alloc(4), mrope[:, 3:7])
    b = make_store(tmp_path, size=8)
    b.fill(_key(11, 4), b.allocator.alloc(4), mrope[:, 3:7])
    b.allocator.alloc(4)  # the batch's own rows: the pool is full
    batch = SimpleNamespace(
        mm_inputs=[_mm([_item(11, 3, 6)], mrope), _mm([_item(22, 3, 6)], mrope)],
        batch_size=2,
        extend_prefix_lens_cpu=[2, 2],
        extend_seq_lens_cpu=[12, 12],
    )
    plans = plan_batch(b, batch)
    assert plans[0].spans == [] and plans[0].reused_tokens == 0
    assert [(s.start, s.end, s.delta) for s in plans[1].spans] == [(3, 7, 0)]
    assert b.counters.evictions == 1 and b.counters.loaded == 1
    assert b.storage.counters.hits == 1


def test_an_entry_whose_shapes_do_not_fit_the_fingerprint_is_never_read(storage):
    """Checked from the header alone, before the payload is read or allocated."""
    wrong = stored()
    wrong.keys, wrong.values = torch.randn(3, 5, 2, 4), torch.randn(3, 5, 2, 4)  # 3 layers
    assert storage.save(key(), wrong)
    assert storage.load(key()) is None
    assert (storage.counters.corrupt, storage.counters.bytes_read) == (1, 0)


def test_two_instances_writing_one_image_at_once_never_mix_payloads(storage, tmp_path):
    """Interleaved as A payload, B payload, A header, B header (skipped: present)."""
    from sgl_mmkv.segments.entry_format import encode_header

    other = open_storage("file", FINGERPRINT, directory=str(tmp_path))
    first, second = stored(), stored()
    second.keys = second.keys + 1  # B computed the image under another prefix
    writes = []
    for instance, content in ((storage, first), (other, second)):
        payload = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in
                             (content.positions, content.keys, content.values)])  # fmt: skip
        fields = instance._header_fields(key(), content, payload)
        writes.append((instance, fields, payload))
    name = storage.entry_name(key())
    for instance, fields, payload in writes:
        assert instance.backend.set(fields["payload"], payload)
    for instance, fields, _ in writes:
        assert instance.backend.set(name + "_h", encode_header(fields))
    assert_same(first, other.load(key()))
    assert other.counters.corrupt == 0

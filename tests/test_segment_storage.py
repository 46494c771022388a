"""Segments in SGLang's L3 storage: round trips through the real ``file`` backend,
corrupt / truncated / foreign entries are misses, a failing backend is a miss.

Storage is untrusted input: planted headers are refused before anything is read or
allocated, objects that are not regular files of the directory are never opened as
such, reads wait at most the deadline, writes never wait, the caps hold, a damaged
entry is written again, and the fingerprint tells two models at one path apart.
Entries carry the image's vision-encoder output when the fingerprint has its layout:
bit exact, bounded by the key before allocation, older formats misses.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace

import pytest
import torch

from sgl_mmkv.segments.entry_format import FORMAT_VERSION, key_fields
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
EMBED_WIDTH = 6  # the vision encoder's output per image token, under EMBEDDED
EMBEDDED = KVFingerprint("models/m", "torch.float32", 2, 2, 4, 4, embed_width=EMBED_WIDTH,
                         embed_dtype="torch.bfloat16")  # fmt: skip


def key(content: int = 7, namespace: Namespace = SHARED, n: int = 5) -> SegmentKey:
    return SegmentKey(namespace, content.to_bytes(32, "big"), "IMAGE", (1, 4, 4), n)


def stored(
    n: int = 5, compressed: bool = False, dtype=torch.float32, embeddings: int = 0
) -> StoredSegment:
    """``embeddings``: rows of a ``(rows, EMBED_WIDTH)`` bfloat16 encoder output (0: none)."""
    torch.manual_seed(n)
    kept = torch.tensor([0, 2, 3]) if compressed else None
    m = 3 if compressed else n
    return StoredSegment(
        positions=torch.arange(3 * n).reshape(3, n),
        kept=kept,
        ranking=torch.rand(n) if compressed else None,
        keys=torch.randn(2, m, 2, 4).to(dtype),
        values=torch.randn(2, m, 2, 4).to(dtype),
        embeddings=torch.randn(embeddings, EMBED_WIDTH).bfloat16() if embeddings else None,
    )


@pytest.fixture
def storage(tmp_path) -> SegmentStorage:
    return open_storage("file", FINGERPRINT, directory=str(tmp_path))


def files(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".bin"))


def assert_same(a: StoredSegment, b: StoredSegment) -> None:
    for name in ("positions", "kept", "ranking", "keys", "values", "embeddings"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name  # bit for bit


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_through_sglang_file_backend_is_bit_exact(tmp_path, compressed, dtype):
    fingerprint = KVFingerprint("models/m", str(dtype), 2, 2, 4, 4)
    storage = open_storage("file", fingerprint, directory=str(tmp_path))
    original = stored(compressed=compressed, dtype=dtype)
    assert storage.save(key(), original)
    assert len(files(tmp_path)) == 3  # the start-up probe, header and payload
    loaded = storage.load(key())
    assert_same(original, loaded)
    c = storage.counters
    assert (c.writes, c.lookups, c.hits, c.misses, c.corrupt) == (1, 1, 1, 0, 0)
    # a second instance on the same directory reads it, and does not write it again
    other = open_storage("file", fingerprint, directory=str(tmp_path))
    assert_same(original, other.load(key()))
    assert other.save(key(), original) and other.counters.write_skipped == 1
    assert other.counters.writes == 0


def test_a_header_key_reads_back_as_the_key_it_records():
    from sgl_mmkv.segments.entry_format import key_fields, key_from_fields

    for k in (key(), key(9, Namespace("a1b2", "adapter-4"), n=3)):
        assert key_from_fields(json.loads(json.dumps(key_fields(k)))) == k


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
        KVFingerprint("models/m", "torch.float32", 2, 2, 4, 4, fill="canonical"),
        KVFingerprint("models/m", "torch.float32", 2, 2, 4, 4, pool="MHATokenToKVPoolFP4"),
    ):
        assert open_storage("file", changed, directory=str(tmp_path)).load(key()) is None
    assert storage.counters.misses == 4 and storage.counters.hits == 0


def test_an_entry_of_another_tp_size_or_rank_is_a_miss(storage, tmp_path):
    """A segment holds its rank's KV heads: a TP-1 entry of a 2-KV-head model has the
    shape a TP-2 rank of a 4-head model holds, and must still never load there, nor
    rank 1's at rank 0. TP-1 names and headers are those of before the TP fields."""
    assert storage.save(key(), stored())
    tp2 = [replace(FINGERPRINT, tp_size=2, tp_rank=rank) for rank in (0, 1)]
    ranks = [open_storage("file", fp, directory=str(tmp_path)) for fp in tp2]
    for rank in ranks:
        assert rank.load(key()) is None  # the TP-1 entry
    assert ranks[1].save(key(), stored())
    assert ranks[0].load(key()) is None  # rank 1's entry
    assert_same(ranks[1].load(key()), stored())
    names = {s.entry_name(key()) for s in (storage, *ranks)}
    assert len(names) == 3
    assert "tp_size" not in FINGERPRINT.fields() and tp2[1].fields()["tp_rank"] == 1
    fields = [f for f in FINGERPRINT.__dataclass_fields__ if not f.startswith("tp_")]
    kv = {f: getattr(FINGERPRINT, f) for f in fields}
    tp1 = {"v": FORMAT_VERSION, "key": key_fields(key()), "kv": kv}
    digest = hashlib.sha256(json.dumps(tp1, sort_keys=True).encode()).hexdigest()
    assert storage.entry_name(key()).endswith(digest)


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
    """Backends other than ``file`` go through SGLang's get / set (no directory)."""
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


@pytest.mark.parametrize("backend", ["sim", "hf3fs", "nixl"])
def test_a_backend_without_tensor_get_set_is_refused_at_start(tmp_path, backend):
    """SGLang 0.5.23's sim keeps no data; hf3fs and nixl cannot be created here or lack
    the tensor API: each is one clear error, never a server that drops every write.
    (``mooncake`` goes through Mooncake's own client: tests/test_mooncake_storage.py.)"""
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


def make_store(tmp_path, size: int = 64, embeds: tuple[int, str] = (0, "")) -> SegmentStore:
    pool = Pool(size)
    fingerprint = KVFingerprint.of_pool(pool, "models/m", embeds=embeds)
    return SegmentStore(
        Allocator(size), pool, storage=open_storage("file", fingerprint, str(tmp_path))
    )


def test_fill_writes_through_and_another_store_loads_it_bit_exact(tmp_path):
    a = make_store(tmp_path)
    src = a.allocator.alloc(5)
    positions = torch.arange(15).reshape(3, 5)
    segment = a.fill(key(), src, positions)
    assert segment.persisted and a.storage.drain() and a.storage.counters.writes == 1
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


def test_a_segment_s_embeddings_travel_with_it_to_another_store(tmp_path):
    layout = (EMBED_WIDTH, "torch.bfloat16")
    a = make_store(tmp_path, embeds=layout)
    rows = torch.randn(5, EMBED_WIDTH).bfloat16()
    segment = a.fill(key(), a.allocator.alloc(5), torch.arange(15).reshape(3, 5), None, rows)
    assert (
        torch.equal(segment.embeddings, rows) and segment.embeddings.data_ptr() != rows.data_ptr()
    )
    assert a.storage.drain() and a.embedding_bytes == 5 * EMBED_WIDTH * 2
    b = make_store(tmp_path, embeds=layout)
    loaded = b.lookup(key())
    assert torch.equal(loaded.embeddings.view(torch.int16), rows.view(torch.int16))
    assert (b.counters.loaded, b.counters.embeddings_loaded) == (1, 1)
    assert b.stats()["embedding_bytes"] == 5 * EMBED_WIDTH * 2
    b.evict_lru(5)
    assert b.embedding_bytes == 0 and loaded.embeddings is None


def test_embeddings_gained_after_a_load_without_them_are_written_back(tmp_path):
    layout = (EMBED_WIDTH, "torch.bfloat16")
    a = make_store(tmp_path, embeds=layout)
    a.fill(key(), a.allocator.alloc(5), torch.arange(15).reshape(3, 5))  # no embeddings
    assert a.storage.drain()
    b = make_store(tmp_path, embeds=layout)
    loaded = b.lookup(key())
    assert loaded.persisted and loaded.embeddings is None
    rows = torch.randn(5, EMBED_WIDTH).bfloat16()
    b.gain_embeddings(loaded, rows)
    assert b.storage.drain() and b.counters.embeddings_gained == 1
    c = b.storage.counters
    assert (c.rewritten, c.writes, c.write_skipped) == (1, 1, 0)
    again = make_store(tmp_path, embeds=layout).lookup(key())
    assert torch.equal(again.embeddings.view(torch.int16), rows.view(torch.int16))
    b.gain_embeddings(loaded, rows)  # has them: nothing attached, nothing written
    assert b.storage.drain() and (b.counters.embeddings_gained, c.writes) == (1, 1)


def test_a_compressed_segment_gains_embeddings_without_writing_its_entry_again(tmp_path):
    layout = (EMBED_WIDTH, "torch.bfloat16")
    a = make_store(tmp_path, embeds=layout)
    a.fill(key(), a.allocator.alloc(5), torch.arange(15).reshape(3, 5))
    assert a.storage.drain()
    b = make_store(tmp_path, embeds=layout)
    loaded = b.lookup(key())
    loaded.ranking = torch.tensor([5.0, 1.0, 4.0, 3.0, 0.0])
    b.compress(loaded, 0.6)
    b.gain_embeddings(loaded, torch.randn(5, EMBED_WIDTH).bfloat16())
    assert b.storage.drain() and loaded.embeddings is not None
    assert (b.storage.counters.writes, b.storage.counters.rewritten) == (0, 0)
    assert make_store(tmp_path, embeds=layout).lookup(key()).kept is None  # whole, as stored


def test_embeddings_beyond_the_cap_let_the_least_recently_used_go():
    one = 5 * EMBED_WIDTH * 4
    store = SegmentStore(Allocator(64), Pool(64), embeddings_max_bytes=2 * one)
    rows = torch.randn(5, EMBED_WIDTH)

    def fill(i: int):
        return store.fill(key(i), store.allocator.alloc(5), torch.arange(5)[None], None, rows)

    segments = [fill(i) for i in range(3)]
    assert [s.embeddings is not None for s in segments] == [False, True, True]
    assert (store.embedding_bytes, store.counters.embeddings_dropped) == (2 * one, 1)
    assert store.lookup(key(1)) is segments[1]  # now the most recently used
    fill(3)
    assert [s.embeddings is not None for s in segments] == [False, True, False]
    assert not store.attach_embeddings(segments[0], torch.randn(11, EMBED_WIDTH))  # > the cap
    assert store.attach_embeddings(segments[0], rows) and segments[1].embeddings is None
    assert store.embedding_bytes == 2 * one and store.counters.embeddings_dropped == 3
    store.clear(free_slots=True)
    assert store.embedding_bytes == 0


def test_compressed_segment_loads_with_its_kept_tokens(tmp_path):
    a = make_store(tmp_path)
    ranking = torch.tensor([5.0, 1.0, 4.0, 3.0, 0.0])
    segment = a.reserve(key(), 5, torch.arange(15).reshape(3, 5), ranking)
    a.compress(segment, 0.6)  # keeps tokens 0, 2, 3
    a.write_through(segment)
    assert a.storage.drain()
    b = make_store(tmp_path)
    loaded = b.lookup(key())
    assert loaded.kept.tolist() == [0, 2, 3] and loaded.num_tokens == 3
    assert torch.equal(loaded.ranking, ranking)
    assert torch.equal(b.kv_pool.get_key_buffer(1)[loaded.slots], a.kv_pool.k[1][segment.slots])


def test_no_room_and_shape_mismatch_are_misses(tmp_path):
    a = make_store(tmp_path)
    a.fill(key(), a.allocator.alloc(5), torch.arange(15).reshape(3, 5))
    assert a.storage.drain()
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
    assert writer.storage.drain()
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
    assert plans[0].spans == () and plans[0].reused_tokens == 0
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


# -- untrusted headers: checked against the key before anything is read or allocated ---


def plant_header(storage: SegmentStorage, k: SegmentKey, **changes) -> None:
    """A valid-checksum header for ``k`` under ``storage``'s fingerprint, with fields
    changed as asked (what someone who can write the directory can do)."""
    from sgl_mmkv.segments.entry_format import encode_header

    n = k.num_tokens
    fields = {
        "version": FORMAT_VERSION,
        "key": key_fields(k),
        "kv": storage.fingerprint.fields(),
        "dtype": storage.fingerprint.dtype,
        "positions": [3, n],
        "kept": None,
        "ranking": False,
        "k_shape": [2, n, 2, 4],
        "v_shape": [2, n, 2, 4],
        "embeds": None,
        "sha256": "0" * 64,
    }
    fields.update(changes)
    fields.setdefault("payload_bytes", 3 * n * 8 + 2 * 2 * n * 2 * 4 * 4)
    fields.setdefault("payload", f"{storage.entry_name(k)}_p{fields['sha256'][:16]}")
    assert storage.backend.set(storage.entry_name(k) + "_h", encode_header(fields))


HUGE = 100 * 2**30 // 128  # tokens: a K and V of ~100 GiB under FINGERPRINT


@pytest.fixture()
def reads(monkeypatch) -> list[int]:
    """The sizes of the file-directory reads the test makes, in order."""
    from sgl_mmkv.segments.file_directory import FileDirectory

    sizes: list[int] = []
    real_read = FileDirectory.read
    monkeypatch.setattr(
        FileDirectory,
        "read",
        lambda self, name, size: sizes.append(size) or real_read(self, name, size),
    )
    return sizes


@pytest.mark.parametrize(
    "changes",
    [
        {"positions": [3, HUGE], "k_shape": [2, HUGE, 2, 4], "v_shape": [2, HUGE, 2, 4]},
        {"positions": [10**9, 5]},
        {"kept": 7, "k_shape": [2, 7, 2, 4], "v_shape": [2, 7, 2, 4]},
        {"kept": 0, "k_shape": [2, 0, 2, 4], "v_shape": [2, 0, 2, 4]},
        {"dtype": "torch.float64"},
        {"dtype": 5},
        {"payload_bytes": 10**12},
        {"payload_bytes": float(3 * 5 * 8 + 2 * 2 * 5 * 2 * 4 * 4)},
        {"k_shape": [2, 5, 2, True]},
        {"ranking": 1},
        {"sha256": "z" * 64},
        {"payload": "../../etc/passwd"},
    ],
    ids=[
        "100GiB",
        "rows",
        "kept>n",
        "kept0",
        "dtype",
        "dtype_type",
        "bytes",
        "bytes_float",
        "bool",
        "ranking",
        "sha",
        "path",
    ],  # fmt: skip
)
def test_a_planted_header_is_refused_before_any_payload_read(storage, reads, changes):
    """Every field is checked against the key and fingerprint: nothing beyond the
    4 KiB header is read, so nothing is sized from what the header claims."""
    plant_header(storage, key(), **changes)
    assert storage.load(key()) is None
    assert reads == [HEADER_BYTES]
    c = storage.counters
    assert (c.corrupt, c.misses, c.hits, c.errors, c.bytes_read) == (1, 1, 0, 0, 0)


def test_every_stored_entry_fits_the_bound_of_its_key(storage, tmp_path):
    from sgl_mmkv.segments.entry_format import max_payload_bytes

    bound = max_payload_bytes(key(), FINGERPRINT)
    for i, compressed in enumerate((False, True)):
        assert storage.save(key(i), stored(compressed=compressed))
    for f in files(tmp_path):
        if "_p" in f:
            assert os.path.getsize(tmp_path / f) <= bound
    assert bound == 3 * 5 * 8 + 5 * 8 + 5 * 4 + 2 * 5 * 2 * (4 + 4) * 4


# -- the image's vision-encoder output, in the entry ----------------------------------


@pytest.mark.parametrize("rows", [5, 3])  # every image token, or fewer (Pixtral's breaks)
def test_embeddings_round_trip_bit_exact_within_the_bound_of_the_key(tmp_path, rows):
    from sgl_mmkv.segments.entry_format import max_payload_bytes

    storage = open_storage("file", EMBEDDED, directory=str(tmp_path))
    original = stored(compressed=True, embeddings=rows)
    assert storage.save(key(), original)
    assert_same(original, storage.load(key()))
    assert_same(original, open_storage("file", EMBEDDED, str(tmp_path)).load(key()))
    bound = max_payload_bytes(key(), EMBEDDED)
    assert bound == max_payload_bytes(key(), FINGERPRINT) + 5 * EMBED_WIDTH * 2
    assert os.path.getsize(object_path(storage, tmp_path, key(), "_p")) <= bound


@pytest.mark.parametrize(
    "embeddings",
    [
        torch.randn(5, EMBED_WIDTH + 1).bfloat16(),
        torch.randn(5, EMBED_WIDTH),
        torch.randn(6, EMBED_WIDTH).bfloat16(),
    ],
    ids=["width", "dtype", "rows"],
)
def test_embeddings_of_another_layout_are_left_out_and_the_kv_stored(tmp_path, embeddings):
    storage = open_storage("file", EMBEDDED, directory=str(tmp_path))
    original = stored()
    original.embeddings = embeddings
    assert storage.save(key(), original)
    original.embeddings = None
    assert_same(original, storage.load(key()))


def test_a_fingerprint_without_the_layout_stores_no_embeddings(storage):
    assert storage.save(key(), stored(embeddings=5))
    assert storage.load(key()).embeddings is None


EMBEDS_BASE = 3 * 5 * 8 + 2 * 2 * 5 * 2 * 4 * 4  # positions, K and V of 5 tokens


@pytest.mark.parametrize(
    "embeds",
    [[5, EMBED_WIDTH], [6, EMBED_WIDTH], [HUGE, EMBED_WIDTH], [5, 10**9], [5, EMBED_WIDTH + 1],
     [0, EMBED_WIDTH], [5], [5, 6.0], "5x6"],
    ids=["fits", "rows>n", "100GiB", "width_huge", "width", "rows0", "short", "float", "str"],
)  # fmt: skip
def test_a_planted_embeddings_section_is_refused_before_any_payload_read(tmp_path, reads, embeds):
    """The header's embeddings must fit the key (at most a row per image token) and the
    fingerprint's layout; only then is the payload it names read (``fits``: read, and
    missing: corrupt all the same)."""
    storage = open_storage("file", EMBEDDED, directory=str(tmp_path))
    reads.clear()  # what opening the directory read
    claimed = embeds[0] * embeds[1] * 2 if isinstance(embeds, list) and len(embeds) == 2 else 0
    plant_header(storage, key(), embeds=embeds, payload_bytes=int(EMBEDS_BASE + claimed))
    assert storage.load(key()) is None
    fits = embeds == [5, EMBED_WIDTH] and all(type(d) is int for d in embeds)
    assert reads == ([HEADER_BYTES, EMBEDS_BASE + 5 * EMBED_WIDTH * 2] if fits else [HEADER_BYTES])
    c = storage.counters
    assert (c.corrupt, c.misses, c.hits, c.errors, c.bytes_read) == (1, 1, 0, 0, 0)


def test_an_entry_of_the_previous_format_is_a_miss_and_the_next_fill_writes_anew(
    tmp_path, monkeypatch
):
    """Entries of format 2 (no embeddings) have other names: never read, never counted
    corrupt; the next fill writes a format-3 entry with the embeddings."""
    import sgl_mmkv.segments.storage as storage_module

    storage = open_storage("file", EMBEDDED, directory=str(tmp_path))
    current = storage.entry_name(key())
    with monkeypatch.context() as patched:
        patched.setattr(storage_module, "FORMAT_VERSION", 2)
        assert storage.entry_name(key()) != current
        assert storage.save(key(), stored())
    assert storage.load(key()) is None
    c = storage.counters
    assert (c.lookups, c.misses, c.corrupt, c.bytes_read) == (1, 1, 0, 0)
    assert storage.save(key(), stored(embeddings=5))
    assert (c.writes, c.write_skipped) == (2, 0)
    assert_same(stored(embeddings=5), storage.load(key()))


# -- the file directory: regular files of the directory only, never blocking ----------


def object_path(storage: SegmentStorage, tmp_path, k: SegmentKey, part: str):
    stem = storage.entry_name(k)
    return tmp_path / [f for f in files(tmp_path) if f.startswith(stem + part)][0]


def load_within(storage: SegmentStorage, k: SegmentKey, seconds: float = 5.0):
    """``storage.load(k)`` on a thread; fails the test instead of hanging it."""
    import threading

    out = {}
    thread = threading.Thread(target=lambda: out.update(got=storage.load(k)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the load blocked"
    return out["got"]


@pytest.mark.parametrize("part", ["_h", "_p"])
@pytest.mark.parametrize("kind", ["fifo", "symlink_out", "directory", "dev_zero"])
def test_an_object_that_is_not_a_regular_file_of_the_directory_is_never_read(
    storage, tmp_path, tmp_path_factory, part, kind
):
    """A FIFO would block ``open()`` (SGLang's HiCacheFile.get); a symlink out of the
    directory points at a copy with valid bytes and checksum, so only the check can
    refuse it."""
    assert storage.save(key(), stored())
    path = object_path(storage, tmp_path, key(), part)
    outside = tmp_path_factory.mktemp("outside") / path.name
    outside.write_bytes(path.read_bytes())
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_out":
        path.symlink_to(outside)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    assert load_within(storage, key()) is None
    c = storage.counters
    assert (c.unsafe, c.misses, c.hits, c.corrupt) == (1, 1, 0, 0)


def test_a_padded_payload_is_corrupt_and_read_no_further(storage, tmp_path):
    assert storage.save(key(), stored())
    path = object_path(storage, tmp_path, key(), "_p")
    path.write_bytes(path.read_bytes() + b"\0" * 2**20)
    assert storage.load(key()) is None
    assert (storage.counters.corrupt, storage.counters.bytes_read) == (1, 0)


def test_object_names_cannot_leave_the_directory(tmp_path):
    from sgl_mmkv.segments.file_directory import FileDirectory, UnsafeObject

    directory = FileDirectory(str(tmp_path), "__0_1")
    for name in ("../x", "a/b", "", "x.bin\0"):
        with pytest.raises(UnsafeObject):
            directory.file_name(name)


# -- the deadline: reads waited for at most the deadline, writes never -----------------


class Gated:
    """A backend whose every call waits for ``gate`` (a hung NFS mount, say)."""

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()
        self.entered = threading.Event()  # a call is waiting at the gate
        self.objects: dict[str, torch.Tensor] = {}

    def exists(self, name):
        self.entered.set()
        self.gate.wait()
        return name in self.objects

    def get(self, name, target):
        self.gate.wait()
        target.copy_(self.objects[name])
        return target

    def set(self, name, value):
        self.gate.wait()
        self.objects[name] = value.clone()
        return True


def test_a_hung_read_is_a_timeout_then_reads_are_skipped_until_it_returns():
    import time

    from sgl_mmkv.segments.storage import StorageLimits

    backend = Gated()
    backend.gate.set()
    storage = SegmentStorage(backend, FINGERPRINT, StorageLimits(deadline_s=0.05))
    assert storage.save(key(), stored())
    backend.gate.clear()  # the backend hangs from now on
    started = time.monotonic()
    assert storage.fetch(key()) is None  # waited 50 ms, then went on
    assert storage.fetch(key()) is None  # not tried: the first read is still out
    waited = time.monotonic() - started
    assert 0.05 <= waited < 1.0
    c = storage.counters
    assert (c.lookups, c.misses, c.timeouts, c.stalled, c.hits) == (2, 2, 1, 1, 0)
    backend.gate.set()  # the hung read returns; the next read is tried again
    deadline = time.monotonic() + 5
    while storage._reads._abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_same(stored(), storage.fetch(key()))
    assert (c.hits, c.timeouts, c.stalled) == (1, 1, 1)


def test_a_read_that_never_returns_costs_at_most_a_few_threads(monkeypatch):
    from sgl_mmkv.segments import deadline as module
    from sgl_mmkv.segments.storage import StorageLimits

    monkeypatch.setattr(module, "STALL_SECONDS", 0.0)  # retry at once after a timeout
    backend = Gated()  # never opens
    storage = SegmentStorage(backend, FINGERPRINT, StorageLimits(deadline_s=0.01))
    for _ in range(10):
        assert storage.fetch(key()) is None
    c = storage.counters
    assert c.timeouts == module.MAX_READ_THREADS and c.stalled == 10 - module.MAX_READ_THREADS
    assert storage._reads.threads == module.MAX_READ_THREADS
    backend.gate.set()


def test_writes_are_queued_never_waited_for_and_dropped_when_the_queue_is_full():
    import time

    from sgl_mmkv.segments.storage import StorageLimits

    backend = Gated()
    limits = StorageLimits(deadline_s=0.05, queue_entries=2)
    storage = SegmentStorage(backend, FINGERPRINT, limits)
    started = time.monotonic()
    assert storage.put(key(0), stored()) and backend.entered.wait(5.0)  # the writer hangs
    queued = [storage.put(key(i), stored()) for i in range(1, 5)]
    assert time.monotonic() - started < 0.5  # none waited for the hung backend
    assert queued == [True, True, False, False]  # two wait, the rest are dropped
    assert storage.counters.write_dropped == 2 and storage.counters.writes == 0
    assert not storage.drain(0.05)
    backend.gate.set()
    assert storage.drain(5.0)
    assert storage.counters.writes == 3 and storage.counters.write_dropped == 2
    assert [storage.load(key(i)) is not None for i in range(5)] == [True] * 3 + [False] * 2


def test_the_write_queue_bounds_the_bytes_it_holds():
    from sgl_mmkv.segments.storage import StorageLimits

    backend = Gated()
    one = sum(t.numel() * t.element_size() for t in (stored().positions, stored().keys,
                                                     stored().values))  # fmt: skip
    storage = SegmentStorage(backend, FINGERPRINT, StorageLimits(queue_bytes=2 * one))
    assert [storage.put(key(i), stored()) for i in range(3)] == [True, True, False]
    backend.gate.set()
    assert storage.drain(5.0) and storage.counters.writes == 2


# -- caps: old entries give way, per namespace and in total ---------------------------

ENTRY_BYTES = HEADER_BYTES + 3 * 5 * 8 + 2 * (2 * 5 * 2 * 4 * 4)  # one stored() entry on disk


def capped(tmp_path, total_entries: float, namespace_entries: float | None = None):
    from sgl_mmkv.segments.storage import StorageLimits

    limits = StorageLimits(
        max_bytes=int(total_entries * ENTRY_BYTES),
        namespace_max_bytes=int((namespace_entries or total_entries) * ENTRY_BYTES),
    )
    return open_storage("file", FINGERPRINT, str(tmp_path), limits=limits)


def entry_bytes(tmp_path) -> int:
    return sum(os.path.getsize(tmp_path / f) for f in files(tmp_path) if "probe" not in f)


def test_the_total_cap_holds_and_the_oldest_entries_give_way(tmp_path):
    storage = capped(tmp_path, 3)
    for i in range(5):
        assert storage.save(key(i), stored())
    assert entry_bytes(tmp_path) == 3 * ENTRY_BYTES <= storage.caps.max_bytes
    assert [storage.load(key(i)) is not None for i in range(5)] == [False] * 2 + [True] * 3
    c = storage.counters
    assert (c.writes, c.evicted, c.evicted_bytes) == (5, 2, 2 * ENTRY_BYTES)


def test_a_hit_keeps_an_entry_from_giving_way(tmp_path):
    storage = capped(tmp_path, 3)
    for i in range(3):
        assert storage.save(key(i), stored())
    assert storage.fetch(key(0)) is not None and storage.drain()  # 0 is now the newest
    assert storage.save(key(3), stored())
    assert [storage.load(key(i)) is not None for i in range(4)] == [True, False, True, True]


def test_a_client_looping_salts_is_held_to_the_caps(tmp_path):
    """One namespace keeps at most its cap, and every namespace together the total:
    a client sending 40 salts pushes out old entries, never past the cap."""
    storage = capped(tmp_path, total_entries=10, namespace_entries=2)
    shared = [key(100 + i) for i in range(2)]
    for k in shared:
        assert storage.save(k, stored())
    for i in range(3):  # one namespace writing three: its own oldest gives way
        assert storage.save(key(i, Namespace("one-tenant", None)), stored())
    assert storage.load(key(0, Namespace("one-tenant", None))) is None
    assert all(storage.load(k) is not None for k in shared)
    for i in range(40):
        assert storage.save(key(i, Namespace(f"salt-{i}", None)), stored())
        assert entry_bytes(tmp_path) <= 10 * ENTRY_BYTES
    assert storage.counters.evicted == 1 + (2 + 2 + 40 - 10)


def test_an_entry_larger_than_a_cap_is_not_written(tmp_path):
    storage = capped(tmp_path, total_entries=0.5)
    assert not storage.save(key(), stored())
    assert (storage.counters.too_large, storage.counters.writes) == (1, 0)
    assert entry_bytes(tmp_path) == 0


def test_caps_count_what_other_instances_wrote(tmp_path, monkeypatch):
    from sgl_mmkv.segments import storage_caps

    monkeypatch.setattr(storage_caps, "RESCAN_SECONDS", 0.0)  # rescan at every write
    a, b = capped(tmp_path, 3), capped(tmp_path, 3)
    for i in range(6):
        assert (a if i % 2 else b).save(key(i), stored())
        assert entry_bytes(tmp_path) <= 3 * ENTRY_BYTES
    assert [a.load(key(i)) is not None for i in range(6)] == [False] * 3 + [True] * 3


def test_caps_by_default_follow_the_free_space(tmp_path):
    storage = open_storage("file", FINGERPRINT, str(tmp_path))
    free = storage.directory.free_bytes()
    assert abs(storage.caps.max_bytes - free // 2) < 64 * 2**20
    assert storage.caps.namespace_max_bytes == storage.caps.max_bytes // 2


# -- a damaged entry is written again at the next fill --------------------------------


@pytest.mark.parametrize("damage", ["payload_gone", "payload_flipped", "payload_fifo"])
@pytest.mark.parametrize("seen_first", [True, False])
def test_a_damaged_entry_is_rewritten_by_the_next_save(storage, tmp_path, damage, seen_first):
    """``seen_first``: a load found the damage before the fill; else the save finds it
    itself (a payload evicted by another instance's evictor) or, for a payload of the
    right size, cannot (flipped bytes are found by a load only)."""
    assert storage.save(key(), stored())
    path = object_path(storage, tmp_path, key(), "_p")
    if damage == "payload_gone":
        path.unlink()
    elif damage == "payload_flipped":
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    else:
        path.unlink()
        os.mkfifo(path)
    if seen_first:
        assert load_within(storage, key()) is None
    rewrites = int(seen_first or damage != "payload_flipped")
    assert storage.save(key(), stored())
    c = storage.counters
    assert (c.rewritten, c.writes, c.write_skipped) == (rewrites, 1 + rewrites, 1 - rewrites)
    assert (load_within(storage, key()) is not None) == bool(rewrites)


# -- the model's fingerprint ----------------------------------------------------------


def test_two_models_at_one_path_have_other_identities(tmp_path):
    """Two checkpoints of one architecture (same config, same safetensors header),
    served in turn from one path, and dtype / quantization changes."""
    import shutil
    from types import SimpleNamespace

    from transformers import AutoConfig

    from sgl_mmkv.segments.fingerprint import model_identity, weights_digest
    from sgl_mmkv.testing.make_tiny_model import make_tiny_model

    for seed in (0, 1):
        make_tiny_model("qwen2_vl", tmp_path / f"seed{seed}", seed=seed)
    served = tmp_path / "served"

    def identity(seed: int, **changes) -> str:
        shutil.rmtree(served, ignore_errors=True)
        shutil.copytree(tmp_path / f"seed{seed}", served)
        config = SimpleNamespace(
            model_path=str(served), revision=None, dtype=torch.bfloat16, quantization=None,
            hf_config=AutoConfig.from_pretrained(served),
        )  # fmt: skip
        for name, value in changes.items():
            setattr(config, name, value)
        return model_identity(config)

    same = identity(0)
    assert identity(0) == same  # a copy of the same weights: shared
    assert identity(1) != same
    assert identity(0, dtype=torch.float16) != same
    assert identity(0, quantization="fp8") != same
    assert weights_digest(str(tmp_path / "seed0")) == weights_digest(str(served)) != "none"
    assert weights_digest("Qwen/Qwen2-VL-7B-Instruct") == "none"  # not a local directory
    assert "weights=none" in identity(0, model_path="Qwen/Qwen2-VL-7B-Instruct")


def test_the_fill_policy_separates_entries(tmp_path):
    first = open_storage("file", FINGERPRINT, str(tmp_path))
    canonical = KVFingerprint("models/m", "torch.float32", 2, 2, 4, 4, fill="canonical")
    other = open_storage("file", canonical, str(tmp_path))
    assert first.save(key(), stored())
    assert other.entry_name(key()) != first.entry_name(key())
    assert other.load(key()) is None and other.counters.misses == 1
    assert KVFingerprint.of_pool(Pool(4), "m", "canonical").fill == "canonical"
    assert KVFingerprint.of_pool(Pool(4), "m").pool == "Pool"


# -- the flags -------------------------------------------------------------------------

STORAGE_FLAGS = ["--mm-reuse", "conduit", "--mm-segment-storage", "file"]


def test_storage_limits_come_from_the_flags():
    from sgl_mmkv.launch_server import resolve_args
    from sgl_mmkv.segments.storage import StorageLimits

    config, _ = resolve_args(
        [*STORAGE_FLAGS, "--mm-segment-storage-dir", "/tmp/x"]
        + ["--mm-segment-storage-deadline-ms", "50", "--mm-segment-storage-max-gib", "2"]
        + ["--mm-segment-storage-namespace-max-gib", "0.5"]
    )
    limits = StorageLimits.of_config(config)
    assert (limits.deadline_s, limits.max_bytes, limits.namespace_max_bytes) == (
        0.05, 2 * 2**30, 2**29,
    )  # fmt: skip
    default, _ = resolve_args([*STORAGE_FLAGS, "--mm-segment-storage-dir", "/tmp/x"])
    assert StorageLimits.of_config(default) == StorageLimits()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--mm-segment-storage-deadline-ms", "0"], "deadline-ms must be in (0, 60000], got 0.0"),
        (["--mm-segment-storage-deadline-ms", "60001"], "must be in (0, 60000]"),
        (["--mm-segment-storage-deadline-ms", "nan"], "must be in (0, 60000], got nan"),
        (["--mm-segment-storage-max-gib", "-1"], "max-gib must be a size in GiB >= 0"),
        (["--mm-segment-storage-max-gib", "inf"], "max-gib must be a size in GiB >= 0"),
        (
            ["--mm-segment-storage-max-gib", "1", "--mm-segment-storage-namespace-max-gib", "2"],
            "--mm-segment-storage-namespace-max-gib 2 is above --mm-segment-storage-max-gib 1",
        ),
    ],
)
def test_bad_storage_limits_exit_2_with_one_line(tmp_path, flags, message):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "sgl_mmkv.launch_server", "--model-path", "x", *STORAGE_FLAGS]
        + ["--mm-segment-storage-dir", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_storage_limits_need_storage():
    from sgl_mmkv.config import ConfigError
    from sgl_mmkv.launch_server import resolve_args

    with pytest.raises(ConfigError, match="need --mm-segment-storage other than none"):
        resolve_args(["--mm-reuse", "conduit", "--mm-segment-storage-deadline-ms", "50"])


def test_embeddings_the_cap_dropped_and_computed_again_do_not_rewrite_the_entry(tmp_path):
    """An entry written with its embeddings is not written again when the host cap
    let them go and the vision tower computed them again (a synchronous all-layer copy
    of the KV per reuse, before)."""
    layout = (EMBED_WIDTH, "torch.bfloat16")
    store = make_store(tmp_path, embeds=layout)
    rows = torch.randn(5, EMBED_WIDTH).bfloat16()
    segment = store.fill(
        key(), store.allocator.alloc(5), torch.arange(15).reshape(3, 5), None, rows
    )
    assert store.storage.drain() and segment.stored_embeddings
    reads = []
    original = store.kv_pool.get_key_buffer
    store.kv_pool.get_key_buffer = lambda layer: reads.append(layer) or original(layer)
    for _ in range(3):
        store._drop_embeddings(segment)  # what the host cap does
        store.gain_embeddings(segment, rows)
    assert store.storage.drain() and segment.embeddings is not None
    assert reads == [] and store.storage.counters.writes == 1
    loaded = make_store(tmp_path, embeds=layout).lookup(key())
    assert loaded.stored_embeddings and loaded.embeddings is not None


@pytest.mark.parametrize(
    "kept",
    [[0, 3, 2], [0, 2, 2], [-1, 2, 3], [0, 2, 5], [0, 2, 7]],
    ids=["unsorted", "repeated", "negative", "n", "past n"],
)
def test_a_stored_segment_s_kept_indices_must_increase_within_the_image(tmp_path, kept):
    from sgl_mmkv.segments.store import valid_kept

    bad = stored(compressed=True)
    assert valid_kept(bad.kept, 3, 5)
    bad = StoredSegment(bad.positions, torch.tensor(kept), bad.ranking, bad.keys, bad.values, None)
    assert not valid_kept(bad.kept, 3, 5)
    a = make_store(tmp_path)
    assert a.storage.put(key(), bad) and a.storage.drain()
    b = make_store(tmp_path)
    assert b.lookup(key()) is None
    assert b.storage.counters.mismatched == 1 and b.allocator.available_size() == 64


def test_a_burst_of_hit_touches_never_takes_a_write_s_place():
    import threading

    from sgl_mmkv.segments.deadline import WriteQueue

    gate, running, done = threading.Event(), threading.Event(), []
    queue = WriteQueue(max_entries=2, max_bytes=1 << 20, max_light=8)
    assert queue.put(lambda: running.set() or gate.wait())  # a slow write holds the thread
    assert running.wait(5.0)  # taken off the queue: the two write places are free
    touched = [queue.put_light(lambda i=i: done.append(("touch", i))) for i in range(20)]
    assert touched == [True] * 8 + [False] * 12  # the light lane has its own bound
    assert queue.put(lambda: done.append(("write", 0)))
    assert queue.put(lambda: done.append(("write", 1)))
    gate.set()
    assert queue.drain(5.0)
    assert done[:2] == [("write", 0), ("write", 1)]  # writes go first
    assert len(done) == 10


def test_one_storage_deadline_per_forward_not_per_request(tmp_path):
    """Eight requests of one batch, each with an image missing in memory: one storage
    round trip under one deadline (eight, one after another, before)."""
    import time
    from types import SimpleNamespace

    from sgl_mmkv.refresh.plan import plan_batch
    from tests.test_segment_store import _item, _mm

    mrope = torch.arange(14).repeat(3, 1)
    store = make_store(tmp_path)
    calls = []
    fetch_many = store.storage.fetch_many

    def slow(keys):
        calls.append(len(keys))
        time.sleep(0.15)  # a backend answering in 150 ms
        return fetch_many(keys)

    store.storage.fetch_many = slow
    batch = SimpleNamespace(
        mm_inputs=[_mm([_item(40 + i, 3, 6)], mrope) for i in range(8)],
        batch_size=8,
        extend_prefix_lens_cpu=[2] * 8,
        extend_seq_lens_cpu=[12] * 8,
    )
    started = time.monotonic()
    plans = plan_batch(store, batch)
    assert time.monotonic() - started < 0.6
    assert calls == [8] and store.counters.lookups == 8
    assert all(len(p.fills) == 1 and p.spans == () for p in plans)

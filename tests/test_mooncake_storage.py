"""Segments in Mooncake's distributed store (``--mm-segment-storage mooncake``), with a
real ``mooncake_master`` and storage process on the loopback (the CPU build, TCP).

Entries are those of ``file`` byte for byte (names, header, payload, checksums);
another instance's client reads them; the existence checks of a request's images are
one round trip whatever their number; every failure of the store (a damaged, planted
or foreign entry, a full store, a master down at start or killed mid-run) is a
counted miss or failed write, never an exception, and a read waits at most the
deadline.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch

from sgl_mmkv.segments.entry_format import HEADER_BYTES, decode_header, encode_header
from sgl_mmkv.segments.key import Namespace
from sgl_mmkv.segments.mooncake_store import MooncakeSettings
from sgl_mmkv.segments.storage import (
    KVFingerprint,
    SegmentStorage,
    StorageError,
    StorageLimits,
    StoredSegment,
    open_storage,
)
from sgl_mmkv.segments.store import SegmentStore
from tests.mooncake_helpers import (
    MooncakeCluster,
    empty_fill,
    fill_store,
    free_port,
    overwrite,
)
from tests.test_segment_storage import FINGERPRINT, assert_same, key, stored
from tests.test_segment_store import Allocator, Pool

GIB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with MooncakeCluster(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


@pytest.fixture(scope="module")
def raw(cluster):
    client = cluster.raw_client()
    yield client
    client.close()


def mooncake(cluster, fingerprint: KVFingerprint = FINGERPRINT, **limits) -> SegmentStorage:
    return open_storage("mooncake", fingerprint, extra_config=cluster.config(),
                        limits=StorageLimits(**limits))  # fmt: skip


@pytest.fixture(scope="module")
def pair(cluster):
    """Two instances' storages (two clients) on one store."""
    a, b = mooncake(cluster), mooncake(cluster)
    yield a, b
    for storage in (a, b):
        storage.backend.close()


def _objects(storage: SegmentStorage, k) -> tuple[str, str]:
    name = storage.entry_name(k)
    fields = decode_header(storage.backend.read(name + "_h", HEADER_BYTES))
    return name + "_h", fields["payload"]


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_another_instance_reads_an_entry_bit_exact(cluster, compressed, dtype):
    fingerprint = KVFingerprint("models/m", str(dtype), 2, 2, 4, 4)
    a, b = mooncake(cluster, fingerprint), mooncake(cluster, fingerprint)
    k = key(100 + compressed + 2 * (dtype == torch.bfloat16))
    segment = stored(compressed=compressed, dtype=dtype)
    assert b.load(k) is None
    assert a.save(k, segment)
    assert_same(segment, b.load(k))
    assert b.save(k, segment)  # already there: not written again
    assert (b.counters.write_skipped, b.counters.writes, b.counters.hits) == (1, 0, 1)
    a.backend.close(), b.backend.close()


def test_entries_are_those_of_file_byte_for_byte(pair, tmp_path, raw):
    """Same names, namespacing, fingerprint, header and payload as ``file``."""
    a, _ = pair
    files = open_storage("file", FINGERPRINT, directory=str(tmp_path))
    k = key(110, Namespace(12345, "adapter"))
    segment = stored(compressed=True)
    assert a.save(k, segment) and files.save(k, segment)
    assert a.entry_name(k) == files.entry_name(k)
    for name in _objects(a, k):
        on_disk = (tmp_path / f"{name}__0_1.bin").read_bytes()
        assert raw.get(name) == on_disk


def test_a_request_s_images_cost_two_round_trips_whatever_their_number(pair):
    """Every header in one ``batch_get_into``, every payload found in one more; keys
    missing everywhere cost one."""
    a, b = pair
    keys = [key(120 + i) for i in range(6)]
    for k in keys[:4]:
        assert a.save(k, stored())
    store = SegmentStore(Allocator(64), Pool(64), storage=b)
    trips = b.backend.round_trips
    segments = store.lookup_many([*keys, keys[0]])  # one image twice
    assert b.backend.round_trips - trips == 2
    assert [s is not None for s in segments] == [True] * 4 + [False] * 2 + [True]
    assert segments[0] is segments[-1]
    assert (store.counters.loaded, b.counters.hits, b.counters.misses) == (4, 4, 2)
    trips = b.backend.round_trips
    assert store.lookup_many([key(130), key(131), key(132)]) == [None] * 3
    assert b.backend.round_trips - trips == 1
    assert store.lookup_many(keys[:2]) == segments[:2]  # in memory now: no trip
    assert b.backend.round_trips - trips == 1


def test_other_namespace_or_fingerprint_is_a_miss(pair, cluster):
    a, b = pair
    k = key(140, Namespace(1, None))
    assert a.save(k, stored())
    assert b.load(key(140, Namespace(2, None))) is None
    assert b.load(key(140)) is None
    other = mooncake(cluster, KVFingerprint("models/other", "torch.float32", 2, 2, 4, 4))
    assert other.load(k) is None
    assert b.load(k) is not None
    other.backend.close()


TIMES = ("load_seconds", "write_seconds")


def _counts(storage: SegmentStorage) -> dict:
    return storage.counters.as_dict()


def _delta(before: dict, storage: SegmentStorage) -> dict:
    """The counters that moved since ``before``, times left out."""
    after = _counts(storage)
    return {n: after[n] - before[n] for n in after if after[n] != before[n] and n not in TIMES}


def _forge(storage: SegmentStorage, k, **changes) -> bytes:
    fields = decode_header(storage.backend.read(storage.entry_name(k) + "_h", HEADER_BYTES))
    fields.update(changes)
    return encode_header(fields).numpy().tobytes()


DAMAGES = {
    "garbage_header": "corrupt",
    "garbage_payload": "corrupt",
    "short_payload": "corrupt",
    "long_payload": "corrupt",
    "claims_100_gib": "corrupt",
    "foreign_fingerprint": "mismatched",
    "payload_gone": "corrupt",
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_entry_is_a_counted_miss_then_written_again(pair, raw, damage):
    """Written as anyone with access to the store could; the next save removes the
    entry's objects and writes it again."""
    a, b = pair
    k = key(1000 + list(DAMAGES).index(damage))
    assert a.save(k, stored())
    header, payload = _objects(a, k)
    body = raw.get(payload)
    if damage == "garbage_header":
        overwrite(raw, header, bytes(HEADER_BYTES))
    elif damage == "garbage_payload":
        overwrite(raw, payload, bytes(len(body)))
    elif damage == "short_payload":
        overwrite(raw, payload, body[:-1])
    elif damage == "long_payload":
        overwrite(raw, payload, body + b"\0" * 4096)
    elif damage == "claims_100_gib":
        overwrite(raw, header, _forge(a, k, payload_bytes=100 * GIB))
    elif damage == "foreign_fingerprint":
        fields = decode_header(raw.get(header))
        overwrite(raw, header, _forge(a, k, kv={**fields["kv"], "fill": "canonical"}))
    else:
        raw.remove(payload, True)
    before = _counts(b)
    assert b.fetch(k) is None
    assert _delta(before, b) == {"lookups": 1, "misses": 1, DAMAGES[damage]: 1}
    assert b.save(k, stored())  # removed and written again
    assert _delta(before, b)["rewritten"] == 1
    assert_same(stored(), b.load(k))


def test_a_planted_header_never_reads_its_payload(pair, raw):
    a, b = pair
    k = key(170)
    assert a.save(k, stored())
    header, _ = _objects(a, k)
    overwrite(raw, header, _forge(a, k, payload_bytes=100 * GIB))
    trips, before = b.backend.round_trips, _counts(b)
    assert b.fetch_many([k]) == [None]
    assert b.backend.round_trips - trips == 1  # the header only
    assert _delta(before, b) == {"lookups": 1, "misses": 1, "corrupt": 1}


def test_a_full_store_is_a_counted_write_failure(tmp_path):
    """A store of 16 MiB full of hard-pinned objects (nothing Mooncake may evict)."""
    with MooncakeCluster(tmp_path, storage_bytes=16 * 2**20) as small:
        raw = small.raw_client()
        a = mooncake(small)
        assert fill_store(raw) > 0
        assert not a.save(key(180), stored())
        assert (a.counters.write_failed, a.counters.errors, a.counters.writes) == (1, 0, 0)
        assert a.load(key(180)) is None
        empty_fill(raw)  # room again (a new image: Mooncake may still evict a payload
        assert a.save(key(181), stored()) and a.load(key(181)) is not None  # of the full store)
        a.backend.close(), raw.close()


def test_an_entry_larger_than_the_staging_buffer_is_not_written(cluster):
    n = 5000  # K and V: 2 x (2 layers x 5000 tokens x 2 heads x 16 x 4 bytes) = 2.5 MiB
    positions = torch.arange(3 * n).reshape(3, n)
    big = StoredSegment(positions, None, None, torch.randn(2, n, 2, 16), torch.randn(2, n, 2, 16))
    fingerprint = KVFingerprint("models/m", "torch.float32", 2, 2, 16, 16)
    storage = open_storage("mooncake", fingerprint,
                           extra_config=cluster.config(local_buffer_size=2**20))  # fmt: skip
    assert not storage.save(key(190, n=n), big)
    assert (storage.counters.too_large, storage.counters.write_failed) == (1, 0)
    storage.backend.close()


def test_a_master_down_at_start_is_unavailable_then_used_once_it_is_up(tmp_path):
    """Start-up does not wait past ``connect_timeout_s``; reads and writes are counted
    (``unavailable``) until Mooncake's own retries reach the master."""
    down = MooncakeCluster(tmp_path, rpc_port=free_port(), metadata_port=free_port())
    started = time.monotonic()
    config = down.config(connect_timeout_s=0.5, retry_s=0.5)
    storage = open_storage("mooncake", FINGERPRINT, extra_config=config)
    assert time.monotonic() - started < 2
    started = time.monotonic()
    assert storage.fetch(key(200)) is None and not storage.save(key(200), stored())
    assert time.monotonic() - started < 1
    c = storage.counters
    assert (c.unavailable, c.misses, c.write_failed, c.errors) == (2, 1, 1, 0)
    with down:
        assert storage.backend.wait_ready(60)
        assert storage.save(key(200), stored())
        assert_same(stored(), storage.load(key(200)))
        storage.backend.close()


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped (SIGSTOP is delivered
    asynchronously: a thread still running may answer one more request)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {
            Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            for tid in os.listdir(f"/proc/{pid}/task")
        }
        if states <= {"T", "t"}:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: {states}")


def test_a_stopped_master_is_not_set_up_with(tmp_path):
    """Mooncake's ``setup`` may hold the GIL while it waits for a master: one that
    accepts connections but does not answer (stopped) is never handed to it."""
    import signal

    from sgl_mmkv.segments.mooncake_store import unreachable

    with MooncakeCluster(tmp_path, storage_bytes=0) as cluster:
        settings = MooncakeSettings.parse(cluster.config())
        assert unreachable(settings) is None
        cluster.master.send_signal(signal.SIGSTOP)
        try:
            wait_stopped(cluster.master.pid)
            started = time.monotonic()
            assert "metadata service" in unreachable(settings, timeout_s=0.5)
            assert time.monotonic() - started < 2
        finally:
            cluster.master.send_signal(signal.SIGCONT)


def test_a_master_killed_mid_run_costs_a_read_at_most_the_deadline(tmp_path):
    with MooncakeCluster(tmp_path) as cluster:
        storage = open_storage("mooncake", FINGERPRINT, extra_config=cluster.config(),
                               limits=StorageLimits(deadline_s=0.2))  # fmt: skip
        assert storage.save(key(210), stored()) and storage.fetch(key(210)) is not None
        cluster.kill_master()
        started = time.monotonic()
        results = [storage.fetch(key(210 + i)) for i in range(5)]
        waited = time.monotonic() - started
        assert results == [None] * 5 and waited < 5 * 0.2 + 0.5
        c = storage.counters
        late = c.timeouts + c.stalled + c.unavailable
        assert late == 5 and c.hits == 1 and c.errors == 0, c
        assert not storage.save(key(220), stored())  # on the writer thread in a server
        assert c.write_failed == 1 and c.unavailable >= 1
        deadline = time.monotonic() + 60  # the abandoned reads return before closing
        while storage._reads._abandoned and time.monotonic() < deadline:
            time.sleep(0.1)
        storage.backend.close()


# -- configuration ---------------------------------------------------------------------


def test_settings_come_from_the_config_then_sglang_s_environment():
    env = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_PROTOCOL": "rdma",
           "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb"}  # fmt: skip
    s = MooncakeSettings.parse({"protocol": "tcp", "local_buffer_size": "64 MiB"}, env)
    assert (s.master_server_address, s.protocol) == ("10.0.0.1:50051", "tcp")
    assert (s.global_segment_size, s.local_buffer_size) == (2 * GIB, 64 * 2**20)
    assert s.metadata_server == "P2PHANDSHAKE" and s.local_hostname == "localhost"
    node = MooncakeSettings.parse({"local_hostname": "a"}, {**env, "LOCAL_HOSTNAME": "node7"})
    assert node.local_hostname == "node7"  # the node's own variable wins, as in SGLang


@pytest.mark.parametrize(
    "config, message",
    [
        ({}, "needs master_server_address"),
        ({"master_server_adress": "h:1"}, "unknown keys ['master_server_adress']"),
        ({"master_server_address": 5}, "master_server_address must be a string"),
        ({"master_server_address": "h"}, "must be host:port"),
        ({"master_server_address": "h:1", "global_segment_size": "lots"}, "a size in bytes"),
        ({"master_server_address": "h:1", "global_segment_size": 2**20}, "at least 16 MiB"),
        ({"master_server_address": "h:1", "connect_timeout_s": 0}, "seconds > 0"),
    ],
)
def test_a_bad_config_is_one_clear_start_up_error(config, message):
    with pytest.raises(
        StorageError, match=f"--mm-segment-storage mooncake: .*{re.escape(message)}"
    ):
        open_storage("mooncake", FINGERPRINT, extra_config=config)


def test_a_missing_package_names_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_libibverbs(name, *args, **kwargs):
        if name == "mooncake.store":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libibverbs)
    with pytest.raises(StorageError, match="apt-get install -y libibverbs1"):
        open_storage("mooncake", FINGERPRINT, extra_config={"master_server_address": "h:1"})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mm-segment-storage-dir", "/tmp/x"], "--mm-segment-storage-dir is the file backend's"),
        (["--mm-segment-storage-max-gib", "1"], "cap a file directory"),
    ],
)
def test_file_only_flags_are_refused_with_mooncake(flags, message):
    from sgl_mmkv.config import ConfigError
    from sgl_mmkv.launch_server import resolve_args

    with pytest.raises(ConfigError, match=message):
        resolve_args(["--mm-reuse", "conduit", "--mm-segment-storage", "mooncake", *flags])


def test_the_launcher_refuses_a_config_without_a_master_in_one_line(tiny_vlm):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    result = subprocess.run(
        [sys.executable, "-m", "sgl_mmkv.launch_server", "--model-path", str(tiny_vlm)]
        + ["--mm-reuse", "conduit", "--mm-segment-storage", "mooncake"]
        + ["--mm-segment-storage-config", '{"protocol": "tcp"}'],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--mm-segment-storage mooncake: needs master_server_address" in result.stderr
    assert "Traceback" not in result.stderr

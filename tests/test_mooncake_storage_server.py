"""``--mm-reuse conduit`` instances sharing Mooncake's store, one machine: the two-instance
tests of tests/test_segment_storage_server.py on ``--mm-segment-storage mooncake``.

The test starts ``mooncake_master`` (with its HTTP metadata service) and a storage
process holding the store's memory on the loopback; the servers are clients that add
no memory. Instance A reads images and writes their segments through, then is
stopped by PID. Instance B, started later, has never seen them: it reuses them under
a new prefix (loaded from the store, with the image's vision-encoder output: no
vision tower), and at budget 1.0 its answer equals a stock server's full prefill.
Another ``cache_salt`` never loads A's segment.

The store is untrusted input: entries of A are replaced with a raw client as anyone
with access to the store could (a garbage header, a header claiming 100 GiB, a header
of another fingerprint, a payload removed). The store is then filled with pinned
objects (writes fail), and last the master is killed. Each request still gets 200
and stock's answer, no read waits past the deadline, and the counters say what
happened.
"""

from __future__ import annotations

import time

import pytest
import requests

from sgl_mmkv.segments.entry_format import HEADER_BYTES, decode_header, encode_header
from sgl_mmkv.testing.images import make_image
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
    mmkv_stats,
    start_together,
    stock_cpu_env,
)
from tests.mooncake_helpers import BIND_ENV, MooncakeCluster, empty_fill, fill_store, overwrite
from tests.test_segment_storage_server import (
    GIB,
    PROBE_SYSTEM,
    SLACK_BYTES,
    TOKENS_PER_IMAGE,
    _assert_same_answer,
    _chat,
    _scheduler_peak_rss,
    _storage,
    _vision,
    _wait_writes,
)

X, Y, Z = make_image(1301), make_image(1302), make_image(1303)
DAMAGED = {name: make_image(1310 + i) for i, name in enumerate(
    ("garbage", "huge", "foreign", "gone", "embeds")
)}  # fmt: skip
DAMAGE_SYSTEM = "B reads a damaged entry."
FULL_SYSTEM, FULL = "B reads into a full store.", make_image(1320)
DOWN_SYSTEM = "B reads while the master is down."
DEADLINE_S = 0.2  # --mm-segment-storage-deadline-ms' default


def _mmkv_args(cluster: MooncakeCluster) -> list[str]:
    return [
        *CPU_SERVER_ARGS,
        "--sleep-on-idle",
        "--mm-reuse", "conduit",
        "--mm-refresh-budget", "1.0",
        "--mm-reuse-gate", "always",
        "--mm-segment-storage", "mooncake",
        "--mm-segment-storage-config", cluster.config_json(),
        REPORT_REUSE,
    ]  # fmt: skip


def _server(tiny_vlm, cluster, log) -> ServerProcess:
    env = {**stock_cpu_env(), **BIND_ENV}
    return ServerProcess("sgl_mmkv.launch_server", tiny_vlm, _mmkv_args(cluster), log, env=env)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with MooncakeCluster(tmp_path_factory.mktemp("mooncake")) as running:
        yield running


@pytest.fixture(scope="module")
def raw(cluster):
    client = cluster.raw_client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def shared(tiny_vlm, cluster, tmp_path_factory) -> dict:
    """Stock's answers, then instance A reads X, Y (salted), Z and the images to damage,
    and stops once its writes have landed."""
    logs = tmp_path_factory.mktemp("mooncake_logs")
    asked = [("probe", PROBE_SYSTEM, X), ("full", FULL_SYSTEM, FULL), ("down", DOWN_SYSTEM, Z)]
    asked += [(name, DAMAGE_SYSTEM, image) for name, image in DAMAGED.items()]
    args = [*CPU_SERVER_ARGS, "--sleep-on-idle"]
    stock = ServerProcess("sglang.launch_server", tiny_vlm, args, logs / "stock.log")
    a = _server(tiny_vlm, cluster, logs / "a.log")
    objects: dict[str, set[str]] = {}
    try:
        start_together([stock, a])
        with stock:  # already started: stopped on leaving
            answers = {name: _chat(stock, system, image) for name, system, image in asked}
        a_before = _storage(a)  # after SGLang's warm-up request
        seen = cluster.keys()
        shown = [("X", X, {}), ("Y", Y, {"cache_salt": "tenant-A"}), ("Z", Z, {})]
        for name, image, extra in [*shown, *((n, im, {}) for n, im in DAMAGED.items())]:
            assert _chat(a, "Instance A reads.", image, **extra)["reused"] == 0
            _wait_writes(a, a_before["writes"] + len(objects) + 1)
            objects[name] = cluster.keys() - seen
            seen |= objects[name]
        a_stats = mmkv_stats(a.base_url)
    finally:
        for server in (stock, a):
            server.stop()  # by PID, the whole process tree
    assert a.process.poll() is not None
    return {"stock": answers, "objects": objects, "a_before": a_before, "a": a_stats,
            "logs": logs}  # fmt: skip


@pytest.fixture(scope="module")
def instance_b(tiny_vlm, cluster, shared):
    with _server(tiny_vlm, cluster, shared["logs"] / "b.log") as b:
        yield b


def _part(shared, name: str, part: str) -> str:
    """The object name of image ``name``'s header (``h``) or payload (``p``)."""
    return next(o for o in shared["objects"][name] if o.rsplit("_", 1)[1].startswith(part))


def test_instance_a_wrote_every_new_segment_through(shared):
    before, after = shared["a_before"], shared["a"]["storage"]
    shown = 3 + len(DAMAGED)
    assert after["writes"] - before["writes"] == shown and after["write_failed"] == 0
    assert after["hits"] == 0 and after["lookups"] - before["lookups"] == shown
    assert after["unavailable"] == 0 and after["errors"] == 0
    assert all(len(o) == 2 for o in shared["objects"].values())  # a header and a payload


def test_b_reuses_a_image_it_never_saw_and_equals_stock_full_prefill(instance_b, shared):
    before = mmkv_stats(instance_b.base_url)
    got = _chat(instance_b, PROBE_SYSTEM, X)
    assert got["reused"] == TOKENS_PER_IMAGE
    _assert_same_answer(got, shared["stock"]["probe"])
    stats = mmkv_stats(instance_b.base_url)
    assert stats["storage"]["hits"] - before["storage"]["hits"] == 1
    assert stats["store"]["loaded"] - before["store"]["loaded"] == 1
    assert stats["storage"]["writes"] == 0  # loaded, not written back
    # the image's encoder output came with its KV: no vision tower for it
    assert _vision(stats, before) == {"embeddings_loaded": 1, "skipped": 1, "encoded": 0}


def test_another_salt_never_loads_a_segment(instance_b):
    before = _storage(instance_b)["hits"]
    assert _chat(instance_b, "Tenant B reads.", Y, cache_salt="tenant-B")["reused"] == 0
    assert _chat(instance_b, "Nobody's tenant.", Y)["reused"] == 0
    assert _storage(instance_b)["hits"] == before
    # the paired hit: A's own salt does load it
    assert _chat(instance_b, "Tenant A, in B.", Y, cache_salt="tenant-A")["reused"] == 16
    assert _storage(instance_b)["hits"] == before + 1


def test_b_writes_its_new_images_through(instance_b, cluster):
    keys_before = cluster.keys()
    before = _storage(instance_b)
    assert _chat(instance_b, "B reads a new image.", make_image(1306))["reused"] == 0
    after = _wait_writes(instance_b, before["writes"] + before["write_failed"] + 1)
    assert after["writes"] == before["writes"] + 1 and after["write_failed"] == 0
    assert len(cluster.keys() - keys_before) == 2


def _rewrite_header(raw, header: str, **changes) -> None:
    """A's header with ``changes``, its checksum valid: a forged, intact header."""
    fields = decode_header(raw.get(header))
    fields.update(changes)
    overwrite(raw, header, encode_header(fields).numpy().tobytes())


@pytest.mark.parametrize(
    "name, counter",
    [("garbage", "corrupt"), ("huge", "corrupt"), ("foreign", "mismatched"), ("gone", "corrupt"),
     ("embeds", "corrupt")],
)  # fmt: skip
def test_a_damaged_entry_is_a_counted_miss_with_stock_s_answer(
    instance_b, shared, raw, name, counter
):
    header, payload = _part(shared, name, "h"), _part(shared, name, "p")
    if name == "garbage":
        overwrite(raw, header, b"\xff" * HEADER_BYTES)
    elif name == "huge":  # a header claiming 100 GiB of payload
        fields = decode_header(raw.get(header))
        layers, _, heads, dim = fields["k_shape"]
        n = 100 * GIB // (3 * 8 + 2 * layers * heads * dim * 4)
        _rewrite_header(raw, header, positions=[3, n], k_shape=[layers, n, heads, dim],
                        v_shape=[layers, n, heads, dim], payload_bytes=100 * GIB)  # fmt: skip
    elif name == "foreign":  # an intact entry of another fill policy at this name
        kv = decode_header(raw.get(header))["kv"]
        _rewrite_header(raw, header, kv={**kv, "fill": "canonical"})
    elif name == "embeds":  # image embeddings claiming a million rows (~256 MiB)
        fields = decode_header(raw.get(header))
        rows, width = fields["embeds"]
        claimed = fields["payload_bytes"] + (10**6 - rows) * width * 2
        _rewrite_header(raw, header, embeds=[10**6, width], payload_bytes=claimed)
    else:
        raw.remove(payload, True)
    peak = _scheduler_peak_rss(instance_b)
    stats_before = mmkv_stats(instance_b.base_url)
    before = stats_before["storage"]
    got = _chat(instance_b, DAMAGE_SYSTEM, DAMAGED[name])
    assert got["reused"] == 0
    _assert_same_answer(got, shared["stock"][name])
    # no embeddings from the damaged entry: the vision tower encoded the image
    vision = _vision(mmkv_stats(instance_b.base_url), stats_before)
    assert vision == {"embeddings_loaded": 0, "skipped": 0, "encoded": 1}
    after = _wait_writes(instance_b, before["writes"] + before["write_failed"] + 1)
    assert after[counter] == before[counter] + 1 and after["hits"] == before["hits"]
    assert after["bytes_read"] == before["bytes_read"] and after["errors"] == before["errors"]
    assert _scheduler_peak_rss(instance_b) - peak < SLACK_BYTES
    # the fill after the miss removed the damaged objects and wrote the entry again
    assert (after["rewritten"], after["writes"]) == (before["rewritten"] + 1, before["writes"] + 1)
    flush_cache(instance_b.base_url)
    again = _chat(instance_b, "B, the repaired entry, elsewhere.", DAMAGED[name])
    assert again["reused"] == TOKENS_PER_IMAGE  # loaded from the rewritten entry
    assert _storage(instance_b)["hits"] == after["hits"] + 1


def test_a_full_store_is_a_counted_write_failure_with_stock_s_answer(instance_b, shared, raw):
    assert fill_store(raw) > 0  # pinned: Mooncake may not evict them
    try:
        before = _storage(instance_b)
        got = _chat(instance_b, FULL_SYSTEM, FULL)
        assert got["reused"] == 0
        _assert_same_answer(got, shared["stock"]["full"])
        after = _wait_writes(instance_b, before["writes"] + before["write_failed"] + 1)
        assert after["write_failed"] == before["write_failed"] + 1
        assert (after["writes"], after["errors"]) == (before["writes"], before["errors"])
    finally:
        empty_fill(raw)


def test_a_master_killed_mid_run_gives_200_and_misses_within_the_deadline(
    instance_b, shared, cluster
):
    """Last: the store is gone for the rest of the module. Z is in the store but not in
    B's memory; with the master down its read is a miss, waited for at most the
    deadline, and the new image's write a counted failure."""
    cluster.kill_master()
    before = _storage(instance_b)
    got = _chat(instance_b, DOWN_SYSTEM, Z)
    assert got["reused"] == 0
    _assert_same_answer(got, shared["stock"]["down"])
    after = _wait_writes(instance_b, before["writes"] + before["write_failed"] + 1)
    assert after["lookups"] - before["lookups"] == after["misses"] - before["misses"] == 1
    late = ("timeouts", "stalled", "unavailable")  # the read, and the write's `unavailable`
    assert sum(after[k] - before[k] for k in late) == 2
    assert after["hits"] == before["hits"] and after["errors"] == before["errors"]
    assert after["write_failed"] == before["write_failed"] + 1
    assert after["load_seconds"] - before["load_seconds"] < DEADLINE_S + 0.3
    fresh = make_image(1330)
    started = time.monotonic()
    assert _chat(instance_b, "B, a new image, no master.", fresh)["reused"] == 0
    assert _chat(instance_b, "B, the new image again.", fresh)["reused"] == TOKENS_PER_IMAGE
    assert time.monotonic() - started < 120
    final = _storage(instance_b)
    assert final["load_seconds"] - before["load_seconds"] < 2 * (DEADLINE_S + 0.3)
    assert requests.get(instance_b.base_url + "/health", timeout=30).status_code == 200

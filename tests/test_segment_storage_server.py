"""``--mm-reuse conduit`` instances sharing SGLang's ``file`` L3 storage, one machine.

Instance A reads images and writes their segments through to the storage directory,
then is stopped by PID. Instance B (same fill policy), started later on the same
directory, has never seen them: it reuses them under a new prefix (loaded from
storage), and at budget 1.0 its answer equals a stock server's full prefill.
Another ``cache_salt`` never loads A's segment. A's entries carry the images'
vision-encoder output: B runs no vision tower for an image it loads, and B2 (budget
0.1: a partial refresh) answers from the stored embeddings exactly as from embeddings
it computes itself (the entry rewritten without them).

The directory is untrusted input: entries of A are then damaged or replaced as
someone who can write the directory could (a header claiming 100 GiB or 0.5 GiB, a
FIFO or a symlink out of the directory at a payload path, a payload gone, a
truncated entry, the directory removed). Each request still gets 200 and stock's
answer, B's scheduler does not allocate what a header claims, and the counters say
what happened. Instance C (canonical fill, a storage whose reads take 1 s, small
caps) waits for no read longer than the deadline, never loads A's ``first``-fill
entries, and keeps the directory under its caps. One server runs at a time, but for
C, started while B is idle.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
import requests

from sgl_mmkv.radix_cache import ACTIVE_LOG_PREFIX
from sgl_mmkv.segments.deadline import DELAY_FILE_ENV
from sgl_mmkv.segments.entry_format import (
    HEADER_BYTES,
    decode_header,
    encode_header,
    key_from_fields,
)
from sgl_mmkv.testing.chat import greedy_chat
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
    mmkv_stats,
    start_together,
    stock_cpu_env,
)

TOKENS_PER_IMAGE = 16
HIDDEN = 128  # the tiny model's: its vision encoder's output per image token
VISION = ("vision_encoded", "vision_skipped")
EMBEDDING_WARNINGS = (  # refresh/segment_embeddings.py's fallbacks to the stock encoders
    "sgl_mmkv: stored image embeddings not used",
    "sgl_mmkv: image embeddings built as stock",
    "sgl_mmkv: image embeddings not captured",
    "sgl_mmkv: reading a segment for L3 failed",
)
# qwen2_vl at budget 1.0 reproduces full prefill (tests/test_architectures_server.py)
TOLERANCE = 1e-3
X, Y, Z, V = make_image(1201), make_image(1202), make_image(1203), make_image(1204)
W = make_image(1207)  # B2 reads it with and without its stored embeddings
# images whose entries the tests damage, each once
DAMAGED = {name: make_image(1210 + i) for i, name in enumerate(
    ("huge", "half", "fifo", "symlink", "gone", "embeds_rows", "embeds_bytes")
)}  # fmt: skip
PROBE_SYSTEM = "Instance B asks, in other words."
DAMAGE_SYSTEM = "B reads a damaged entry."
GIB = 2**30
SLACK_BYTES = 64 * 2**20  # what one request may add to the scheduler's peak RSS


def _mmkv_args(storage_dir, *extra: str) -> list[str]:
    return [
        *CPU_SERVER_ARGS,
        "--sleep-on-idle",
        "--mm-reuse", "conduit",
        "--mm-refresh-budget", "1.0",
        "--mm-reuse-gate", "always",
        "--mm-segment-storage", "file",
        "--mm-segment-storage-dir", str(storage_dir),
        REPORT_REUSE,
        *extra,
    ]  # fmt: skip


def _chat(server, system: str, image, **extra) -> dict:
    messages = [{"role": "system", "content": system}, user_message("Describe.", [image])]
    return greedy_chat(server.base_url, messages, **extra)


def _assert_same_answer(got: dict, want: dict) -> None:
    assert got["text"] == want["text"]
    shared_tokens = set(got["top"]) & set(want["top"])
    assert len(shared_tokens) >= 4
    for token in shared_tokens:
        assert abs(got["top"][token] - want["top"][token]) < TOLERANCE, token


def _entries(directory) -> set[str]:
    return {f for f in os.listdir(directory) if f.endswith(".bin")}


def _storage(server) -> dict:
    return mmkv_stats(server.base_url)["storage"]


def _wait_writes(server, writes: int, timeout_s: float = 60.0) -> dict:
    """The storage counters once ``writes + write_failed`` reached ``writes`` (writes
    run on the writer thread, after the response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _storage(server)
        if stats["writes"] + stats["write_failed"] >= writes or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _scheduler_peak_rss(server) -> int:
    """VmHWM (peak resident set) of the server's scheduler process, in bytes."""
    pid = re.search(rf"{ACTIVE_LOG_PREFIX}: .* pid=(\d+)", server.log_text()).group(1)
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _part(storage, files: set[str], part: str):
    return storage / next(f for f in files if re.search(rf"_{part}[0-9a-f]*__0_1\.bin$", f))


@pytest.fixture(scope="module")
def shared(tiny_vlm, tmp_path_factory) -> dict:
    """Stock's answers, then instance A reads X, Y (salted), Z, V and the images to
    damage, and stops once its writes have landed."""
    logs = tmp_path_factory.mktemp("storage_logs")
    storage = tmp_path_factory.mktemp("l3") / "segments"
    args = [*CPU_SERVER_ARGS, "--sleep-on-idle"]
    stock = ServerProcess("sglang.launch_server", tiny_vlm, args, logs / "stock.log")
    a = ServerProcess("sgl_mmkv.launch_server", tiny_vlm, _mmkv_args(storage), logs / "a.log")
    files: dict[str, set[str]] = {}
    try:
        start_together([stock, a])
        with stock:  # already started: stopped on leaving
            answers = {"probe": _chat(stock, PROBE_SYSTEM, X)}
            for name, image in DAMAGED.items():
                answers[name] = _chat(stock, DAMAGE_SYSTEM, image)
        a_before = _storage(a)  # after SGLang's warm-up request
        a_store_before = mmkv_stats(a.base_url)["store"]
        seen: set[str] = _entries(storage)
        shown = [("X", X, {}), ("Y", Y, {"cache_salt": "tenant-A"}), ("Z", Z, {}), ("V", V, {})]
        shown.append(("W", W, {}))
        for name, image, extra in [*shown, *((n, im, {}) for n, im in DAMAGED.items())]:
            assert _chat(a, "Instance A reads.", image, **extra)["reused"] == 0
            _wait_writes(a, a_before["writes"] + len(files) + 1)
            files[name] = _entries(storage) - seen
            seen |= files[name]
        a_stats = mmkv_stats(a.base_url)
    finally:
        for server in (stock, a):
            server.stop()  # by PID, the whole process tree
    assert a.process.poll() is not None
    return {
        "stock": answers,
        "storage": storage,
        "files": files,
        "a_before": a_before,
        "a_store_before": a_store_before,
        "a": a_stats,
        "logs": logs,
    }


@pytest.fixture(scope="module")
def instance_b(tiny_vlm, shared):
    args = _mmkv_args(shared["storage"])
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, shared["logs"] / "b.log") as b:
        yield b


def test_instance_a_wrote_every_new_segment_through(shared):
    before, after = shared["a_before"], shared["a"]["storage"]
    shown = 5 + len(DAMAGED)
    assert after["writes"] - before["writes"] == shown and after["write_failed"] == 0
    assert after["hits"] == 0 and after["lookups"] - before["lookups"] == shown
    assert all(len(f) == 2 for f in shared["files"].values())  # a header and a payload each
    vision = {k: shared["a"]["store"][k] - shared["a_store_before"][k] for k in VISION}
    assert vision == {"vision_encoded": shown, "vision_skipped": 0}  # one tower run per image
    fields = decode_header(_part(shared["storage"], shared["files"]["X"], "h").read_bytes())
    assert fields["embeds"] == [TOKENS_PER_IMAGE, HIDDEN]  # the image's encoder output


def _vision(after: dict, before: dict) -> dict:
    """What the vision tower did between two ``mmkv_stats``: images whose embeddings a
    segment held (``skipped``), images encoded, segments loaded with embeddings."""
    a, b = after["store"], before["store"]
    return {
        "embeddings_loaded": a["embeddings_loaded"] - b["embeddings_loaded"],
        "skipped": a["vision_skipped"] - b["vision_skipped"],
        "encoded": a["vision_encoded"] - b["vision_encoded"],
    }


def _without_embeddings(shared, name: str) -> int:
    """Rewrite A's entry of image ``name`` with its KV alone (as an instance whose
    encoder output did not fit would have written it), through the storage itself.
    Returns the bytes of the embeddings it had."""
    from sgl_mmkv.segments.storage import KVFingerprint, open_storage

    directory, files = shared["storage"], shared["files"][name]
    header = _part(directory, files, "h")
    fields = decode_header(header.read_bytes())
    key = key_from_fields(fields["key"])
    storage = open_storage("file", KVFingerprint(**fields["kv"]), str(directory))
    stored = storage.load(key)
    assert stored is not None and stored.embeddings is not None
    size = stored.embeddings.numel() * stored.embeddings.element_size()
    stored.embeddings = None
    for f in files:
        (directory / f).unlink()
    assert storage.save(key, stored)
    assert decode_header(header.read_bytes())["embeds"] is None  # the same name
    return size


def _embeds_written(header, timeout_s: float) -> bool:
    """Whether the entry of ``header`` records embeddings within ``timeout_s`` (it is
    written on the storage's writer thread, its header last)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = decode_header(header.read_bytes()) if header.exists() else None
        if fields is not None and fields["embeds"] is not None:
            return True
        time.sleep(0.2)
    return False


def test_b2_partial_refresh_from_stored_embeddings_equals_recomputed_ones(tiny_vlm, shared):
    """At budget 0.1 the refresh pass recomputes the text and a few image tokens from
    their input embeddings: the answer from A's stored encoder output is B2's own to the
    last bit. The segment B2 loads without embeddings keeps those it computed."""
    args = _mmkv_args(shared["storage"])
    args[args.index("--mm-refresh-budget") + 1] = "0.1"
    log = shared["logs"] / "b2.log"
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log) as b2:
        before = mmkv_stats(b2.base_url)
        stored = _chat(b2, PROBE_SYSTEM, W)
        after = mmkv_stats(b2.base_url)
        assert stored["reused"] == TOKENS_PER_IMAGE
        assert _vision(after, before) == {"embeddings_loaded": 1, "skipped": 1, "encoded": 0}
        flush_cache(b2.base_url)  # memory only: the entry stays
        size = _without_embeddings(shared, "W")
        computed = _chat(b2, PROBE_SYSTEM, W)
        again = mmkv_stats(b2.base_url)
        assert computed["reused"] == TOKENS_PER_IMAGE
        assert again["storage"]["hits"] - after["storage"]["hits"] == 1
        assert _vision(again, after) == {"embeddings_loaded": 0, "skipped": 0, "encoded": 1}
        assert computed == stored  # text and every top logprob, exactly
        # the loaded segment keeps what B2 computed (the store held nothing else) and
        # its entry is written again with them, under the same name
        assert again["store"]["embedding_bytes"] == size == TOKENS_PER_IMAGE * HIDDEN * 2
        assert again["store"]["embeddings_gained"] == 1
        header = _part(shared["storage"], shared["files"]["W"], "h")
        assert _embeds_written(header, timeout_s=30)
        assert mmkv_stats(b2.base_url)["storage"]["rewritten"] - after["storage"]["rewritten"] == 1
    _assert_no_embedding_warning(log.read_text())


def _assert_no_embedding_warning(log: str) -> None:
    """No stored embeddings given up on, no build left to stock, nothing uncaptured."""
    for line in EMBEDDING_WARNINGS:
        assert line not in log, line


def test_b_reuses_a_image_it_never_saw_and_equals_stock_full_prefill(instance_b, shared):
    before = mmkv_stats(instance_b.base_url)
    got = _chat(instance_b, PROBE_SYSTEM, X)
    assert got["reused"] == TOKENS_PER_IMAGE
    _assert_same_answer(got, shared["stock"]["probe"])
    stats = mmkv_stats(instance_b.base_url)
    assert stats["storage"]["hits"] - before["storage"]["hits"] == 1
    assert stats["store"]["loaded"] - before["store"]["loaded"] == 1
    assert stats["storage"]["writes"] == 0  # loaded, not written back
    assert _vision(stats, before) == {"embeddings_loaded": 1, "skipped": 1, "encoded": 0}


def test_another_salt_never_loads_a_segment(instance_b):
    before = _storage(instance_b)["hits"]
    assert _chat(instance_b, "Tenant B reads.", Y, cache_salt="tenant-B")["reused"] == 0
    assert _chat(instance_b, "Nobody's tenant.", Y)["reused"] == 0
    assert _storage(instance_b)["hits"] == before
    # the paired hit: A's own salt does load it
    assert _chat(instance_b, "Tenant A, in B.", Y, cache_salt="tenant-A")["reused"] == 16
    assert _storage(instance_b)["hits"] == before + 1


def test_b_writes_its_new_images_through(instance_b, shared):
    files_before = _entries(shared["storage"])
    before = _storage(instance_b)
    assert _chat(instance_b, "B reads a new image.", make_image(1206))["reused"] == 0
    after = _wait_writes(instance_b, before["writes"] + before["write_failed"] + 1)
    assert after["writes"] == before["writes"] + 1 and after["write_failed"] == 0
    assert len(_entries(shared["storage"]) - files_before) == 2


def _plant_claim(shared, name: str, claimed_bytes: int) -> None:
    """Rewrite A's header of image ``name`` (valid checksum, same key and fingerprint)
    to claim a payload of about ``claimed_bytes``."""
    header = _part(shared["storage"], shared["files"][name], "h")
    fields = decode_header(header.read_bytes())
    layers, _, heads, dim = fields["k_shape"]
    per_token = 3 * 8 + 2 * layers * heads * dim * (4 if "32" in fields["dtype"] else 2)
    n = claimed_bytes // per_token
    fields.update(
        positions=[3, n], k_shape=[layers, n, heads, dim], v_shape=[layers, n, heads, dim]
    )
    fields["payload_bytes"] = n * per_token
    header.write_bytes(encode_header(fields).numpy().tobytes())
    assert len(header.read_bytes()) == HEADER_BYTES


@pytest.mark.parametrize("name,claim", [("half", GIB // 2), ("huge", 100 * GIB)])
def test_a_planted_header_allocates_nothing_and_is_a_miss(instance_b, shared, name, claim):
    """Before the fix the loader sized ``torch.zeros`` from these headers."""
    _plant_claim(shared, name, claim)
    peak = _scheduler_peak_rss(instance_b)
    before = _storage(instance_b)
    got = _chat(instance_b, DAMAGE_SYSTEM, DAMAGED[name])
    assert got["reused"] == 0
    _assert_same_answer(got, shared["stock"][name])
    after = _storage(instance_b)
    assert after["corrupt"] == before["corrupt"] + 1 and after["hits"] == before["hits"]
    assert after["bytes_read"] == before["bytes_read"] and after["errors"] == before["errors"]
    assert _scheduler_peak_rss(instance_b) - peak < SLACK_BYTES


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_payload_that_is_not_a_regular_file_of_the_directory_is_never_read(
    instance_b, shared, tmp_path, kind
):
    """A FIFO would block the scheduler in ``open()``; the symlink points out of the
    directory at a copy of the real payload (valid checksum): a read would be a hit."""
    payload = _part(shared["storage"], shared["files"][kind], "p")
    if kind == "fifo":
        payload.unlink()
        os.mkfifo(payload)
    else:
        outside = tmp_path / payload.name
        shutil.copy(payload, outside)
        payload.unlink()
        payload.symlink_to(outside)
    before = _storage(instance_b)
    started = time.monotonic()
    got = _chat(instance_b, DAMAGE_SYSTEM, DAMAGED[kind])
    assert time.monotonic() - started < 60
    assert got["reused"] == 0
    _assert_same_answer(got, shared["stock"][kind])
    after = _storage(instance_b)
    assert after["unsafe"] == before["unsafe"] + 1
    assert (after["hits"], after["corrupt"]) == (before["hits"], before["corrupt"])


def test_an_entry_whose_payload_went_is_written_again_at_the_next_fill(instance_b, shared):
    _part(shared["storage"], shared["files"]["gone"], "p").unlink()
    before = _storage(instance_b)
    got = _chat(instance_b, DAMAGE_SYSTEM, DAMAGED["gone"])
    assert got["reused"] == 0
    _assert_same_answer(got, shared["stock"]["gone"])
    after = _wait_writes(instance_b, before["writes"] + before["write_failed"] + 1)
    assert after["corrupt"] == before["corrupt"] + 1
    assert (after["rewritten"], after["writes"]) == (before["rewritten"] + 1, before["writes"] + 1)
    flush_cache(instance_b.base_url)
    again = _chat(instance_b, "B, the repaired entry, elsewhere.", DAMAGED["gone"])
    assert again["reused"] == TOKENS_PER_IMAGE  # loaded from the rewritten entry
    assert _storage(instance_b)["hits"] == after["hits"] + 1


def test_a_truncated_entry_is_a_miss_not_an_error(instance_b, shared):
    storage = shared["storage"]
    for name in shared["files"]["Z"]:
        path = storage / name
        path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    before = _storage(instance_b)
    assert _chat(instance_b, "B reads a damaged entry.", Z)["reused"] == 0
    after = _storage(instance_b)
    assert after["corrupt"] == before["corrupt"] + 1 and after["hits"] == before["hits"]
    # computed fresh and kept in memory: the next prefix reuses it from the store
    assert _chat(instance_b, "B reads it again.", Z)["reused"] == TOKENS_PER_IMAGE


@pytest.mark.parametrize("name", ["embeds_rows", "embeds_bytes"])
def test_a_damaged_embeddings_section_is_a_miss_and_the_tower_runs(instance_b, shared, name):
    """``embeds_rows``: a header (valid checksum) whose embeddings claim a million rows
    of a 16-token image, about 256 MiB: refused before the payload is read or anything
    allocated. ``embeds_bytes``: the payload's last bytes (the encoder output) changed:
    its checksum fails. Either way a counted miss, and B's vision tower encodes the
    image."""
    directory, files = shared["storage"], shared["files"][name]
    if name == "embeds_rows":
        header = _part(directory, files, "h")
        fields = decode_header(header.read_bytes())
        rows, width = fields["embeds"]
        claim = 10**6
        fields.update(embeds=[claim, width])
        fields["payload_bytes"] += (claim - rows) * width * 2
        header.write_bytes(encode_header(fields).numpy().tobytes())
    else:
        payload = _part(directory, files, "p")
        data = bytearray(payload.read_bytes())
        data[-64:] = bytes(255 - b for b in data[-64:])
        payload.write_bytes(bytes(data))
    peak = _scheduler_peak_rss(instance_b)
    before = mmkv_stats(instance_b.base_url)
    got = _chat(instance_b, DAMAGE_SYSTEM, DAMAGED[name])
    assert got["reused"] == 0
    _assert_same_answer(got, shared["stock"][name])
    after = mmkv_stats(instance_b.base_url)
    s, b = after["storage"], before["storage"]
    assert (s["corrupt"] - b["corrupt"], s["hits"] - b["hits"], s["errors"] - b["errors"]) == (
        1, 0, 0,
    )  # fmt: skip
    if name == "embeds_rows":
        assert s["bytes_read"] == b["bytes_read"]
    assert _vision(after, before) == {"embeddings_loaded": 0, "skipped": 0, "encoded": 1}
    assert _scheduler_peak_rss(instance_b) - peak < SLACK_BYTES


def _directory_bytes(storage) -> int:
    return sum(os.path.getsize(storage / f) for f in _entries(storage) if "probe" not in f)


def _stems(names) -> set[str]:
    return {
        m.group(1) for f in names if (m := re.match(r"(sgl_mmkv_[0-9a-f]{16}_[0-9a-f]{64})_", f))
    }


def _namespaces(storage) -> list:
    """The namespace seed of each entry with a readable header."""
    seeds = []
    for f in _entries(storage):
        if re.search(r"_h__0_1\.bin$", f):
            fields = decode_header((storage / f).read_bytes())
            if fields is not None:
                seeds.append(fields["key"]["namespace_seed"])
    return seeds


def test_c_never_waits_for_a_read_nor_loads_another_fill_policy_and_keeps_the_caps(
    tiny_vlm, shared, instance_b, tmp_path
):
    """C: canonical fill, every storage read slowed to 1 s (``SGL_MMKV_STORAGE_DELAY_FILE``)
    against the default deadline of 200 ms, and caps of five entries in total and two
    per namespace on the directory A and B filled."""
    storage = shared["storage"]
    entry = sum(os.path.getsize(storage / f) for f in shared["files"]["X"])
    total, per_space = 5 * entry, 2 * entry
    args = _mmkv_args(
        storage,
        *("--mm-segment-fill", "canonical"),
        *("--mm-segment-storage-max-gib", f"{total / GIB:.9f}"),
        *("--mm-segment-storage-namespace-max-gib", f"{per_space / GIB:.9f}"),
    )
    delay = tmp_path / "storage_delay"
    delay.write_text("1.0")
    env = {**stock_cpu_env(), DELAY_FILE_ENV: str(delay)}
    log = shared["logs"] / "c.log"
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log, env=env) as c:
        start = _wait_writes(c, 0)  # after SGLang's warm-up request

        def since_start(stats: dict) -> dict:
            return {k: v - start[k] for k, v in stats.items()}

        files_before = _entries(storage)
        got = _chat(c, PROBE_SYSTEM, X)  # A's entry of X is there, under fill "first"
        assert got["reused"] == 0
        _assert_same_answer(got, shared["stock"]["probe"])
        after = since_start(_wait_writes(c, start["writes"] + 1))
        assert after["timeouts"] + after["stalled"] == after["lookups"] == 1
        assert after["hits"] == 0 and after["write_skipped"] == 0 and after["writes"] == 1
        assert len(_entries(storage) - files_before) == 2  # its own entry, another name
        for i in range(3):  # one namespace writes three: its oldest gives way
            # (a system prompt of its own each: after a cached <|vision_start|> a
            # canonical fill could not compute the image alone, and would not store it)
            system = f"C, one tenant, picture {i}."
            _chat(c, system, make_image(1230 + i), cache_salt="one-tenant")
        for i in range(4):  # a client looping salts
            _chat(c, "C, looping salts.", make_image(1240 + i), cache_salt=f"salt-{i}")
        stats = since_start(_wait_writes(c, start["writes"] + 8))
        assert mmkv_stats(c.base_url)["store"]["canonical_skipped"] == 0
        assert stats["writes"] == 8 and stats["too_large"] == 0, stats
        assert stats["timeouts"] + stats["stalled"] == stats["lookups"] == 8
        assert stats["timeouts"] >= 1 and stats["hits"] == 0
        assert stats["load_seconds"] < 8 * 0.2 + 0.5  # never the 1 s of a read
    seeds = _namespaces(storage)
    assert _directory_bytes(storage) <= total
    assert max(seeds.count(s) for s in set(seeds)) <= 2
    old = _stems(files_before)
    gone = old - _stems(_entries(storage))
    assert len(gone) >= len(old) - 5 and stats["evicted"] >= len(gone)  # A's and B's gave way
    assert requests.get(instance_b.base_url + "/health", timeout=30).status_code == 200


def test_removed_storage_directory_gives_misses_not_failed_requests(instance_b, shared):
    shutil.rmtree(shared["storage"])
    before = _storage(instance_b)
    assert _chat(instance_b, "B after the directory went.", V)["reused"] == 0
    fresh = make_image(1205)
    assert _chat(instance_b, "B, a new image.", fresh)["reused"] == 0
    after = _wait_writes(instance_b, before["writes"] + before["write_failed"] + 2)
    assert after["hits"] == before["hits"] and after["errors"] == before["errors"]
    assert after["write_failed"] >= before["write_failed"] + 1
    assert _chat(instance_b, "B, the new image again.", fresh)["reused"] == TOKENS_PER_IMAGE
    assert requests.get(instance_b.base_url + "/health", timeout=30).status_code == 200


def test_no_fallback_nor_embedding_warning_in_the_logs(instance_b, shared):
    """A's and B's logs so far (B2's is checked in its test; every server's log for
    ``refresh path failed`` when it stops)."""
    for log in ((shared["logs"] / "a.log").read_text(), instance_b.log_text()):
        assert "sgl_mmkv: refresh path failed" not in log
        _assert_no_embedding_warning(log)

"""Two ``--mm-reuse conduit`` instances sharing SGLang's ``file`` L3 storage, one machine.

Instance A reads images and writes their segments through to the storage directory,
then is stopped by PID. Instance B (canonical fill), started later on the same
directory, has never seen them: it reuses them under a new prefix (loaded from
storage), and at budget 1.0 its answer equals a stock server's full prefill.
Another ``cache_salt`` never loads A's segment; a truncated entry and a removed
directory are misses, never failed requests. One server runs at a time.
"""

from __future__ import annotations

import os
import shutil

import pytest
import requests

from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

TOKENS_PER_IMAGE = 16
# qwen2_vl at budget 1.0 reproduces full prefill (tests/test_architectures_server.py)
TOLERANCE = 1e-3
X, Y, Z, V = make_image(1201), make_image(1202), make_image(1203), make_image(1204)
PROBE_SYSTEM = "Instance B asks, in other words."


def _mmkv_args(storage_dir) -> list[str]:
    return [
        *CPU_SERVER_ARGS,
        "--sleep-on-idle",
        "--mm-reuse", "conduit",
        "--mm-refresh-budget", "1.0",
        "--mm-reuse-gate", "always",
        "--mm-segment-storage", "file",
        "--mm-segment-storage-dir", str(storage_dir),
        REPORT_REUSE,
    ]  # fmt: skip


def _chat(server, system: str, image, **extra) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "system", "content": system}, user_message("Describe.", [image])],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "return_meta_info": True,
        **extra,
    }
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    first = choice["logprobs"]["content"][0]
    return {
        "text": choice["message"]["content"],
        "top": {t["token"]: t["logprob"] for t in first["top_logprobs"]},
        "reused": choice["meta_info"].get("sgl_mmkv", [{}])[0].get("reused_tokens", 0),
    }


def _entries(directory) -> set[str]:
    return {f for f in os.listdir(directory) if f.endswith(".bin")}


@pytest.fixture(scope="module")
def shared(tiny_vlm, tmp_path_factory) -> dict:
    """Stock's probe answer, then instance A reads X, Y (salted), Z and V and stops."""
    logs = tmp_path_factory.mktemp("storage_logs")
    storage = tmp_path_factory.mktemp("l3") / "segments"
    args = [*CPU_SERVER_ARGS, "--sleep-on-idle"]
    with ServerProcess("sglang.launch_server", tiny_vlm, args, logs / "stock.log") as stock:
        probe = _chat(stock, PROBE_SYSTEM, X)
    a = ServerProcess("sgl_mmkv.launch_server", tiny_vlm, _mmkv_args(storage), logs / "a.log")
    files: dict[str, set[str]] = {}
    try:
        a.start()
        a_before = mmkv_stats(a.base_url)["storage"]  # after SGLang's warm-up request
        seen: set[str] = _entries(storage)
        for name, image, extra in (
            ("X", X, {}),
            ("Y", Y, {"cache_salt": "tenant-A"}),
            ("Z", Z, {}),
            ("V", V, {}),
        ):
            assert _chat(a, "Instance A reads.", image, **extra)["reused"] == 0
            files[name] = _entries(storage) - seen
            seen |= files[name]
        a_stats = mmkv_stats(a.base_url)
    finally:
        a.stop()  # by PID, the whole process tree
    assert a.process.poll() is not None
    return {
        "stock": probe,
        "storage": storage,
        "files": files,
        "a_before": a_before,
        "a": a_stats,
        "logs": logs,
    }


@pytest.fixture(scope="module")
def instance_b(tiny_vlm, shared):
    """B fills new images canonically (A: ``first``), so both fill paths write through."""
    args = [*_mmkv_args(shared["storage"]), "--mm-segment-fill", "canonical"]
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, shared["logs"] / "b.log") as b:
        yield b


def test_instance_a_wrote_every_new_segment_through(shared):
    before, after = shared["a_before"], shared["a"]["storage"]
    assert after["writes"] - before["writes"] == 4 and after["write_failed"] == 0
    assert after["hits"] == 0 and after["lookups"] - before["lookups"] == 4  # none there before
    assert all(len(f) == 2 for f in shared["files"].values())  # a header and a payload each


def test_b_reuses_a_image_it_never_saw_and_equals_stock_full_prefill(instance_b, shared):
    before = mmkv_stats(instance_b.base_url)
    got = _chat(instance_b, PROBE_SYSTEM, X)
    assert got["reused"] == TOKENS_PER_IMAGE
    want = shared["stock"]
    assert got["text"] == want["text"]
    shared_tokens = set(got["top"]) & set(want["top"])
    assert len(shared_tokens) >= 4
    for token in shared_tokens:
        assert abs(got["top"][token] - want["top"][token]) < TOLERANCE, token
    stats = mmkv_stats(instance_b.base_url)
    assert stats["storage"]["hits"] - before["storage"]["hits"] == 1
    assert stats["store"]["loaded"] - before["store"]["loaded"] == 1
    assert stats["storage"]["writes"] == 0  # loaded, not written back


def test_another_salt_never_loads_a_segment(instance_b):
    before = mmkv_stats(instance_b.base_url)["storage"]["hits"]
    assert _chat(instance_b, "Tenant B reads.", Y, cache_salt="tenant-B")["reused"] == 0
    assert _chat(instance_b, "Nobody's tenant.", Y)["reused"] == 0
    assert mmkv_stats(instance_b.base_url)["storage"]["hits"] == before
    # the paired hit: A's own salt does load it
    assert _chat(instance_b, "Tenant A, in B.", Y, cache_salt="tenant-A")["reused"] == 16
    assert mmkv_stats(instance_b.base_url)["storage"]["hits"] == before + 1


def test_b_writes_its_new_images_through_from_the_canonical_fill(instance_b, shared):
    files_before = _entries(shared["storage"])
    before = mmkv_stats(instance_b.base_url)["storage"]
    assert _chat(instance_b, "B reads a new image.", make_image(1206))["reused"] == 0
    after = mmkv_stats(instance_b.base_url)["storage"]
    assert after["writes"] == before["writes"] + 1 and after["write_failed"] == 0
    assert len(_entries(shared["storage"]) - files_before) == 2


def test_a_truncated_entry_is_a_miss_not_an_error(instance_b, shared):
    storage = shared["storage"]
    for name in shared["files"]["Z"]:
        path = storage / name
        path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    before = mmkv_stats(instance_b.base_url)["storage"]
    assert _chat(instance_b, "B reads a damaged entry.", Z)["reused"] == 0
    after = mmkv_stats(instance_b.base_url)["storage"]
    assert after["corrupt"] == before["corrupt"] + 1 and after["hits"] == before["hits"]
    # computed fresh and kept in memory: the next prefix reuses it from the store
    assert _chat(instance_b, "B reads it again.", Z)["reused"] == TOKENS_PER_IMAGE


def test_removed_storage_directory_gives_misses_not_failed_requests(instance_b, shared):
    shutil.rmtree(shared["storage"])
    before = mmkv_stats(instance_b.base_url)["storage"]
    assert _chat(instance_b, "B after the directory went.", V)["reused"] == 0
    fresh = make_image(1205)
    assert _chat(instance_b, "B, a new image.", fresh)["reused"] == 0
    after = mmkv_stats(instance_b.base_url)["storage"]
    assert after["hits"] == before["hits"] and after["errors"] == before["errors"]
    assert after["write_failed"] >= before["write_failed"] + 1
    assert _chat(instance_b, "B, the new image again.", fresh)["reused"] == TOKENS_PER_IMAGE
    assert requests.get(instance_b.base_url + "/health", timeout=30).status_code == 200

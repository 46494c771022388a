"""A failure anywhere in the refresh path falls back to stock for that batch.

One real server with every part of the path on (conduit scoring, scored ranking,
decode-time compression) at refresh budget 1.0, where reuse equals full prefill.
A fault is injected at each stage in turn (``sgl_mmkv.refresh.faults``): the
request that hits it is answered exactly as cold, the failure is counted, the
server keeps serving, and the slot ledger stays exact.
"""

from __future__ import annotations

import pytest
import requests

from sgl_mmkv.refresh.faults import FAULT_FILE_ENV, STAGES
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
    mmkv_stats,
    stock_cpu_env,
)

ARGS = [
    *CPU_SERVER_ARGS,
    *("--mm-reuse", "conduit", "--mm-refresh-budget", "1.0", "--mm-reuse-gate", "always"),
    *("--mm-evict", "snapkv", "--mm-kv-budget", "1.0", "--mm-compress-at", "decode"),
    REPORT_REUSE,
]


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "stage"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory, fault_file):
    log = tmp_path_factory.mktemp("logs") / "fallback.log"
    env = {**stock_cpu_env(), FAULT_FILE_ENV: str(fault_file)}
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, ARGS, log, env=env) as proc:
        yield proc


def _flush(server) -> None:
    flush_cache(server.base_url)


def _chat(server, system: str, images) -> str:
    body = {
        "model": "default",
        "messages": [{"role": "system", "content": system}, user_message("Describe.", images)],
        "max_tokens": 6,
        "temperature": 0,
    }
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _failures(server) -> int:
    stats = mmkv_stats(server.base_url)
    return stats["refresh"]["fallbacks"] + stats["row_compaction"]["failures"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_each_stage_is_answered_as_stock(server, fault_file, stage):
    images = [make_image(970), make_image(971)]
    first, second = "One system prompt.", "Another, longer system prompt for the reuse."
    fault_file.write_text("")
    _flush(server)
    cold_first = _chat(server, first, images)
    _flush(server)
    cold_second = _chat(server, second, images)
    _flush(server)

    before = _failures(server)
    fault_file.write_text(stage)
    try:
        assert _chat(server, first, images) == cold_first  # stores the images
        assert _chat(server, second, images) == cold_second  # reuses them
    finally:
        fault_file.write_text("")
    assert _failures(server) > before
    assert requests.get(server.base_url + "/health", timeout=30).status_code == 200
    _flush(server)
    pool = mmkv_stats(server.base_url)["pool"]
    assert pool["available"] == pool["size"] and pool["free_unique"]
    assert pool["store"] == 0 and pool["in_use"] == 0


def test_without_a_fault_the_same_requests_reuse(server, fault_file):
    # the paired hit: the path the faults interrupt does reuse when left alone
    fault_file.write_text("")
    _flush(server)
    images = [make_image(972)]
    _chat(server, "One system prompt.", images)
    before = mmkv_stats(server.base_url)["refresh"]
    _chat(server, "Another, longer system prompt for the reuse.", images)
    after = mmkv_stats(server.base_url)["refresh"]
    assert after["reused_tokens"] - before["reused_tokens"] == 16
    assert after["fallbacks"] == before["fallbacks"]

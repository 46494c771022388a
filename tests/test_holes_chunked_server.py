"""No decode step reads a slot its request never wrote: holes under chunked prefill.

Reused compressed segments leave holes (positions with no KV) that the row compactor
removes right after the prefill, before anything decodes. Under SGLang's overlap
scheduler a request's last prefill chunk runs before the result of its previous
chunk is processed; the compactor must still shrink its row then. Checked on real
servers at chunk sizes 32, 64 and 8192, overlap on, each against the same server
with every freed and hole slot NaN-poisoned (``SGL_MMKV_POISON_FREED=1``): equal
answers and finite logprobs mean no decode step attended a hole. Session requests
(whose row or inputs outlive the request) never get holes. A fault at the
compaction point aborts the holed request instead of decoding it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from transformers import AutoProcessor

from sgl_mmkv.refresh.faults import FAULT_FILE_ENV
from sgl_mmkv.segments.poison import POISON_ENV
from sgl_mmkv.testing.images import data_url, make_image
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
    mmkv_stats,
    stock_cpu_env,
)

HOLED = ["--mm-reuse", "reuse", "--mm-reuse-gate", "always", REPORT_REUSE]
HOLED += ["--enable-streaming-session"]
HOLED += ["--mm-evict", "snapkv", "--mm-kv-budget", "0.5", "--mm-compress-at", "fill"]
DECODED = 8


@pytest.fixture(scope="module", params=[32, 64, 8192])
def servers(request, tiny_vlm, tmp_path_factory):
    """One server per chunk size, its freed and hole slots NaN-poisoned while the
    poison file holds ``1`` (from the start): ``(server, fault file, poison file)``."""
    chunk = request.param
    logs = tmp_path_factory.mktemp(f"logs-{chunk}")
    fault, poison = logs / "fault", logs / "poison"
    fault.write_text("")
    poison.write_text("1")
    args = [*CPU_SERVER_ARGS, *HOLED, "--chunked-prefill-size", str(chunk)]
    env = {**stock_cpu_env(), FAULT_FILE_ENV: str(fault), POISON_ENV: f"@{poison}"}
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, logs / "server", env=env) as s:
        yield s, fault, poison


def poisoned_then_plain(server, poison: Path, run: Callable) -> tuple:
    """``run(server)`` from an empty cache with every freed and hole slot poisoned,
    then again from an empty cache without: ``(poisoned, plain)``. Poisoned first, so
    the plain run meets the NaN the first one left in freed slots too. Leaves the
    poison on."""
    flush_cache(server.base_url)
    poison.write_text("1")
    poisoned = run(server)
    poison.write_text("")
    try:
        flush_cache(server.base_url)
        plain = run(server)
    finally:
        poison.write_text("1")
    return poisoned, plain


def _prompt(model, system: str, images: int, text: str = "") -> str:
    processor = AutoProcessor.from_pretrained(model)
    content = [{"type": "text", "text": text}] if text else []
    content += [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": "Go on."}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def _generate(server, text: str, images: list, max_new_tokens: int, **extra) -> dict:
    body = {
        "text": text,
        "image_data": [data_url(image) for image in images],
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        "return_logprob": True,
        **extra,
    }
    response = requests.post(server.base_url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def _reply(out: dict) -> tuple[list[int], list[float]]:
    pairs = out["meta_info"]["output_token_logprobs"]
    return [token for _, token, _ in pairs], [logprob for logprob, _, _ in pairs]


def _holed_requests(server, model) -> tuple[list, dict]:
    """Four requests of 2-3 stored images after about 150 text tokens each (their last
    prefill chunk reuses them, with holes); the replies and the hole counters moved."""
    replies = []
    before = mmkv_stats(server.base_url)["row_compaction"]
    for k in range(4):
        images = [make_image(700 + 10 * k + j) for j in range(2 + k % 2)]
        _generate(server, _prompt(model, "You are a helpful assistant.", len(images)), images, 1)
        words = " ".join(f"w{k}x{i}" for i in range(60))
        text = _prompt(model, "Answer in one word.", len(images), words)
        replies.append(_reply(_generate(server, text, images, DECODED)))
    after = mmkv_stats(server.base_url)["row_compaction"]
    return replies, {name: after[name] - before[name] for name in after}


def _assert_exact_ledger(server) -> None:
    flush_cache(server.base_url)
    pool = mmkv_stats(server.base_url)["pool"]
    assert pool["free_unique"] and pool["in_use"] == 0 and pool["store"] == 0
    assert pool["available"] == pool["size"]


def test_chunked_rows_with_holes_are_compacted_before_any_decode(servers, tiny_vlm):
    server, _, poison = servers
    runs = poisoned_then_plain(server, poison, lambda s: _holed_requests(s, tiny_vlm))
    (poisoned, moved), (plain, plain_moved) = runs
    assert moved == plain_moved
    assert moved["hole_tokens"] > 0 and moved["holed_requests"] > 0
    assert moved["skipped_requests"] == 0 and moved["aborted_requests"] == 0
    assert moved["failures"] == 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(poisoned, plain, strict=True):
        assert tokens == want_tokens
        assert all(lp is not None and math.isfinite(lp) for lp in logprobs)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
    _assert_exact_ledger(server)


def _open_session(server, streaming: bool) -> str:
    body = {"capacity_of_str_len": 100000, "streaming": streaming}
    response = requests.post(server.base_url + "/open_session", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _session_turns(server, model, streaming: bool, seed: int) -> tuple[list, dict]:
    images = [make_image(seed), make_image(seed + 1)]
    _generate(server, _prompt(model, "You are a helpful assistant.", 2), images, 1)
    before = mmkv_stats(server.base_url)
    session = _open_session(server, streaming)
    replies, rid = [], None
    try:
        for turn in range(2):
            text = _prompt(model, f"Turn {turn}. Answer in one word.", 2)
            params = {"id": session, "rid": rid}
            out = _generate(server, text, images, DECODED, session_params=params)
            rid = out["meta_info"]["id"]
            replies.append(_reply(out))
    finally:
        requests.post(server.base_url + "/close_session", json={"session_id": session}, timeout=60)
    after = mmkv_stats(server.base_url)
    moved = {
        "hole_tokens": after["row_compaction"]["hole_tokens"]
        - before["row_compaction"]["hole_tokens"],
        "reused_tokens": after["refresh"]["reused_tokens"] - before["refresh"]["reused_tokens"],
    }
    return replies, moved


@pytest.mark.parametrize("servers", [8192], indirect=True)
@pytest.mark.parametrize("streaming", [False, True])
def test_session_requests_reuse_without_holes(servers, tiny_vlm, streaming):
    server, _, poison = servers
    seed = 800 + 10 * streaming
    runs = poisoned_then_plain(
        server, poison, lambda s: _session_turns(s, tiny_vlm, streaming, seed)
    )
    (poisoned, moved), (plain, _) = runs
    assert moved["hole_tokens"] == 0 and moved["reused_tokens"] > 0
    for (tokens, logprobs), (want_tokens, _) in zip(poisoned, plain, strict=True):
        assert tokens == want_tokens
        assert all(lp is not None and math.isfinite(lp) for lp in logprobs)
    _assert_exact_ledger(server)


@pytest.mark.parametrize("servers", [64], indirect=True)
def test_a_fault_at_compaction_aborts_the_holed_request(servers, tiny_vlm):
    server, fault, _ = servers
    images = [make_image(900), make_image(901)]
    _generate(server, _prompt(tiny_vlm, "You are a helpful assistant.", 2), images, 1)
    before = mmkv_stats(server.base_url)["row_compaction"]
    fault.write_text("row_compaction")
    try:
        body = {
            "text": _prompt(tiny_vlm, "Answer in one word.", 2),
            "image_data": [data_url(image) for image in images],
            "sampling_params": {"max_new_tokens": DECODED, "temperature": 0},
        }
        response = requests.post(server.base_url + "/generate", json=body, timeout=300)
    finally:
        fault.write_text("")
    after = mmkv_stats(server.base_url)["row_compaction"]
    assert after["aborted_requests"] - before["aborted_requests"] == 1
    assert after["failures"] - before["failures"] >= 1  # every batch while the fault is on
    finish = response.json()["meta_info"]["finish_reason"] if response.ok else None
    assert response.status_code >= 400 or finish["type"] == "abort", response.text
    # the server keeps serving, exactly
    _generate(server, _prompt(tiny_vlm, "Answer in one word.", 1), [make_image(902)], 2)
    _assert_exact_ledger(server)

"""Scored eviction on real servers (tiny M-RoPE VLM, 16 tokens per image).

- ``--mm-kv-budget 1.0`` (compressing keeps every token) answers exactly as the
  server without scored eviction, while its segments are ranked.
- A compressed segment (``--mm-compress-at fill``) is reused for its kept tokens
  only; its dropped tokens are holes (``--mm-compressed-reuse holes``, the default:
  neither computed nor attended, the row shrinks after prefill and stays out of the
  radix tree) or recomputed (``recompute``). With every freed and hole slot
  overwritten with NaN the answers are the same and finite: holes are never read.
- Memory pressure (more distinct images than the pool holds) compresses segments
  before whole ones go; every request is answered and the slot ledger is exact.
- Decode-time compression (``--mm-compress-at decode``): at budget 1.0 answers equal
  the uncompressed server's; at 0.5 each running request frees exactly the dropped
  image tokens after prefill, decodes to the end, stays out of the radix tree, and
  the ledger returns to its start.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from sgl_mmkv.segments.poison import POISON_ENV
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerPool,
    ServerProcess,
    mmkv_stats,
    stock_cpu_env,
)

TOKENS_PER_IMAGE = 16


def _server_args(pool_tokens: int, *extra: str) -> list[str]:
    args = list(CPU_SERVER_ARGS)
    args[args.index("--max-total-tokens") + 1] = str(pool_tokens)
    return [*args, "--mm-reuse", "conduit", "--mm-reuse-gate", "always", REPORT_REUSE, *extra]


@pytest.fixture(scope="module")
def servers(tiny_vlm, tmp_path_factory):
    """name -> server, started when a test first asks for it (three up at once: the
    tests in file order then start 10 servers for 9 configurations, two at a time 13)."""
    logs = tmp_path_factory.mktemp("logs")
    configs = {
        "lru": _server_args(2048),
        "aircache_full": _server_args(
            2048, "--mm-evict", "aircache", "--mm-kv-budget", "1.0", "--mm-compress-at", "fill"
        ),
        "snapkv_fill": _server_args(
            2048, "--mm-evict", "snapkv", "--mm-kv-budget", "0.5", "--mm-compress-at", "fill"
        ),
        "mmshiftkv_pressure": _server_args(
            480, "--mm-evict", "mmshiftkv", "--mm-kv-budget", "0.25"
        ),
        "snapkv_decode_full": _server_args(
            2048, "--mm-evict", "snapkv", "--mm-kv-budget", "1.0", "--mm-compress-at", "decode"
        ),
        "snapkv_decode": _server_args(
            2048, "--mm-evict", "snapkv", "--mm-kv-budget", "0.5", "--mm-compress-at", "decode"
        ),
    }
    configs["snapkv_decode_retracting"] = configs["snapkv_decode"]
    configs["snapkv_fill_poisoned"] = configs["snapkv_fill"]
    configs["snapkv_fill_recompute"] = [
        *configs["snapkv_fill"],
        "--mm-compressed-reuse",
        "recompute",
    ]
    # SGLang's own test switch: every third decode step retracts the running requests.
    envs = {
        "snapkv_decode_retracting": {**stock_cpu_env(), "SGLANG_TEST_RETRACT": "1"},
        "snapkv_fill_poisoned": {**stock_cpu_env(), POISON_ENV: "1"},
    }
    servers = ServerPool(
        {
            name: ServerProcess(
                "sgl_mmkv.launch_server", tiny_vlm, args, log_path=logs / name, env=envs.get(name)
            )
            for name, args in configs.items()
        },
        max_alive=3,
    )
    try:
        yield servers
    finally:
        servers.close()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _stats(server) -> dict:
    return mmkv_stats(server.base_url)


def _completion(server, system: str, images: list, max_tokens: int = 6, **extra):
    return _client(server).chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": system}, user_message("Describe.", images)],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body=extra or None,
    )


def _chat(server, system: str, images: list, max_tokens: int = 6):
    r = _completion(server, system, images, max_tokens)
    first = r.choices[0].logprobs.content[0]
    return r.choices[0].message.content, {t.token: t.logprob for t in first.top_logprobs}


def _delta(after: dict, before: dict, group: str, name: str) -> float:
    return after[group][name] - before[group][name]


def test_budget_one_answers_as_the_uncompressed_server(servers):
    images = [make_image(300 + i) for i in range(3)]
    results = {}
    for name in ("lru", "aircache_full"):
        server = servers[name]
        _chat(server, "You are a helpful assistant.", images)
        before = _stats(server)
        results[name] = _chat(server, "Answer in one word.", images[::-1])
        after = _stats(server)
        assert _delta(after, before, "refresh", "reused_tokens") == 3 * TOKENS_PER_IMAGE
    ranked = _stats(servers["aircache_full"])
    assert ranked["store"]["ranked_fills"] == ranked["store"]["fills"] >= 3
    assert ranked["store"]["compressions"] == 0  # budget 1.0 keeps every token
    text, logprobs = results["aircache_full"]
    assert text == results["lru"][0]
    for token, value in results["lru"][1].items():
        assert abs(logprobs[token] - value) < 1e-4


def test_a_compressed_segment_is_reused_for_its_kept_tokens(servers):
    server = servers["snapkv_fill"]
    images = [make_image(400), make_image(401)]
    before = _stats(server)
    _chat(server, "You are a helpful assistant.", images)
    filled = _stats(server)
    kept = math.ceil(0.5 * TOKENS_PER_IMAGE)
    assert _delta(filled, before, "store", "compressions") == 2
    assert _delta(filled, before, "store", "compressed_tokens") == 2 * (TOKENS_PER_IMAGE - kept)
    assert _delta(filled, before, "store", "tokens") == 2 * kept
    text, _ = _chat(server, "Answer in one word.", images[::-1])
    after = _stats(server)
    assert text
    assert _delta(after, filled, "store", "hits") == 2
    assert _delta(after, filled, "refresh", "reused_tokens") == 2 * kept
    holes = 2 * (TOKENS_PER_IMAGE - kept)
    assert _delta(after, filled, "refresh", "hole_tokens") == holes
    assert _delta(after, filled, "row_compaction", "holed_requests") == 1
    assert _delta(after, filled, "row_compaction", "hole_tokens") == holes
    assert after["pool"]["tree"] == filled["pool"]["tree"]  # the holed row stays out
    ledger = after["pool"]
    assert ledger["free_unique"] and ledger["in_use"] == 0


def _fill_then_reuse(server, seed: int, max_tokens: int = 6):
    images = [make_image(seed), make_image(seed + 1)]
    _chat(server, "You are a helpful assistant.", images)
    before = _stats(server)
    reply = _completion(server, "Answer in one word.", images[::-1], max_tokens, ignore_eos=True)
    return reply, before, _stats(server)


def test_holes_are_never_read_poisoned_slots_leave_the_answers_finite_and_equal(servers):
    """Every slot the store frees and every hole of a reused row holds NaN on the
    poisoned server; any read of one would spread NaN into the logprobs."""
    plain, _, _ = _fill_then_reuse(servers["snapkv_fill"], 420, max_tokens=8)
    poisoned, before, after = _fill_then_reuse(servers["snapkv_fill_poisoned"], 420, 8)
    assert _delta(after, before, "row_compaction", "hole_tokens") > 0
    got_tokens = poisoned.choices[0].logprobs.content
    want_tokens = plain.choices[0].logprobs.content
    assert [t.token for t in got_tokens] == [t.token for t in want_tokens]
    for got, want in zip(got_tokens, want_tokens, strict=True):
        assert math.isfinite(got.logprob)
        assert abs(got.logprob - want.logprob) < 1e-4
    ledger = after["pool"]
    assert ledger["free_unique"] and ledger["in_use"] == 0


def test_recompute_computes_the_dropped_tokens_instead_of_leaving_holes(servers):
    _, before, after = _fill_then_reuse(servers["snapkv_fill_recompute"], 440)
    kept = math.ceil(0.5 * TOKENS_PER_IMAGE)
    assert _delta(after, before, "refresh", "reused_tokens") == 2 * kept
    assert _delta(after, before, "refresh", "hole_tokens") == 0
    assert "row_compaction" not in after
    _, holed_before, holed_after = _fill_then_reuse(servers["snapkv_fill"], 440)

    def computed_fresh(after, before):  # recomputed tokens less the refreshed reused ones
        recomputed = _delta(after, before, "refresh", "recomputed_tokens")
        return recomputed - _delta(after, before, "refresh", "refreshed_tokens")

    dropped = 2 * (TOKENS_PER_IMAGE - kept)
    assert computed_fresh(after, before) - computed_fresh(holed_after, holed_before) == dropped


def test_memory_pressure_compresses_before_evicting_and_answers_everything(servers):
    server = servers["mmshiftkv_pressure"]
    requests.post(server.base_url + "/flush_cache", timeout=30)
    start = _stats(server)["pool"]
    assert start["available"] == start["size"]
    for i in range(12):  # 36 distinct images, 576 image tokens: more than the pool
        images = [make_image(500 + 3 * i + j) for j in range(3)]
        text, _ = _chat(server, f"Request {i}.", images, max_tokens=4)
        assert isinstance(text, str)
    stats = _stats(server)
    store = stats["store"]
    freed_per_segment = TOKENS_PER_IMAGE - math.ceil(0.25 * TOKENS_PER_IMAGE)
    assert store["compressions"] > 0
    assert store["compressed_tokens"] == store["compressions"] * freed_per_segment
    assert store["ranked_fills"] == store["fills"] > 0
    ledger = stats["pool"]
    assert ledger["free_unique"] and ledger["in_use"] == 0
    assert ledger["available"] + ledger["tree"] + ledger["store"] == ledger["size"]
    requests.post(server.base_url + "/flush_cache", timeout=30)
    end = _stats(server)["pool"]
    assert end["available"] == start["available"] and end["store"] == 0


def _decoded(server, system: str, images: list, max_tokens: int = 8) -> list[str]:
    """The tokens of a reply that decodes ``max_tokens`` tokens (EOS ignored)."""
    r = _completion(server, system, images, max_tokens, ignore_eos=True)
    assert r.usage.completion_tokens == max_tokens
    return [t.token for t in r.choices[0].logprobs.content]


def test_decode_compression_at_budget_one_answers_as_the_uncompressed_server(servers):
    images = [make_image(700 + i) for i in range(3)]
    replies = {
        name: _decoded(servers[name], "Decode all of it.", images)
        for name in ("lru", "snapkv_decode_full")
    }
    assert replies["snapkv_decode_full"] == replies["lru"]
    counters = _stats(servers["snapkv_decode_full"])["row_compaction"]
    assert counters["compressed_requests"] == 0 and counters["freed_tokens"] == 0


def test_decode_compression_frees_the_dropped_tokens_of_running_requests(servers):
    server = servers["snapkv_decode"]
    requests.post(server.base_url + "/flush_cache", timeout=30)
    start = _stats(server)
    images = [[make_image(800 + 3 * i + j) for j in range(3)] for i in range(3)]
    with ThreadPoolExecutor(3) as pool:  # prefilled together: rows of one batch shrink
        replies = list(
            pool.map(lambda i: _decoded(server, f"Running request {i}.", images[i]), range(3))
        )
    first_tokens = [_decoded(servers["lru"], f"Running request {i}.", images[i]) for i in range(3)]
    for reply, stock in zip(replies, first_tokens, strict=True):
        assert reply[0] == stock[0]  # the prefill (first token) is untouched
    after = _stats(server)
    dropped = TOKENS_PER_IMAGE - math.ceil(0.5 * TOKENS_PER_IMAGE)
    assert _delta(after, start, "row_compaction", "compressed_requests") == 3
    assert _delta(after, start, "row_compaction", "freed_tokens") == 3 * 3 * dropped
    ledger = after["pool"]
    assert ledger["free_unique"] and ledger["in_use"] == 0
    assert ledger["tree"] == start["pool"]["tree"]  # compressed rows stay out of the tree
    assert after["store"]["fills"] - start["store"]["fills"] == 9  # images stored whole
    # The same images in another order: reused from the store, compressed again.
    reused = _decoded(server, "Another order.", images[0][::-1])
    again = _stats(server)
    assert len(reused) == 8
    assert _delta(again, after, "refresh", "reused_tokens") == 3 * TOKENS_PER_IMAGE
    assert _delta(again, after, "row_compaction", "freed_tokens") == 3 * dropped
    requests.post(server.base_url + "/flush_cache", timeout=30)
    end = _stats(server)["pool"]
    assert end["available"] == end["size"] and end["free_unique"]


def test_retracted_compressed_requests_prefill_again_and_finish(servers):
    """Retraction releases a shrunk row (its M-RoPE state put back) and the request
    prefills again from its original inputs: all answered, nothing leaked."""
    server = servers["snapkv_decode_retracting"]
    images = [[make_image(950 + 3 * i + j) for j in range(3)] for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        replies = list(
            pool.map(lambda i: _decoded(server, f"Retracted {i}.", images[i], 16), range(3))
        )
    assert all(len(reply) == 16 for reply in replies)
    retracted = [int(n) for n in re.findall(r"#retracted_reqs: (\d+)", server.log_text())]
    assert sum(retracted) > 0  # SGLang's log of each test retraction
    after = _stats(server)
    # Each prefill after a retraction shrinks the row again.
    assert after["row_compaction"]["compressed_requests"] > 3
    ledger = after["pool"]
    assert ledger["free_unique"] and ledger["in_use"] == 0
    requests.post(server.base_url + "/flush_cache", timeout=30)
    end = _stats(server)["pool"]
    assert end["available"] == end["size"] and end["free_unique"]


def test_decode_compression_leaves_a_one_token_request_to_the_tree(servers):
    server = servers["snapkv_decode"]
    before = _stats(server)
    text, _ = _chat(server, "One token only.", [make_image(900)], max_tokens=1)
    after = _stats(server)
    assert isinstance(text, str)
    assert _delta(after, before, "row_compaction", "compressed_requests") == 0
    assert after["pool"]["tree"] > before["pool"]["tree"]  # inserted as stock would


def test_decode_compression_refuses_a_model_without_mrope(tiny_llm, tmp_path):
    args = _server_args(2048, "--mm-evict", "snapkv", "--mm-compress-at", "decode")
    server = ServerProcess("sgl_mmkv.launch_server", tiny_llm, args, log_path=tmp_path / "log")
    try:
        with pytest.raises(RuntimeError, match="does not support Qwen2ForCausalLM"):
            server.start(300.0)
    finally:
        server.stop()

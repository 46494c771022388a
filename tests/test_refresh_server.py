"""A real ``--mm-reuse conduit --mm-refresh-budget 1.0`` server on the tiny M-RoPE VLM.

At budget 1.0 every reused image token is refreshed, so a request served from
segments must equal its full prefill (the same server after a flush, whose cold
path is SGLang's own extend). The pool is small so that segments get evicted
while requests that copied them still decode; the slot ledger is checked after.
"""

from __future__ import annotations

import threading

import openai
import pytest
import requests
from transformers import AutoProcessor

from harness.fidelity import FidelityClient
from sgl_mmkv.testing.images import data_url, make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

TOKENS_PER_IMAGE = 16
POOL_TOKENS = 1200


def _server_args(*extra: str) -> list[str]:
    args = list(CPU_SERVER_ARGS)
    args[args.index("--max-total-tokens") + 1] = str(POOL_TOKENS)
    # Every match is reused, however little it saves: these tests check reuse itself.
    return [*args, "--mm-reuse-gate", "always", REPORT_REUSE, *extra]


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "sgl_mmkv_conduit.log"
    args = _server_args("--mm-reuse", "conduit", "--mm-refresh-budget", "1.0")
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _stats(server) -> dict:
    return mmkv_stats(server.base_url)


def _flush(server) -> None:
    FidelityClient(server.base_url).flush()


def _chat(client, messages, max_tokens=8, **extra):
    r = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body=extra or None,
    )
    first = r.choices[0].logprobs.content[0]
    return r.choices[0].message.content, {t.token: t.logprob for t in first.top_logprobs}


def _conversation(system: str, images: list, question: str = "Describe the images.") -> list:
    return [{"role": "system", "content": system}, user_message(question, images)]


def _assert_same(probe, cold, tol=2e-2):
    text, logprobs = probe
    cold_text, cold_logprobs = cold
    assert text == cold_text
    shared = set(logprobs) & set(cold_logprobs)
    assert len(shared) >= 4
    for token in shared:
        assert abs(logprobs[token] - cold_logprobs[token]) < tol, token


def _cold_then_reused(server, client, probe_messages: list, images: list):
    """``probe_messages`` answered cold (a full prefill after a flush), then again after
    another conversation stored ``images``: ``(reused reply, cold reply, stats before
    and after the reused one)``."""
    _flush(server)
    cold = _chat(client, probe_messages)
    _flush(server)
    _chat(client, _conversation("You are a helpful assistant.", images))
    before = _stats(server)
    probe = _chat(client, probe_messages)
    return probe, cold, before, _stats(server)


@pytest.mark.parametrize(
    "order, num_images",
    [("changed_prefix", 1), ("changed_prefix", 3), ("reordered", 3)],
)
def test_budget_one_reproduces_full_prefill(server, client, order, num_images):
    images = [make_image(100 + i) for i in range(num_images)]
    probe_images = images[::-1] if order == "reordered" else images
    probe_messages = _conversation("Answer in one word.", probe_images)
    probe, cold, before, after = _cold_then_reused(server, client, probe_messages, images)

    _assert_same(probe, cold)
    reused = num_images * TOKENS_PER_IMAGE
    assert after["store"]["hits"] - before["store"]["hits"] == num_images
    assert after["refresh"]["reused_tokens"] - before["refresh"]["reused_tokens"] == reused
    assert after["refresh"]["refreshed_tokens"] - before["refresh"]["refreshed_tokens"] == reused


def test_multi_turn_new_image_and_earlier_ones_again(server, client):
    a, b, c = (make_image(200 + i) for i in range(3))
    _flush(server)
    turn1 = [user_message("Look at these.", [a, b])]
    reply, _ = _chat(client, turn1)
    # Turn 2 after the conversation's system prompt changed: the earlier images are
    # segment hits, the new one is computed.
    turn2 = [
        {"role": "system", "content": "Now answer briefly."},
        *turn1,
        {"role": "assistant", "content": reply},
        user_message("And with this one, which is brightest?", [c]),
    ]
    before = _stats(server)
    probe = _chat(client, turn2)
    after = _stats(server)
    _flush(server)
    cold = _chat(client, turn2)
    _assert_same(probe, cold)
    assert after["store"]["hits"] - before["store"]["hits"] == 2
    assert after["refresh"]["reused_tokens"] - before["refresh"]["reused_tokens"] == 32


def test_meta_info_reports_reused_and_refreshed_tokens(server, tiny_vlm):
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    image = make_image(300)
    _flush(server)

    def generate(system: str) -> dict:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        ]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        body = {
            "text": text,
            "image_data": [data_url(image)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        }
        r = requests.post(server.base_url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    first = generate("One.")
    second = generate("Two, a longer system prompt.")
    assert first["sgl_mmkv"][0]["reused_tokens"] == 0
    info = second["sgl_mmkv"][0]
    assert info == {
        "method": "conduit",
        "reused_segments": 1,
        "reused_tokens": TOKENS_PER_IMAGE,
        "hole_tokens": 0,
        "refreshed_tokens": TOKENS_PER_IMAGE,
        "recomputed_tokens": second["prompt_tokens"] - second["cached_tokens"],
    }


def test_concurrent_requests_share_a_segment_next_to_text_requests(server, client):
    shared = make_image(400)
    prompts = [_conversation(f"System prompt number {i}.", [shared]) for i in range(6)]
    texts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(3)]
    cold = []
    for messages in prompts + texts:
        _flush(server)
        cold.append(_chat(client, messages))
    _flush(server)
    _chat(client, _conversation("Warm-up.", [shared]))
    before = _stats(server)
    results: dict[int, tuple] = {}

    def run(i, messages):
        results[i] = _chat(client, messages)

    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate(prompts + texts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = _stats(server)
    assert len(results) == len(prompts) + len(texts)
    for i, reference in enumerate(cold):
        _assert_same(results[i], reference)
    assert after["store"]["hits"] - before["store"]["hits"] == len(prompts)
    ledger = after["pool"]
    assert ledger["free_unique"]
    assert ledger["in_use"] == 0


def test_segment_evicted_while_its_copy_decodes(server, client):
    _flush(server)
    evictions_before = _stats(server)["store"]["evictions"]
    image = make_image(500)
    _chat(client, _conversation("First context.", [image]))
    decoded: dict[str, str] = {}

    def long_decode():
        decoded["text"] = _chat(
            client, _conversation("Second context.", [image]), max_tokens=160, ignore_eos=True
        )[0]

    thread = threading.Thread(target=long_decode)
    thread.start()
    # Enough new images to push the store past the pool while the copy decodes.
    flood = 0
    while thread.is_alive() or flood < 12:
        new_images = [make_image(1000 + 8 * flood + j) for j in range(8)]
        _chat(client, _conversation(f"Flood {flood}.", new_images), max_tokens=2)
        flood += 1
        if flood >= 40:
            break
    thread.join(timeout=300)
    stats = _stats(server)
    assert decoded["text"]
    assert stats["store"]["evictions"] > evictions_before
    ledger = stats["pool"]
    assert ledger["free_unique"]
    assert ledger["in_use"] == 0
    assert ledger["available"] + ledger["tree"] + ledger["store"] == ledger["size"]
    _flush(server)
    ledger = _stats(server)["pool"]
    assert ledger["available"] == ledger["size"]
    assert ledger["store"] == 0


def test_chunked_prefill_reuses_every_image_even_when_a_chunk_cuts_it(tiny_vlm, tmp_path_factory):
    """Chunks of 40 tokens: images wholly inside a chunk are reused whole, an image
    cut by a chunk boundary part by part (one store hit per part); the output still
    equals full prefill."""
    log = tmp_path_factory.mktemp("logs") / "sgl_mmkv_chunked.log"
    args = _server_args(
        "--mm-reuse", "conduit", "--mm-refresh-budget", "1.0", "--chunked-prefill-size", "40"
    )
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0)
        images = [make_image(600 + i) for i in range(4)]
        probe_messages = _conversation("A different system prompt.", images)
        probe, cold, before, after = _cold_then_reused(proc, client, probe_messages, images)
        _assert_same(probe, cold)
        hits = after["store"]["hits"] - before["store"]["hits"]
        reused = after["refresh"]["reused_tokens"] - before["refresh"]["reused_tokens"]
        assert reused == 4 * TOKENS_PER_IMAGE  # every image token, cut images included
        assert hits > 4  # at least one image was cut, and its parts were each a hit
        assert after["pool"]["in_use"] == 0 and after["pool"]["free_unique"]
        # the meta info sums the request's chunks (SGLang keeps only the last one's)
        before = mmkv_stats(proc.base_url)
        meta = _generate_meta(proc.base_url, tiny_vlm, "Yet another system prompt.", images)
        after = mmkv_stats(proc.base_url)
        delta = {k: after["refresh"][k] - before["refresh"][k] for k in ("reused_tokens",)}
        assert meta["sgl_mmkv"] == [
            {
                "method": "conduit",
                "reused_segments": 4,
                "reused_tokens": delta["reused_tokens"],
                "hole_tokens": 0,
                "refreshed_tokens": 4 * TOKENS_PER_IMAGE,  # budget 1.0
                "recomputed_tokens": meta["prompt_tokens"] - meta["cached_tokens"],
            }
        ]
        assert delta["reused_tokens"] == 4 * TOKENS_PER_IMAGE


def _generate_meta(base_url: str, model, system: str, images: list) -> dict:
    """The meta info of a two-token greedy ``/generate`` over ``images`` under ``system``."""
    processor = AutoProcessor.from_pretrained(model)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "Hi"}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    body = {
        "text": processor.apply_chat_template(messages, add_generation_prompt=True),
        "image_data": [data_url(image) for image in images],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    r = requests.post(base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_bad_requests_leave_the_refresh_server_serving_and_the_ledger_exact(server, client):
    image = make_image(700)
    _chat(client, _conversation("Before the bad ones.", [image]))
    broken = {
        "model": "default",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}},
                    {"type": "text", "text": "hi"},
                ],
            }
        ],
        "max_tokens": 4,
    }
    too_long = {
        "model": "default",
        "messages": [{"role": "user", "content": "red green blue " * 3000}],
        "max_tokens": 4,
    }
    for body in (broken, too_long):
        r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert 400 <= r.status_code < 500, r.text
    before = _stats(server)
    text, _ = _chat(client, _conversation("After the bad ones.", [image]))
    after = _stats(server)
    assert text
    assert after["store"]["hits"] - before["store"]["hits"] == 1
    assert after["pool"]["in_use"] == 0 and after["pool"]["free_unique"]


def test_scorer_knobs_reach_the_scheduler_and_select_within_the_budget(tiny_vlm, tmp_path_factory):
    """``--mm-refresh-scorer-args`` builds the scorer the spawned scheduler runs: the
    server reports it, and a reordered request refreshes ceil(0.25 x 48) tokens."""
    log = tmp_path_factory.mktemp("logs") / "sgl_mmkv_knobs.log"
    knobs = '{"use_value_norm": false, "query_span": "last_text", "layers": [1]}'
    args = _server_args(
        *("--mm-reuse", "conduit", "--mm-refresh-budget", "0.25"),
        *("--mm-refresh-scorer-args", knobs),
    )
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        stats = _stats(proc)
        assert stats["refresh_scorer"] == (
            "ConduitScorer(amplification=1.0, use_value_norm=False, "
            "query_span='last_text', layers=(1,))"
        )
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0)
        images = [make_image(700 + i) for i in range(3)]
        _chat(client, _conversation("You are a helpful assistant.", images))
        before = _stats(proc)
        text, logprobs = _chat(client, _conversation("Another prompt.", images[::-1]))
        after = _stats(proc)
        reused = after["refresh"]["reused_tokens"] - before["refresh"]["reused_tokens"]
        refreshed = after["refresh"]["refreshed_tokens"] - before["refresh"]["refreshed_tokens"]
        assert reused == 3 * TOKENS_PER_IMAGE
        assert refreshed == 12  # ceil(0.25 * 48)
        assert text and len(logprobs) == 5
        assert after["refresh"]["fallbacks"] == 0
        assert after["pool"]["in_use"] == 0 and after["pool"]["free_unique"]


def test_staleprobe_at_budget_one_reproduces_full_prefill(tiny_vlm, tmp_path_factory):
    """staleprobe's probes (computed in the scoring pass over the stale row) are run
    again in the refresh pass: at budget 1.0 a reordered request answers as a full
    prefill, every reused token refreshed once, no fallback."""
    log = tmp_path_factory.mktemp("logs") / "sgl_mmkv_staleprobe.log"
    args = _server_args("--mm-reuse", "staleprobe", "--mm-refresh-budget", "1.0")
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0)
        images = [make_image(800 + i) for i in range(3)]
        probe_messages = _conversation("Answer in one word.", images[::-1])
        probe, cold, before, after = _cold_then_reused(proc, client, probe_messages, images)
        _assert_same(probe, cold)
        reused = after["refresh"]["reused_tokens"] - before["refresh"]["reused_tokens"]
        refreshed = after["refresh"]["refreshed_tokens"] - before["refresh"]["refreshed_tokens"]
        assert reused == refreshed == 3 * TOKENS_PER_IMAGE
        assert after["refresh"]["fallbacks"] == 0


def test_staleprobe_auto_refreshes_the_images_its_probes_find_stale(tiny_vlm, tmp_path_factory):
    """``--mm-refresh-budget auto`` at threshold 1e-6 (every probed image whose probe's
    K/V moved at all is stale; probes that measured nothing would refresh nothing) and
    fraction 1: reordered images are all probed and refreshed in full, so the answer
    is the full prefill's; images moved together under a new system prompt are probed
    only at the first, so that image alone is refreshed (16 tokens of 48)."""
    log = tmp_path_factory.mktemp("logs") / "sgl_mmkv_staleprobe_auto.log"
    knobs = '{"auto_threshold": 1e-6, "auto_fraction": 1.0}'
    args = _server_args(
        "--mm-reuse", "staleprobe", "--mm-refresh-budget", "auto",
        "--mm-refresh-scorer-args", knobs,
    )  # fmt: skip
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0)
        assert _stats(proc)["refresh_budget"] == "auto"
        images = [make_image(850 + i) for i in range(3)]
        counts = {}
        for name, probe_messages in (
            ("reordered", _conversation("Answer in one word.", images[::-1])),
            ("moved together", _conversation("Answer in a few words.", images)),
        ):
            probe, cold, before, after = _cold_then_reused(proc, client, probe_messages, images)
            if name == "reordered":
                _assert_same(probe, cold)
            counts[name] = {
                key: after["refresh"][key] - before["refresh"][key]
                for key in ("reused_tokens", "refreshed_tokens", "fallbacks")
            }
    assert counts["reordered"] == {
        "reused_tokens": 3 * TOKENS_PER_IMAGE,
        "refreshed_tokens": 3 * TOKENS_PER_IMAGE,
        "fallbacks": 0,
    }
    assert counts["moved together"] == {
        "reused_tokens": 3 * TOKENS_PER_IMAGE,
        "refreshed_tokens": TOKENS_PER_IMAGE,
        "fallbacks": 0,
    }

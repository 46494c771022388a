"""A real sgl_mmkv server on the tiny VLM, used as users use it: OpenAI client,
SGLang frontend, bad input. One server for the whole module."""

from __future__ import annotations

import base64
import re

import openai
import psutil
import pytest
import requests

from sgl_mmkv.radix_cache import ACTIVE_LOG_PREFIX
from sgl_mmkv.testing.images import make_image, png_bytes, save_png, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

QUESTION = "Which of the two images is brighter?"


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "sgl_mmkv_exact.log"
    proc = ServerProcess(
        "sgl_mmkv.launch_server",
        tiny_vlm,
        ["--mm-reuse", "exact", "--mm-refresh-budget", "0.25", REPORT_REUSE, *CPU_SERVER_ARGS],
        log_path=log,
    )
    with proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _chat(client, messages, max_tokens=8):
    return client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_openai_two_images_and_cache_report(client):
    messages = [user_message(QUESTION, [make_image(11), make_image(12)])]
    first = _chat(client, messages)
    second = _chat(client, messages)

    assert first.choices[0].message.content
    assert first.usage.completion_tokens == 8
    assert first.usage.prompt_tokens_details.image_tokens == 32  # 2 images x 16 tokens
    # New images: at most the shared chat-template prefix is cached, no image token.
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 32
    # The repeat is served from the radix tree: all but the last prompt token.
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content


def test_frontend_program_with_two_images(server, client, tmp_path):
    import sglang as sgl

    from sgl_mmkv.frontend import RuntimeEndpoint

    paths = [
        save_png(make_image(21), tmp_path / "a.png"),
        save_png(make_image(22), tmp_path / "b.png"),
    ]

    @sgl.function
    def two_images(s, image_a, image_b, question):
        s += sgl.user(sgl.image(image_a) + sgl.image(image_b) + question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))

    backend = RuntimeEndpoint(server.base_url)
    state = two_images.run(
        image_a=str(paths[0]), image_b=str(paths[1]), question=QUESTION, backend=backend
    )
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 8
    # The frontend's qwen2-vl template yields the same prompt as the chat API:
    # same token count and the same greedy answer.
    via_openai = _chat(client, [user_message(QUESTION, [make_image(21), make_image(22)])])
    assert meta["prompt_tokens"] == via_openai.usage.prompt_tokens
    assert state["answer"] == via_openai.choices[0].message.content


def test_radix_cache_runs_in_the_scheduler_process(server):
    """Proof from inside the scheduler: its own log line, with its own PID."""
    match = re.search(
        re.escape(ACTIVE_LOG_PREFIX)
        + r": class=(\w+) mode=(\w+) refresh_budget=([\d.]+) pid=(\d+)",
        server.log_text(),
    )
    assert match, server.log_tail()
    cls, mode, budget, pid = (
        match.group(1),
        match.group(2),
        float(match.group(3)),
        int(match.group(4)),
    )
    assert (cls, mode, budget) == ("MMKVRadixCache", "exact", 0.25)
    assert pid != server.pid
    scheduler = psutil.Process(pid)
    assert pid in {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
    assert "scheduler" in " ".join(scheduler.cmdline()) + scheduler.name()
    info = requests.get(server.base_url + "/get_server_info", timeout=10).json()
    assert info["radix_cache_backend"] == "sgl_mmkv"


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,!!!not-base64!!!",
        _b64(b"this is not an image at all"),
        _b64(png_bytes(make_image(5))[:60]),  # truncated PNG
    ],
    ids=["bad-base64", "not-an-image", "truncated-png"],
)
def test_broken_image_is_a_4xx_and_the_server_keeps_serving(server, client, url):
    body = {
        "model": "default",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "hi"},
                ],
            }
        ],
        "max_tokens": 4,
    }
    response = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert 400 <= response.status_code < 500, response.text
    assert "image" in response.json()["message"].lower()
    after = _chat(client, [user_message("Is the server still up?", [make_image(6)])], max_tokens=4)
    assert after.usage.completion_tokens == 4


def test_request_longer_than_the_context_is_a_4xx(server, client):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "red green blue " * 3000}],
        "max_tokens": 4,
    }
    response = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert 400 <= response.status_code < 500, response.text
    after = _chat(client, [user_message("Still serving?")], max_tokens=4)
    assert after.usage.completion_tokens == 4


def _segment_counters(server) -> dict:
    return mmkv_stats(server.base_url)["segments"]


def test_server_counts_image_segments_stock_matching_misses(server, client):
    images = [make_image(41), make_image(42)]
    before = _segment_counters(server)
    _chat(client, [user_message(QUESTION, images)], max_tokens=2)  # new
    other_prefix = [{"role": "system", "content": "Be brief."}, user_message(QUESTION, images)]
    _chat(client, other_prefix, max_tokens=2)  # same images, new prefix: reusable
    _chat(client, [user_message(QUESTION, images)], max_tokens=2)  # exact repeat: prefix
    after = _segment_counters(server)
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {
        "requests": 3,
        "image_items": 6,
        "prefix_items": 2,
        "reusable_items": 2,
        "new_items": 2,
        "image_tokens": 96,
        "prefix_tokens": 32,
        "reusable_tokens": 32,
        "new_tokens": 32,
    }

"""Qwen3-VL (interleaved M-RoPE, QK-norm, DeepStack) through real servers, one at a time.

Stock ``sglang.launch_server``, then sgl_mmkv ``off``, ``exact`` and ``conduit`` at
budget 1.0 on the tiny random-weight Qwen3-VL. ``off`` and ``exact`` must equal
stock. At budget 1.0 every reused image token is recomputed, so a request served
from segments must equal its full prefill. DeepStack adds vision features to the
image tokens' hidden states after decoder layers 0 and 1; a refresh pass that
dropped them moved the first token's top logprobs by 4e-3 to 7e-3 on this model
(text unchanged), hence the tight tolerance.
"""

from __future__ import annotations

import openai
import pytest
import requests
from transformers import AutoProcessor

from sgl_mmkv.testing.images import data_url, make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
    mmkv_stats,
)

TOKENS_PER_IMAGE = 16
# Budget 1.0 recomputes exactly what a full prefill computes: equal up to float
# reordering (0.0 here), far below DeepStack's 4e-3 when it was dropped.
LOGPROB_TOL = 1e-4
A, B, C = make_image(31), make_image(32), make_image(33)
SYSTEM = {"role": "system", "content": "You answer in few words."}

# Requests for the parity runs, in one sequence (so radix hits are compared too).
SEQUENCE: list[tuple[str, list[dict]]] = [
    ("one-image", [user_message("What is in the image?", [A])]),
    ("one-image-repeat", [user_message("What is in the image?", [A])]),
    ("multi-image", [user_message("Compare the images.", [A, B, C])]),
    ("multi-image-new-system", [SYSTEM, user_message("Compare the images.", [A, B, C])]),
]


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8) -> dict:
    r = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = r.choices[0].logprobs.content
    return {
        "text": r.choices[0].message.content,
        "prompt_tokens": r.usage.prompt_tokens,
        "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
        "image_tokens": r.usage.prompt_tokens_details.image_tokens or 0,
        "tokens": [t.token for t in content],
        "top": {t.token: t.logprob for t in content[0].top_logprobs},
    }


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _serve(module: str, model, extra: list[str], log) -> ServerProcess:
    return ServerProcess(module, model, [*CPU_SERVER_ARGS, *extra], log_path=log)


def _probe(system: str, images: list) -> list[dict]:
    return [{"role": "system", "content": system}, user_message("Describe the images.", images)]


PROBES = {n: _probe("Answer in one word.", [make_image(100 + i) for i in range(n)]) for n in (1, 3)}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_vl_logs")


@pytest.fixture(scope="module")
def stock(tiny_qwen3_vl, logs) -> dict:
    """Stock SGLang: the parity sequence, then each probe alone after a flush."""
    with _serve("sglang.launch_server", tiny_qwen3_vl, [], logs / "stock.log") as server:
        client = _client(server)
        sequence = [_chat(client, messages) for _, messages in SEQUENCE]
        probes = {}
        for n, messages in PROBES.items():
            flush_cache(server.base_url)
            probes[n] = _chat(client, messages)
    return {"sequence": sequence, "probes": probes}


def _assert_close(got: dict, want: dict, tol: float = LOGPROB_TOL) -> None:
    """Same greedy tokens; first-token top logprobs within ``tol``."""
    assert got["text"] == want["text"]
    assert got["tokens"] == want["tokens"]
    shared = set(got["top"]) & set(want["top"])
    assert len(shared) >= 4
    diff = max(abs(got["top"][t] - want["top"][t]) for t in shared)
    assert diff < tol, diff


def test_stock_serves_qwen3_vl_on_the_cpu(stock):
    by_name = dict(zip((name for name, _ in SEQUENCE), stock["sequence"], strict=True))
    assert by_name["one-image"]["image_tokens"] == TOKENS_PER_IMAGE
    assert by_name["multi-image"]["image_tokens"] == 3 * TOKENS_PER_IMAGE
    repeat = by_name["one-image-repeat"]
    assert repeat["cached_tokens"] == repeat["prompt_tokens"] - 1
    assert all(len(r["tokens"]) == 8 for r in stock["sequence"])


@pytest.mark.parametrize("mode", ["off", "exact"])
def test_off_and_exact_equal_stock(stock, tiny_qwen3_vl, logs, mode):
    args = ["--mm-reuse", mode]
    with _serve("sgl_mmkv.launch_server", tiny_qwen3_vl, args, logs / f"{mode}.log") as server:
        client = _client(server)
        ours = [_chat(client, messages) for _, messages in SEQUENCE]
    for (name, _), want, got in zip(SEQUENCE, stock["sequence"], ours, strict=True):
        assert got == want, name


@pytest.fixture(scope="module")
def conduit(tiny_qwen3_vl, logs):
    args = [
        "--mm-reuse",
        "conduit",
        "--mm-refresh-budget",
        "1.0",
        "--mm-reuse-gate",
        "always",
        REPORT_REUSE,
    ]
    with _serve("sgl_mmkv.launch_server", tiny_qwen3_vl, args, logs / "conduit.log") as server:
        yield server


@pytest.mark.parametrize("num_images", [1, 3])
def test_budget_one_reproduces_full_prefill(stock, conduit, num_images):
    client = _client(conduit)
    probe = PROBES[num_images]
    flush_cache(conduit.base_url)
    cold = _chat(client, probe)
    assert cold == stock["probes"][num_images]  # the cold path is SGLang's own extend
    flush_cache(conduit.base_url)
    images = [make_image(100 + i) for i in range(num_images)]
    _chat(client, _probe("You are a helpful assistant.", images))
    before = mmkv_stats(conduit.base_url)
    warm = _chat(client, probe)
    after = mmkv_stats(conduit.base_url)
    _assert_close(warm, cold)
    reused = num_images * TOKENS_PER_IMAGE
    assert after["store"]["hits"] - before["store"]["hits"] == num_images
    assert after["refresh"]["reused_tokens"] - before["refresh"]["reused_tokens"] == reused
    assert after["refresh"]["refreshed_tokens"] - before["refresh"]["refreshed_tokens"] == reused


def test_meta_info_counts_segment_hits_under_a_changed_system_prompt(conduit, tiny_qwen3_vl):
    processor = AutoProcessor.from_pretrained(tiny_qwen3_vl)
    image = make_image(300)
    flush_cache(conduit.base_url)

    def generate(system: str) -> dict:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        ]
        body = {
            "text": processor.apply_chat_template(messages, add_generation_prompt=True),
            "image_data": [data_url(image)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        }
        r = requests.post(conduit.base_url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    first = generate("One.")
    second = generate("Two, a longer system prompt.")
    assert first["sgl_mmkv"][0]["reused_tokens"] == 0
    assert second["sgl_mmkv"][0] == {
        "method": "conduit",
        "reused_segments": 1,
        "reused_tokens": TOKENS_PER_IMAGE,
        "refreshed_tokens": TOKENS_PER_IMAGE,
        "recomputed_tokens": second["prompt_tokens"] - second["cached_tokens"],
    }

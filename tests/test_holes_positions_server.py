"""Positions after holes, on real servers, for M-RoPE and 1-D RoPE models.

A request that reuses compressed segments with holes has a row ``d`` slots shorter
than its sequence once its prefill is done. Its decode tokens must still sit at the
sequence's positions: through M-RoPE's per-request offset (tiny Qwen2-VL) or the
position offset that ``patches/forward_batch_positions.py`` adds (tiny LLaVA, 1-D
RoPE). Checked as *decode equals prefill*: the 4th token decoded after holes has
the logprobs of the 1st token of a request whose prompt already holds the 3 tokens
decoded before it (a prefill computes positions from the sequence itself). A decode
position off by ``d`` changes every rotary phase and fails this by far more than
the tolerance (checked when the test was written by adding no offset: 1-D
logprobs then moved by about 1 and the top 5 changed).
"""

from __future__ import annotations

import math

import pytest
import requests
from transformers import AutoProcessor, AutoTokenizer

from sgl_mmkv.segments.poison import POISON_ENV
from sgl_mmkv.testing.images import data_url, make_image
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    mmkv_stats,
    start_together,
    stock_cpu_env,
)

# Plain reuse: no refresh, whose picks would depend on the prompt's last tokens.
HOLED = ["--mm-reuse", "reuse", "--mm-reuse-gate", "always", REPORT_REUSE]
HOLED += ["--mm-evict", "snapkv", "--mm-kv-budget", "0.5", "--mm-compress-at", "fill"]
DECODED = 4
# Mostly bitwise equal; one step in four or so differs by up to 0.009 (seen on both
# rope kinds, the KV of that step still equal). Decode positions off by the hole
# count move the logprobs by about 1 and change the top 5.
TOLERANCE = 0.02


@pytest.fixture(scope="module", params=["tiny_vlm", "tiny_llava"])
def model(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    procs = {
        "plain": ServerProcess(
            "sgl_mmkv.launch_server", model, [*CPU_SERVER_ARGS, *HOLED], log_path=logs / "plain"
        ),
        "poisoned": ServerProcess(
            "sgl_mmkv.launch_server",
            model,
            [*CPU_SERVER_ARGS, *HOLED],
            log_path=logs / "poisoned",
            env={**stock_cpu_env(), POISON_ENV: "1"},
        ),
    }
    try:
        start_together(list(procs.values()), 400.0)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _prompt(model, system: str, images: int) -> str:
    processor = AutoProcessor.from_pretrained(model)
    content = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": "Go on."}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def _generate(server, text: str, images: list, max_new_tokens: int) -> dict:
    body = {
        "text": text,
        "image_data": [data_url(image) for image in images],
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    response = requests.post(server.base_url + "/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]


def _top(meta: dict, index: int) -> dict[int, float]:
    return {token: logprob for logprob, token, _ in meta["output_top_logprobs"][index]}


def _holed_decode(server, model, seed: int) -> tuple[dict, str]:
    """Fill two images (compressed at fill), then decode after reusing them with holes."""
    images = [make_image(seed), make_image(seed + 1)]
    _generate(server, _prompt(model, "You are a helpful assistant.", 2), images, 1)
    before = mmkv_stats(server.base_url)
    prompt = _prompt(model, "Answer in one word.", 2)
    meta = _generate(server, prompt, images[::-1], DECODED)
    after = mmkv_stats(server.base_url)
    holes = after["row_compaction"]["hole_tokens"] - before["row_compaction"]["hole_tokens"]
    assert holes == meta["sgl_mmkv"][0]["hole_tokens"] > 0
    return meta, prompt


def _round_trips(tokenizer, prompt: str, tokens: list[int]) -> bool:
    """Whether the prompt followed by the decoded ``tokens`` tokenizes to exactly that."""
    base = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full = tokenizer(prompt + tokenizer.decode(tokens), add_special_tokens=False)["input_ids"]
    return full == base + tokens


def test_decode_after_holes_equals_a_prefill_of_the_same_tokens(servers, model):
    server, tokenizer = servers["plain"], AutoTokenizer.from_pretrained(model)
    for seed in range(1200, 1240, 4):  # the first pair whose reply survives a text round trip
        meta, prompt = _holed_decode(server, model, seed)
        tokens = [token for _, token, _ in meta["output_token_logprobs"]]
        if _round_trips(tokenizer, prompt, tokens[: DECODED - 1]):
            break
    else:
        pytest.fail("no reply in 10 image pairs survives decode -> tokenize")
    images = [make_image(seed + 1), make_image(seed)]
    for k in range(1, DECODED):  # the logprobs of decoded token k against a prefill of 0..k-1
        text = prompt + tokenizer.decode(tokens[:k])
        continued = _generate(server, text, images, 1)
        assert continued["prompt_tokens"] == meta["prompt_tokens"] + k
        assert continued["sgl_mmkv"][0]["hole_tokens"] == meta["sgl_mmkv"][0]["hole_tokens"]
        want, got = _top(meta, k), _top(continued, 0)
        assert set(got) == set(want)
        assert max(abs(got[token] - logprob) for token, logprob in want.items()) < TOLERANCE
    ledger = mmkv_stats(server.base_url)["pool"]
    assert ledger["free_unique"] and ledger["in_use"] == 0


def test_holes_are_never_read_on_either_rope(servers, model):
    plain, _ = _holed_decode(servers["plain"], model, 1300)
    poisoned, _ = _holed_decode(servers["poisoned"], model, 1300)
    got, want = poisoned["output_token_logprobs"], plain["output_token_logprobs"]
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    for (g, _, _), (w, _, _) in zip(got, want, strict=True):
        assert math.isfinite(g) and abs(g - w) < 1e-4

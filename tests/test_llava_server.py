"""A 1-D RoPE VLM end to end on CPU: the tiny HF-format LLaVA (Pixtral vision tower,
Qwen2 text model) served by stock SGLang, by ``--mm-reuse exact`` and by
``--mm-reuse conduit --mm-refresh-budget 1.0``.

Each server starts fresh and gets the same requests: per image set, a first turn
under one system prompt, then a probe with the same images under another. The
probe's images sit at other positions (one constant shift), so conduit serves them
from segments, re-positioned by rotating their keys, and refreshes every reused
token: its greedy text and top logprobs must match stock's full prefill.
"""

from __future__ import annotations

import pytest
import requests

from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess

# 112 x 112 px, 16 px patches: 7 rows of 7 [IMG], 6 [IMG_BREAK] between them.
IMAGE_TOKENS = 49
SEGMENT_TOKENS = 55
IMAGE_SETS = {"one": [100], "other": [101], "two": [102, 103]}
SYSTEMS = ("You are a helpful assistant.", "Answer in one word.")
# Conduit at budget 1.0 recomputes the reused tokens in its own attention pass;
# observed differences are at most 8e-3 (float16 KV on CPU).
LOGPROB_TOL = 2e-2

SERVERS = {
    "stock": ("sglang.launch_server", []),
    "exact": ("sgl_mmkv.launch_server", ["--mm-reuse", "exact", REPORT_REUSE]),
    "conduit": (
        "sgl_mmkv.launch_server",
        [
            "--mm-reuse",
            "conduit",
            "--mm-refresh-budget",
            "1.0",
            "--mm-reuse-gate",
            "always",
            REPORT_REUSE,
        ],
    ),
}


@pytest.fixture(scope="module")
def tiny_llava(model_dir):
    from sgl_mmkv.testing.make_tiny_model import make_tiny_model

    # A name that matches none of SGLang's chat-template rules: the checkpoint's own
    # template (one [IMG] per image part) is used.
    out = model_dir / "tiny-hf-lv"
    if not (out / "config.json").exists():
        make_tiny_model("llava", out, seed=0)
    return out


def _chat(base_url: str, system: str, seeds: list[int], meta: bool) -> dict:
    body = {
        "model": "default",
        "messages": [
            {"role": "system", "content": system},
            user_message("Describe the images.", [make_image(s) for s in seeds]),
        ],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    if meta:
        body["return_meta_info"] = True
    r = requests.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {
        "text": choice["message"]["content"],
        "top": {t["token"]: t["logprob"] for t in choice["logprobs"]["content"][0]["top_logprobs"]},
        "image_tokens": r.json()["usage"]["prompt_tokens_details"]["image_tokens"],
        "reuse": (choice.get("meta_info") or {}).get("sgl_mmkv", [None])[0],
    }


@pytest.fixture(scope="module")
def runs(tiny_llava, tmp_path_factory) -> dict:
    """``{server: {(image set, turn): result}}``, one server at a time, and the
    conduit server's ``/flush_cache`` response."""
    logs = tmp_path_factory.mktemp("llava_logs")
    out = {}
    for name, (module, extra) in SERVERS.items():
        args = [*CPU_SERVER_ARGS, *extra]
        with ServerProcess(module, tiny_llava, args, log_path=logs / f"{name}.log") as proc:
            out[name] = {
                (images, turn): _chat(proc.base_url, system, seeds, meta=name != "stock")
                for images, seeds in IMAGE_SETS.items()
                for turn, system in zip(("first", "probe"), SYSTEMS, strict=True)
            }
            if name == "conduit":
                out["conduit_flush"] = requests.post(proc.base_url + "/flush_cache", timeout=60)
    return out


def test_stock_serves_image_requests(runs):
    stock = runs["stock"]
    for (images, _), result in stock.items():
        assert result["image_tokens"] == IMAGE_TOKENS * len(IMAGE_SETS[images])
        assert result["text"]
    # The image reaches the text model: another image, another first-token distribution.
    assert stock[("one", "first")]["top"] != stock[("other", "first")]["top"]


def test_exact_equals_stock(runs):
    for key, result in runs["stock"].items():
        exact = runs["exact"][key]
        assert exact["text"] == result["text"], key
        assert exact["top"] == pytest.approx(result["top"], abs=1e-6), key


def test_conduit_budget_one_reproduces_stock(runs):
    for key, result in runs["stock"].items():
        conduit = runs["conduit"][key]
        assert conduit["text"] == result["text"], key
        shared = set(conduit["top"]) & set(result["top"])
        assert len(shared) >= 4, key
        for token in shared:
            assert abs(conduit["top"][token] - result["top"][token]) < LOGPROB_TOL, (key, token)


def test_flush_cache_answers_200_with_refresh(runs):
    # Stock SGLang 0.5.23 answers 500 here for LlavaForConditionalGeneration
    # (patches/mm_processor_flush.py).
    assert runs["conduit_flush"].status_code == 200, runs["conduit_flush"].text


def test_changed_system_prompt_gets_segment_hits(runs):
    for images, seeds in IMAGE_SETS.items():
        first = runs["conduit"][(images, "first")]["reuse"]
        probe = runs["conduit"][(images, "probe")]["reuse"]
        assert first["reused_segments"] == 0
        assert probe["reused_segments"] == len(seeds)
        assert probe["reused_tokens"] == SEGMENT_TOKENS * len(seeds)
        assert probe["refreshed_tokens"] == probe["reused_tokens"]

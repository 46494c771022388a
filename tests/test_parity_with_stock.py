"""Stock stays stock: with --mm-reuse off and exact, greedy outputs, logprobs and
cached-token counts equal a real stock `python -m sglang.launch_server`.

Each server starts fresh and gets the same request sequence, so the radix
trees see the same history; the sequence repeats and reorders requests so that
cache hits (and misses) are part of what is compared.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from sgl_mmkv.radix_cache import ACTIVE_LOG_PREFIX
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess

A, B, C = make_image(31), make_image(32), make_image(33)
SYSTEM = {"role": "system", "content": "You answer in few words."}

REQUESTS: list[tuple[str, list[dict]]] = [
    ("text", [user_message("Name three colours.")]),
    ("text-repeat", [user_message("Name three colours.")]),
    ("one-image", [user_message("What is in the image?", [A])]),
    ("one-image-repeat", [user_message("What is in the image?", [A])]),
    ("one-image-new-question", [user_message("How many shapes?", [A])]),
    ("multi-image", [user_message("Compare the images.", [A, B, C])]),
    ("multi-image-repeat", [user_message("Compare the images.", [A, B, C])]),
    ("multi-image-reordered", [user_message("Compare the images.", [C, A, B])]),
    ("multi-image-new-system", [SYSTEM, user_message("Compare the images.", [A, B, C])]),
    (
        "multi-turn",
        [
            user_message("What is in the image?", [A]),
            {"role": "assistant", "content": "Shapes."},
            user_message("And in these?", [B, C]),
        ],
    ),
]


def _run_sequence(server: ServerProcess) -> list[dict]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    results = []
    for name, messages in REQUESTS:
        r = client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=10,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
        results.append(
            {
                "name": name,
                "text": r.choices[0].message.content,
                "prompt_tokens": r.usage.prompt_tokens,
                "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
                "image_tokens": getattr(r.usage.prompt_tokens_details, "image_tokens", 0) or 0,
                "logprobs": [
                    (t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                    for t in r.choices[0].logprobs.content
                ],
            }
        )
    return results


def _serve_and_run(module: str, model, extra: list[str], log) -> tuple[list[dict], dict, str]:
    with ServerProcess(module, model, [*extra, *CPU_SERVER_ARGS], log_path=log) as server:
        results = _run_sequence(server)
        info = requests.get(server.base_url + "/get_server_info", timeout=10).json()
        return results, info, server.log_text()


@pytest.fixture(scope="module")
def runs(tiny_vlm, tmp_path_factory) -> dict[str, tuple[list[dict], dict, str]]:
    """Each side's sequence, two servers up at a time (each its own fresh tree)."""
    logs = tmp_path_factory.mktemp("parity_logs")
    sides = {
        "stock": ("sglang.launch_server", []),
        "off": ("sgl_mmkv.launch_server", ["--mm-reuse", "off"]),
        "exact": ("sgl_mmkv.launch_server", ["--mm-reuse", "exact"]),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(_serve_and_run, module, tiny_vlm, extra, logs / f"{name}.log")
            for name, (module, extra) in sides.items()
        }
        return {name: future.result() for name, future in futures.items()}


def test_stock_run_exercises_hits_and_misses(runs):
    stock = {r["name"]: r for r in runs["stock"][0]}
    assert stock["text-repeat"]["cached_tokens"] == stock["text-repeat"]["prompt_tokens"] - 1
    assert stock["multi-image-repeat"]["cached_tokens"] == stock["multi-image"]["prompt_tokens"] - 1
    assert stock["multi-image"]["image_tokens"] == 48
    # Stock reuses no image KV once the prefix changed: the hit stops before image C.
    reordered = stock["multi-image-reordered"]
    assert reordered["cached_tokens"] < reordered["prompt_tokens"] - 48
    assert stock["multi-turn"]["cached_tokens"] > 0


@pytest.mark.parametrize("mode", ["off", "exact"])
def test_outputs_and_cache_hits_equal_stock(runs, mode):
    stock, ours = runs["stock"][0], runs[mode][0]
    for want, got in zip(stock, ours, strict=True):
        assert got["name"] == want["name"]
        assert got["text"] == want["text"], want["name"]
        assert got["prompt_tokens"] == want["prompt_tokens"], want["name"]
        assert got["cached_tokens"] == want["cached_tokens"], want["name"]
        assert got["logprobs"] == want["logprobs"], want["name"]


def test_backend_is_ours_only_when_enabled(runs):
    assert runs["stock"][1]["radix_cache_backend"] is None
    assert runs["off"][1]["radix_cache_backend"] is None
    assert runs["exact"][1]["radix_cache_backend"] == "sgl_mmkv"
    assert "sgl_mmkv" not in runs["stock"][1]["internal_states"][0]
    assert "sgl_mmkv" not in runs["off"][1]["internal_states"][0]
    # sgl_mmkv's counters reach /get_server_info only with --mm-report-reuse
    assert "sgl_mmkv" not in runs["exact"][1]["internal_states"][0]
    assert ACTIVE_LOG_PREFIX not in runs["stock"][2]
    assert ACTIVE_LOG_PREFIX not in runs["off"][2]
    assert f"{ACTIVE_LOG_PREFIX}: class=MMKVRadixCache mode=exact" in runs["exact"][2]

"""A refresh mode at ``--page-size`` 16 (and 64, slow) on real servers: budget 1.0 equals ``off``.

SGLang's paged allocator hands out and frees whole pages, and its radix tree matches
prefixes in whole pages. Per page size, one ``--mm-reuse off`` server answers every
scenario, then one ``--mm-reuse conduit --mm-refresh-budget 1.0`` server answers the
same requests in the same order (one server up at a time). At budget 1.0 every
reused image token is recomputed, so each answer must equal ``off``'s (greedy text,
the first token's top-5 logprobs within 1e-3, the cached prefix), while the reused
image tokens are counted in ``meta_info["sgl_mmkv"]``. Images are 18 tokens with
their markers, so they straddle page boundaries; one scenario has a page-aligned
prefix match that ends inside an image, whose rest is then reused. The slot ledger
is exact after every scenario and after the flush.
"""

from __future__ import annotations

import json

import pytest
import requests
from transformers import AutoProcessor

from sgl_mmkv.testing.images import data_url, make_image
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
    mmkv_stats,
)

# 64 (what trtllm_mha forces on Blackwell) in make test-slow: two more server starts
PAGE_SIZES = (16, pytest.param(64, marks=pytest.mark.slow))
TOKENS_PER_IMAGE = 16
TOLERANCE = 1e-3
IMAGES = [make_image(700 + i) for i in range(6)]
A, B, C, D, E, X = IMAGES


def _turn(role: str, text: str, images: int = 0) -> dict:
    return {
        "role": role,
        "content": [*([{"type": "image"}] * images), {"type": "text", "text": text}],
    }


def _request(system: str, images: list, text: str = "Describe the images.") -> tuple:
    return ([_turn("system", system), _turn("user", text, len(images))], images)


def _second_turn(system: str) -> tuple:
    messages = [
        _turn("system", system),
        _turn("user", "Look at these.", 2),
        _turn("assistant", "Two pictures."),
        _turn("user", "And this one, next to them?", 1),
    ]
    return (messages, [A, B, C])


# scenario -> requests sent in order after a flush (each compared with off's answer)
SCENARIOS = {
    "changed_system": [
        _request("You are a helpful assistant.", [A, B, C]),
        _request("Answer in one word, please.", [A, B, C]),
    ],
    "reordered": [
        _request("You look at pictures.", [A, B, C, D, E]),
        _request("You look at pictures.", [E, D, C, B, A]),
    ],
    "second_turn": [
        ([_turn("system", "Time 09:01."), _turn("user", "Look at these.", 2)], [A, B]),
        _second_turn("Time 09:02."),
    ],
    # the probe shares the context's prefix up to its fourth image: the page-aligned
    # match ends inside an image of the shared part (checked below), the rest of it
    # and the images before the new one are reused
    "prefix_ends_inside_an_image": [
        _request("Compare them.", [A, B, C, D, E]),
        _request("Compare them.", [A, B, C, X]),
    ],
}


def _answer(server: ServerProcess, processor, messages: list, images: list) -> dict:
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    body = {
        "text": text,
        "image_data": [data_url(image) for image in images],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    r = requests.post(server.base_url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    return {
        "text": out["text"],
        "top": {token: logprob for logprob, token, _ in meta["output_top_logprobs"][0]},
        "prompt_tokens": meta["prompt_tokens"],
        "cached_tokens": meta["cached_tokens"],
        "mmkv": (meta.get("sgl_mmkv") or [{}])[0],
    }


def _image_spans(processor, messages: list, images: list) -> list[tuple[int, int]]:
    """``[start, end)`` of each image's pad tokens in the prompt."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    spans, start = [], None
    for i, token in enumerate([*ids, -1]):
        if token == pad and start is None:
            start = i
        elif token != pad and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _serve(model, page: int, mode: list[str], log) -> ServerProcess:
    args = [*CPU_SERVER_ARGS, "--page-size", str(page), *mode]
    return ServerProcess("sgl_mmkv.launch_server", model, args, log_path=log)


def _run_all(server: ServerProcess, processor, ledgers: bool) -> dict:
    out = {}
    for name, requests_ in SCENARIOS.items():
        flush_cache(server.base_url)
        answers = [_answer(server, processor, m, images) for m, images in requests_]
        out[name] = {"answers": answers, "stats": mmkv_stats(server.base_url) if ledgers else {}}
    if ledgers:
        flush_cache(server.base_url)
        out["flushed"] = mmkv_stats(server.base_url)
    return out


CONDUIT = [
    *("--mm-reuse", "conduit", "--mm-refresh-budget", "1.0", "--mm-reuse-gate", "always"),
    REPORT_REUSE,
]


@pytest.fixture(scope="module", params=PAGE_SIZES, ids=lambda page: f"page{page}")
def runs(request, tiny_vlm, tmp_path_factory) -> dict:
    """Every scenario's answers at one page size: ``runs["off"]`` and ``runs["conduit"]``
    (with the counters after each scenario, and after the last flush)."""
    page = request.param
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    logs = tmp_path_factory.mktemp(f"page-{page}-logs")
    out = {"page": page, "processor": processor}
    with _serve(tiny_vlm, page, ["--mm-reuse", "off"], logs / "off.log") as off:
        out["off"] = _run_all(off, processor, ledgers=False)
    with _serve(tiny_vlm, page, CONDUIT, logs / "conduit.log") as ours:
        out["conduit"] = _run_all(ours, processor, ledgers=True)
        out["log"] = ours.log_text()
    summary = {
        side: {
            name: [{k: a[k] for k in ("text", "cached_tokens", "mmkv")} for a in run["answers"]]
            for name, run in out[side].items()
            if name in SCENARIOS
        }
        for side in ("off", "conduit")
    }
    (logs / "summary.json").write_text(json.dumps(summary, indent=1))
    return out


@pytest.mark.parametrize("name", SCENARIOS)
def test_budget_one_equals_off_at_the_same_page_size(runs, name):
    page = runs["page"]
    off, ours = runs["off"][name], runs["conduit"][name]
    for i, (want, got) in enumerate(zip(off["answers"], ours["answers"], strict=True)):
        assert got["text"] == want["text"], (i, got["text"], want["text"])
        assert (got["prompt_tokens"], got["cached_tokens"]) == (
            want["prompt_tokens"],
            want["cached_tokens"],
        ), i
        assert got["cached_tokens"] % page == 0  # the radix match is page-granular
        assert set(got["top"]) == set(want["top"]) and len(got["top"]) == 5, i
        for token, logprob in want["top"].items():
            assert abs(got["top"][token] - logprob) < TOLERANCE, (i, token)
    first, probe = (a["mmkv"] for a in ours["answers"])
    assert first["reused_tokens"] == 0
    assert probe["reused_tokens"] > 0 and probe["refreshed_tokens"] == probe["reused_tokens"]
    pool = ours["stats"]["pool"]
    assert pool["free_unique"] and pool["in_use"] == 0
    assert pool["store"] % page == 0 and pool["store"] > 0
    assert pool["available"] + pool["tree"] + pool["store"] == pool["size"]


def test_reused_tokens_are_the_images_outside_the_page_aligned_prefix(runs):
    processor = runs["processor"]
    expected, cut = {}, None
    for name, requests_ in SCENARIOS.items():
        messages, images = requests_[-1]
        spans = _image_spans(processor, messages, images)
        assert all(end - start == TOKENS_PER_IMAGE for start, end in spans)
        probe = runs["conduit"][name]["answers"][-1]
        cached = probe["cached_tokens"]
        stored = {id(image) for image in requests_[0][1]}
        expected[name] = sum(
            max(0, end - max(start, cached))
            for (start, end), image in zip(spans, images, strict=True)
            if id(image) in stored
        )
        assert probe["mmkv"]["reused_tokens"] == expected[name], name
        if name == "prefix_ends_inside_an_image":
            cut = [(start, end, cached) for start, end in spans if start < cached < end]
    # every stored image is reused whole but the one the page-aligned match cut: its
    # pad tokens are 50-65, the probe's new image starts at 68, so the match is 64
    # at page 16 and 64 alike, and the image's last two tokens are reused
    assert expected["changed_system"] == 3 * TOKENS_PER_IMAGE
    assert expected["reordered"] == 5 * TOKENS_PER_IMAGE
    assert expected["second_turn"] == 2 * TOKENS_PER_IMAGE
    assert cut == [(50, 66, 64)] and expected["prefix_ends_inside_an_image"] == 2


def test_the_store_holds_whole_pages_and_the_flush_frees_every_slot(runs):
    assert "sgl_mmkv: radix cache active" in runs["log"]
    flushed = runs["conduit"]["flushed"]
    pool = flushed["pool"]
    assert pool["free_unique"] and pool["in_use"] == 0 and pool["store"] == 0
    assert pool["available"] == pool["size"] and pool["tree"] == 0
    store = flushed["store"]
    assert store["fills"] > 0 and store["hits"] > 0 and store["fill_skipped"] == 0


COMPRESSING = [
    *CONDUIT,
    *("--mm-evict", "snapkv", "--mm-kv-budget", "0.3", "--mm-compress-at", "fill"),
    *("--mm-compressed-reuse", "recompute"),
]


def test_compressed_segments_keep_whole_pages_and_budget_one_equals_a_full_prefill(
    tiny_vlm, tmp_path_factory
):
    """At page 4 a 16-token image compressed to budget 0.3 (5 tokens) keeps two pages:
    its top 8 tokens, moved into them; the other two pages are freed. Reused at budget
    1.0 with its dropped tokens recomputed, the answer equals the same server's full
    prefill after a flush (SGLang's own extend)."""
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    log = tmp_path_factory.mktemp("page-4-logs") / "compressing.log"
    context, probe = SCENARIOS["changed_system"]
    with _serve(tiny_vlm, 4, COMPRESSING, log) as server:
        flush_cache(server.base_url)
        cold = _answer(server, processor, *probe)
        flush_cache(server.base_url)
        before = mmkv_stats(server.base_url)["store"]
        _answer(server, processor, *context)
        filled = mmkv_stats(server.base_url)
        reused = _answer(server, processor, *probe)
        after = mmkv_stats(server.base_url)
        flush_cache(server.base_url)
        flushed = mmkv_stats(server.base_url)
    counts = ("fills", "compressions", "compressed_tokens")
    assert tuple(filled["store"][k] - before[k] for k in counts) == (3, 3, 24)
    assert filled["pool"]["store"] == 3 * 8 and filled["pool"]["in_use"] == 0
    assert reused["text"] == cold["text"] and reused["cached_tokens"] == 4  # the template's
    assert set(reused["top"]) == set(cold["top"])
    for token, logprob in cold["top"].items():
        assert abs(reused["top"][token] - logprob) < TOLERANCE, token
    info = reused["mmkv"]
    # 8 kept tokens of each image reused; budget 1.0 selects all 48 image tokens
    assert (info["reused_segments"], info["reused_tokens"], info["refreshed_tokens"]) == (3, 24, 48)
    pool = after["pool"]
    assert pool["free_unique"] and pool["in_use"] == 0 and pool["store"] == 24
    assert (
        flushed["pool"]["available"] == flushed["pool"]["size"] and flushed["pool"]["free_unique"]
    )

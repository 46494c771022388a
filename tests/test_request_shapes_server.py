"""Every request shape stock accepts stays correct next to a reusing request.

One ``--mm-reuse conduit`` server (every match reused). Each case sends a batch in
which one request reuses an image under a new prefix while another asks for prompt
logprobs or token-id logprobs; the other request's numbers must equal
the same request served alone (a batch without reuse runs SGLang's own extend), and
the server must keep serving. Every prompt row's hidden states
(``--enable-return-hidden-states``) are refused at start-up in refresh modes
(tests/test_refusals.py): every batch would capture them and none could reuse.
"""

from __future__ import annotations

import concurrent.futures
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
)

TOL = 1e-3
QUESTION = "What colour is the dotted shape? " * 8
TEXT = "some text only prompt about shapes and colours " * 6
ARGS = [*CPU_SERVER_ARGS, *("--mm-reuse", "conduit", "--mm-reuse-gate", "always", REPORT_REUSE)]


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "shapes.log"
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, ARGS, log) as proc:
        yield proc


@pytest.fixture(scope="module")
def prompt(tiny_vlm):
    processor = AutoProcessor.from_pretrained(tiny_vlm)

    def render(system: str) -> str:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        ]
        return processor.apply_chat_template(messages, add_generation_prompt=True)

    return render


def _post(server, body: dict) -> list[dict] | dict:
    r = requests.post(server.base_url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _solo(server, other: dict) -> dict:
    """``other`` served alone on a flushed server: a cold prefill, no reuse."""
    flush_cache(server.base_url)
    return _post(server, {**other, "sampling_params": _greedy()})


def _healthy(server) -> bool:
    return requests.get(server.base_url + "/health", timeout=30).status_code == 200


def _reuse_batch(server, prompt, seed: int, other: dict) -> tuple[dict, dict]:
    """Store image ``seed`` under one prefix, then send one batch: the image under a
    new prefix (a reuse) and ``other`` (a text request with its own return fields)."""
    image = data_url(make_image(seed))
    flush_cache(server.base_url)
    _post(server, {"text": prompt("First."), "image_data": [image], "sampling_params": _greedy()})
    fields = sorted(set(other) - {"text"})
    body = {
        "text": [prompt(f"A new and longer system prompt {seed}."), other["text"]],
        "image_data": [[image], None],
        "sampling_params": _greedy(),
        **{k: [_default(k), other[k]] for k in fields},
    }
    reuse, answer = _post(server, body)
    return reuse, answer


def _greedy(n: int = 1) -> dict:
    return {"max_new_tokens": n, "temperature": 0}


def _default(field: str):
    defaults = {
        "return_logprob": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "token_ids_logprob": [],
    }
    return defaults[field]


def _close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x[1] == y[1]  # same token
        if x[0] is not None:
            assert abs(x[0] - y[0]) <= TOL


def test_prompt_logprobs_from_any_start_next_to_a_reuse(server, prompt):
    for start, seed in ((0, 950), (5, 951)):
        other = {
            "text": TEXT,
            "return_logprob": True,
            "logprob_start_len": start,
            "top_logprobs_num": 3,
        }
        solo = _solo(server, other)
        reuse, got = _reuse_batch(server, prompt, seed, other)
        assert reuse["meta_info"]["sgl_mmkv"][0]["reused_segments"] == 1
        _close(got["meta_info"]["input_token_logprobs"], solo["meta_info"]["input_token_logprobs"])
        tops = zip(
            got["meta_info"]["input_top_logprobs"],
            solo["meta_info"]["input_top_logprobs"],
            strict=True,
        )
        for g, s in tops:
            _close(g or [], s or [])
        assert got["text"] == solo["text"]
    assert _healthy(server)


def test_token_id_logprobs_next_to_a_reuse(server, prompt):
    other = {
        "text": TEXT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "token_ids_logprob": [1, 2, 3],
    }
    solo = _solo(server, other)
    reuse, got = _reuse_batch(server, prompt, 952, other)
    assert reuse["meta_info"]["sgl_mmkv"][0]["reused_segments"] == 1
    for g, s in zip(
        got["meta_info"]["input_token_ids_logprobs"],
        solo["meta_info"]["input_token_ids_logprobs"],
        strict=True,
    ):
        _close(g or [], s or [])
    assert _healthy(server)


def test_openai_echo_logprobs_next_to_reuses(server, prompt):
    body = {"model": "default", "prompt": TEXT, "max_tokens": 2, "temperature": 0}
    body |= {"echo": True, "logprobs": 3}
    url = server.base_url + "/v1/completions"
    flush_cache(server.base_url)
    solo = requests.post(url, json=body, timeout=300).json()["choices"][0]["logprobs"]
    image = data_url(make_image(954))
    _post(server, {"text": prompt("First."), "image_data": [image], "sampling_params": _greedy()})

    def reuse(i: int):
        return _post(
            server,
            {
                "text": prompt(f"Reuse number {i} of the image."),
                "image_data": [image],
                "sampling_params": _greedy(),
            },
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(reuse, i) for i in range(3)]
        echo = pool.submit(lambda: requests.post(url, json=body, timeout=300))
        got = echo.result()
        assert all(f.result()["meta_info"]["sgl_mmkv"] for f in futures)
    assert got.status_code == 200, got.text
    logprobs = got.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == solo["tokens"]
    for a, b in zip(logprobs["token_logprobs"], solo["token_logprobs"], strict=True):
        assert (a is None and b is None) or abs(a - b) <= TOL
    assert _healthy(server)


def test_n_greater_than_one_and_streaming_with_a_reuse(server):
    from sgl_mmkv.testing.images import user_message

    image = make_image(955)
    url = server.base_url + "/v1/chat/completions"

    def body(system: str, **extra) -> dict:
        messages = [{"role": "system", "content": system}, user_message("Hi.", [image])]
        return {"model": "default", "messages": messages, "max_tokens": 4, **extra}

    requests.post(url, json=body("First.", temperature=0), timeout=300).raise_for_status()
    many = requests.post(url, json=body("Second.", n=2, temperature=0), timeout=300)
    assert many.status_code == 200, many.text
    choices = many.json()["choices"]
    assert (
        len(choices) == 2 and choices[0]["message"]["content"] == choices[1]["message"]["content"]
    )
    plain = requests.post(url, json=body("Third.", temperature=0), timeout=300).json()
    text = ""
    with requests.post(url, json=body("Third.", temperature=0, stream=True), stream=True) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += (choice.get("delta") or {}).get("content") or ""
    assert text == plain["choices"][0]["message"]["content"]
    assert _healthy(server)

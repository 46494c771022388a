"""One non-streamed chat request with SGLang's meta info, and its stages.

With ``return_meta_info`` in the body SGLang returns each choice's request
timestamps (set when the server runs with ``--enable-metrics``); :func:`request_stages`
turns them into the stages of one request in milliseconds. Used by ``make demo``
(:mod:`harness.demo`) and ``benchmarks/profile_reuse.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import requests


@dataclass(frozen=True, slots=True)
class MetaReply:
    """A greedy reply's text, its meta info, and the seconds the client waited."""

    text: str
    meta: dict
    client_s: float


def chat_with_meta(
    base_url: str, messages: list[dict], max_tokens: int, timeout_s: float = 3600.0
) -> MetaReply:
    """POST ``messages`` to ``/v1/chat/completions`` (greedy, ``return_meta_info``);
    raises RuntimeError with the body's head on a non-200 answer."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_meta_info": True,
    }
    started = time.perf_counter()
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
    choice = response.json()["choices"][0]
    return MetaReply((choice["message"]["content"] or "").strip(), choice["meta_info"], elapsed)


def request_stages(meta: dict) -> dict[str, float]:
    """SGLang's stages of one request in ms, by the server's clock: ``tokenizer``
    (received to dispatched to the scheduler: image loading, processing, hashing),
    ``queue`` (dispatched to forward entry), ``prefill_forward`` (forward entry to
    prefill finished), ``ttft`` (received to first token) and ``after_prefill`` (the
    part of ``ttft`` after the prefill finished)."""
    received = meta["request_received_ts"]
    dispatched = meta["api_server_dispatch_finish_ts"]
    entered = meta["forward_entry_time"]
    prefilled = meta["prefill_finished_time"]
    first = meta.get("first_token_latency", prefilled - received)
    return {
        "tokenizer": 1e3 * (dispatched - received),
        "queue": 1e3 * (entered - dispatched),
        "prefill_forward": 1e3 * (prefilled - entered),
        "ttft": 1e3 * first,
        "after_prefill": 1e3 * (first - (prefilled - received)),
    }

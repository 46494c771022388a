"""One greedy chat request over HTTP and the facts the server tests compare."""

from __future__ import annotations

from typing import Any

import requests


def greedy_chat(
    base_url: str, messages: list[dict], max_tokens: int = 4, timeout_s: float = 120.0, **extra: Any
) -> dict:
    """POST a greedy ``/v1/chat/completions`` with the top-5 logprobs and meta info.

    Returns ``text``, ``top`` (the first token's top-5 ``{token: logprob}``) and
    ``reused`` (sgl_mmkv's reused tokens over the request's facts; 0 when the server
    reports none). ``extra`` goes into the body (``cache_salt``, ``ignore_eos``, ...).
    """
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "return_meta_info": True,
        **extra,
    }
    r = requests.post(base_url + "/v1/chat/completions", json=body, timeout=timeout_s)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    first = choice["logprobs"]["content"][0]
    facts = (choice.get("meta_info") or {}).get("sgl_mmkv") or []
    return {
        "text": choice["message"]["content"],
        "top": {t["token"]: t["logprob"] for t in first["top_logprobs"]},
        "reused": sum(f.get("reused_tokens", 0) for f in facts),
    }

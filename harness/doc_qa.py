"""Doc-QA requests of the routing benchmarks: pages as images under a system prompt,
streamed, one output token; their time to the first chunk."""

from __future__ import annotations

import random
import time

import requests

from harness.workloads import _image_url

QUESTION = "What do these pages say?"


def doc_messages(system: str, seeds: list[int], size: int) -> list[dict]:
    """A chat of ``system`` and one user turn of the pages ``seeds`` (``size`` pixels
    square) and the question."""
    images = [{"type": "image_url", "image_url": {"url": _image_url(s, size)}} for s in seeds]
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": [*images, {"type": "text", "text": QUESTION}]},
    ]


def doc_qa_trace(
    docs: int, pages: int, rounds: int, image_size: int, base_seed: int, rng: random.Random
) -> tuple[list[list[dict]], list[list[dict]]]:
    """``(reads, queries)``: ``docs`` documents of ``pages`` pages (image seeds from
    ``base_seed``), each read once, then ``rounds`` rounds asking about every document
    in an ``rng`` order under a new system prompt, its pages in a new order."""
    pool = [[base_seed + d * pages + p for p in range(pages)] for d in range(docs)]
    reads = [doc_messages(f"Read document {d}.", seeds, image_size) for d, seeds in enumerate(pool)]
    queries = []
    for r in range(rounds):
        for d in rng.sample(range(docs), docs):
            seeds = rng.sample(pool[d], len(pool[d]))
            queries.append(doc_messages(f"Round {r}: a new question on {d}.", seeds, image_size))
    return reads, queries


def stream_ttft_ms(url: str, messages: list[dict], timeout_s: float = 600) -> float:
    """Time to the first streamed chunk of one chat request to ``url``, in ms.

    Raises:
        RuntimeError: a status other than 200, an error chunk, or a stream without a
            data chunk or without its end (``[DONE]``).
    """
    body = {"model": "default", "messages": messages, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    first, done = None, False
    with requests.post(
        url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=timeout_s
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text}")
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                if b'"error"' in line:  # SGLang reports a failure inside the stream
                    raise RuntimeError(f"error in the stream: {line[:200]!r}")
                if first is None:
                    first = time.perf_counter()
                done = done or line.strip() == b"data: [DONE]"
    if first is None or not done:
        raise RuntimeError("the stream ended early" if first else "no streamed chunk")
    return (first - start) * 1000

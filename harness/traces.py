"""Workloads as JSONL traces for SGLang's own client, ``sglang.benchmark.serving``.

Its ``--dataset-name openai`` reads one OpenAI chat request per line (``messages``,
``max_tokens`` and any other body field, passed through as is). A trace here is a
list of :class:`~harness.workloads.BenchRequest` written that way:
greedy, a fixed output length (``ignore_eos``), so both sides decode the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from harness import workloads as wl


def trace_line(request: wl.BenchRequest, max_tokens: int) -> dict:
    """One JSONL record: the request's ``messages`` and the body fields of a fair run."""
    return {
        "messages": request.messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def write_trace(requests: Sequence[wl.BenchRequest], path: Path, max_tokens: int) -> Path:
    """Write ``requests`` in order as an ``openai`` JSONL trace; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for request in requests:
            out.write(json.dumps(trace_line(request, max_tokens)) + "\n")
    return path


def doc_qa_traces(
    out_dir: Path,
    num_images: int,
    num_requests: int,
    pool_size: int,
    rounds: int,
    image_size: int = 448,
    max_tokens: int = 8,
    seed: int = 0,
) -> dict[str, Path]:
    """The pool warm-up (each page read once) and one doc-QA trace per round (new
    system prompts and page orders over the same pool each round).

    Returns ``{"warmup": path, "round-0": path, ...}``.
    """
    paths = {"warmup": out_dir / "warmup.jsonl"}
    write_trace(wl.pool_warmup(pool_size, image_size), paths["warmup"], max_tokens)
    for r in range(rounds):
        requests = wl.doc_qa(num_requests, num_images, pool_size, image_size, seed + 1000 * r)
        paths[f"round-{r}"] = out_dir / f"doc_qa-{num_images}img-round{r}.jsonl"
        write_trace(requests, paths[f"round-{r}"], max_tokens)
    return paths


def no_reuse_traces(
    out_dir: Path,
    num_images: int,
    num_requests: int,
    rounds: int,
    image_size: int = 448,
    max_tokens: int = 8,
    seed: int = 0,
) -> dict[str, Path]:
    """The control: per round, requests whose every image is new to the server
    (nothing reusable by anyone). Returns ``{"round-0": path, ...}``."""
    paths = {}
    for r in range(rounds):
        requests = wl.no_reuse(num_requests, num_images, image_size, seed + 1000 * r)
        paths[f"round-{r}"] = out_dir / f"no_reuse-{num_images}img-round{r}.jsonl"
        write_trace(requests, paths[f"round-{r}"], max_tokens)
    return paths

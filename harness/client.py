"""Drive a server through its OpenAI-compatible API, streaming, at a fixed concurrency.

Time to first token is measured at the first streamed chunk with a choice: SGLang
sends it (the assistant role, then each token's text) once the first token
exists. Its text may be empty (a byte-level token that completes no character
yet), so success is judged by the ``usage`` chunk's token counts, which also give
the cached-token count (``--enable-cache-report``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from harness.workloads import BenchRequest


@dataclass(slots=True)
class RequestResult:
    """What one request measured. ``error`` is empty when it succeeded."""

    uid: str
    workload: str
    num_images: int
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def chat_payload(request: BenchRequest, max_tokens: int) -> dict:
    """Greedy, fixed output length (``ignore_eos``) so both sides decode the same."""
    return {
        "model": "default",
        "messages": request.messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one(
    session: aiohttp.ClientSession, url: str, request: BenchRequest, max_tokens: int
) -> RequestResult:
    result = RequestResult(request.uid, request.workload, request.num_images)
    started = time.perf_counter()
    try:
        async with session.post(url, json=chat_payload(request, max_tokens)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                choices = chunk.get("choices") or []
                if choices and not result.ttft_s:
                    result.ttft_s = time.perf_counter() - started
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage["prompt_tokens"])
                    result.completion_tokens = int(usage["completion_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.latency_s = time.perf_counter() - started
    if not result.ttft_s or result.completion_tokens == 0:
        result.error = f"no output token streamed (usage: {result.completion_tokens} tokens)"
    return result


async def _run(
    base_url: str, requests: Sequence[BenchRequest], concurrency: int, max_tokens: int
) -> list[RequestResult]:
    url = f"{base_url}/v1/chat/completions"
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def gated(request: BenchRequest) -> RequestResult:
            async with gate:
                return await _one(session, url, request, max_tokens)

        return list(await asyncio.gather(*(gated(r) for r in requests)))


def run_requests(
    base_url: str, requests: Sequence[BenchRequest], concurrency: int, max_tokens: int
) -> list[RequestResult]:
    """Send ``requests`` in order, at most ``concurrency`` in flight; results in order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return asyncio.run(_run(base_url, requests, concurrency, max_tokens))

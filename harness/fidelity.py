"""Fidelity of KV reuse, measured through a running server exactly as a user sees it.

For each test example and scenario, a *reference* request is served cold (radix
cache flushed: full prefill) and a *probe* with the same final prompt is served
after the scenario's warm-up requests put the same images in the cache under
another context. Probe vs. reference gives: exact-match accuracy, first-token
agreement, the KL divergence of the first next-token distribution (from the
returned top-k logprobs), and the server's cached-token count.

Scenarios:
    repeat          the identical prompt again (exact-prefix reuse)
    changed_prefix  images first served after another system prompt and preamble
    reordered       images first served in another order
    image_prefix    images first served after another system prompt, a preamble and
                    one more image (dotted, so a ``next`` model flags the first
                    image as the one after the dot: stale in the probe)
    multi_turn      turn 1 shows images 1..n-1; turn 2 adds image n and asks about
                    any image (the earlier ones asked about again)
    turn_reordered  turn 1 shows the images in reverse order; turn 2 shows them
                    again, in order, with the question (reused across turns, stale)
    cold            no warm-up: the probe is the prompt served cold, for servers
                    that change decoding (``--mm-compress-at decode``); its
                    reference comes from another, uncompressed server
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai

from harness.fidelity_task import (
    BACKGROUNDS,
    COLOURS,
    REMEMBER,
    Example,
    ShapeImage,
    chat_messages,
    score,
    two_turns,
)
from sgl_mmkv.testing.images import image_part
from sgl_mmkv.testing.server import flush_cache, mmkv_stats

SCENARIOS = (
    "repeat",
    "changed_prefix",
    "reordered",
    "multi_turn",
    "image_prefix",
    "turn_reordered",
)
COLD = "cold"
TOP_K = 10
MAX_TOKENS = 6
OTHER_SYSTEM = "You are a careful assistant that studies pictures."
OTHER_PREAMBLE = "Some pictures from an album, to look at before the question."


@dataclass(slots=True)
class Reply:
    """What the server returned for one request."""

    text: str
    first_token: str
    first_top_logprobs: dict[str, float]
    prompt_tokens: int
    cached_tokens: int
    latency_s: float


@dataclass(slots=True)
class ProbeRecord:
    """One (example, scenario) measurement."""

    uid: str
    qtype: str
    num_images: int
    scenario: str
    answer: str
    reference: str
    probe: str
    reference_correct: bool
    probe_correct: bool
    first_token_agree: bool
    first_token_kl: float
    prompt_tokens: int
    reference_cached_tokens: int
    probe_cached_tokens: int
    image_tokens: int
    probe_cached_image_tokens: int
    probe_latency_s: float
    probe_reused_tokens: float = 0
    probe_refreshed_tokens: float = 0
    # the probes' executed FLOPs over their extends' full-prefill FLOPs (server
    # counters over the probe's chunk; 1.0 on a server without them)
    probe_flops_fraction: float = 1.0


def kl_from_top_logprobs(reference: dict[str, float], probe: dict[str, float]) -> float:
    """KL(reference || probe) over the reference's top-k tokens.

    Each distribution is known only on its top-k; a reference token missing from
    the probe's top-k gets the probe's smallest returned logprob (an upper bound
    on its probability), and the reference mass outside its top-k is ignored.
    Both choices bias the estimate towards 0; identical distributions give 0.
    """
    if not reference:
        raise ValueError("reference has no logprobs")
    floor = min(probe.values()) if probe else math.log(1e-9)
    kl = 0.0
    for token, ref_lp in reference.items():
        kl += math.exp(ref_lp) * (ref_lp - probe.get(token, floor))
    return max(kl, 0.0)


class FidelityClient:
    """Sends the benchmark's requests to one server."""

    def __init__(self, base_url: str, max_tokens: int = MAX_TOKENS) -> None:
        self.base_url = base_url
        self.max_tokens = max_tokens
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Empty the server's caches (retried while a request is being retired)."""
        flush_cache(self.base_url, timeout_s)

    def refresh_counters(self) -> dict[str, int]:
        """sgl_mmkv's server-wide refresh counters (zeros on a stock server)."""
        return mmkv_stats(self.base_url).get("refresh") or {}

    def chat(self, messages: list[dict]) -> Reply:
        started = time.monotonic()
        r = self.client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=self.max_tokens,
            temperature=0,
            logprobs=True,
            top_logprobs=TOP_K,
        )
        latency = time.monotonic() - started
        first = r.choices[0].logprobs.content[0]
        details = r.usage.prompt_tokens_details
        return Reply(
            text=r.choices[0].message.content or "",
            first_token=first.token,
            first_top_logprobs={t.token: t.logprob for t in first.top_logprobs},
            prompt_tokens=r.usage.prompt_tokens,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
            latency_s=latency,
        )


def scenario_requests(
    example: Example, scenario: str, part: Callable[..., dict] = image_part
) -> tuple[list[list[dict]], list[dict]]:
    """(warm-up requests, final prompt) of one scenario; the final prompt is what
    both the cold reference and the probe send. ``part`` renders an image part."""
    canonical = chat_messages(example, part)
    n = len(example.images)
    if scenario == COLD:
        return [], canonical
    if scenario == "repeat":
        return [canonical], canonical
    if scenario == "changed_prefix":
        warm = chat_messages(example, part, system=OTHER_SYSTEM, preamble=OTHER_PREAMBLE)
        return [warm], canonical
    if scenario == "reordered":
        order = list(reversed(range(n))) if n > 1 else [0]
        return [chat_messages(example, part, order=order)], canonical
    if scenario == "multi_turn":
        return _multi_turn(canonical, n)
    if scenario == "turn_reordered":
        return _turn_reordered(example, part, canonical)
    if scenario == "image_prefix":
        system, user = chat_messages(example, part, system=OTHER_SYSTEM, preamble=OTHER_PREAMBLE)
        preamble, *rest = user["content"]
        lead = [_text("Picture: "), part(leading_image(example).render()), _text("\n")]
        return [[system, {**user, "content": [preamble, *lead, *rest]}]], canonical
    raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")


class ReferenceReplies:
    """Cold replies of another server (flushed before each), each prompt served once."""

    def __init__(self, client: FidelityClient) -> None:
        self.client = client
        self._replies: dict[str, Reply] = {}

    def flush(self) -> None:
        """Nothing to do: :meth:`chat` flushes the other server before serving."""

    def chat(self, messages: list[dict]) -> Reply:
        key = json.dumps(messages, sort_keys=True, default=str)
        if key not in self._replies:
            self.client.flush()
            self._replies[key] = self.client.chat(messages)
        return self._replies[key]


def _multi_turn(full: list[dict], n: int) -> tuple[list[list[dict]], list[dict]]:
    """Turn 1: images 1..n-1 with a fixed question and a fixed assistant reply;
    turn 2: image n and the example's question (which may name any image)."""
    system, user = full
    content = user["content"]
    # Each image contributes three parts: label, image, newline; the question is last.
    split = 3 * (n - 1)
    first_turn = content[:split] or [{"type": "text", "text": "Hello.\n"}]
    turn1 = [system, {"role": "user", "content": [*first_turn, _text("Remember these.")]}]
    conversation = [
        *turn1,
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": content[split:]},
    ]
    return [turn1], conversation


def _turn_reordered(
    example: Example, part: Callable[..., dict], canonical: list[dict]
) -> tuple[list[list[dict]], list[dict]]:
    """Turn 1 shows the images in reverse order; turn 2 shows them again, in order,
    with the question. Turn 1 is an exact prefix; turn 2's images are reused from
    turn 1, whose order their KV was computed in."""
    n = len(example.images)
    system, user = chat_messages(example, part, order=list(reversed(range(n))))
    turn1 = [system, {"role": "user", "content": [*user["content"][:-1], _text(REMEMBER)]}]
    return [turn1], two_turns(turn1, canonical[1])


def leading_image(example: Example) -> ShapeImage:
    """The dotted image ``image_prefix`` shows before ``example``'s images: a colour
    and background of its own where the example leaves one free."""
    colours = [c for c, _ in COLOURS if c not in {im.colour for im in example.images}]
    taken = {im.background for im in example.images}
    backgrounds = [b for b in range(len(BACKGROUNDS)) if b not in taken] or [0]
    first = example.images[0]
    return ShapeImage(
        colour=(colours or [first.colour])[0],
        kind=first.kind,
        quadrant=first.quadrant,
        background=backgrounds[0],
        jitter=(0, 0, 0),
        marked=True,
        side=first.side,
    )


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def measure(
    client: FidelityClient,
    layout: PromptLayout,
    examples: Iterable[Example],
    scenarios: Iterable[str] = SCENARIOS,
    references: FidelityClient | ReferenceReplies | None = None,
    concurrency: int = 1,
) -> list[ProbeRecord]:
    """Run every scenario on every example; see the module docstring. The cold
    references come from ``references`` (default: ``client`` itself).

    ``concurrency`` > 1 measures that many (example, scenario) probes at once: the
    caches are flushed, their references served together, flushed again, their
    warm-ups served together (each probe's own warm-ups in order), then their
    probes together. A chunk never holds one example twice (its scenarios share
    its images), so probes of one chunk share the server's caches but not their
    images. The refresh counters are read per chunk: each probe records the
    chunk's mean reused / refreshed tokens (the summaries' means stay exact)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    references = references or client
    examples = list(examples)
    jobs = [(example, scenario) for scenario in scenarios for example in examples]
    records: list[ProbeRecord] = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for chunk in _chunks(jobs, concurrency):
            records += _measure_chunk(client, references, layout, chunk, pool)
    return records


def _chunks(jobs: list[tuple[Example, str]], size: int) -> list[list[tuple[Example, str]]]:
    """``jobs`` in order, ``size`` at a time, never one example twice in a chunk: two
    scenarios of one example share its images, and the first warm-up to store them
    would decide what the other probe reuses."""
    chunks: list[list[tuple[Example, str]]] = []
    current: list[tuple[Example, str]] = []
    for job in jobs:
        if len(current) == size or any(job[0] is other for other, _ in current):
            chunks.append(current)
            current = []
        current.append(job)
    return [*chunks, current] if current else chunks


def _measure_chunk(client, references, layout, chunk, pool) -> list[ProbeRecord]:
    requests = [scenario_requests(example, scenario) for example, scenario in chunk]
    finals = [final for _, final in requests]
    references.flush()
    # ReferenceReplies flushes its server before each reply: one at a time.
    serve = map if isinstance(references, ReferenceReplies) else pool.map
    reference_replies = list(serve(references.chat, finals))
    client.flush()

    def warm_up(warmups: list[list[dict]]) -> None:
        for warm in warmups:
            client.chat(warm)

    list(pool.map(warm_up, [warmups for warmups, _ in requests]))
    before = client.refresh_counters()
    probes = list(pool.map(client.chat, finals))
    after = client.refresh_counters()
    reused = (after.get("reused_tokens", 0) - before.get("reused_tokens", 0)) / len(chunk)
    refreshed = (after.get("refreshed_tokens", 0) - before.get("refreshed_tokens", 0)) / len(chunk)
    full_flops = after.get("full_prefill_flops", 0) - before.get("full_prefill_flops", 0)
    executed = after.get("executed_flops", 0) - before.get("executed_flops", 0)
    flops_fraction = executed / full_flops if full_flops > 0 else 1.0
    records = []
    for (example, scenario), reference, probe in zip(chunk, reference_replies, probes, strict=True):
        image_mask = layout.image_mask(
            lambda part, ex=example, sc=scenario: scenario_requests(ex, sc, part)[1]
        )
        if len(image_mask) != probe.prompt_tokens:
            raise RuntimeError(
                f"local prompt has {len(image_mask)} tokens, the server's "
                f"{probe.prompt_tokens}: the processor and the server disagree"
            )
        answer = example.answer
        records.append(
            ProbeRecord(
                uid=example.uid(),
                qtype=example.qtype,
                num_images=len(example.images),
                scenario=scenario,
                answer=answer,
                reference=reference.text,
                probe=probe.text,
                reference_correct=score(reference.text, answer),
                probe_correct=score(probe.text, answer),
                first_token_agree=reference.first_token == probe.first_token,
                first_token_kl=kl_from_top_logprobs(
                    reference.first_top_logprobs, probe.first_top_logprobs
                ),
                prompt_tokens=probe.prompt_tokens,
                reference_cached_tokens=reference.cached_tokens,
                probe_cached_tokens=probe.cached_tokens,
                image_tokens=sum(image_mask),
                probe_cached_image_tokens=sum(image_mask[: probe.cached_tokens]),
                probe_latency_s=probe.latency_s,
                probe_reused_tokens=reused,
                probe_refreshed_tokens=refreshed,
                probe_flops_fraction=flops_fraction,
            )
        )
    return records


class PromptLayout:
    """Which positions of a prompt are image tokens, from the model's own processor."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path)
        self.image_token_id = self.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def image_mask(self, messages_fn: Callable[..., list[dict]]) -> list[bool]:
        """Per prompt token: is it an image token? ``messages_fn(image_part)`` builds
        the same messages the server gets, with local image parts."""
        images: list = []

        def local_part(image) -> dict:
            images.append(image)
            return {"type": "image"}

        messages = messages_fn(local_part)
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.processor(text=[text], images=images or None, return_tensors="pt")
        return [int(t) == self.image_token_id for t in ids["input_ids"][0]]

"""Seeded serving workloads in which images recur under changed prefixes.

Every request is an OpenAI chat payload (``messages``) plus labels. The same seed
gives the same requests, byte for byte, so both sides of a comparison get the
identical list.

    doc_qa       a pool of page images; each request asks a new question over k
                 pages, in a new order, after a new system prompt (the paper's
                 latency setting: the pages were read once before)
    multi_turn   chat sessions; each turn adds an image, the system prompt carries
                 the turn's time (so the prefix changes), earlier images asked again
    no_reuse     control: every image new, nothing reusable by anyone
    same_prefix  stock-friendly: identical system prompt and pages in the same
                 order, only the final question differs
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from sgl_mmkv.testing.images import data_url, make_image

WORKLOADS = ("doc_qa", "multi_turn", "no_reuse", "same_prefix")

_SYSTEM_PROMPTS = (
    "You are a document assistant. Answer from the pages only.",
    "You read scanned reports and answer briefly.",
    "Answer the user's question about the attached pages in a few words.",
    "You are an analyst. Cite the page number in your answer.",
)
_QUESTIONS = (
    "Which page has a red shape?",
    "How many pages show a circle?",
    "What colour is the background of the last page?",
    "Which page is the brightest?",
    "Summarise the first page in three words.",
    "Is there a green rectangle anywhere?",
)
_POOL_SEED = 10_000
_NO_REUSE_SEED = 1_000_000
_SESSION_SEED = 2_000_000


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: an OpenAI ``messages`` list and its labels."""

    workload: str
    num_images: int
    messages: list[dict] = field(repr=False, hash=False, compare=False)
    uid: str = ""


@functools.lru_cache(maxsize=4096)
def _image_url(seed: int, size: int) -> str:
    return data_url(make_image(seed, size))


def _user(text: str, image_seeds: list[int], size: int) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": _image_url(s, size)}} for s in image_seeds]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _system(text: str) -> dict:
    return {"role": "system", "content": text}


def pool_warmup(pool_size: int, image_size: int) -> list[BenchRequest]:
    """Each pool page read once on its own (not measured): the document was seen."""
    return [
        BenchRequest(
            "warmup",
            1,
            [
                _system("Describe the page."),
                _user("What is on this page?", [_POOL_SEED + i], image_size),
            ],
            uid=f"warmup-{i}",
        )
        for i in range(pool_size)
    ]


def doc_qa(
    num_requests: int, num_images: int, pool_size: int, image_size: int, seed: int
) -> list[BenchRequest]:
    if num_images > pool_size:
        raise ValueError(f"{num_images} pages per request > pool of {pool_size}")
    rng = random.Random(f"doc_qa-{seed}-{num_images}")
    out = []
    for i in range(num_requests):
        pages = rng.sample(range(pool_size), num_images)
        system = f"{rng.choice(_SYSTEM_PROMPTS)} Ticket {rng.randrange(10**6):06d}."
        user = _user(rng.choice(_QUESTIONS), [_POOL_SEED + p for p in pages], image_size)
        out.append(BenchRequest("doc_qa", num_images, [_system(system), user], uid=f"doc-{i}"))
    return out


def no_reuse(num_requests: int, num_images: int, image_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(f"no_reuse-{seed}-{num_images}")
    base = _NO_REUSE_SEED + 100_000 * seed + 1000 * num_images
    out = []
    for i in range(num_requests):
        seeds = [base + i * num_images + j for j in range(num_images)]
        system = f"{rng.choice(_SYSTEM_PROMPTS)} Ticket {rng.randrange(10**6):06d}."
        user = _user(rng.choice(_QUESTIONS), seeds, image_size)
        out.append(BenchRequest("no_reuse", num_images, [_system(system), user], uid=f"new-{i}"))
    return out


def same_prefix(
    num_requests: int, num_images: int, pool_size: int, image_size: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(f"same_prefix-{seed}-{num_images}")
    pages = [_POOL_SEED + p for p in rng.sample(range(pool_size), min(num_images, pool_size))]
    system = _system(_SYSTEM_PROMPTS[0])
    return [
        BenchRequest(
            "same_prefix",
            len(pages),
            [system, _user(_QUESTIONS[i % len(_QUESTIONS)], pages, image_size)],
            uid=f"same-{i}",
        )
        for i in range(num_requests)
    ]


def multi_turn(num_sessions: int, turns: int, image_size: int, seed: int) -> list[BenchRequest]:
    """Sessions of ``turns`` requests; request t of a session carries images 1..t.

    Ordered turn by turn across sessions, so a session's earlier turn has usually
    finished before its next one is sent, as in a chat.
    """
    rng = random.Random(f"multi_turn-{seed}")
    out = []
    for t in range(1, turns + 1):
        for s in range(num_sessions):
            seeds = [_SESSION_SEED + 100_000 * seed + 100 * s + i for i in range(turns)]
            messages = [_system(f"You are a helpful assistant. Session {s}, time 09:{t:02d}.")]
            for i in range(t - 1):
                messages.append(_user(f"Here is picture {i + 1}.", [seeds[i]], image_size))
                messages.append({"role": "assistant", "content": f"I see picture {i + 1}."})
            asked = rng.randint(1, t)
            question = f"Here is picture {t}. What is in picture {asked}?"
            messages.append(_user(question, [seeds[t - 1]], image_size))
            out.append(BenchRequest("multi_turn", t, messages, uid=f"chat-{s}-{t}"))
    return out

"""Mixed traffic as one ``openai`` JSONL trace for SGLang's client, with the kind of
each request beside it.

Three kinds, in a stated mix (``70/15/15``: fractions of doc-QA / new images / text):

    doc_qa      a question over ``doc_pages`` pages of the pool the server read once
                (new system prompt and page order: :func:`harness.workloads.doc_qa`)
    new_images  ``new_pages`` pages nobody sent before (:func:`harness.workloads.no_reuse`)
    text        a text-only chat turn of ``text_words`` seeded words

The kinds are interleaved by a seeded shuffle. SGLang's client sends the lines in
file order (its ``openai`` dataset is not shuffled) and reports per-request figures
in that order (``--output-details``), so the labels file (``<trace>.labels.json``:
one ``{"uid", "kind", "images"}`` per line) splits them by kind.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from harness import workloads as wl
from harness.traces import write_trace

KINDS = ("doc_qa", "new_images", "text")

_WORDS = (
    "invoice report quarter revenue margin contract clause supplier delivery schedule "
    "budget forecast risk audit policy customer region product launch review summary "
    "meeting decision owner deadline status issue update figure table chart account "
    "balance payment order shipment warehouse stock price cost growth team plan goal"
).split()


@dataclass(frozen=True, slots=True)
class Mix:
    """Fractions of doc-QA, new-image and text-only requests (summing to 1)."""

    doc_qa: float
    new_images: float
    text: float

    @classmethod
    def parse(cls, text: str) -> Mix:
        """``"70/15/15"`` (any positive weights, normalised)."""
        parts = [float(x) for x in text.split("/")]
        if len(parts) != 3 or min(parts) < 0 or sum(parts) <= 0:
            raise ValueError(f"a mix is three weights a/b/c, not {text!r}")
        total = sum(parts)
        return cls(*(p / total for p in parts))

    @property
    def label(self) -> str:
        return "-".join(f"{round(100 * f, 1):g}" for f in self.fractions())

    def fractions(self) -> tuple[float, float, float]:
        return (self.doc_qa, self.new_images, self.text)

    def counts(self, n: int) -> dict[str, int]:
        """Requests of each kind among ``n`` (largest remainders; they add up to ``n``)."""
        exact = [f * n for f in self.fractions()]
        counts = [int(x) for x in exact]
        by_remainder = sorted(range(3), key=lambda i: (counts[i] - exact[i], i))
        for i in by_remainder[: n - sum(counts)]:
            counts[i] += 1
        return dict(zip(KINDS, counts, strict=True))


def text_chat(num_requests: int, text_words: int, seed: int) -> list[wl.BenchRequest]:
    """Text-only chat turns: a new system prompt and ``text_words`` seeded words each."""
    rng = random.Random(f"text-{seed}-{text_words}")
    out = []
    for i in range(num_requests):
        system = f"You are a helpful assistant. Ticket {rng.randrange(10**6):06d}."
        body = " ".join(rng.choice(_WORDS) for _ in range(text_words))
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Summarise these notes: {body}"},
        ]
        out.append(wl.BenchRequest("text", 0, messages, uid=f"text-{i}"))
    return out


def mixed_requests(
    mix: Mix,
    num_requests: int,
    *,
    doc_pages: int,
    new_pages: int,
    pool_size: int,
    image_size: int,
    text_words: int,
    seed: int,
) -> list[wl.BenchRequest]:
    """``num_requests`` requests of the three kinds in ``mix``, interleaved by ``seed``.

    New-image pages are distinct for distinct seeds; the pool is the warm-up's
    (:func:`harness.workloads.pool_warmup`)."""
    counts = mix.counts(num_requests)
    requests = [
        *wl.doc_qa(counts["doc_qa"], doc_pages, pool_size, image_size, seed),
        *wl.no_reuse(counts["new_images"], new_pages, image_size, seed),
        *text_chat(counts["text"], text_words, seed),
    ]
    random.Random(f"mix-{seed}").shuffle(requests)
    return requests


def kind_of(request: wl.BenchRequest) -> str:
    return {"doc_qa": "doc_qa", "no_reuse": "new_images", "text": "text"}[request.workload]


def labels_path(trace: Path) -> Path:
    return trace.with_suffix(".labels.json")


def write_mixed_trace(requests: list[wl.BenchRequest], path: Path, max_tokens: int) -> Path:
    """The trace at ``path`` and its labels at :func:`labels_path`; returns ``path``."""
    write_trace(requests, path, max_tokens)
    labels = [{"uid": r.uid, "kind": kind_of(r), "images": r.num_images} for r in requests]
    labels_path(path).write_text(json.dumps(labels) + "\n")
    return path


def read_labels(trace: Path) -> list[dict]:
    return json.loads(labels_path(trace).read_text())

"""Task variants in which an image's decoder KV should depend on its context.

The committed fidelity task (``style="marked"``) asks its question after the images
and marks the target in the pixels, so an image token never needs its context: KV
computed under another prefix or order gives the same answers (issue 25). The
variants here make the image tokens' right content depend on what comes before:

- ``marked``: the committed task (control);
- ``qfirst``: the keyed question ("Which background has the red shape?") is asked
  *before* the images, so an image token can flag itself as the target only by
  reading the question; reused under another question, the flag is wrong;
- ``repeat``: two images share a shape colour and the question (after the images)
  asks for the background of the *later* one ("Which background has a colour seen
  before?"); only the later copy's tokens can see the earlier copy, so the flag
  moves to the other copy when the images are reused in another order;
- ``count``: "How many shapes are red?" asked before the images (0 to 3 of them are
  red); reused under another colour's question, every flag is wrong;
- ``next``: one image carries the dot (as in ``marked``) and the question asks
  about the image *after* it ("What colour is the shape after the dotted one?");
  only the next image's tokens can see the dotted one, so in another order the
  flag sits on another image.

:func:`stale_messages` renders a prompt with any system prompt, preamble, image
order and question, which is all a reuse context changes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from harness.fidelity_task import (
    BACKGROUNDS,
    COLOURS,
    NEXT_QUESTIONS,
    QUESTION_TYPES,
    SPLIT_SEEDS,
    SYSTEM_PROMPT,
    ShapeImage,
    answer_of,
    ask,
    make_example,
)

VARIANT_NAMES = ("marked", "qfirst", "repeat", "count", "next")
REPEAT_QUESTION = "Which background has a colour seen before?"
MAX_COUNT = 3


@dataclass(frozen=True, slots=True)
class StaleExample:
    """One prompt of a staleness variant.

    ``other_question`` is what a changed-prefix reuse context asks instead (for
    question-first variants; the same question otherwise)."""

    variant: str
    images: tuple[ShapeImage, ...]
    question: str
    answer: str
    question_first: bool
    other_question: str


def _count_question(colour: str) -> str:
    return f"How many shapes are {colour}?"


def _qfirst(rng: random.Random, split: str, n: int) -> StaleExample:
    qtype = rng.choice(QUESTION_TYPES)
    base = make_example(split, rng.randrange(10**9), num_images=n, qtype=qtype, style="keyed")
    other = rng.choice([i for i in range(n) if i != base.target] or [base.target])
    other_question, _ = ask(base.images, other, rng.choice(QUESTION_TYPES))
    return StaleExample("qfirst", base.images, base.question, base.answer, True, other_question)


def _repeat(rng: random.Random, split: str, n: int) -> StaleExample:
    if n < 2:
        raise ValueError("a repeat needs at least 2 images")
    images = list(make_example(split, rng.randrange(10**9), num_images=n).images)
    first, later = sorted(rng.sample(range(n), 2))
    images[later] = replace(images[later], colour=images[first].colour)
    answer = BACKGROUNDS[images[later].background][0]
    return StaleExample("repeat", tuple(images), REPEAT_QUESTION, answer, False, REPEAT_QUESTION)


def _count(rng: random.Random, split: str, n: int) -> StaleExample:
    images = list(make_example(split, rng.randrange(10**9), num_images=n).images)
    named, *others = rng.sample([c for c, _ in COLOURS], n + 1)
    count = rng.randint(0, min(MAX_COUNT, n))
    chosen = set(rng.sample(range(n), count))
    for i in range(n):  # the rest: distinct colours other than the named one
        images[i] = replace(images[i], colour=named if i in chosen else others[i])
    present = sorted({im.colour for im in images} - {named}) or [others[0]]
    other_question = _count_question(rng.choice(present))
    return StaleExample(
        "count", tuple(images), _count_question(named), str(count), True, other_question
    )


def _marked(rng: random.Random, split: str, n: int) -> StaleExample:
    base = make_example(split, rng.randrange(10**9), num_images=n, style="marked")
    return StaleExample("marked", base.images, base.question, base.answer, False, base.question)


def _next(rng: random.Random, split: str, n: int) -> StaleExample:
    if n < 2:
        raise ValueError("an image after the dotted one needs at least 2 images")
    images = list(make_example(split, rng.randrange(10**9), num_images=n).images)
    dotted = rng.randrange(n - 1)
    images[dotted] = replace(images[dotted], marked=True)
    qtype = rng.choice(QUESTION_TYPES)
    question = NEXT_QUESTIONS[qtype]
    answer = answer_of(images[dotted + 1], qtype)
    return StaleExample("next", tuple(images), question, answer, False, question)


_MAKERS: dict[str, Callable[[random.Random, str, int], StaleExample]] = {
    "marked": _marked,
    "qfirst": _qfirst,
    "repeat": _repeat,
    "count": _count,
    "next": _next,
}


def make_stale_example(variant: str, split: str, index: int, num_images: int) -> StaleExample:
    """The ``index``-th example of ``variant`` in ``split`` with ``num_images`` images
    (deterministic; splits draw from the task's split seeds)."""
    if variant not in _MAKERS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANT_NAMES)}")
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}")
    seed = (SPLIT_SEEDS[split] * 7_000_003 + index) * 31 + VARIANT_NAMES.index(variant)
    rng = random.Random(seed)
    return _MAKERS[variant](rng, split, num_images)


def stale_messages(
    example: StaleExample,
    image_part: Callable[..., dict],
    system: str = SYSTEM_PROMPT,
    preamble: str | None = None,
    order: list[int] | None = None,
    question: str | None = None,
) -> list[dict]:
    """OpenAI-style messages: optional preamble, the question first for
    question-first variants, "Image k: <image>" lines in ``order``, else the
    question last. ``question`` overrides the example's (a reuse context)."""
    order = list(range(len(example.images))) if order is None else order
    if sorted(order) != list(range(len(example.images))):
        raise ValueError(f"order {order} is not a permutation of the images")
    question = example.question if question is None else question
    content: list[dict] = []
    if preamble:
        content.append({"type": "text", "text": preamble + "\n"})
    if example.question_first:
        content.append({"type": "text", "text": question + "\n"})
    for label, i in enumerate(order, start=1):
        content.append({"type": "text", "text": f"Image {label}: "})
        content.append(image_part(example.images[i].render()))
        content.append({"type": "text", "text": "\n"})
    if not example.question_first:
        content.append({"type": "text", "text": question})
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]

"""A synthetic multi-image question-answering task whose answers need the right
few tokens of the right image.

Every image is 112 x 112 pixels (16 visual tokens of the tiny Qwen2-VL, one per
28 x 28 cell): a plain background with one shape (circle, square or triangle) in
one quadrant, so the answer lives in the 4 tokens of that quadrant. The shapes of
one prompt have distinct colours; a prompt holds 1 to 8 labelled images
("Image 1: <image>") and one question that names a shape by its colour:

- ``kind``  (one specific image):          "What shape is the red one?"     -> "circle"
- ``where`` (fine detail inside an image): "Where is the red shape?"        -> "top left"
- ``same``  (comparison across images):    "Are the red and blue shapes the same kind?" -> "yes"

Answers are short and scored by exact match. Same (split, index) -> same example.
Questions address an image by content, not by its label: label binding ("image
3") needs far more training than a CPU budget allows a model this small, while
content addressing still needs the right tokens of the right image.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace

from PIL import Image, ImageDraw

IMAGE_SIZE = 112
COLOURS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (220, 30, 30)),
    ("green", (30, 170, 50)),
    ("blue", (40, 60, 220)),
    ("yellow", (235, 215, 30)),
    ("purple", (140, 40, 170)),
    ("orange", (245, 140, 20)),
    ("pink", (240, 110, 180)),
    ("cyan", (30, 200, 210)),
)
MAX_IMAGES = 8
BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((250, 250, 250), (40, 40, 40), (150, 150, 150))
KINDS = ("circle", "square", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
QUESTION_TYPES = ("kind", "where", "same")
SPLIT_SEEDS = {"train": 1_000_003, "validation": 2_000_003, "test": 3_000_017}
SYSTEM_PROMPT = "You answer questions about the images in few words."


@dataclass(frozen=True, slots=True)
class ShapeImage:
    """One image of the task: its background, and the shape's colour, kind and quadrant."""

    colour: str
    kind: str
    quadrant: str
    background: int
    jitter: tuple[int, int, int]

    def render(self) -> Image.Image:
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[self.background])
        draw = ImageDraw.Draw(image)
        half = IMAGE_SIZE // 2
        col, row = QUADRANTS.index(self.quadrant) % 2, QUADRANTS.index(self.quadrant) // 2
        dx, dy, size_delta = self.jitter
        size = 38 + size_delta
        x0 = col * half + (half - size) // 2 + dx
        y0 = row * half + (half - size) // 2 + dy
        box = (x0, y0, x0 + size, y0 + size)
        fill = dict(COLOURS)[self.colour]
        if self.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif self.kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0 + size // 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=fill)
        return image

    def key(self) -> tuple:
        return (self.colour, self.kind, self.quadrant, self.background, self.jitter)


@dataclass(frozen=True, slots=True)
class Example:
    """A prompt: its images in order, the question, the answer and its type."""

    split: str
    index: int
    images: tuple[ShapeImage, ...]
    question: str
    answer: str
    qtype: str
    target: int  # 0-based index of the image the answer depends on

    def user_text_parts(self) -> list[tuple[str, int | None]]:
        """The user turn as (text, image index) parts: a label before each image."""
        parts: list[tuple[str, int | None]] = []
        for i in range(len(self.images)):
            parts.append((f"Image {i + 1}: ", None))
            parts.append(("", i))
            parts.append(("\n", None))
        parts.append((self.question, None))
        return parts

    def uid(self) -> str:
        text = repr([im.key() for im in self.images]) + self.question
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _random_image(rng: random.Random, colour: str | None = None) -> ShapeImage:
    return ShapeImage(
        colour=colour or rng.choice(COLOURS)[0],
        kind=rng.choice(KINDS),
        quadrant=rng.choice(QUADRANTS),
        background=rng.randrange(len(BACKGROUNDS)),
        jitter=(rng.randint(-4, 4), rng.randint(-4, 4), rng.randint(-6, 6)),
    )


def make_example(
    split: str, index: int, num_images: int | None = None, qtype: str | None = None
) -> Example:
    """The ``index``-th example of ``split``; 1 to 8 images unless ``num_images`` is given."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLIT_SEEDS)}")
    rng = random.Random(SPLIT_SEEDS[split] * 1_000_003 + index)
    n = num_images if num_images is not None else rng.randint(1, MAX_IMAGES)
    if not 1 <= n <= MAX_IMAGES:
        raise ValueError(f"num_images must be in [1, {MAX_IMAGES}], got {n}")
    qtype = qtype or rng.choice(QUESTION_TYPES if n > 1 else QUESTION_TYPES[:2])
    if qtype == "same" and n < 2:
        raise ValueError("a 'same' question needs at least 2 images")
    colours = rng.sample([c for c, _ in COLOURS], n)
    images = tuple(_random_image(rng, c) for c in colours)
    target = rng.randrange(n)
    shape = images[target]
    if qtype == "kind":
        question, answer = f"What shape is the {shape.colour} one?", shape.kind
    elif qtype == "where":
        question, answer = f"Where is the {shape.colour} shape?", shape.quadrant
    elif qtype == "same":
        other = rng.choice([i for i in range(n) if i != target])
        if rng.random() < 0.5:  # balance yes / no
            images = tuple(
                replace(im, kind=shape.kind) if i == other else im for i, im in enumerate(images)
            )
        same = images[other].kind == shape.kind
        question = f"Are the {shape.colour} and {images[other].colour} shapes the same kind?"
        answer = "yes" if same else "no"
    else:
        raise ValueError(f"unknown question type {qtype!r}")
    return Example(split, index, images, question, answer, qtype, target)


def make_split(split: str, count: int, start: int = 0, **kwargs) -> list[Example]:
    return [make_example(split, i, **kwargs) for i in range(start, start + count)]


def score(prediction: str, answer: str) -> bool:
    """Exact match after trimming whitespace, a final full stop and case."""
    return prediction.strip().rstrip(".").strip().lower() == answer.lower()


def chat_messages(
    example: Example,
    image_part,
    system: str = SYSTEM_PROMPT,
    preamble: str | None = None,
    order: list[int] | None = None,
) -> list[dict]:
    """OpenAI-style messages for ``example``.

    Args:
        image_part: maps a PIL image to one content part (a data-URL part for the
            HTTP API, ``{"type": "image"}`` for a local processor).
        system: the system prompt.
        preamble: optional text before the first image (a changed prefix).
        order: optional permutation: position j shows image ``order[j]``
            (questions name shapes by colour, so the answer is unchanged).
    """
    order = list(range(len(example.images))) if order is None else order
    if sorted(order) != list(range(len(example.images))):
        raise ValueError(f"order {order} is not a permutation of the images")
    content: list[dict] = []
    if preamble:
        content.append({"type": "text", "text": preamble + "\n"})
    for label, i in enumerate(order, start=1):
        content.append({"type": "text", "text": f"Image {label}: "})
        content.append(image_part(example.images[i].render()))
        content.append({"type": "text", "text": "\n"})
    content.append({"type": "text", "text": example.question})
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]

"""A synthetic multi-image question-answering task whose answers need the right
few tokens of the right image.

Every image is 112 x 112 pixels (16 visual tokens of the tiny Qwen2-VL, one per
28 x 28 cell): a plain background with one shape (circle, square or triangle) in
one quadrant, so the shape lives in the 4 tokens of that quadrant. Within one
prompt the backgrounds are distinct and so are the shape colours; a prompt holds
1 to 8 labelled images ("Image 1: <image>") and one question:

- ``colour`` (one specific image): "What colour is the shape on the navy background?"
  -> "red"
- ``which`` (comparison across images): "Which background has the red shape?" -> "navy"
- ``kind`` (fine detail inside an image): "What shape is the red one?" -> "circle"
  (the shape's outline lives in the few tokens of its quadrant)

Answers are short and scored by exact match. Same (split, index) -> same example.
Questions address an image by its content, not by its label. Two earlier designs
did not train on 2 CPU cores in the time available (tiny model, 16 x 16 batch):
binding "image 3" to the third image stayed at chance after 1,300 steps, and
shape-kind / same-kind questions reached 45 % (chance 36 %) after 1,600 steps.
"Where is the red shape?" stayed at chance even with one image: the vision tower
and the language model see positions only through rotary phases, so a token's value
does not say which quadrant it covers.

The keyed questions above do not train on this tiny model, even with the images
written as text (``training/retrieval_probes.py``). ``style="marked"`` puts a
dot on the target image's shape and asks about "the dotted shape" (the same
three question types; the query no longer depends on the question's words): the
committed ``models/fidelity-qwen2-vl-marked`` is trained on it.

``style="next"`` dots one image and asks about the image *after* it ("What colour
is the shape after the dotted one?"; 2 or more images). Only the next image's
tokens can see the dot before them, so their KV depends on the order the images
were shown in: KV reused from another order is stale (issue 25). :func:`describe`
renders an image as text for the control that takes the vision tower out.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

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
BACKGROUNDS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("white", (250, 250, 250)),
    ("black", (20, 20, 20)),
    ("grey", (140, 140, 140)),
    ("brown", (120, 70, 30)),
    ("navy", (20, 30, 100)),
    ("olive", (110, 110, 20)),
    ("teal", (20, 110, 110)),
    ("maroon", (110, 20, 40)),
)
KINDS = ("circle", "square", "triangle")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
QUESTION_TYPES = ("colour", "which", "kind")
QUESTION_STYLES = ("keyed", "marked", "next")
# ``training.json`` styles written by ``training.staleness_probes`` -> question style.
TRAINED_STYLES = {"staleness-next": "next", "staleness-marked": "marked"}
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
    marked: bool = False  # a dot on the shape: the target of a "marked" question
    # pixels a side it is sent at: drawn at IMAGE_SIZE, then resized (bicubic), as a
    # processor resizing to the model's size would (the page-sized model: 224)
    side: int = IMAGE_SIZE

    def render(self) -> Image.Image:
        image = self._draw()
        if self.side != IMAGE_SIZE:
            image = image.resize((self.side, self.side), Image.Resampling.BICUBIC)
        return image

    def _draw(self) -> Image.Image:
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[self.background][1])
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
        if self.marked:
            cx = x0 + size // 2
            cy = y0 + size // 2 + (size // 6 if self.kind == "triangle" else 0)
            dot = (250, 250, 250) if BACKGROUNDS[self.background][0] == "black" else (0, 0, 0)
            draw.ellipse((cx - 7, cy - 7, cx + 7, cy + 7), fill=dot)
        return image

    def key(self) -> tuple:
        base = (self.colour, self.kind, self.quadrant, self.background, self.jitter)
        return (*base, "marked") if self.marked else base


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


def make_example(
    split: str,
    index: int,
    num_images: int | None = None,
    qtype: str | None = None,
    style: str = "keyed",
    max_images: int = MAX_IMAGES,
    image_side: int = IMAGE_SIZE,
) -> Example:
    """The ``index``-th example of ``split``; 1 (2 for ``next``) to ``max_images``
    images unless ``num_images`` is given, each sent at ``image_side`` pixels a side.

    ``style="marked"`` draws the same images and target, marks the target and asks
    about "the dotted shape" (:func:`ask_marked`); ``style="next"`` marks the image
    before the target and asks about "the shape after the dotted one"."""
    if style not in QUESTION_STYLES:
        raise ValueError(f"unknown style {style!r}; choose one of {', '.join(QUESTION_STYLES)}")
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLIT_SEEDS)}")
    rng = random.Random(SPLIT_SEEDS[split] * 1_000_003 + index)
    fewest = 2 if style == "next" else 1
    n = num_images if num_images is not None else rng.randint(fewest, max_images)
    if not fewest <= n <= MAX_IMAGES:
        raise ValueError(f"{style} examples need {fewest} to {MAX_IMAGES} images, got {n}")
    qtype = qtype or rng.choice(QUESTION_TYPES)
    colours = rng.sample([c for c, _ in COLOURS], n)
    backgrounds = rng.sample(range(len(BACKGROUNDS)), n)
    images = tuple(
        ShapeImage(
            colour=colour,
            kind=rng.choice(KINDS),
            quadrant=rng.choice(QUADRANTS),
            background=background,
            jitter=(rng.randint(-4, 4), rng.randint(-4, 4), rng.randint(-6, 6)),
            side=image_side,
        )
        for colour, background in zip(colours, backgrounds, strict=True)
    )
    target = rng.randrange(n - 1) + 1 if style == "next" else rng.randrange(n)
    if style == "next":
        dotted = replace(images[target - 1], marked=True)
        images = (*images[: target - 1], dotted, *images[target:])
        question, answer = NEXT_QUESTIONS[qtype], answer_of(images[target], qtype)
    elif style == "marked":
        marked = replace(images[target], marked=True)
        images = (*images[:target], marked, *images[target + 1 :])
        question, answer = ask_marked(images, target, qtype)
    else:
        question, answer = ask(images, target, qtype)
    return Example(split, index, images, question, answer, qtype, target)


def answer_of(image: ShapeImage, qtype: str) -> str:
    """What a ``qtype`` question about ``image`` is answered with."""
    if qtype == "colour":
        return image.colour
    if qtype == "which":
        return BACKGROUNDS[image.background][0]
    if qtype == "kind":
        return image.kind
    raise ValueError(f"unknown question type {qtype!r}; choose one of {', '.join(QUESTION_TYPES)}")


def ask(images: tuple[ShapeImage, ...], target: int, qtype: str) -> tuple[str, str]:
    """(question, answer) of type ``qtype`` about ``images[target]``."""
    shape = images[target]
    answer = answer_of(shape, qtype)
    if qtype == "colour":
        background = BACKGROUNDS[shape.background][0]
        return f"What colour is the shape on the {background} background?", answer
    if qtype == "which":
        return f"Which background has the {shape.colour} shape?", answer
    return f"What shape is the {shape.colour} one?", answer


MARKED_QUESTIONS = {
    "colour": "What colour is the dotted shape?",
    "which": "Which background has the dotted shape?",
    "kind": "What shape has the dot?",
}


NEXT_QUESTIONS = {
    "colour": "What colour is the shape after the dotted one?",
    "which": "Which background comes after the dotted shape?",
    "kind": "What shape comes after the dotted one?",
}


def ask_marked(images: tuple[ShapeImage, ...], target: int, qtype: str) -> tuple[str, str]:
    """(question, answer) of type ``qtype`` about the marked ``images[target]``."""
    answer = answer_of(images[target], qtype)
    return MARKED_QUESTIONS[qtype], answer


def describe(image: ShapeImage) -> str:
    """The image as text, for the text-only control: "a red circle on navy"."""
    mark = " with a dot" if image.marked else ""
    return f"a {image.colour} {image.kind}{mark} on {BACKGROUNDS[image.background][0]}"


def _training_record(model_path: str | Path) -> dict:
    record = Path(model_path) / "training.json"
    return json.loads(record.read_text()) if record.exists() else {}


def model_style(model_path: str | Path) -> str:
    """The question style a fidelity checkpoint was trained on (``training.json``;
    "keyed" when it does not say)."""
    written = _training_record(model_path).get("style", "keyed")
    style = TRAINED_STYLES.get(written, written)
    if style not in QUESTION_STYLES:
        raise ValueError(f"{Path(model_path) / 'training.json'}: unknown style {written!r}")
    return style


def model_max_images(model_path: str | Path) -> int:
    """The most images per prompt a checkpoint was trained on (``training.json``'s
    ``config.max_images``; :data:`MAX_IMAGES` when it does not say)."""
    return int(_training_record(model_path).get("config", {}).get("max_images", MAX_IMAGES))


def _image_processor(model_path: str | Path) -> dict:
    """The checkpoint's image processor settings (the task's 112 x 112 when it has none)."""
    path = Path(model_path) / "processor_config.json"
    if not path.exists():
        return {"max_pixels": IMAGE_SIZE**2, "patch_size": 14, "merge_size": 2}
    return json.loads(path.read_text())["image_processor"]


def _fixed_pixels(image: dict) -> int:
    """The pixels every image is resized to; the task's 112 x 112 where the processor
    allows a range (a 112-pixel image is then kept as it is)."""
    size = image.get("size") or {}
    low = image.get("min_pixels") or size.get("shortest_edge")
    high = image.get("max_pixels") or size.get("longest_edge")
    return high if high is not None and low == high else IMAGE_SIZE**2


def model_image_tokens(model_path: str | Path) -> int:
    """Tokens per image of a fidelity checkpoint: its processor resizes every image to
    ``max_pixels``, one token per ``(patch * merge) ** 2`` pixels."""
    image = _image_processor(model_path)
    return _fixed_pixels(image) // (image["patch_size"] * image["merge_size"]) ** 2


def model_image_side(model_path: str | Path) -> int:
    """Pixels a side a fidelity checkpoint's images are sent at: its processor's fixed
    size (112 for the small-image models, 224 for the page-sized one)."""
    return math.isqrt(_fixed_pixels(_image_processor(model_path)))


def fidelity_pool_tokens(model_path: str | Path, concurrency: int) -> int:
    """A KV pool (tokens) that holds a whole chunk of ``concurrency`` probes with their
    warm-ups, so no warm-up's images are evicted before their probe reuses them: per
    probe a warm-up and a two-turn probe (three times the most images) and 512 text
    tokens; at least the suite's 4096."""
    per_probe = 3 * model_max_images(model_path) * model_image_tokens(model_path) + 512
    return max(4096, concurrency * per_probe)


def make_split(split: str, count: int, start: int = 0, **kwargs) -> list[Example]:
    return [make_example(split, i, **kwargs) for i in range(start, start + count)]


def model_split(model_path: str | Path, split: str, count: int) -> list[Example]:
    """``split[0:count]`` in the question style, image counts and image size
    ``model_path`` was trained on."""
    style, most = model_style(model_path), model_max_images(model_path)
    return make_split(
        split, count, style=style, max_images=most, image_side=model_image_side(model_path)
    )


def score(prediction: str, answer: str) -> bool:
    """Exact match after trimming whitespace, a final full stop and case."""
    return prediction.strip().rstrip(".").strip().lower() == answer.lower()


def chat_messages(
    example: Example,
    image_part,
    system: str = SYSTEM_PROMPT,
    preamble: str | None = None,
    order: list[int] | None = None,
    as_text: bool = False,
) -> list[dict]:
    """OpenAI-style messages for ``example``.

    Args:
        image_part: maps a PIL image to one content part (a data-URL part for the
            HTTP API, ``{"type": "image"}`` for a local processor).
        system: the system prompt.
        preamble: optional text before the first image (a changed prefix).
        order: optional permutation: position j shows image ``order[j]``
            (questions name shapes by colour, so the answer is unchanged).
        as_text: each image as its :func:`describe` text instead (text-only control).
    """
    order = list(range(len(example.images))) if order is None else order
    if sorted(order) != list(range(len(example.images))):
        raise ValueError(f"order {order} is not a permutation of the images")
    content: list[dict] = []
    if preamble:
        content.append({"type": "text", "text": preamble + "\n"})
    for label, i in enumerate(order, start=1):
        content.append({"type": "text", "text": f"Image {label}: "})
        image = example.images[i]
        if as_text:
            content.append({"type": "text", "text": describe(image)})
        else:
            content.append(image_part(image.render()))
        content.append({"type": "text", "text": "\n"})
    content.append({"type": "text", "text": example.question})
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


REMEMBER = "Remember these."  # the question of a first turn that only shows images
ACKNOWLEDGE = "OK."


def two_turns(turn1: list[dict], user2: dict) -> list[dict]:
    """A conversation: ``turn1`` (system and user, the user's question
    :data:`REMEMBER`), the assistant's :data:`ACKNOWLEDGE`, then the user message
    ``user2``."""
    return [*turn1, {"role": "assistant", "content": ACKNOWLEDGE}, user2]

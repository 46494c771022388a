"""Deterministic test images and the request payloads that carry them."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

from PIL import Image, ImageDraw

_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")


def make_image(seed: int, size: int = 112) -> Image.Image:
    """A ``size`` x ``size`` RGB image of a few coloured shapes, fixed by ``seed``.

    Different seeds give different images: the shapes never take the background's
    colour, and the seed's 32 low bits are drawn as a row of marks along the top.
    """
    rng = random.Random(seed)
    background = rng.choice(_COLOURS)
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    fills = [c for c in _COLOURS if c != background]
    for _ in range(rng.randint(1, 4)):
        x0, y0 = rng.randrange(size // 2), rng.randrange(size // 2)
        x1, y1 = x0 + rng.randint(10, size // 2), y0 + rng.randint(10, size // 2)
        shape = rng.choice((draw.ellipse, draw.rectangle))
        shape((x0, y0, x1, y1), fill=rng.choice(fills))
    mark = max(1, size // 40)
    on, off = ("white", "black") if background != "white" else ("black", "grey")
    for bit in range(32):
        colour = on if (seed >> bit) & 1 else off
        x = bit * mark
        draw.rectangle((x, 0, x + mark - 1, mark - 1), fill=colour)
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    """The image as a ``data:image/png;base64,...`` URL for the OpenAI API."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def save_png(image: Image.Image, path: str | Path) -> Path:
    path = Path(path)
    path.write_bytes(png_bytes(image))
    return path


def image_part(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def user_message(text: str, images: list[Image.Image] = ()) -> dict:
    """One OpenAI chat user turn: the images first, then the text."""
    return {
        "role": "user",
        "content": [*(image_part(im) for im in images), {"type": "text", "text": text}],
    }

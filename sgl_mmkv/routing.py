"""Image-affinity routing keys for SGLang's router (``sglang-router``, manual policy).

SGLang's router (``python -m sglang_router.launch_router``) cannot look inside a
request's images, but its ``manual`` policy routes by a key in the
``X-SMG-Routing-Key`` header: the first request with a key goes to a worker chosen by
``--assignment-mode`` (``min_load``: the one with the fewest requests in flight), and
every later request with that key goes to the same worker while it is healthy.

This module computes that key from the images of a request, so requests that show
the same images land on the instance that holds their segments in memory:

- each image is identified by the SHA-256 of its bytes (a ``data:`` URL or a raw
  base64 string decoded), or of its URL string for any other URL or a file path (a
  remote URL is not fetched);
- the key is the smallest of these digests (a min-hash), so it does not depend on
  the images' order, and two requests about the same set of pages get the same key;
- a request without images gets no key (the router then picks a worker itself).

The gateway (``python -m sgl_mmkv.gateway``) sets the header on the server side from
the request body, so clients send nothing; a client or proxy may also call
:func:`affinity_headers` itself. Standard library only: importable without SGLang.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
KEY_PREFIX = "mmkv-img-"
CHAT_PATH = "/v1/chat/completions"
GENERATE_PATH = "/generate"
_NOT_BASE64 = ("http://", "https://", "file:")


def _decoded(payload: str, strict: bool) -> bytes | None:
    try:
        return base64.b64decode(payload, validate=strict)
    except (binascii.Error, ValueError):
        return None


def image_digest(url: str) -> str:
    """SHA-256 hex of an image's content: the decoded bytes of a base64 ``data:`` URL
    or of a raw base64 string (as SGLang reads an image string that is neither a URL
    nor a path), else the string itself (UTF-8; a lone surrogate, which a JSON body
    may hold, encoded as it is)."""
    raw = None
    if url.startswith("data:"):
        if ";base64," in url:
            raw = _decoded(url.split(";base64,", 1)[1], strict=False)
    elif url and not url.startswith(_NOT_BASE64):
        raw = _decoded(url, strict=True)
    if raw is None:  # a JSON body may hold a lone surrogate ("\\ud800"): hashed as is
        raw = url.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()


def image_urls(messages: Any) -> list[str]:
    """Every ``image_url`` URL in OpenAI chat ``messages``, in order; parts of any
    other shape are skipped (the body is the client's)."""
    urls: list[str] = []
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return urls
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, Mapping) else image
                if isinstance(url, str):
                    urls.append(url)
    return urls


def generate_image_urls(image_data: Any, depth: int = 0) -> list[str]:
    """Every image of a native ``/generate`` request's ``image_data``, in order: a
    string (URL, ``data:`` URL, raw base64, path), an ``{"url": ...}`` object, a list
    of them, or a list of such lists (a batch)."""
    if isinstance(image_data, str):
        return [image_data]
    if isinstance(image_data, Mapping):
        url = image_data.get("url")
        return [url] if isinstance(url, str) else []
    if isinstance(image_data, list) and depth < 2:
        return [u for item in image_data for u in generate_image_urls(item, depth + 1)]
    return []


def affinity_key(urls: Iterable[str]) -> str | None:
    """The routing key of a set of images: the smallest content digest, prefixed;
    ``None`` for no images."""
    digests = [image_digest(url) for url in urls]
    return KEY_PREFIX + min(digests)[:32] if digests else None


def request_key(path: str, payload: Any) -> str | None:
    """The routing key of a parsed request body: the images of an OpenAI chat request
    (``/v1/chat/completions``, ``messages``) or of a native ``/generate`` request
    (``image_data``); ``None`` for another path, another shape, or no image."""
    if not isinstance(payload, Mapping):
        return None
    if path == CHAT_PATH:
        return affinity_key(image_urls(payload.get("messages")))
    if path == GENERATE_PATH:
        return affinity_key(generate_image_urls(payload.get("image_data")))
    return None


def affinity_headers(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """HTTP headers that route a chat request by its images: ``{X-SMG-Routing-Key:
    key}``, or ``{}`` when the request shows no image."""
    key = affinity_key(image_urls(messages))
    return {ROUTING_KEY_HEADER: key} if key else {}

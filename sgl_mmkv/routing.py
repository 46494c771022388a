"""Image-affinity routing keys for SGLang's router (``sglang-router``, manual policy).

SGLang's router (``python -m sglang_router.launch_router``) cannot look inside a
request's images, but its ``manual`` policy routes by a key the client sends in the
``X-SMG-Routing-Key`` header: the first request with a key goes to a worker chosen by
``--assignment-mode`` (``min_load``: the one with the fewest requests in flight), and
every later request with that key goes to the same worker while it is healthy.

This module computes that key from the images of an OpenAI chat request, so requests
that show the same images land on the instance that holds their segments in memory:

- each image is identified by the SHA-256 of its bytes (a ``data:`` URL decoded), or
  of its URL string for any other URL (a remote URL is not fetched);
- the key is the smallest of these digests (a min-hash), so it does not depend on
  the images' order, and two requests about the same set of pages get the same key;
- a request without images gets no key (the router then picks a worker itself).

Standard library only: a client or a proxy imports it without SGLang.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
KEY_PREFIX = "mmkv-img-"


def image_digest(url: str) -> str:
    """SHA-256 hex of an image URL's content: the decoded bytes of a base64 ``data:``
    URL, else the URL string itself."""
    if url.startswith("data:") and ";base64," in url:
        payload = url.split(";base64,", 1)[1]
        try:
            return hashlib.sha256(base64.b64decode(payload, validate=False)).hexdigest()
        except (binascii.Error, ValueError):
            pass
    return hashlib.sha256(url.encode()).hexdigest()


def image_urls(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every ``image_url`` URL in OpenAI chat ``messages``, in order."""
    urls: list[str] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, Mapping) else image
                if isinstance(url, str):
                    urls.append(url)
    return urls


def affinity_key(urls: Iterable[str]) -> str | None:
    """The routing key of a set of images: the smallest content digest, prefixed;
    ``None`` for no images."""
    digests = [image_digest(url) for url in urls]
    return KEY_PREFIX + min(digests)[:32] if digests else None


def affinity_headers(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """HTTP headers that route a chat request by its images: ``{X-SMG-Routing-Key:
    key}``, or ``{}`` when the request shows no image."""
    key = affinity_key(image_urls(messages))
    return {ROUTING_KEY_HEADER: key} if key else {}

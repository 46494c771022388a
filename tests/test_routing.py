"""Image-affinity routing keys (``sgl_mmkv/routing.py``): pure functions, no server."""

from __future__ import annotations

import base64

from sgl_mmkv.routing import (
    KEY_PREFIX,
    ROUTING_KEY_HEADER,
    affinity_headers,
    affinity_key,
    image_digest,
    image_urls,
)
from sgl_mmkv.testing.images import data_url, make_image, png_bytes, user_message


def _messages(system: str, seeds: list[int]) -> list[dict]:
    images = [make_image(seed) for seed in seeds]
    return [{"role": "system", "content": system}, user_message("Read.", images)]


def test_key_ignores_prefix_and_image_order():
    a = affinity_headers(_messages("first prompt", [1, 2, 3]))
    b = affinity_headers(_messages("another prompt", [3, 1, 2]))
    assert list(a) == [ROUTING_KEY_HEADER] and a == b
    assert a[ROUTING_KEY_HEADER].startswith(KEY_PREFIX)
    assert len(a[ROUTING_KEY_HEADER]) == len(KEY_PREFIX) + 32


def test_key_is_the_smallest_image_digest():
    urls = image_urls(_messages("p", [4, 5, 6]))
    assert len(urls) == 3
    assert affinity_key(urls) == KEY_PREFIX + min(image_digest(u) for u in urls)[:32]
    assert affinity_key(urls[:1]) != affinity_key(urls[1:2])  # other images, other key


def test_data_url_is_hashed_by_its_bytes_and_other_urls_by_their_text():
    image = make_image(7)
    raw = png_bytes(image)
    other_mime = "data:image/x-png;base64," + base64.b64encode(raw).decode()
    assert image_digest(data_url(image)) == image_digest(other_mime)
    assert image_digest("https://example.com/p1.png") != image_digest("https://example.com/p2.png")


def test_request_without_images_gets_no_key():
    assert affinity_headers([{"role": "user", "content": "Only text."}]) == {}
    assert affinity_key([]) is None
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert image_urls(text_parts) == []

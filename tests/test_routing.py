"""Image-affinity routing keys (``sgl_mmkv/routing.py``): pure functions, no server."""

from __future__ import annotations

import base64
import hashlib

import pytest

from sgl_mmkv.routing import (
    CHAT_PATH,
    GENERATE_PATH,
    KEY_PREFIX,
    ROUTING_KEY_HEADER,
    affinity_headers,
    affinity_key,
    generate_image_urls,
    image_digest,
    image_urls,
    request_key,
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


def test_a_raw_base64_image_is_hashed_by_its_bytes_and_a_path_by_its_text():
    raw = png_bytes(make_image(8))
    assert image_digest(base64.b64encode(raw).decode()) == image_digest(data_url(make_image(8)))
    assert image_digest("/tmp/page.png") == hashlib.sha256(b"/tmp/page.png").hexdigest()
    assert image_digest("file:///tmp/p") == hashlib.sha256(b"file:///tmp/p").hexdigest()


def test_generate_images_in_every_shape_sglang_takes():
    a, b = data_url(make_image(9)), data_url(make_image(10))
    assert generate_image_urls(a) == [a]
    assert generate_image_urls([a, {"url": b}]) == [a, b]
    assert generate_image_urls([[a], [b], None]) == [a, b]  # a batch
    assert generate_image_urls([[[a]]]) == []  # deeper than SGLang's format: no key
    assert generate_image_urls({"format": "processor_output"}) == []


def test_request_key_matches_the_clients_key_on_both_apis():
    messages = _messages("p", [11, 12])
    key = affinity_headers(messages)[ROUTING_KEY_HEADER]
    assert request_key(CHAT_PATH, {"messages": messages}) == key
    images = [data_url(make_image(12)), base64.b64encode(png_bytes(make_image(11))).decode()]
    assert request_key(GENERATE_PATH, {"text": "t", "image_data": images}) == key
    assert request_key("/v1/completions", {"messages": messages}) is None


@pytest.mark.parametrize(
    "payload",
    [
        [],
        "text",
        {"messages": "hi"},
        {"messages": [1, None, "x", {"content": [7, {"type": "image_url"}]}]},
        {"messages": {"role": "user"}},
        {"image_data": 3},
    ],
)
def test_a_body_of_another_shape_gets_no_key(payload):
    assert request_key(CHAT_PATH, payload) is None
    assert request_key(GENERATE_PATH, payload) is None

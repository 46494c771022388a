"""Image segments respect tenants, on real ``--mm-reuse conduit`` servers.

Every "miss" is paired with a "hit" that proves the path works: a request under the
same namespace and a new prefix reuses the image, one under another ``cache_salt``,
``extra_key`` or none does not. Caller-chosen ``mm_hashes`` never pick a segment.
Reuse facts reach callers only with ``--mm-report-reuse``, and without it not in
``/metrics`` either (tests/test_metrics_server.py pairs a hit with a miss there).
"""

from __future__ import annotations

import re

import pytest
import requests
from transformers import AutoProcessor

from sgl_mmkv.testing.images import data_url, make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

TOKENS_PER_IMAGE = 16
# Every match is reused (the tiny images would be declined by the cost gate).
SHARED = [*CPU_SERVER_ARGS, "--mm-reuse", "conduit", "--mm-reuse-gate", "always"]


@pytest.fixture(scope="module")
def reporting(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "reporting.log"
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, [*SHARED, REPORT_REUSE], log) as proc:
        yield proc


@pytest.fixture(scope="module")
def quiet(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "quiet.log"
    args = [*SHARED, "--enable-metrics"]
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log) as proc:
        yield proc


def _chat(server, system: str, image, **extra) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "system", "content": system}, user_message("Describe.", [image])],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _reused(server, system: str, image, **extra) -> int:
    body = _chat(server, system, image, return_meta_info=True, **extra)
    return body["choices"][0]["meta_info"]["sgl_mmkv"][0]["reused_segments"]


@pytest.mark.parametrize("field", ["cache_salt", "extra_key"])
def test_a_namespace_reuses_its_own_images_and_no_other(reporting, field):
    image = make_image(900 if field == "cache_salt" else 901)
    assert _reused(reporting, "Tenant A reads.", image, **{field: "tenant-A"}) == 0
    # same namespace, new prefix: hit
    assert _reused(reporting, "Tenant A again, other words.", image, **{field: "tenant-A"}) == 1
    # other namespace, or none: miss, however often it asks
    assert _reused(reporting, "Tenant B reads.", image, **{field: "tenant-B"}) == 0
    assert _reused(reporting, "Tenant B once more.", image, **{field: "tenant-B"}) == 1
    assert _reused(reporting, "No tenant at all.", image) == 0
    assert _reused(reporting, "No tenant, second prompt.", image) == 1


def test_salt_and_extra_key_are_separate_namespaces(reporting):
    image = make_image(902)
    assert _reused(reporting, "One.", image, cache_salt="x") == 0
    assert _reused(reporting, "Two.", image, extra_key="x") == 0
    assert _reused(reporting, "Three.", image, cache_salt="x", extra_key="x") == 0
    assert _reused(reporting, "Four.", image, cache_salt="x", extra_key="x") == 1


def _generate(server, processor, system: str, image, mm_hashes=None) -> dict:
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
    ]
    body = {
        "text": processor.apply_chat_template(messages, add_generation_prompt=True),
        "image_data": [data_url(image)],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    if mm_hashes is not None:
        body["mm_hashes"] = mm_hashes
    r = requests.post(server.base_url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_caller_mm_hashes_never_choose_the_segment(reporting, tiny_vlm):
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    attacker, victim, spoofed = make_image(903), make_image(904), "0123456789abcdef"
    first = _generate(reporting, processor, "Attacker.", attacker, mm_hashes=[spoofed])
    assert first["sgl_mmkv"][0]["reused_segments"] == 0
    # the victim's image named by the same hash is not served the attacker's KV ...
    probe = _generate(reporting, processor, "Victim.", victim, mm_hashes=[spoofed])
    assert probe["sgl_mmkv"][0]["reused_segments"] == 0
    # ... while the attacker's image, stored under its own content, is reused
    again = _generate(reporting, processor, "Attacker, new prefix.", attacker)
    assert again["sgl_mmkv"][0]["reused_segments"] == 1
    assert "ignoring caller mm_hashes" in reporting.log_text()


def test_reuse_facts_are_reported_when_asked(reporting, tiny_vlm):
    image = make_image(905)
    _chat(reporting, "Reads first.", image)
    body = _chat(reporting, "Reads second.", image, return_meta_info=True)
    info = body["choices"][0]["meta_info"]["sgl_mmkv"][0]
    assert info["reused_segments"] == 1 and info["reused_tokens"] == TOKENS_PER_IMAGE
    stats = mmkv_stats(reporting.base_url)
    assert stats["store"]["hits"] >= 1 and stats["refresh"]["reused_tokens"] >= TOKENS_PER_IMAGE


def _metric(server, name: str) -> float:
    text = requests.get(server.base_url + "/metrics", timeout=60).text
    values = [
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    ]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_without_the_flag_no_response_carries_reuse_facts(quiet, tiny_vlm):
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    image = make_image(906)
    items_before = _metric(quiet, "sglang:mmkv_segments_image_items")  # the warm-up's
    _chat(quiet, "Reads first.", image)
    with_meta = _chat(quiet, "Reads second.", image, return_meta_info=True)
    plain = _chat(quiet, "Reads third.", image)
    native = _generate(quiet, processor, "Reads fourth.", image)
    assert "sgl_mmkv" not in with_meta["choices"][0]["meta_info"]
    assert "sgl_mmkv" not in str(plain) and "sgl_mmkv" not in native
    info = requests.get(quiet.base_url + "/get_server_info", timeout=60).json()
    assert all("sgl_mmkv" not in state for state in info["internal_states"])
    # /metrics counts the four images (the same sequence reuses on `reporting`) but
    # publishes no hit counter
    assert _metric(quiet, "sglang:mmkv_segments_image_items") - items_before == 4
    text = requests.get(quiet.base_url + "/metrics", timeout=60).text
    assert "sglang:mmkv_store_hits" not in text and "mmkv_refresh_reused_tokens" not in text
    assert "sgl_mmkv: rid=" not in quiet.log_text()

"""What `/metrics` tells its reader about reuse, on real ``--enable-metrics`` servers.

SGLang serves `/metrics` without authentication, even with ``--api-key``. One paired
sequence runs on two servers, one without ``--mm-report-reuse`` and one with it: an
image sent under the same prompt where its namespace holds it (a hit) and where it
does not (a miss), the radix state of the two namespaces alike. Without the flag
every ``sglang:mmkv_*`` gauge moves identically for the two; with it, the hit
counters move for the hit only. SGLang's own pool gauges are measured too, since
docs/security.md states what they reveal.
"""

from __future__ import annotations

import re

import pytest
import requests

from sgl_mmkv.metrics import COARSE_COUNTERS, PREFIX
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess

TOKENS_PER_IMAGE = 16
API_KEY = "metrics-test-key"
SHARED = [
    *CPU_SERVER_ARGS,
    *("--mm-reuse", "conduit", "--mm-reuse-gate", "always"),
    *("--enable-metrics", "--api-key", API_KEY),
]
# the coarse gauges of these servers' groups (no row compaction with --mm-evict lru)
COARSE_GAUGES = {
    f"{PREFIX}{group}_{name}"
    for group in ("segments", "refresh")
    for name in COARSE_COUNTERS[group]
}


def _server(tiny_vlm, tmp_path_factory, name: str, extra: list[str]):
    log = tmp_path_factory.mktemp("logs") / f"{name}.log"
    return ServerProcess("sgl_mmkv.launch_server", tiny_vlm, [*SHARED, *extra], log)


def _metrics(server) -> dict[str, float]:
    """Every ``sglang:*`` sample of ``/metrics``, read without the API key, summed
    over labels."""
    response = requests.get(server.base_url + "/metrics", timeout=60)
    assert response.status_code == 200
    found: dict[str, float] = {}
    for name, value in re.findall(r"^(sglang:\w+)(?:\{[^}]*\})? (\S+)$", response.text, re.M):
        found[name] = found.get(name, 0.0) + float(value)
    return found


def _chat(server, system: str, image, salt: str) -> None:
    images = [] if image is None else [image]
    body = {
        "model": "default",
        "messages": [{"role": "system", "content": system}, user_message("Describe.", images)],
        "max_tokens": 2,
        "temperature": 0,
        "cache_salt": salt,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def _settled_metrics(server, probe: int) -> dict[str, float]:
    """``/metrics`` after a text-only probe in a namespace of its own: SGLang samples
    its pool gauges when it reports a prefill, so the probe's report shows the pool
    as the request before it left it (every probe has the same shape)."""
    _chat(server, "A probe.", None, f"probe-{probe}")
    return _metrics(server)


def _paired_sequence(server) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(gauges after the sequence, deltas of the hit, deltas of the miss)."""
    x, y = make_image(730), make_image(731)
    _chat(server, "First look.", x, "tenant-a")  # stores x in a
    _chat(server, "First look.", y, "tenant-b")  # the same shape in b, another image
    before = _settled_metrics(server, 0)
    _chat(server, "Second look, other words.", x, "tenant-a")  # hit: a holds x
    middle = _settled_metrics(server, 1)
    _chat(server, "Second look, other words.", x, "tenant-b")  # miss: b does not
    after = _settled_metrics(server, 2)
    return after, _delta(before, middle), _delta(middle, after)


@pytest.fixture(scope="module")
def quiet(tiny_vlm, tmp_path_factory):
    with _server(tiny_vlm, tmp_path_factory, "quiet", []) as server:
        yield _paired_sequence(server)


@pytest.fixture(scope="module")
def reporting(tiny_vlm, tmp_path_factory):
    with _server(tiny_vlm, tmp_path_factory, "reporting", [REPORT_REUSE]) as server:
        yield _paired_sequence(server)


def _mmkv(deltas: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in deltas.items() if k.startswith(PREFIX)}


def test_without_the_flag_a_hit_and_a_miss_move_every_mmkv_gauge_alike(quiet):
    gauges, hit, miss = quiet
    assert {k for k in gauges if k.startswith(PREFIX)} == COARSE_GAUGES
    assert _mmkv(hit) == _mmkv(miss)
    assert hit[f"{PREFIX}segments_requests"] == 1  # requests with images: not the probe
    assert hit[f"{PREFIX}segments_image_tokens"] == TOKENS_PER_IMAGE
    assert hit[f"{PREFIX}refresh_fallbacks"] == 0


def test_with_the_flag_the_hit_counters_move_for_the_hit_only(reporting):
    gauges, hit, miss = reporting
    assert COARSE_GAUGES < {k for k in gauges if k.startswith(PREFIX)}
    assert (hit[f"{PREFIX}store_hits"], miss[f"{PREFIX}store_hits"]) == (1, 0)
    assert (hit[f"{PREFIX}store_fills"], miss[f"{PREFIX}store_fills"]) == (0, 1)
    reused = (hit[f"{PREFIX}refresh_reused_tokens"], miss[f"{PREFIX}refresh_reused_tokens"])
    assert reused == (TOKENS_PER_IMAGE, 0)
    # the coarse ones still move alike
    assert all(hit[name] == miss[name] for name in COARSE_GAUGES)


@pytest.mark.parametrize("side", ["quiet", "reporting"])
def test_sglang_pool_gauges_show_the_miss_fill_and_radix_gauges_do_not(side, request):
    _, hit, miss = request.getfixturevalue(side)
    # the two namespaces' radix states are alike: SGLang's prefix-cache gauges agree
    assert hit["sglang:cached_tokens_total"] == miss["sglang:cached_tokens_total"]
    # the store's slots are evictable in SGLang's accounting: the miss keeps a copy
    extra = miss["sglang:kv_evictable_tokens"] - hit["sglang:kv_evictable_tokens"]
    taken = hit["sglang:kv_available_tokens"] - miss["sglang:kv_available_tokens"]
    assert extra == taken == TOKENS_PER_IMAGE

"""Two ``--mm-reuse conduit`` instances behind SGLang's router (``sglang-router``).

With the ``manual`` policy and the image-affinity key of ``sgl_mmkv/routing.py`` in
``X-SMG-Routing-Key``, a second request for the same images under a new prefix (and
a new image order) lands on the instance that read them and reuses every image
token. With ``round_robin`` and no key, the second request goes to the other
instance, which has never seen the images, and reuses none. Counted on each
instance through ``/get_server_info`` (``--mm-report-reuse``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_mmkv.routing import affinity_headers
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.router import RouterProcess, router_available
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

pytestmark = pytest.mark.skipif(
    not router_available(),
    reason="sglang-router is not installed (requirements-test.txt): SGLang's router "
    "cannot be started, so routing through it is not tested",
)

TOKENS_PER_IMAGE = 16
ARGS = [
    *CPU_SERVER_ARGS,
    "--sleep-on-idle",
    "--mm-reuse", "conduit",
    "--mm-reuse-gate", "always",
    REPORT_REUSE,
]  # fmt: skip


@pytest.fixture(scope="module")
def workers(tiny_vlm, tmp_path_factory):
    """Two instances, started side by side, ended by PID."""
    logs = tmp_path_factory.mktemp("routing_logs")
    servers = [
        ServerProcess("sgl_mmkv.launch_server", tiny_vlm, ARGS, logs / f"{name}.log")
        for name in ("a", "b")
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        yield servers, logs
    finally:
        for server in servers:
            server.stop()


def _counts(servers) -> list[dict[str, int]]:
    out = []
    for server in servers:
        stats = mmkv_stats(server.base_url)
        out.append(
            {
                "requests": stats["segments"]["requests"],
                "image_tokens": stats["segments"]["image_tokens"],
                "reused": stats["refresh"]["reused_tokens"],
            }
        )
    return out


def _ask(router: RouterProcess, servers, system: str, seeds: list[int], affinity: bool) -> dict:
    """One chat request through the router; which instance served it and what it reused."""
    messages = [
        {"role": "system", "content": system},
        user_message("Describe the pages.", [make_image(s) for s in seeds]),
    ]
    headers = affinity_headers(messages) if affinity else {}
    before = _counts(servers)
    body = {"model": "default", "messages": messages, "max_tokens": 2, "temperature": 0}
    r = requests.post(
        router.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=300
    )
    assert r.status_code == 200, r.text
    after = _counts(servers)
    served = [i for i in range(len(servers)) if after[i]["requests"] > before[i]["requests"]]
    assert len(served) == 1, (before, after)
    i = served[0]
    return {
        "instance": i,
        "image_tokens": after[i]["image_tokens"] - before[i]["image_tokens"],
        "reused": after[i]["reused"] - before[i]["reused"],
    }


def test_affinity_sends_seen_images_back_to_their_instance(workers):
    servers, logs = workers
    urls = [s.base_url for s in servers]
    extra = ["--assignment-mode", "min_load"]
    with RouterProcess(urls, "manual", logs / "router-manual.log", extra) as router:
        docs = {"A": [101, 102], "B": [103, 104], "C": [105, 106]}
        read = {d: _ask(router, servers, f"Read {d}.", p, True) for d, p in docs.items()}
        for got in read.values():
            assert got == {**got, "image_tokens": 2 * TOKENS_PER_IMAGE, "reused": 0}
        for d, pages in docs.items():
            got = _ask(router, servers, f"A new question on {d}.", pages[::-1], True)
            assert got["instance"] == read[d]["instance"]
            assert got["image_tokens"] == 2 * TOKENS_PER_IMAGE
            assert got["reused"] == 2 * TOKENS_PER_IMAGE  # every image token reused


def test_round_robin_sends_the_second_request_elsewhere(workers):
    servers, logs = workers
    urls = [s.base_url for s in servers]
    with RouterProcess(urls, "round_robin", logs / "router-rr.log") as router:
        first = _ask(router, servers, "Read D.", [107, 108], False)
        second = _ask(router, servers, "A new question on D.", [108, 107], False)
        assert first["instance"] != second["instance"]
        assert first["reused"] == 0 and second["reused"] == 0  # the other one never saw them
        assert second["image_tokens"] == 2 * TOKENS_PER_IMAGE

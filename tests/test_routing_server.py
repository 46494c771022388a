"""Two ``--mm-reuse conduit`` instances behind SGLang's router (``sglang-router``).

With the ``manual`` policy and the image-affinity key of ``sgl_mmkv/routing.py`` in
``X-SMG-Routing-Key``, a second request for the same images under a new prefix (and
a new image order) lands on the instance that read them and reuses every image
token: with the key sent by the client, and with no client code at all through the
gateway (``python -m sgl_mmkv.gateway``), which sets the key from the body and
drops a client's own key unless ``--allow-client-routing-key``. With
``round_robin`` and no key, the second request goes to the other instance, which has
never seen the images, and reuses none. Counted on each instance through
``/get_server_info`` (``--mm-report-reuse``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import pytest
import requests
from transformers import AutoProcessor

from sgl_mmkv.routing import ROUTING_KEY_HEADER, affinity_headers
from sgl_mmkv.testing.images import make_image, png_bytes, user_message
from sgl_mmkv.testing.router import GatewayProcess, RouterProcess, router_available
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    mmkv_stats,
    start_together,
)

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
        start_together(servers)
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


def _served(servers, send: Callable[[], None]) -> dict:
    """Run ``send`` (one request); which instance served it and what it reused."""
    before = _counts(servers)
    send()
    after = _counts(servers)
    served = [i for i in range(len(servers)) if after[i]["requests"] > before[i]["requests"]]
    assert len(served) == 1, (before, after)
    i = served[0]
    return {
        "instance": i,
        "image_tokens": after[i]["image_tokens"] - before[i]["image_tokens"],
        "reused": after[i]["reused"] - before[i]["reused"],
    }


def _messages(system: str, seeds: list[int]) -> list[dict]:
    return [
        {"role": "system", "content": system},
        user_message("Describe the pages.", [make_image(s) for s in seeds]),
    ]


def _chat(url: str, messages: list[dict], headers: dict, stream: bool) -> None:
    body = {"model": "default", "messages": messages, "max_tokens": 2, "temperature": 0}
    if not stream:
        r = requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        return
    body["stream"] = True
    with requests.post(
        url + "/v1/chat/completions", json=body, headers=headers, stream=True, timeout=300
    ) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith(b"data:")]
    assert events[-1] == b"data: [DONE]" and len(events) >= 3, events
    assert all("choices" in json.loads(e[len(b"data:") :]) for e in events[:-1])


def _ask(
    url: str, servers, system: str, seeds: list[int], headers=None, stream: bool = False
) -> dict:
    """One chat request to ``url``: which instance served it and what it reused."""
    messages = _messages(system, seeds)
    return _served(servers, lambda: _chat(url, messages, headers or {}, stream))


def test_affinity_sends_seen_images_back_to_their_instance(workers):
    servers, logs = workers
    urls = [s.base_url for s in servers]
    extra = ["--assignment-mode", "min_load"]

    def ask(router, system, pages):
        key = affinity_headers(_messages(system, pages))  # computed by the client
        return _ask(router.base_url, servers, system, pages, key)

    with RouterProcess(urls, "manual", logs / "router-manual.log", extra) as router:
        docs = {"A": [101, 102], "B": [103, 104], "C": [105, 106]}
        read = {d: ask(router, f"Read {d}.", p) for d, p in docs.items()}
        for got in read.values():
            assert got == {**got, "image_tokens": 2 * TOKENS_PER_IMAGE, "reused": 0}
        for d, pages in docs.items():
            got = ask(router, f"A new question on {d}.", pages[::-1])
            assert got["instance"] == read[d]["instance"]
            assert got["image_tokens"] == 2 * TOKENS_PER_IMAGE
            assert got["reused"] == 2 * TOKENS_PER_IMAGE  # every image token reused


def _generate_prompt(model) -> str:
    processor = AutoProcessor.from_pretrained(model)
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Go on."}]
    messages = [{"role": "system", "content": "Native."}, {"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)


def _generate(url: str, prompt: str, seeds: list[int]) -> None:
    """A native ``/generate`` with raw base64 images, as sglang's RuntimeEndpoint sends."""
    images = [base64.b64encode(png_bytes(make_image(s))).decode() for s in seeds]
    body = {"text": prompt, "image_data": images, "sampling_params": {"max_new_tokens": 2}}
    r = requests.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text


def _gateway_stack(servers, logs, tag: str, *gateway_args: list[str]):
    """The router (``manual``, ``min_load``, as in docs/deployment.md) and gateways in
    front of it. A new key goes to a worker at random here (requests come one at a
    time, so every worker has none in flight)."""
    urls = [s.base_url for s in servers]
    extra = ["--assignment-mode", "min_load"]
    router = RouterProcess(urls, "manual", logs / f"router-{tag}.log", extra).start()
    gateways = []
    try:
        for i, args in enumerate(gateway_args):
            gateways.append(GatewayProcess(router.base_url, logs / f"gw-{tag}{i}.log", args))
            gateways[-1].start()
    except BaseException:
        for process in [*gateways, router]:
            process.stop()
        raise
    return router, gateways


def test_the_gateway_routes_by_image_without_client_code(workers, tiny_vlm):
    servers, logs = workers
    router, (gateway,) = _gateway_stack(servers, logs, "plain", [])
    try:
        url = gateway.base_url
        docs = {"A": [111, 112], "B": [113, 114], "C": [115, 116], "D": [117, 118]}
        read = {d: _ask(url, servers, f"Read {d}.", p) for d, p in docs.items()}
        for got in read.values():
            assert got == {**got, "image_tokens": 2 * TOKENS_PER_IMAGE, "reused": 0}
        assert router.manual_branches() == {"vacant": 4}  # four new keys, one per document
        for d, pages in docs.items():
            got = _ask(url, servers, f"A new question on {d}.", pages[::-1], stream=d == "A")
            assert got == {**read[d], "reused": 2 * TOKENS_PER_IMAGE}  # same instance
        prompt = _generate_prompt(tiny_vlm)
        got = _served(servers, lambda: _generate(url, prompt, docs["B"]))
        assert got == {**read["B"], "reused": 2 * TOKENS_PER_IMAGE}
        assert router.manual_branches() == {"vacant": 4, "occupied_hit": 5}  # the same keys
    finally:
        gateway.stop()
        router.stop()


def test_a_client_key_cannot_pin_unless_the_operator_allows_it(workers):
    servers, logs = workers
    router, (closed, open_) = _gateway_stack(
        servers, logs, "pin", [], ["--allow-client-routing-key"]
    )
    try:
        pages = [121, 122]
        read = _ask(closed.base_url, servers, "Read E.", pages)
        for i in range(12):  # a client key the router places on the other instance
            pin = {ROUTING_KEY_HEADER: f"client-pin-{i}"}
            pinned = _ask(router.base_url, servers, "Pin it.", [125], pin)["instance"]
            if pinned != read["instance"]:
                break
        assert pinned != read["instance"]
        got = _ask(closed.base_url, servers, "Again E.", pages[::-1], pin)
        assert got == {**read, "reused": 2 * TOKENS_PER_IMAGE}  # by content, not pinned
        got = _ask(open_.base_url, servers, "Allowed E.", pages[::-1], pin)
        assert got == {"instance": pinned, "image_tokens": 2 * TOKENS_PER_IMAGE, "reused": 0}
    finally:
        for process in (open_, closed, router):
            process.stop()


def test_round_robin_sends_the_second_request_elsewhere(workers):
    servers, logs = workers
    urls = [s.base_url for s in servers]
    with RouterProcess(urls, "round_robin", logs / "router-rr.log") as router:
        first = _ask(router.base_url, servers, "Read D.", [107, 108])
        second = _ask(router.base_url, servers, "A new question on D.", [108, 107])
        assert first["instance"] != second["instance"]
        assert first["reused"] == 0 and second["reused"] == 0  # the other one never saw them
        assert second["image_tokens"] == 2 * TOKENS_PER_IMAGE

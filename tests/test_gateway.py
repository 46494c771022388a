"""The image-affinity gateway (``sgl_mmkv/gateway``) against a tiny fake upstream.

The gateway runs in this process (its own event loop in a thread); the upstream is a
threaded HTTP server that records what reached it and answers JSON, a chunked event
stream held until the test releases it, or a chosen status. The two-instance test
behind the real router is tests/test_routing_server.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from sgl_mmkv.gateway.proxy import Gateway, GatewayConfig
from sgl_mmkv.routing import ROUTING_KEY_HEADER, affinity_headers
from sgl_mmkv.testing.images import make_image, png_bytes, user_message

LIMIT = 200_000
EVENTS = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]


class Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict] = []
        self.release = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def log_message(self, *args) -> None:
        pass

    def _record(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        seen = {
            "method": self.command,
            "path": self.path,
            "headers": list(self.headers.items()),
            "body": self.rfile.read(length),
        }
        self.server.seen.append(seen)
        return seen

    def do_GET(self) -> None:
        self._answer(self._record())

    def do_POST(self) -> None:
        self._answer(self._record())

    def _answer(self, seen: dict) -> None:
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, event in enumerate(EVENTS):
                if i == 1 and not self.server.release.wait(20):
                    return  # the test never saw the first event: the gateway held it
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        status = 418 if self.path == "/teapot" else 200
        body = json.dumps({"path": seen["path"], "n": len(seen["body"])}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Upstream", "yes")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream():
    server = Upstream()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


class _Running:
    """A Gateway served by its own event loop in a thread."""

    def __init__(self, config: GatewayConfig) -> None:
        self.gateway = Gateway(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = self.gateway.start("127.0.0.1", 0)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:  # connections kept alive
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def gateway(upstream):
    made = []

    def make(**options) -> _Running:
        port = upstream.server_address[1]
        made.append(_Running(GatewayConfig("127.0.0.1", port, max_body_bytes=LIMIT, **options)))
        return made[-1]

    yield make
    for running in made:
        running.close()


def _chat(seeds: list[int], text: str = "Describe.") -> dict:
    messages = [user_message(text, [make_image(s) for s in seeds])]
    return {"model": "default", "messages": messages, "max_tokens": 2}


def _routing(seen: dict) -> list[tuple[str, str]]:
    return [(n, v) for n, v in seen["headers"] if n.lower().startswith("x-smg-")]


def test_chat_with_images_gets_the_clients_key_and_is_forwarded_unchanged(upstream, gateway):
    g = gateway()
    body = json.dumps(_chat([1, 2])).encode()
    r = requests.post(g.url + "/v1/chat/completions?x=1", data=body, timeout=10)
    assert r.status_code == 200 and r.json() == {"path": "/v1/chat/completions?x=1", "n": len(body)}
    (seen,) = upstream.seen
    assert seen["body"] == body
    key = affinity_headers(_chat([2, 1])["messages"])[ROUTING_KEY_HEADER]
    assert _routing(seen) == [(ROUTING_KEY_HEADER, key)]
    assert g.gateway.counters.keyed == 1


def test_generate_keys_like_chat_for_every_image_form(upstream, gateway):
    g = gateway()
    pages = [png_bytes(make_image(s)) for s in (3, 4)]
    raw = base64.b64encode(pages[0]).decode()  # as sglang's RuntimeEndpoint sends
    url = "data:image/png;base64," + base64.b64encode(pages[1]).decode()
    forms = [[raw, url], [{"url": url}, raw], [[url], [raw]]]
    for image_data in forms:
        body = {"text": "<image> <image> Describe.", "image_data": image_data}
        assert requests.post(g.url + "/generate", json=body, timeout=10).status_code == 200
    key = affinity_headers(_chat([4, 3])["messages"])[ROUTING_KEY_HEADER]
    assert [_routing(s) for s in upstream.seen] == [[(ROUTING_KEY_HEADER, key)]] * 3


def test_no_key_without_images_or_on_other_paths(upstream, gateway):
    g = gateway()
    text_only = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    requests.post(g.url + "/v1/chat/completions", json=text_only, timeout=10)
    requests.post(g.url + "/v1/completions", json=_chat([5]), timeout=10)
    requests.get(g.url + "/v1/chat/completions", timeout=10)
    requests.post(g.url + "/generate", json={"text": "hi", "image_data": 7}, timeout=10)
    assert len(upstream.seen) == 4
    assert [_routing(s) for s in upstream.seen] == [[]] * 4


def test_a_client_key_is_replaced_and_a_target_worker_dropped(upstream, gateway):
    g = gateway()
    pin = {ROUTING_KEY_HEADER: "pin-me", "X-SMG-Target-Worker": "1"}
    requests.post(g.url + "/v1/chat/completions", json=_chat([6]), headers=pin, timeout=10)
    text_only = {"messages": [{"role": "user", "content": "hi"}]}
    requests.post(g.url + "/v1/chat/completions", json=text_only, headers=pin, timeout=10)
    requests.get(g.url + "/v1/models", headers=pin, timeout=10)
    key = affinity_headers(_chat([6])["messages"])[ROUTING_KEY_HEADER]
    assert [_routing(s) for s in upstream.seen] == [[(ROUTING_KEY_HEADER, key)], [], []]
    assert g.gateway.counters.client_keys_dropped == 3
    assert g.gateway.counters.client_keys_kept == 0


def test_an_allowed_client_key_is_kept(upstream, gateway):
    g = gateway(allow_client_routing_key=True)
    pin = {ROUTING_KEY_HEADER: "pin-me", "X-SMG-Target-Worker": "1"}
    requests.post(g.url + "/v1/chat/completions", json=_chat([7]), headers=pin, timeout=10)
    requests.post(g.url + "/v1/chat/completions", json=_chat([7]), timeout=10)
    key = affinity_headers(_chat([7])["messages"])[ROUTING_KEY_HEADER]
    assert [_routing(s) for s in upstream.seen] == [
        [(ROUTING_KEY_HEADER, "pin-me")],
        [(ROUTING_KEY_HEADER, key)],
    ]
    assert g.gateway.counters.client_keys_kept == 1


def test_bodies_over_the_limit_are_refused_with_413(upstream, gateway):
    g = gateway()
    at_limit = b'"' + b"a" * (LIMIT - 2) + b'"'
    r = requests.post(g.url + "/v1/chat/completions", data=at_limit, timeout=10)
    assert r.status_code == 200 and r.json()["n"] == LIMIT
    over = at_limit + b" "
    r = requests.post(g.url + "/v1/chat/completions", data=over, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    chunks = (over[i : i + 50_000] for i in range(0, len(over), 50_000))  # chunked upload
    r = requests.post(g.url + "/generate", data=chunks, timeout=10)
    assert r.status_code == 413
    assert len(upstream.seen) == 1
    assert g.gateway.counters.refused == 2


def test_a_chunked_request_body_is_forwarded_whole(upstream, gateway):
    g = gateway()
    body = json.dumps(_chat([8])).encode()
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))
    r = requests.post(g.url + "/v1/chat/completions", data=chunks, timeout=10)
    assert r.status_code == 200
    (seen,) = upstream.seen
    assert seen["body"] == body and len(_routing(seen)) == 1


def test_a_bad_json_body_is_forwarded_untouched_without_a_key(upstream, gateway):
    g = gateway()
    for body in (b'{"messages": [', b"\xff\xfe\x00", b"[" * 100_000):
        r = requests.post(g.url + "/v1/chat/completions", data=body, timeout=10)
        assert r.status_code == 200 and r.json()["n"] == len(body)
    assert [s["body"] for s in upstream.seen] == [
        b'{"messages": [',
        b"\xff\xfe\x00",
        b"[" * 100_000,
    ]
    assert [_routing(s) for s in upstream.seen] == [[]] * 3


def test_events_pass_through_as_they_are_produced(upstream, gateway):
    g = gateway()
    with requests.post(g.url + "/stream", json={}, stream=True, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        pieces = r.iter_content(chunk_size=None)
        first = next(pieces)  # the upstream holds the second event until release
        assert first == EVENTS[0]
        upstream.release.set()
        rest = b"".join(pieces)
    assert first + rest == b"".join(EVENTS)


def test_status_and_headers_pass_through_on_a_kept_alive_connection(upstream, gateway):
    g = gateway()
    with requests.Session() as session:
        for _ in range(2):
            r = session.get(g.url + "/teapot", timeout=10)
            assert r.status_code == 418 and r.headers["X-Upstream"] == "yes"
            assert r.json() == {"path": "/teapot", "n": 0}
    assert g.gateway.counters.requests == 2


def _raw(port: int, wire: bytes, then: bytes = b"") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(wire)
        if then:
            assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
            s.sendall(then)
        out = b""
        while piece := s.recv(65536):
            out += piece
    return out


def test_expect_continue_and_an_http10_client(upstream, gateway):
    g = gateway()
    body = b'{"a": 1}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    out = _raw(g.port, head, body)
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(
        b'{"path": "/v1/chat/completions", "n": 8}'
    )
    upstream.release.set()
    out = _raw(g.port, b"POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    head, _, data = out.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and data == b"".join(EVENTS)  # dechunked


def test_malformed_requests_are_answered_400(upstream, gateway):
    g = gateway()
    assert _raw(g.port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    both = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert _raw(g.port, both).startswith(b"HTTP/1.1 400 ")
    assert _raw(g.port, b"GET / HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.1 505 ")
    assert _raw(g.port, b"GET /a\rb HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(g.port, b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert upstream.seen == []


@pytest.mark.parametrize("listening", [False, True])
def test_an_unreachable_or_silent_router_is_502(listening):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        if listening:
            s.listen()
            closer = threading.Thread(target=lambda: s.accept()[0].close(), daemon=True)
            closer.start()  # accepts, then closes without an answer
        running = _Running(GatewayConfig("127.0.0.1", port))
        try:
            r = requests.get(running.url + "/v1/models", timeout=10)
        finally:
            running.close()
    assert r.status_code == 502 and r.json()["error"]["code"] == 502
    assert running.gateway.counters.upstream_errors == 1


@pytest.mark.parametrize(
    "args",
    [["--router-url", "https://127.0.0.1:30000"], ["--router-url", "http://h:1/v1"]],
)
def test_the_command_line_refuses_a_bad_router_url(args):
    done = subprocess.run(
        [sys.executable, "-m", "sgl_mmkv.gateway", *args], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--router-url must be http://host[:port]" in done.stderr

"""The image-affinity gateway (``sgl_mmkv/gateway``) against a tiny fake upstream.

The gateway runs in this process (its own event loop in a thread); the upstream is a
threaded HTTP server that records what reached it and answers JSON, a chunked event
stream held until the test releases it, or a chosen status. A stand-in router on its
own event loop streams without end or never answers, and records when the gateway
closes its connection. Malformed requests go over raw sockets; every one must be
answered 4xx (or the connection closed) without reaching the upstream and without an
ERROR in the log. The two-instance test behind the real router is
tests/test_routing_server.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from sgl_mmkv.gateway.proxy import Gateway, GatewayConfig
from sgl_mmkv.routing import ROUTING_KEY_HEADER, affinity_headers, affinity_key
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
        asyncio.run_coroutine_threadsafe(self.gateway.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def gateway(upstream):
    made = []

    def make(port: int | None = None, **options) -> _Running:
        options.setdefault("max_body_bytes", LIMIT)
        config = GatewayConfig("127.0.0.1", port or upstream.server_address[1], **options)
        made.append(_Running(config))
        return made[-1]

    yield make
    for running in made:
        running.close()


@pytest.fixture
def quiet_log(caplog):
    """The log records of the test; at the end, none may be an ERROR or carry a
    traceback (the gateway answers bad input, it does not crash on it)."""
    caplog.set_level(logging.INFO)
    yield caplog
    records = [r for when in ("setup", "call", "teardown") for r in caplog.get_records(when)]
    bad = [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], [f"{r.name}: {r.getMessage()}" for r in bad]


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


def _post(framing: bytes, body: bytes, path: bytes = b"/generate") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%s\r\n%s" % (path, framing, body)


def _chunked(body: bytes, size: int) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


TE = b"Transfer-Encoding: chunked\r\n"
BODY = b'{"text": "hi"}'
MALFORMED = {
    # framing the old hand parser got wrong: the request was dropped with a traceback
    "content-length superscript two": _post(b"Content-Length: \xb2\r\n", b"ab"),  # latin-1
    "content-length superscript two, UTF-8": _post(b"Content-Length: \xc2\xb2\r\n", b"ab"),
    "content-length of 4,301 digits": _post(b"Content-Length: %s\r\n" % (b"9" * 4301), b""),
    # ... or read leniently and forwarded
    "vertical tab before chunked": _post(b"Transfer-Encoding: \x0bchunked\r\n", _chunked(BODY, 4)),
    "vertical tab after a length": _post(b"Content-Length: 5\x0b\r\n", b"12345"),
    "bare LF line ends": b"POST /generate HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
    "bare LF after the request line": _post(b"Content-Length: 2\r\n", b"{}").replace(
        b"HTTP/1.1\r\n", b"HTTP/1.1\n"
    ),
    # framing
    "length and chunked": _post(b"Content-Length: 3\r\n" + TE, _chunked(BODY, 4)),
    "two lengths": _post(b"Content-Length: 2\r\nContent-Length: 3\r\n", b"{}x"),
    "negative length": _post(b"Content-Length: -2\r\n", b"{}"),
    "signed length": _post(b"Content-Length: +2\r\n", b"{}"),
    "hex length": _post(b"Content-Length: 0x2\r\n", b"{}"),
    "chunked not last": _post(b"Transfer-Encoding: chunked, gzip\r\n", _chunked(BODY, 4)),
    "unknown coding": _post(b"Transfer-Encoding: gzip\r\n", BODY),
    "chunked twice": _post(TE + TE, _chunked(BODY, 4)),
    "bad chunk size": _post(TE, b"zz\r\n{}\r\n0\r\n\r\n"),
    "huge chunk size": _post(TE, b"%s\r\n{}\r\n0\r\n\r\n" % (b"f" * 40)),
    "chunk without its CRLF": _post(TE, b"2\r\n{}XX0\r\n\r\n"),
    "chunk size with a space": _post(TE, b"2 3\r\n{}\r\n0\r\n\r\n"),
    # request line
    "garbage": b"GARBAGE\r\n\r\n",
    "bad method": b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n",
    "control in the target": b"GET /a\x01b HTTP/1.1\r\nHost: x\r\n\r\n",
    "CR in the target": b"GET /a\rb HTTP/1.1\r\nHost: x\r\n\r\n",
    "space in the target": b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n",
    "no version": b"GET /\r\nHost: x\r\n\r\n",
    "bad version": b"GET / HTTP/1.x\r\nHost: x\r\n\r\n",
    "HTTP/2.0": b"GET / HTTP/2.0\r\nHost: x\r\n\r\n",
    "HTTP/0.9": b"GET / HTTP/0.9\r\nHost: x\r\n\r\n",
    "request line too long": b"GET /%s HTTP/1.1\r\nHost: x\r\n\r\n" % (b"a" * 70_000),
    # headers
    "no colon": b"GET / HTTP/1.1\r\nHost x\r\n\r\n",
    "space before the colon": b"GET / HTTP/1.1\r\nHost : x\r\n\r\n",
    "empty name": b"GET / HTTP/1.1\r\n: x\r\n\r\n",
    "NUL in a value": b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n",
    "CR in a value": b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",
    "folded line": b"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
    "line too long": b"GET / HTTP/1.1\r\nX: %s\r\n\r\n" % (b"a" * 70_000),
    "too many headers": b"GET / HTTP/1.1\r\n%s\r\n" % (b"X: a\r\n" * 200),
    "two hosts": b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
}


def _answer_or_close(out: bytes) -> None:
    """A gateway refusal: a 4xx (or 505) status line, or a closed connection with
    nothing."""
    if out:
        status = out.split(b" ", 2)[1]  # 505 for HTTP/0.9 and 2.0 echoes their version
        assert out.startswith(b"HTTP/"), out[:200]
        assert status.startswith(b"4") or status == b"505", out[:200]


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_requests_are_refused_without_a_traceback(name, upstream, gateway, quiet_log):
    g = gateway()
    _answer_or_close(_raw(g.port, MALFORMED[name]))
    assert upstream.seen == []  # never forwarded


def test_mutated_requests_are_answered_or_refused_never_crash(upstream, gateway, quiet_log):
    """Valid requests with one byte changed to a troublesome one: each is forwarded (the
    upstream answers) or refused 4xx, and nothing reaches the log as an ERROR."""
    g = gateway(idle_timeout_s=0.5, read_timeout_s=0.5)  # a length made longer
    valid = _post(b"Content-Length: %d\r\nConnection: close\r\n" % len(BODY), BODY)
    chunked = _post(TE + b"Connection: close\r\n", _chunked(BODY, 5))
    rng = random.Random(0)
    troublesome = b"\x00\x0b\x0c\r\n \t:;,\x7f\x80\xb2\xff0-+"
    for _ in range(120):
        wire = bytearray(rng.choice([valid, chunked]))
        i = rng.randrange(len(wire))
        wire[i : i + rng.choice([0, 1])] = bytes([rng.choice(troublesome)])
        out = _raw(g.port, bytes(wire))
        if b"X-Upstream: yes" not in out.split(b"\r\n\r\n")[0]:
            _answer_or_close(out)


def test_a_lone_surrogate_in_an_image_url_still_gets_a_key(upstream, gateway, quiet_log):
    """``"\\ud800"`` is valid JSON but no UTF-8: the old key computation raised."""
    g = gateway()
    body = b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
    body += b'"image_url": {"url": "http://x/\\ud800"}}]}]}'
    r = requests.post(g.url + "/v1/chat/completions", data=body, timeout=10)
    assert r.status_code == 200 and r.json()["n"] == len(body)
    (seen,) = upstream.seen
    assert _routing(seen) == [(ROUTING_KEY_HEADER, affinity_key(["http://x/\ud800"]))]


def test_a_body_of_tiny_chunks_is_read_in_bounded_memory(upstream, gateway, quiet_log):
    """300,000 chunks of two bytes (a 0.6 MB body): the old parser peaked at 37.7 MB."""
    g = gateway(max_body_bytes=2**20)
    body = b'"' + b"ab" * 299_999 + b'"'
    wire = _post(TE + b"Connection: close\r\n", _chunked(body, 2))
    tracemalloc.start()
    try:
        out = _raw(g.port, wire)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.startswith(b"HTTP/1.1 200 ")
    assert upstream.seen[0]["body"] == body
    assert peak < 5 * 2**20, peak  # the body and its copy at the upstream: 1.2 MB


def _close_each(listener: socket.socket) -> None:
    """Accept connections and close each without an answer (aiohttp's client tries
    an idempotent request a second time), until the listener is closed."""
    with contextlib.suppress(OSError):
        while True:
            listener.accept()[0].close()


@pytest.mark.parametrize("listening", [False, True])
def test_an_unreachable_or_silent_router_is_502_without_its_address(listening, quiet_log):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        if listening:
            s.listen()
            threading.Thread(target=_close_each, args=(s,), daemon=True).start()
        running = _Running(GatewayConfig("127.0.0.1", port))
        try:
            r = requests.get(running.url + "/v1/models", timeout=10)
        finally:
            running.close()
    assert r.status_code == 502 and r.json()["error"]["code"] == 502
    assert "127.0.0.1" not in r.text and str(port) not in r.text  # was repr(e)
    assert running.gateway.counters.upstream_errors == 1


class StandIn:
    """A stand-in router on its own event loop. Every request is answered with an event
    stream that never ends (``stream``), one event and then silence (``stall``), or
    never answered (``hold``); ``closed`` is set when the gateway closes the
    connection (a write or read fails)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requested = threading.Event()
        self.closed = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    await reader.readexactly(int(line.split(b":")[1]))
            self.requested.set()
            if self.mode == "hold":
                await reader.read()  # b"" once the gateway closes the connection
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            event = b"data: " + b"x" * 32_000 + b"\n\n"
            if self.mode == "stall":  # one event, then silence
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await reader.read()
                return
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.001)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed.set()
            writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def stand_in():
    made = []

    def make(mode: str) -> StandIn:
        made.append(StandIn(mode))
        return made[-1]

    yield make
    for router in made:
        router.close()


STREAM_REQUEST = _post(b"Content-Length: 2\r\n", b"{}", b"/v1/chat/completions")


def test_a_client_gone_before_the_answer_cancels_the_router_request(gateway, stand_in, quiet_log):
    """The router holds a non-streamed answer; the client leaves. The old gateway
    noticed only when the head came (or after ``upstream_timeout_s``, 1,800 s)."""
    router = stand_in("hold")
    g = gateway(router.port)
    with socket.create_connection(("127.0.0.1", g.port), timeout=10) as s:
        s.sendall(STREAM_REQUEST)
        assert router.requested.wait(10)
    gone = time.monotonic()
    assert router.closed.wait(10)
    assert time.monotonic() - gone < 3


def test_a_client_gone_mid_stream_closes_the_router_stream(gateway, stand_in, quiet_log):
    router = stand_in("stream")
    g = gateway(router.port)
    with socket.create_connection(("127.0.0.1", g.port), timeout=10) as s:
        s.sendall(STREAM_REQUEST)
        got = b""
        while len(got) < 100_000:
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 ") and b"data: xxx" in got
    gone = time.monotonic()
    assert router.closed.wait(10)
    assert time.monotonic() - gone < 3


def test_a_client_that_stops_reading_a_stream_is_dropped(gateway, stand_in, quiet_log):
    """The client reads the head, then nothing: within ``write_timeout_s`` of the
    stall the gateway drops it and closes the router's stream (the old gateway held
    both, and a task, for good)."""
    router = stand_in("stream")
    g = gateway(router.port, write_timeout_s=1.0)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", g.port))
        s.sendall(STREAM_REQUEST)
        assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        assert router.closed.wait(15)
        assert time.monotonic() - started < 8
    assert g.gateway.counters.clients_dropped == 1


def test_a_stream_the_router_stalls_is_cut_after_the_upstream_timeout(gateway, stand_in, quiet_log):
    """The client sees its connection end without the last chunk (not a clean end of a
    truncated answer), and the router's connection is closed."""
    router = stand_in("stall")
    g = gateway(router.port, upstream_timeout_s=0.5)
    started = time.monotonic()
    out = _raw(g.port, STREAM_REQUEST)
    assert out.startswith(b"HTTP/1.1 200 ") and b"data: xxx" in out
    assert not out.endswith(b"0\r\n\r\n") and time.monotonic() - started < 3
    assert router.closed.wait(5)
    assert g.gateway.counters.upstream_errors == 1


def test_connections_past_the_cap_are_answered_503(upstream, gateway, quiet_log):
    g = gateway(max_connections=2)
    held = [socket.create_connection(("127.0.0.1", g.port), timeout=10) for _ in range(2)]
    try:
        time.sleep(0.2)  # both accepted
        out = _raw(g.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 503 ") and b"too many connections" in out
        assert upstream.seen == [] and g.gateway.counters.busy == 1
    finally:
        held.pop().close()
    time.sleep(0.2)  # one slot free again
    assert requests.get(g.url + "/v1/models", timeout=10).status_code == 200
    held[0].close()


def _closed_within(port: int, trickle: bytes, seconds: float) -> bool:
    """Whether the gateway closes a connection that sends ``trickle`` a byte every
    0.1 s (nothing for an empty one) within ``seconds``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(0.1)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            try:
                if i < len(trickle):
                    s.sendall(trickle[i : i + 1])
                    i += 1
                if s.recv(4096) == b"":
                    return True
            except TimeoutError:
                continue
            except ConnectionError:
                return True
    return False


def test_idle_and_slow_head_connections_are_closed(gateway, quiet_log):
    g = gateway(idle_timeout_s=0.5)
    assert _closed_within(g.port, b"", 3)
    assert _closed_within(g.port, b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 100, 3)


def test_a_slow_body_is_answered_408(upstream, gateway, quiet_log):
    g = gateway(read_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", g.port), timeout=10) as s:
        s.sendall(_post(b"Content-Length: 100\r\n", b"{" * 10))
        started = time.monotonic()
        out = s.recv(4096)
    assert out.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 3
    assert upstream.seen == []


def test_a_client_gone_while_its_request_is_read_is_let_go(upstream, gateway, quiet_log):
    g = gateway()
    cut = [
        _post(b"Content-Length: 100\r\n", b"{" * 10),
        _post(TE, b"5\r\n{"),
        _post(b"Content-Length: 2\r\nExpect: 100-continue\r\n", b""),
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le",
    ]
    for wire in cut:
        with socket.create_connection(("127.0.0.1", g.port), timeout=10) as s:
            s.sendall(wire)
            time.sleep(0.05)
    time.sleep(0.2)
    assert requests.get(g.url + "/v1/models", timeout=10).status_code == 200
    assert len(upstream.seen) == 1


def test_the_config_refuses_bounds_out_of_range():
    GatewayConfig("127.0.0.1", 1)
    for bad in (
        {"router_port": 0},
        {"max_connections": 0},
        {"max_body_bytes": -1},
        {"write_timeout_s": 0},
        {"upstream_timeout_s": float("nan")},
        {"max_headers": 1.5},
    ):
        with pytest.raises(ValueError):
            GatewayConfig(**{"router_host": "127.0.0.1", "router_port": 1, **bad})


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

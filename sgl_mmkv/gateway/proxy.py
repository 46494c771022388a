"""The gateway: a reverse proxy in front of SGLang's router that routes by image.

``client -> gateway -> sglang-router (--policy manual) -> workers``. Every request is
forwarded to the router as it came, but for its routing headers:

- ``POST /v1/chat/completions`` and ``POST /generate`` whose JSON body shows images
  get ``X-SMG-Routing-Key`` from :func:`sgl_mmkv.routing.request_key` (the key a
  client would compute with ``affinity_headers``);
- a client's own ``X-SMG-Routing-Key`` is dropped, so no client pins traffic to one
  worker, unless ``allow_client_routing_key``: then it is kept and wins over the
  computed key;
- ``X-SMG-Target-Worker`` (a direct worker choice in other router versions and
  policies) is always dropped.

A body that is not JSON (or not an object) is forwarded untouched, without a key: the
router answers it exactly as it would without the gateway. Responses are relayed as
they arrive (status, headers, body; streamed events one by one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.parse
from dataclasses import dataclass
from http import HTTPStatus

from sgl_mmkv.counters import Counters
from sgl_mmkv.gateway.http1 import (
    HOP_BY_HOP,
    Framing,
    Head,
    HTTPError,
    encode_head,
    read_body,
    read_head,
    relay_body,
    request_framing,
    response_framing,
)
from sgl_mmkv.routing import CHAT_PATH, GENERATE_PATH, ROUTING_KEY_HEADER, request_key

log = logging.getLogger("sgl_mmkv.gateway")

TARGET_WORKER_HEADER = "X-SMG-Target-Worker"
KEYED_PATHS = (CHAT_PATH, GENERATE_PATH)
_ROUTING = {ROUTING_KEY_HEADER.lower(), TARGET_WORKER_HEADER.lower()}
_CLIENT_GONE = (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Where the router is and the gateway's bounds (bytes, seconds)."""

    router_host: str
    router_port: int
    max_body_bytes: int = 64 * 2**20
    allow_client_routing_key: bool = False
    max_head_bytes: int = 64 * 1024
    max_headers: int = 128
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    upstream_timeout_s: float = 1800.0
    linger_s: float = 5.0


@dataclass(slots=True)
class GatewayCounters(Counters):
    """Counts since start, read in-process (every HTTP path is the router's)."""

    requests: int = 0
    keyed: int = 0
    client_keys_dropped: int = 0
    client_keys_kept: int = 0
    refused: int = 0
    upstream_errors: int = 0


def parse_router_url(url: str) -> tuple[str, int]:
    """``http://host[:port]`` -> ``(host, port)``; ``ValueError`` for anything else."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--router-url must be http://host[:port], got {url!r}")
    if parts.query or parts.fragment or parts.username:
        raise ValueError(f"--router-url must be http://host[:port], got {url!r}")
    return parts.hostname, parts.port or 80


def body_key(method: str, path: str, head: Head, body: bytes) -> str | None:
    """The image-affinity key of a request, or ``None`` (not a keyed path, an encoded
    or malformed body, no image)."""
    if method != "POST" or path not in KEYED_PATHS:
        return None
    if any(coding != "identity" for coding in head.tokens("content-encoding")):
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return request_key(path, payload)


def routed_headers(
    headers: list[tuple[str, str]], key: str | None, allow_client_key: bool
) -> tuple[list[tuple[str, str]], str]:
    """The request headers with the gateway's routing rule applied, and what happened
    to a client key (``none``, ``dropped``, ``kept``)."""
    client = [v for n, v in headers if n.lower() == ROUTING_KEY_HEADER.lower() and v]
    kept = [(n, v) for n, v in headers if n.lower() not in _ROUTING]
    if client and allow_client_key:
        return [*kept, (ROUTING_KEY_HEADER, client[0])], "kept"
    out = [*kept, (ROUTING_KEY_HEADER, key)] if key else kept
    return out, "dropped" if client else "none"


def _connection_named(head: Head) -> set[str]:
    return HOP_BY_HOP | set(head.tokens("connection"))


def _request_line(start: str) -> tuple[str, str, str]:
    parts = start.split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/"):
        raise HTTPError(400, "malformed request line")
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in parts[1]):
        raise HTTPError(400, "control character in the request target")
    if parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise HTTPError(505, "HTTP/1.0 and HTTP/1.1 only")
    return parts[0], parts[1], parts[2]


def _status_line(start: str) -> tuple[int, str]:
    version, _, rest = start.partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise HTTPError(502, "malformed status line from the router")
    return int(code), reason


class Gateway:
    """Serves connections from clients; one fresh router connection per request."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.counters = GatewayCounters()

    async def start(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self.handle, host, port, limit=self.config.max_head_bytes)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: requests one after another while it stays open."""
        try:
            while await self._one(reader, writer):
                pass
        except (*_CLIENT_GONE, asyncio.TimeoutError):
            pass
        except Exception:
            log.exception("sgl_mmkv gateway: connection failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read, forward and answer one request; whether the connection stays open."""
        c = self.config
        try:
            head = await asyncio.wait_for(
                read_head(reader, c.max_head_bytes, c.max_headers), c.idle_timeout_s
            )
            if head is None:
                return False
            self.counters.requests += 1
            method, target, version = _request_line(head.start)
            framing, length = request_framing(head, c.max_body_bytes)
            if "100-continue" in head.tokens("expect"):
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            body = await asyncio.wait_for(
                read_body(reader, framing, length, c.max_body_bytes), c.read_timeout_s
            )
        except HTTPError as e:
            await self._answer(writer, e.status, e.reason, close=True)
            await self._linger(reader, writer)
            return False
        keep_alive = version == "HTTP/1.1" and "close" not in head.tokens("connection")
        path = target.split("?", 1)[0]
        key = None
        if method == "POST" and path in KEYED_PATHS:
            key = await asyncio.to_thread(body_key, method, path, head, body)
        dropped = _connection_named(head) | {"content-length", "expect"}
        headers, client_key = routed_headers(
            [(n, v) for n, v in head.headers if n.lower() not in dropped],
            key,
            c.allow_client_routing_key,
        )
        if framing is not Framing.NONE:
            headers.append(("Content-Length", str(len(body))))
        headers.append(("Connection", "close"))
        self.counters.keyed += int(key is not None and client_key != "kept")
        self.counters.client_keys_dropped += int(client_key == "dropped")
        self.counters.client_keys_kept += int(client_key == "kept")
        log.debug("%s %s key=%s client key %s", method, path, key, client_key)
        upstream = encode_head(f"{method} {target} HTTP/1.1", headers) + body
        return await self._forward(upstream, method, version, keep_alive, writer)

    async def _forward(
        self,
        upstream: bytes,
        method: str,
        version: str,
        keep_alive: bool,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Send one request to the router and relay its answer; whether the client's
        connection stays open."""
        c = self.config
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(c.router_host, c.router_port, limit=c.max_head_bytes),
                c.connect_timeout_s,
            )
        except (OSError, asyncio.TimeoutError) as e:
            self.counters.upstream_errors += 1
            await self._answer(writer, 502, f"router unreachable: {e!r}", close=not keep_alive)
            return keep_alive
        try:
            try:
                up_writer.write(upstream)
                await up_writer.drain()
                status, reason, head = await asyncio.wait_for(
                    self._response_head(up_reader), c.upstream_timeout_s
                )
            except asyncio.TimeoutError:
                self.counters.upstream_errors += 1
                await self._answer(writer, 504, "no answer from the router", close=True)
                return False
            except (HTTPError, *_CLIENT_GONE) as e:
                self.counters.upstream_errors += 1
                await self._answer(writer, 502, f"bad answer from the router: {e!r}", close=True)
                return False
            framing = response_framing(head, status, method)
            dechunk = framing is Framing.CHUNKED and version == "HTTP/1.0"
            close = not keep_alive or framing is Framing.CLOSE or dechunk
            dropped = _connection_named(head) - (set() if dechunk else {"transfer-encoding"})
            out = [(n, v) for n, v in head.headers if n.lower() not in dropped]
            if close:
                out.append(("Connection", "close"))
            writer.write(encode_head(f"HTTP/1.1 {status} {reason}", out))
            await writer.drain()
            length = int(head.get("content-length") or 0) if framing is Framing.LENGTH else 0
            await relay_body(up_reader, writer, framing, length, dechunk)
            return not close
        finally:
            up_writer.close()

    async def _response_head(self, reader: asyncio.StreamReader) -> tuple[int, str, Head]:
        """The router's final response head (interim 1xx heads are skipped)."""
        c = self.config
        while True:
            head = await read_head(reader, 4 * c.max_head_bytes, 4 * c.max_headers)
            if head is None:
                raise ConnectionError("the router closed the connection")
            status, reason = _status_line(head.start)
            if not 100 <= status < 200:
                return status, reason, head

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Half-close after a refusal and discard what the client still sends (for
        ``linger_s``), so it reads the answer instead of a reset connection."""
        if not writer.can_write_eof():
            return
        writer.write_eof()

        async def discard() -> None:
            while await reader.read(64 * 1024):
                pass

        with contextlib.suppress(*_CLIENT_GONE, asyncio.TimeoutError):
            await asyncio.wait_for(discard(), self.config.linger_s)

    async def _answer(
        self, writer: asyncio.StreamWriter, status: int, reason: str, close: bool
    ) -> None:
        """The gateway's own answer: a JSON error body."""
        self.counters.refused += int(status < 500)
        body = json.dumps({"error": {"message": reason, "type": "gateway", "code": status}})
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        if close:
            headers.append(("Connection", "close"))
        phrase = HTTPStatus(status).phrase
        writer.write(encode_head(f"HTTP/1.1 {status} {phrase}", headers) + body.encode())
        await writer.drain()

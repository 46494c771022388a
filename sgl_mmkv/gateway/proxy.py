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

HTTP is aiohttp's on both sides: ``aiohttp.web``'s low-level server (its llhttp
parser, strict framing) towards clients, one pooled ``aiohttp.ClientSession``
towards the router. Every wait is bounded (:class:`GatewayConfig`): the number of
client connections, an idle connection or a slow request head, the request body, the
router's connect and each read, and each piece written to a client (one that stops
reading is dropped). A client that goes away cancels its request, and the gateway
closes its router connection, so the router and the worker abort it too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from sgl_mmkv.counters import Counters
from sgl_mmkv.routing import CHAT_PATH, GENERATE_PATH, ROUTING_KEY_HEADER, request_key

log = logging.getLogger("sgl_mmkv.gateway")

TARGET_WORKER_HEADER = "X-SMG-Target-Worker"
KEYED_PATHS = (CHAT_PATH, GENERATE_PATH)
# Hop-by-hop: they describe one connection, never forwarded as they are (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Framing the gateway sets itself on each side.
_REQUEST_OWN = frozenset({"content-length", "expect"})
_RESPONSE_OWN = frozenset({"content-length"})
_ROUTING = frozenset({ROUTING_KEY_HEADER.lower(), TARGET_WORKER_HEADER.lower()})
# What aiohttp's client adds on its own unless told not to: a client's request goes
# to the router with the headers it came with.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: 78\r\nConnection: close\r\n\r\n"
    b'{"error": {"message": "too many connections", "type": "gateway", "code": 503}}'
)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Where the router is and the gateway's bounds (counts, bytes, seconds).

    ``max_connections``: client connections open at once (more are answered 503);
    ``idle_timeout_s``: a connection with no complete request head for this long is
    closed (a new one, and one kept alive between requests); ``read_timeout_s``: a
    request body must arrive within it (408); ``connect_timeout_s``: to connect to
    the router (502); ``upstream_timeout_s``: the router's response head, and each
    later piece of its body, must come within it (504, or the relay ends);
    ``write_timeout_s``: each piece relayed must be taken by the client within it,
    or the client is dropped; ``linger_s``: how long unread request bytes are
    discarded after a refusal so the client reads the answer."""

    router_host: str
    router_port: int
    max_body_bytes: int = 64 * 2**20
    allow_client_routing_key: bool = False
    max_connections: int = 1024
    max_head_bytes: int = 64 * 1024
    max_headers: int = 128
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    upstream_timeout_s: float = 1800.0
    write_timeout_s: float = 60.0
    linger_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.router_host:
            raise ValueError("router_host must not be empty")
        if not 0 < self.router_port < 2**16:
            raise ValueError(f"router_port must be in 1..65535, got {self.router_port}")
        bounds = {
            "max_body_bytes": 2**40,
            "max_connections": 2**20,
            "max_head_bytes": 2**24,
            "max_headers": 2**16,
        }
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in bounds and not (isinstance(value, int) and 0 < value <= bounds[f.name]):
                raise ValueError(f"{f.name} must be in 1..{bounds[f.name]}, got {value!r}")
            if f.name.endswith("_s") and not 0 < value <= 86400:
                raise ValueError(f"{f.name} must be in (0, 86400] seconds, got {value!r}")


@dataclass(slots=True)
class GatewayCounters(Counters):
    """Counts since start, read in-process (every HTTP path is the router's).

    ``refused``: requests answered 4xx by the gateway (malformed ones included);
    ``busy``: connections answered 503 past ``max_connections``; ``clients_dropped``:
    responses cut short because the client stopped reading or went away."""

    requests: int = 0
    keyed: int = 0
    client_keys_dropped: int = 0
    client_keys_kept: int = 0
    refused: int = 0
    upstream_errors: int = 0
    busy: int = 0
    clients_dropped: int = 0


def parse_router_url(url: str) -> tuple[str, int]:
    """``http://host[:port]`` -> ``(host, port)``; ``ValueError`` for anything else."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--router-url must be http://host[:port], got {url!r}")
    if parts.query or parts.fragment or parts.username:
        raise ValueError(f"--router-url must be http://host[:port], got {url!r}")
    return parts.hostname, parts.port or 80


def _tokens(headers: Mapping[str, str] | Any, name: str) -> list[str]:
    """The comma-separated tokens of every ``name`` header, lower-cased."""
    values = headers.getall(name, [])
    return [t.strip().lower() for v in values for t in v.split(",") if t.strip()]


def body_key(method: str, path: str, headers: Any, body: bytes) -> str | None:
    """The image-affinity key of a request, or ``None`` (not a keyed path, an encoded
    or malformed body, no image). ``headers``: a multidict (``getall``)."""
    if method != "POST" or path not in KEYED_PATHS:
        return None
    if any(coding != "identity" for coding in _tokens(headers, "content-encoding")):
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    try:
        return request_key(path, payload)
    except RecursionError:
        return None


def routed_headers(
    headers: Iterable[tuple[str, str]], key: str | None, allow_client_key: bool
) -> tuple[list[tuple[str, str]], str]:
    """The request headers with the gateway's routing rule applied, and what happened
    to a client key (``none``, ``dropped``, ``kept``)."""
    headers = list(headers)
    client = [v for n, v in headers if n.lower() == ROUTING_KEY_HEADER.lower() and v]
    kept = [(n, v) for n, v in headers if n.lower() not in _ROUTING]
    if client and allow_client_key:
        return [*kept, (ROUTING_KEY_HEADER, client[0])], "kept"
    out = [*kept, (ROUTING_KEY_HEADER, key)] if key else kept
    return out, "dropped" if client else "none"


def _end_to_end(headers: Any, own: frozenset[str]) -> list[tuple[str, str]]:
    """``headers`` without hop-by-hop ones, those named in ``Connection`` and ``own``."""
    dropped = HOP_BY_HOP | own | set(_tokens(headers, "connection"))
    return [(n, v) for n, v in headers.items() if n.lower() not in dropped]


def _error(status: int, message: str) -> web.Response:
    """The gateway's own answer: a JSON error body; the connection then closes."""
    body = {"error": {"message": message, "type": "gateway", "code": status}}
    response = web.json_response(body, status=status)
    response.force_close()
    return response


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger, but a malformed request (answered 400 by aiohttp's
    parser) is one INFO line and counted, not an ERROR with a traceback."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__(logging.getLogger("sgl_mmkv.gateway.http"), {})
        self._gateway = gateway

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self._gateway.counters.refused += 1
            self.info("refused a malformed request: %s", exc_info.message)
        else:
            self.error(msg, *args, exc_info=exc_info, **kw)


class _Busy(asyncio.Protocol):
    """A connection past ``max_connections``: answered 503, half-closed, what it sends
    discarded, closed after ``linger_s``."""

    def __init__(self, linger_s: float) -> None:
        self._linger_s = linger_s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_BUSY)
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(self._linger_s, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False


class Gateway:
    """Serves client connections (``start``) and forwards each request to the router
    over a pooled session; ``close`` ends both."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.counters = GatewayCounters()
        self._base = URL.build(scheme="http", host=config.router_host, port=config.router_port)
        self._web: web.Server | None = None
        self._server: asyncio.Server | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self, host: str, port: int) -> asyncio.Server:
        """Listen on ``host:port`` (0: any free port); the listening server."""
        c = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=c.max_connections, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=c.connect_timeout_s, sock_read=c.upstream_timeout_s
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=_NO_AUTO_HEADERS,
            max_line_size=c.max_head_bytes,
            max_field_size=c.max_head_bytes,
        )
        self._web = web.Server(
            self._handle,
            request_factory=self._request,
            handler_cancellation=True,
            keepalive_timeout=c.idle_timeout_s,
            max_line_size=c.max_head_bytes,
            max_field_size=c.max_head_bytes,
            max_headers=c.max_headers,
            lingering_time=c.linger_s,
            auto_decompress=False,
            access_log=None,
            logger=_ServerLog(self),
        )
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, host, port)
        return self._server

    async def close(self) -> None:
        """Stop listening, end every client connection and the router session."""
        if self._server is not None:
            self._server.close()
        if self._web is not None:
            await self._web.shutdown(1.0)
        if self._session is not None:
            await self._session.close()
        if self._server is not None:
            await self._server.wait_closed()

    def _protocol(self) -> asyncio.BaseProtocol:
        """One client connection: aiohttp's, or :class:`_Busy` past the cap."""
        assert self._web is not None
        if len(self._web.connections) >= self.config.max_connections:
            self.counters.busy += 1
            return _Busy(min(self.config.linger_s, 1.0))
        return self._web()

    def _request(
        self, message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        """aiohttp's request, with the gateway's body limit."""
        return web.BaseRequest(
            message,
            payload,
            protocol,
            writer,
            task,
            asyncio.get_running_loop(),
            client_max_size=self.config.max_body_bytes,
        )

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """One request; a client that leaves while it is read is let go quietly."""
        try:
            return await self._serve(request)
        except ConnectionError:
            self.counters.clients_dropped += 1
            _abort(request)
            return web.Response(status=400)  # not sent: aiohttp finds the connection gone

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        """One request: read its body, set the routing header, forward, relay."""
        c = self.config
        self.counters.requests += 1
        if request.version not in ((1, 0), (1, 1)):  # llhttp reads "GET /" as HTTP/0.9
            self.counters.refused += 1
            return _error(505, "HTTP/1.0 and HTTP/1.1 only")
        body = await self._body(request)
        if isinstance(body, web.Response):
            self.counters.refused += 1
            return body
        path = request.rel_url.path
        key = None
        if request.method == "POST" and path in KEYED_PATHS:
            key = await asyncio.to_thread(body_key, request.method, path, request.headers, body)
        headers, client_key = routed_headers(
            _end_to_end(request.headers, _REQUEST_OWN), key, c.allow_client_routing_key
        )
        if not all(v.isascii() or _utf8(v) for _, v in headers):
            self.counters.refused += 1
            return _error(400, "a header value is not UTF-8")
        self.counters.keyed += int(key is not None and client_key != "kept")
        self.counters.client_keys_dropped += int(client_key == "dropped")
        self.counters.client_keys_kept += int(client_key == "kept")
        log.debug("%s %s key=%s client key %s", request.method, path, key, client_key)
        return await self._forward(request, headers, body)

    async def _body(self, request: web.BaseRequest) -> bytes | web.Response:
        """The request body, whole, or the gateway's refusal (413, 408, 400)."""
        c = self.config
        length = request.content_length
        if length is not None and length > c.max_body_bytes:
            return _error(413, f"request body over {c.max_body_bytes} bytes")
        if request.version >= (1, 1) and "100-continue" in _tokens(request.headers, "expect"):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            return await asyncio.wait_for(request.read(), c.read_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {c.max_body_bytes} bytes")
        except asyncio.TimeoutError:
            return _error(408, f"request body not received within {c.read_timeout_s} s")
        except (HttpProcessingError, aiohttp.ClientPayloadError, ValueError) as e:
            log.info("refused a malformed request body: %s", e)
            return _error(400, "malformed request body")

    async def _forward(
        self, request: web.BaseRequest, headers: list[tuple[str, str]], body: bytes
    ) -> web.StreamResponse:
        """Send the request to the router and relay its answer as it arrives."""
        assert self._session is not None
        url = URL(str(self._base) + request.rel_url.raw_path_qs, encoded=True)
        try:
            upstream = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=body or None,
                allow_redirects=False,
            )
        except aiohttp.ConnectionTimeoutError as e:
            return self._bad_gateway(502, "the router could not be reached", e)
        except asyncio.TimeoutError as e:
            return self._bad_gateway(504, "no answer from the router in time", e)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            return self._bad_gateway(502, "bad gateway: no valid answer from the router", e)
        try:
            return await self._relay(request, upstream)
        finally:
            upstream.close()  # a no-op once the body was read whole and released

    async def _relay(
        self, request: web.BaseRequest, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Relay the router's response piece by piece, each written within
        ``write_timeout_s``; cut short (the client's connection aborted) when the
        client stops reading or the router's body breaks off."""
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        out.headers.extend(_end_to_end(upstream.headers, _RESPONSE_OWN))
        if upstream.content_length is not None and "chunked" not in _tokens(
            upstream.headers, "transfer-encoding"
        ):
            out.content_length = upstream.content_length
        try:
            await self._to_client(out.prepare(request))
            while piece := await _from_router(upstream):
                await self._to_client(out.write(piece))
            await self._to_client(out.write_eof())
            upstream.release()
        except _ClientGone as e:
            self.counters.clients_dropped += 1
            log.info("dropped a client mid-response: %s", type(e.__cause__).__name__)
            _abort(request)
        except _RouterBroke as e:
            self.counters.upstream_errors += 1
            log.warning("the router's response broke off: %s", type(e.__cause__).__name__)
            _abort(request)
        return out

    async def _to_client(self, step: Awaitable[Any]) -> None:
        """One write to the client, taken within ``write_timeout_s``."""
        try:
            await asyncio.wait_for(step, self.config.write_timeout_s)
        except (asyncio.TimeoutError, ConnectionError) as e:
            raise _ClientGone from e

    def _bad_gateway(self, status: int, message: str, e: BaseException) -> web.Response:
        """A 502 / 504 without the router's address or the error's text (logged)."""
        self.counters.upstream_errors += 1
        log.warning("router request failed (%s): %s", status, e)
        return _error(status, message)


class _ClientGone(Exception):
    """The client stopped reading (``write_timeout_s``) or closed its connection."""


class _RouterBroke(Exception):
    """The router's response body broke off or stalled (``upstream_timeout_s``)."""


async def _from_router(upstream: aiohttp.ClientResponse) -> bytes:
    """The next piece of the router's response body as it arrives; ``b""`` at its end."""
    try:
        return await upstream.content.readany()
    except (aiohttp.ClientError, HttpProcessingError, asyncio.TimeoutError, OSError) as e:
        raise _RouterBroke from e


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _abort(request: web.BaseRequest) -> None:
    """End a client connection at once, a response half sent or not taken."""
    if request.transport is not None:
        request.transport.abort()

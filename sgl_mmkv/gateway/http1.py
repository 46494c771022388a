"""HTTP/1.1 messages on asyncio streams: what the gateway reads and relays.

Only what a reverse proxy in front of SGLang's router needs: message heads read
under a size bound, request bodies read whole under a size bound (``Content-Length``
or chunked), and response bodies relayed piece by piece as they arrive
(``Content-Length``, chunked, or until the upstream closes), so server-sent events
reach the client as they are produced. Header bytes are kept as latin-1 text.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from enum import Enum

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
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_PIECE = 64 * 1024
_MAX_TRAILERS = 32


class HTTPError(Exception):
    """A request the gateway answers itself: ``status`` and a one-line ``reason``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Framing(Enum):
    """How a message's body ends."""

    NONE = "none"
    LENGTH = "length"
    CHUNKED = "chunked"
    CLOSE = "close"


@dataclass(slots=True)
class Head:
    """A request or status line and its headers, in order, names as sent."""

    start: str
    headers: list[tuple[str, str]]

    def values(self, name: str) -> list[str]:
        name = name.lower()
        return [v for n, v in self.headers if n.lower() == name]

    def get(self, name: str) -> str | None:
        found = self.values(name)
        return found[0] if found else None

    def tokens(self, name: str) -> list[str]:
        """The comma-separated tokens of every ``name`` header, lower-cased."""
        return [t.strip().lower() for v in self.values(name) for t in v.split(",") if t.strip()]


async def read_head(reader: asyncio.StreamReader, max_bytes: int, max_headers: int) -> Head | None:
    """One message head; ``None`` on a clean end of stream before it. Raises
    :class:`HTTPError` (431) past ``max_bytes`` or ``max_headers``, (400) when malformed."""
    used = 0
    start = ""
    while not start:  # empty lines before a request line are ignored (RFC 9112 2.2)
        line = await _line(reader)
        if line is None:
            return None
        used += len(line)
        if used > max_bytes:
            raise HTTPError(431, "request head too large")
        start = line.decode("latin-1").rstrip("\r\n")
    headers: list[tuple[str, str]] = []
    while True:
        line = await _line(reader)
        if line is None:
            raise asyncio.IncompleteReadError(b"", None)
        used += len(line)
        if used > max_bytes or len(headers) >= max_headers:
            raise HTTPError(431, "request head too large")
        text = line.decode("latin-1").rstrip("\r\n")
        if not text:
            return Head(start, headers)
        name, colon, value = text.partition(":")
        if not colon or not _TOKEN.match(name) or "\r" in value or "\x00" in value:
            raise HTTPError(400, "malformed header line")
        headers.append((name, value.strip(" \t")))


async def _line(reader: asyncio.StreamReader) -> bytes | None:
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    except asyncio.LimitOverrunError as e:
        raise HTTPError(431, "header line too long") from e
    return line


def request_framing(head: Head, max_bytes: int) -> tuple[Framing, int]:
    """A request body's framing and its declared length (0 unless ``LENGTH``).
    Raises :class:`HTTPError`: 400 for conflicting or malformed framing, 501 for a
    transfer coding other than chunked, 413 for a declared length over ``max_bytes``."""
    codings = head.tokens("transfer-encoding")
    lengths = {v.strip() for v in head.values("content-length")}
    if codings:
        if lengths:
            raise HTTPError(400, "both Transfer-Encoding and Content-Length")
        if codings != ["chunked"]:
            raise HTTPError(501, "only the chunked transfer coding is accepted")
        return Framing.CHUNKED, 0
    if not lengths:
        return Framing.NONE, 0
    if len(lengths) > 1 or not next(iter(lengths)).isdigit():
        raise HTTPError(400, "malformed Content-Length")
    length = int(next(iter(lengths)))
    if length > max_bytes:
        raise HTTPError(413, f"request body over {max_bytes} bytes")
    return Framing.LENGTH, length


async def read_body(
    reader: asyncio.StreamReader, framing: Framing, length: int, max_bytes: int
) -> bytes:
    """A request body, whole. Raises :class:`HTTPError` (413) when a chunked body
    passes ``max_bytes``, (400) for malformed chunks."""
    if framing is Framing.LENGTH:
        return await reader.readexactly(length)
    if framing is not Framing.CHUNKED:
        return b""
    parts: list[bytes] = []
    total = 0
    while True:
        size = _chunk_size(await reader.readuntil(b"\n"))
        if size == 0:
            await _skip_trailers(reader)
            return b"".join(parts)
        total += size
        if total > max_bytes:
            raise HTTPError(413, f"request body over {max_bytes} bytes")
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise HTTPError(400, "malformed chunk")


def _chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip()
    if not text or len(text) > 16 or not re.fullmatch(rb"[0-9A-Fa-f]+", text):
        raise HTTPError(400, "malformed chunk size")
    return int(text, 16)


async def _skip_trailers(reader: asyncio.StreamReader) -> list[bytes]:
    lines = []
    for _ in range(_MAX_TRAILERS):
        line = await reader.readuntil(b"\n")
        lines.append(line)
        if not line.strip():
            return lines
    raise HTTPError(400, "too many trailer lines")


def response_framing(head: Head, status: int, request_method: str) -> Framing:
    """How a response body ends (RFC 9112 6.3)."""
    if request_method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        return Framing.NONE
    codings = head.tokens("transfer-encoding")
    if codings:
        return Framing.CHUNKED if codings[-1] == "chunked" else Framing.CLOSE
    lengths = {v.strip() for v in head.values("content-length")}
    if len(lengths) == 1 and next(iter(lengths)).isdigit():
        return Framing.LENGTH
    return Framing.CLOSE


async def relay_body(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    framing: Framing,
    length: int,
    dechunk: bool = False,
) -> None:
    """Copy a response body from ``reader`` to ``writer`` as it arrives, draining after
    each piece. Chunked bodies keep their chunks (one SSE event stays one chunk) unless
    ``dechunk`` (an HTTP/1.0 client: the data alone, ended by closing)."""
    if framing is Framing.LENGTH:
        await _copy(reader, writer, length)
    elif framing is Framing.CLOSE:
        while piece := await reader.read(_PIECE):
            writer.write(piece)
            await writer.drain()
    elif framing is Framing.CHUNKED:
        while True:
            line = await reader.readuntil(b"\n")
            size = _chunk_size(line)
            if size == 0:
                trailers = await _skip_trailers(reader)
                if not dechunk:
                    writer.write(line + b"".join(trailers))
                    await writer.drain()
                return
            if not dechunk:
                writer.write(line)
            await _copy(reader, writer, size)
            crlf = await reader.readexactly(2)
            if not dechunk:
                writer.write(crlf)
            await writer.drain()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        piece = await reader.read(min(n, _PIECE))
        if not piece:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(piece)
        writer.write(piece)
        await writer.drain()


def encode_head(start: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [start, *(f"{name}: {value}" for name, value in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")

"""Segment storage in Mooncake's distributed store: ``--mm-segment-storage mooncake``.

SGLang 0.5.23's ``MooncakeStore`` HiCache backend moves data only as pages of its
host pool (``batch_set_v1`` / ``batch_get_v1``), so segment storage uses Mooncake's
own client, ``mooncake.store.MooncakeDistributedStore``: one client per process, set
up with the master, metadata service and transfer protocol of
:class:`MooncakeSettings` (``--mm-segment-storage-config``, else SGLang's
``MOONCAKE_*`` variables).

:class:`MooncakeObjects` holds the objects of an entry for
:class:`~sgl_mmkv.segments.storage.SegmentStorage` (the names, header, payload and
checksums of ``file``):

- reads land in buffers of exactly the size a checked header implies
  (``batch_get_into``: one round trip for any number of objects); Mooncake refuses
  an object larger than its buffer before copying anything;
- writes are staged through the client's local buffer, which Mooncake registers
  with its transfer engine at set-up (``put``); a larger object is not written;
- a damaged entry's objects are removed (``remove_by_regex`` on its name).

Set-up runs on a thread of its own, and only once the master answers
(:func:`unreachable`): Mooncake's ``setup`` may hold Python's GIL while it retries
an absent master (about 90 s, seen with torch imported), which would stall the
whole scheduler; its other calls release the GIL. Until set-up succeeds every call
raises :class:`StoreUnavailable`, a counted miss or failed write; the master is
tried again every ``retry_s``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from sgl_mmkv.segments.file_directory import WrongSize

logger = logging.getLogger(__name__)

MIB = 2**20
MIN_SEGMENT_BYTES = 16 * MIB  # Mooncake refuses a smaller global segment
# Mooncake's ErrorCode values (mooncake-store/include/types.h) the client returns
NO_AVAILABLE_HANDLE = -200  # no room in any mounted segment: the store is full
BUFFER_TOO_SMALL = -600  # INVALID_PARAMS: the object is larger than the buffer
OBJECT_NOT_FOUND = -704
RPC_FAIL, RPC_TIMEOUT = -900, -901  # the master is down or does not answer
ENTRY_STEM = re.compile(r"sgl_mmkv_[0-9a-f]{16}_[0-9a-f]{64}")
_SIZE = re.compile(r"(\d+)\s*([kmg]i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
WARN_EVERY_S = 60.0
_STRINGS = ("master_server_address", "metadata_server", "local_hostname", "protocol",
            "device_name")  # fmt: skip
_SIZES = ("global_segment_size", "local_buffer_size")
_SECONDS = ("connect_timeout_s", "retry_s")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
_ADDRESS = re.compile(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}")


class StoreUnavailable(ConnectionError):
    """The store cannot be reached: not set up yet, or its master does not answer."""


class MooncakeError(RuntimeError):
    """A Mooncake call returned an error code."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what}: Mooncake error {code}")
        self.code = code


def parse_size(value: Any, key: str) -> int:
    """Bytes of ``value``: an integer, or a string such as ``"4gb"``, ``"512 MiB"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{key} must be a size in bytes or like '4gb', got {value!r}")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    """How the client is set up; keys of ``--mm-segment-storage-config``.

    Attributes:
        master_server_address: ``host:port`` of ``mooncake_master``'s RPC
            (``MOONCAKE_MASTER``).
        metadata_server: the transfer engine's metadata service, e.g. the master's
            ``http://host:port/metadata``, or ``P2PHANDSHAKE``
            (``MOONCAKE_TE_META_DATA_SERVER``).
        local_hostname: this node's address as the other nodes reach it;
            ``MOONCAKE_LOCAL_HOSTNAME`` / ``LOCAL_HOSTNAME`` win over the config (as
            in SGLang), so one config serves every node.
        protocol: ``tcp`` (tested) or ``rdma`` (``MOONCAKE_PROTOCOL``).
        device_name: RDMA devices (``MOONCAKE_DEVICE``).
        global_segment_size: memory this process adds to the store (0: none, a
            client only; else at least 16 MiB) (``MOONCAKE_GLOBAL_SEGMENT_SIZE``).
        local_buffer_size: the client's registered staging buffer; the largest
            object written.
        connect_timeout_s: how long start-up waits for the set-up before going on
            without the store (it keeps trying).
        retry_s: the wait between two set-ups that failed.
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "localhost"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 4 * 2**30
    local_buffer_size: int = 128 * MIB
    connect_timeout_s: float = 5.0
    retry_s: float = 10.0

    @classmethod
    def parse(
        cls, config: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> MooncakeSettings:
        """From ``--mm-segment-storage-config``, then the environment, then defaults.

        Raises:
            ValueError: an unknown key, a value of the wrong type, or no master.
        """
        env = os.environ if env is None else env
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: {sorted(known)}")
        from_env = {
            "master_server_address": env.get("MOONCAKE_MASTER"),
            "metadata_server": env.get("MOONCAKE_TE_META_DATA_SERVER"),
            "protocol": env.get("MOONCAKE_PROTOCOL"),
            "device_name": env.get("MOONCAKE_DEVICE"),
            "global_segment_size": env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE"),
        }
        values = {k: v for k, v in from_env.items() if v is not None}
        values.update(config)
        hostname = env.get("MOONCAKE_LOCAL_HOSTNAME") or env.get("LOCAL_HOSTNAME")
        if hostname:
            values["local_hostname"] = hostname
        if not values.get("master_server_address"):
            raise ValueError("needs master_server_address (host:port) or MOONCAKE_MASTER")
        for key in _STRINGS:
            if key in values and not isinstance(values[key], str):
                raise ValueError(f"{key} must be a string, got {values[key]!r}")
        for key in _SIZES:
            if key in values:
                values[key] = parse_size(values[key], key)
        for key in _SECONDS:
            value = values.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
        settings = cls(**values)
        if not _ADDRESS.fullmatch(settings.master_server_address):
            raise ValueError(
                f"master_server_address must be host:port, got {settings.master_server_address!r}"
            )
        segment = settings.global_segment_size
        if 0 < segment < MIN_SEGMENT_BYTES:
            raise ValueError(f"global_segment_size must be 0 or at least 16 MiB, got {segment}")
        if settings.local_buffer_size < MIB:
            raise ValueError(
                f"local_buffer_size must be at least 1 MiB, got {settings.local_buffer_size}"
            )
        return settings


def unreachable(settings: MooncakeSettings, timeout_s: float = 1.0) -> str | None:
    """Why the master cannot be set up with now, or None: its RPC port must accept a
    connection and, with metadata over HTTP (the master's own service, or another),
    that service must answer (any HTTP status), so a stopped master is not tried."""
    host, _, port = settings.master_server_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except (OSError, ValueError) as error:
        return f"master {settings.master_server_address}: {error}"
    url = settings.metadata_server
    if url.startswith(("http://", "https://")):
        try:
            _DIRECT.open(f"{url}?key=sgl_mmkv_reachable", timeout=timeout_s).close()
        except urllib.error.HTTPError:
            pass  # it answered
        except (OSError, ValueError) as error:
            return f"metadata service {url}: {error}"
    return None


def import_client():
    """Mooncake's ``MooncakeDistributedStore`` class.

    Raises:
        ImportError: the package, or the ``libibverbs`` it links, is not installed;
            the message says what to install.
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        hint = "pip install mooncake-transfer-engine-non-cuda (a CPU build)"
        if "libibverbs" in str(error):
            hint = "install Debian's libibverbs1 (apt-get install -y libibverbs1)"
        raise ImportError(f"Mooncake's store client does not import ({error}); {hint}") from error
    return MooncakeDistributedStore


class MooncakeObjects:
    """The objects of segment entries in a Mooncake store.

    Args:
        settings: how to set up the client.
        client_class: ``MooncakeDistributedStore`` (or a stand-in with its methods).
    """

    def __init__(self, settings: MooncakeSettings, client_class) -> None:
        self.settings = settings
        self.max_object_bytes = settings.local_buffer_size
        self.round_trips = 0  # calls that went to the store (tests count them)
        self._client = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._warned: dict[str, float] = {}
        self._register = settings.protocol != "tcp"  # TCP copies from any host memory
        self._thread = threading.Thread(
            target=self._connect, args=(client_class,), name="sgl_mmkv-mooncake-setup",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the client is set up, waiting at most ``timeout_s``."""
        return self._ready.wait(timeout_s)

    def _connect(self, client_class) -> None:
        s = self.settings
        while not self._closed.is_set():
            why = unreachable(s)
            if why is not None:
                self._warn("setup", f"sgl_mmkv: Mooncake store unavailable ({why}); "
                           f"misses until it answers, tried every {s.retry_s:g} s")  # fmt: skip
                self._closed.wait(s.retry_s)
                continue
            client = client_class()
            try:
                code = client.setup(
                    s.local_hostname, s.metadata_server, s.global_segment_size,
                    s.local_buffer_size, s.protocol, s.device_name, s.master_server_address,
                )  # fmt: skip
            except Exception as error:
                code = repr(error)
            if code == 0:
                with self._lock:
                    self._client = client
                self._ready.set()
                logger.info("sgl_mmkv: Mooncake store client set up (master %s)",
                            s.master_server_address)  # fmt: skip
                if self._closed.is_set():
                    self.close()
                return
            logger.warning(
                "sgl_mmkv: Mooncake set-up with master %s failed (%s); segment storage is "
                "unavailable (misses), trying again in %g s",
                s.master_server_address, code, s.retry_s,
            )  # fmt: skip
            self._closed.wait(s.retry_s)

    def _connected(self):
        client = self._client
        if client is None:
            raise StoreUnavailable(f"not set up with master {self.settings.master_server_address}")
        self.round_trips += 1
        return client

    def _failure(self, what: str, code: int) -> Exception:
        if code in (RPC_FAIL, RPC_TIMEOUT):
            return StoreUnavailable(f"{what}: master does not answer ({code})")
        return MooncakeError(what, code)

    def read_many(self, wanted: Sequence[tuple[str, int]]) -> list[bytes | None | Exception]:
        """Each object ``(name, size)`` of ``wanted``, in one round trip: its bytes if
        it has exactly ``size``, None if it is missing, else the error (``WrongSize``,
        :class:`StoreUnavailable`, :class:`MooncakeError`).

        Raises:
            StoreUnavailable: the client is not set up.
        """
        sizes: dict[str, int] = {}
        for name, size in wanted:
            sizes.setdefault(name, size)  # a key twice in one batch is read once
        if not sizes:
            return []
        client = self._connected()
        names = list(sizes)
        offsets, total = [], 0
        for name in names:
            offsets.append(total)
            total += sizes[name]
        buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        base = buffer.data_ptr()
        if self._register and client.register_buffer(base, total) != 0:
            raise MooncakeError("register_buffer", -1)
        try:
            codes = client.batch_get_into(
                names, [base + o for o in offsets], [sizes[n] for n in names]
            )
        finally:
            if self._register:
                client.unregister_buffer(base)
        got: dict[str, bytes | None | Exception] = {}
        for name, offset, code in zip(names, offsets, codes, strict=True):
            size = sizes[name]
            if code == size:
                got[name] = buffer[offset : offset + size].numpy().tobytes()
            elif code == OBJECT_NOT_FOUND:
                got[name] = None
            elif code == BUFFER_TOO_SMALL:
                got[name] = WrongSize(f"{name} is larger than {size} bytes")
            elif code >= 0:
                got[name] = WrongSize(f"{name} has {code} bytes, not {size}")
            else:
                got[name] = self._failure(f"reading {name}", code)
        return [
            got[name] if size == sizes[name] else WrongSize(f"{name} asked at two sizes")
            for name, size in wanted
        ]

    def read(self, name: str, size: int) -> bytes | None:
        """Exactly ``size`` bytes of object ``name``, or None if it is missing.

        Raises:
            WrongSize: it has another size.
            StoreUnavailable: not set up, or the master does not answer.
        """
        (got,) = self.read_many([(name, size)])
        if isinstance(got, Exception):
            raise got
        return got

    def exists(self, name: str) -> bool:
        code = self._connected().is_exist(name)
        if code < 0:
            raise self._failure(f"is_exist {name}", code)
        return code == 1

    def set(self, name: str, value: torch.Tensor) -> bool:
        """Write ``value`` (uint8) as object ``name`` unless one is there (Mooncake keeps
        the first); False if the store refused it (full: no room in any segment)."""
        data = value.detach().contiguous().view(torch.uint8).numpy()
        if data.nbytes > self.max_object_bytes:
            return False
        code = self._connected().put(name, data)
        if code in (RPC_FAIL, RPC_TIMEOUT):
            raise self._failure(f"put {name}", code)
        if code != 0:
            full = ", the store is full" if code == NO_AVAILABLE_HANDLE else ""
            self._warn(f"put {code}", f"sgl_mmkv: Mooncake put failed ({code}{full})")
        return code == 0

    def remove_entry(self, entry: str) -> int:
        """Remove every object of entry ``entry`` (header and payloads); their count."""
        if not ENTRY_STEM.fullmatch(entry):
            raise ValueError(f"{entry!r} is not an entry name")
        code = self._connected().remove_by_regex(f"^{entry}_", True)
        if code < 0:
            raise self._failure(f"removing {entry}", code)
        return code

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[kind] = now
            logger.warning(message)

    def close(self) -> None:
        """Stop setting up, and close the client (no call may be in flight)."""
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

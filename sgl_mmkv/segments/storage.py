"""Image segments in SGLang's L3 storage (``HiCacheStorage``): the tier below the store.

A segment is written through to a storage backend made by SGLang's own
``StorageBackendFactory`` (``--mm-segment-storage file|hf3fs|nixl|...``), or to
Mooncake's store through its own client (``mooncake``,
:mod:`~sgl_mmkv.segments.mooncake_store`), so several server instances pointed at
one storage reuse each other's images. An entry is two backend objects:

- ``<name>_h``: a header of :data:`HEADER_BYTES` bytes: magic, sha256 of its JSON,
  JSON length, then the JSON (format version, the full segment key, the KV
  fingerprint, tensor shapes and dtype, payload size and payload sha256);
- ``<name>_p<sha256[:16]>``: the payload: positions, kept indices, ranking, then
  every layer's K and V of the kept tokens, then (optional) the image's vision
  encoder output, as raw bytes, named by its checksum (so two instances writing one
  image at once never pair a header with the other's payload).

``<name>`` is ``sgl_mmkv_<namespace tag>_<sha256 of (format version, namespaced
content key, fingerprint)>``, so salts, extra keys, adapters, models, dtypes, fill
policies and KV layouts never share an entry; the header repeats key and fingerprint
in full and a load checks them. The payload is written before the header, so a
header implies a complete payload on backends whose writes are atomic per object
(``file`` writes a temporary file, then renames).

Storage is untrusted input (anyone who can write the directory writes what the
scheduler reads): a header is checked against the key and fingerprint before
anything is read or allocated (:func:`~sgl_mmkv.segments.entry_format.payload_layout`),
``file`` objects are read only as regular files of the expected size inside the
directory (:mod:`~sgl_mmkv.segments.file_directory`), and the forward waits for a
read at most the deadline (:mod:`~sgl_mmkv.segments.deadline`); writes are queued
and never waited for. With ``file`` the directory is kept under a total and a
per-namespace size cap, old entries giving way (:mod:`~sgl_mmkv.segments.storage_caps`),
and an entry found damaged is removed and written again at the next fill (also
with ``mooncake``). With ``mooncake`` the headers of one request's images are read
in one round trip, their payloads in one more (:meth:`SegmentStorage.fetch_many`).

Nothing here raises into the server: a missing, truncated, corrupt, unsafe, foreign
or late entry, a backend that raises or cannot be reached, is a miss (counted); a
failed or refused write is counted and dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from sgl_mmkv.counters import Counters
from sgl_mmkv.segments.deadline import DONE, TIMEOUT, DeadlineCaller, WriteQueue, injected_delay
from sgl_mmkv.segments.entry_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    BadHeader,
    KVFingerprint,
    StoredSegment,
    decode_header,
    encode_header,
    key_fields,
    namespace_tag,
    payload_layout,
    payload_name,
    payload_parts,
    tensor_bytes,
)
from sgl_mmkv.segments.file_directory import FileDirectory, UnsafeObject, WrongSize
from sgl_mmkv.segments.key import SegmentKey
from sgl_mmkv.segments.mooncake_store import StoreUnavailable
from sgl_mmkv.segments.storage_caps import StorageCaps

logger = logging.getLogger(__name__)

NO_STORAGE = "none"
MOONCAKE = "mooncake"  # Mooncake's own client, not SGLang's HiCache backend
GIB = 2**30
# What SGLang 0.5.23's HiCacheFile appends to an object name for the config
# open_storage gives it (no model name, TP rank 0 of 1); checked by the probe.
FILE_SUFFIX = "__0_1"
DERIVED_CAP_FALLBACK = 16 * GIB  # when the file system's free space is unknown
DAMAGED_REMEMBERED = 4096


class StorageError(RuntimeError):
    """The storage backend could not be created (raised at start-up only)."""


@dataclass(slots=True)
class StorageCounters(Counters):
    """Server-wide L3 counts since start."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # bad header, checksum or size, missing payload: a miss
    mismatched: int = 0  # an intact entry for another key or fingerprint: a miss
    unsafe: int = 0  # a symlink, FIFO, device or directory where an object should be
    errors: int = 0  # the backend raised: a miss or a dropped write
    unavailable: int = 0  # not reachable (Mooncake: not set up, master down): a miss
    timeouts: int = 0  # a read past the deadline: a miss, the read is not waited for
    stalled: int = 0  # not read: an earlier read is still past its deadline
    load_skipped: int = 0  # found, but no free pool slots to load it into
    writes: int = 0
    write_skipped: int = 0  # already stored (by us or another instance)
    write_failed: int = 0  # also: the store is full, or not reachable
    write_dropped: int = 0  # the write queue was full: not written
    write_stale: int = 0  # queued before a weight update: not written
    write_slow: int = 0  # writes that took longer than the deadline (off the forward)
    rewritten: int = 0  # a damaged entry removed and written again
    too_large: int = 0  # an entry larger than a cap (or Mooncake's buffer): not written
    evicted: int = 0  # entries removed to keep the caps
    evicted_bytes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # the forward's waits for reads
    write_seconds: float = 0.0  # the writer thread's writes


@dataclass(frozen=True, slots=True)
class StorageLimits:
    """Attributes:
    deadline_s: the longest a forward waits for one read.
    max_bytes: every entry in a ``file`` directory together; 0: half the free space
        of its file system when the storage is opened.
    namespace_max_bytes: the entries of one namespace; 0: half of ``max_bytes``.
    queue_entries, queue_bytes: writes waiting at most (entries, bytes of KV).
    """

    deadline_s: float = 0.2
    max_bytes: int = 0
    namespace_max_bytes: int = 0
    queue_entries: int = 32
    queue_bytes: int = 256 * 2**20

    @classmethod
    def of_config(cls, config) -> StorageLimits:
        """From an ``MMKVConfig``'s ``--mm-segment-storage-*`` flags."""
        return cls(
            deadline_s=config.mm_segment_storage_deadline_ms / 1000,
            max_bytes=int(config.mm_segment_storage_max_gib * GIB),
            namespace_max_bytes=int(config.mm_segment_storage_namespace_max_gib * GIB),
        )


_MISS = {"lookups": 1, "misses": 1}


class _Corrupt(Exception):
    """An entry that is not what its header says."""


class _Mismatched(Exception):
    """An intact entry of another key or fingerprint."""


class SegmentStorage:
    """Write-through and read-back of segments in one ``HiCacheStorage`` backend.

    :meth:`load` and :meth:`save` do the I/O on the caller's thread; the store calls
    :meth:`fetch` (a load under the deadline) and :meth:`put` (a queued save).

    Args:
        backend: a ``HiCacheStorage`` (``get(key, target)``, ``set(key, value)``,
            ``exists(key)``).
        fingerprint: this server's :class:`KVFingerprint`.
        limits: deadline, caps and write queue.
        directory: the ``file`` backend's directory: reads go through it, and the
            caps are kept in it. None: every operation goes through ``backend``.
    """

    def __init__(
        self,
        backend,
        fingerprint: KVFingerprint,
        limits: StorageLimits | None = None,
        directory: FileDirectory | None = None,
    ) -> None:
        self.backend = backend
        self.fingerprint = fingerprint
        self.limits = limits = limits or StorageLimits()
        self.directory = directory
        self.counters = StorageCounters()
        self._fingerprint_fields = fingerprint.fields()
        self._generation = 0  # bumped by rebind(): writes queued before it are dropped
        self._lock = threading.Lock()
        self._damaged: OrderedDict[str, None] = OrderedDict()
        self._reads = DeadlineCaller(limits.deadline_s)
        self._writes = WriteQueue(limits.queue_entries, limits.queue_bytes)
        self.caps: StorageCaps | None = None
        if directory is not None:
            total = limits.max_bytes or (directory.free_bytes() or 2 * DERIVED_CAP_FALLBACK) // 2
            space = limits.namespace_max_bytes or total // 2
            self.caps = StorageCaps(directory, total, space)

    def entry_name(self, key: SegmentKey) -> str:
        """The backend object name stem of ``key`` (hex, safe as a file name)."""
        identity = {"v": FORMAT_VERSION, "key": key_fields(key), "kv": self._fingerprint_fields}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        return f"sgl_mmkv_{namespace_tag(key)}_{digest}"

    def count(self, counts: dict[str, int | float]) -> None:
        """Add ``counts`` (counter name -> amount) to the counters (any thread)."""
        with self._lock:
            for name, value in counts.items():
                setattr(self.counters, name, getattr(self.counters, name) + value)

    def _mark_damaged(self, name: str, damaged: bool = True) -> None:
        with self._lock:
            if damaged:
                self._damaged[name] = None
                if len(self._damaged) > DAMAGED_REMEMBERED:
                    self._damaged.popitem(last=False)
            else:
                self._damaged.pop(name, None)

    # -- reads ------------------------------------------------------------------------

    def load(self, key: SegmentKey) -> StoredSegment | None:
        """The stored segment of ``key``, or None (missing, corrupt, unsafe, foreign,
        or the backend failed; each counted). Reads on this thread, no deadline."""
        stored, counts = self._read_entry(key)
        self.count(counts)
        return stored

    def fetch(self, key: SegmentKey) -> StoredSegment | None:
        """:meth:`load` on a worker thread, waited for at most the deadline: a read
        that takes longer (``timeouts``) or is not started because an earlier one is
        still running late (``stalled``) is a miss."""
        return self.fetch_many([key])[0]

    def fetch_many(self, keys: list[SegmentKey]) -> list[StoredSegment | None]:
        """:meth:`fetch` of several keys (one request's images) under one deadline.
        A backend that reads many objects at once (``read_many``: Mooncake) reads
        every header in one round trip and the payloads found in one more."""
        if not keys:
            return []
        started = time.perf_counter()
        outcome = self._reads.call(lambda: self._read_entries(keys))
        if outcome.status == DONE and outcome.error is None:
            results = outcome.value
        else:
            late = {DONE: "errors", TIMEOUT: "timeouts"}.get(outcome.status, "stalled")
            results = [(None, {**_MISS, late: 1}) for _ in keys]
        total: dict[str, int | float] = {"load_seconds": time.perf_counter() - started}
        for _, counts in results:
            for name, value in counts.items():
                total[name] = total.get(name, 0) + value
        self.count(total)
        found = [stored for stored, _ in results]
        if self.caps is not None:
            for key, stored in zip(keys, found, strict=True):
                if stored is not None:
                    self._writes.put_light(lambda key=key: self._touch(self.entry_name(key)))
        return found

    def _read_entries(self, keys: list[SegmentKey]) -> list[tuple[StoredSegment | None, dict]]:
        """:meth:`_read_entry` of each key; with ``read_many``, every header in one
        call, then every payload of an intact header in one more."""
        read_many = getattr(self.backend, "read_many", None)
        if self.directory is not None or read_many is None:
            return [self._read_entry(key) for key in keys]
        names = [self.entry_name(key) for key in keys]
        injected_delay()
        try:
            headers = read_many([(name + "_h", HEADER_BYTES) for name in names])
        except Exception as error:
            return [(None, self._failure(name, error)) for name in names]
        results: list = [None] * len(keys)
        found = []
        for i, (key, name, raw) in enumerate(zip(keys, names, headers, strict=True)):
            try:
                if isinstance(raw, Exception):
                    raise raw
                if raw is None:
                    results[i] = (None, dict(_MISS))
                    continue
                found.append((i, *self._check_header(raw, name, key)))
            except Exception as error:
                results[i] = (None, self._failure(name, error))
        try:
            payloads = read_many([(f["payload"], f["payload_bytes"]) for _, f, _ in found])
        except Exception as error:
            payloads = [error] * len(found)
        for (i, fields, layout), raw in zip(found, payloads, strict=True):
            try:
                if isinstance(raw, Exception):
                    raise raw
                results[i] = self._finish(names[i], fields, layout, raw)
            except Exception as error:
                results[i] = (None, self._failure(names[i], error))
        return results

    def _read_entry(self, key: SegmentKey) -> tuple[StoredSegment | None, dict]:
        """The stored segment of ``key`` or None, and the counts of the read."""
        name = self.entry_name(key)
        injected_delay()
        try:
            found = self._header(name, key)
            if found is None:
                return None, dict(_MISS)
            fields, layout = found
            payload = self._get(fields["payload"], fields["payload_bytes"])
            return self._finish(name, fields, layout, payload)
        except Exception as error:
            return None, self._failure(name, error)

    def _finish(
        self, name: str, fields: dict, layout: list, payload: bytes | None
    ) -> tuple[StoredSegment, dict]:
        """The segment of a checked header's ``payload``, and the counts of a hit."""
        if payload is None:
            raise _Corrupt("payload missing")
        if hashlib.sha256(payload).hexdigest() != fields["sha256"]:
            raise _Corrupt("payload checksum")
        stored = self._unpack(fields, layout, payload)
        self._mark_damaged(name, False)
        return stored, {"lookups": 1, "hits": 1, "bytes_read": len(payload) + HEADER_BYTES}

    def _failure(self, name: str, error: BaseException) -> dict:
        """The counts of a read of entry ``name`` that raised ``error`` (a miss)."""
        if isinstance(error, (_Corrupt, BadHeader, WrongSize)):
            return self._bad(dict(_MISS), name, "corrupt", error)
        if isinstance(error, UnsafeObject):
            return self._bad(dict(_MISS), name, "unsafe", error)
        if isinstance(error, _Mismatched):
            return self._bad(dict(_MISS), name, "mismatched", error)
        if isinstance(error, StoreUnavailable):
            return {**_MISS, "unavailable": 1}
        self._error("read", error)
        return {**_MISS, "errors": 1}

    def _header(self, name: str, key: SegmentKey) -> tuple[dict, list] | None:
        """``(fields, payload layout)`` of ``name``'s header, checked against ``key`` and
        the fingerprint; None if there is no header."""
        raw = self._get(name + "_h", HEADER_BYTES)
        return None if raw is None else self._check_header(raw, name, key)

    def _check_header(self, raw: bytes, name: str, key: SegmentKey) -> tuple[dict, list]:
        fields = decode_header(raw)
        if fields is None or fields.get("version") != FORMAT_VERSION:
            raise _Corrupt("header")
        if fields.get("key") != key_fields(key) or fields.get("kv") != self._fingerprint_fields:
            raise _Mismatched("another key or fingerprint")
        return fields, payload_layout(fields, key, self.fingerprint, name)

    def _bad(self, counts: dict, name: str, kind: str, error: BaseException) -> dict:
        self._mark_damaged(name)
        logger.warning("sgl_mmkv: L3 segment %s is %s (%s); treated as a miss", name, kind, error)
        return {**counts, kind: 1}

    def _get(self, name: str, size: int) -> bytes | None:
        """Exactly ``size`` bytes of object ``name``, or None if it is missing."""
        if self.directory is not None:
            try:
                return self.directory.read(name, size)
            except FileNotFoundError:
                return None
        if hasattr(self.backend, "read"):  # Mooncake: one call, exactly ``size`` bytes
            return self.backend.read(name, size)
        if not self.backend.exists(name):
            return None
        target = torch.empty(size, dtype=torch.uint8)
        got = self.backend.get(name, target)
        if not isinstance(got, torch.Tensor) or got.numel() * got.element_size() != size:
            raise _Corrupt(f"{name}: missing or wrong size")
        return got.contiguous().view(torch.uint8).numpy().tobytes()

    @staticmethod
    def _unpack(fields: dict, layout, payload: bytes) -> StoredSegment:
        """The tensors of ``payload`` as laid out by :meth:`save`."""
        tensors, offset = [], 0
        for shape, kind, size in layout:
            chunk = bytearray(payload[offset : offset + size])
            if len(chunk) != size:
                raise _Corrupt("payload shorter than its shapes")
            tensors.append(torch.frombuffer(chunk, dtype=kind).reshape(shape))
            offset += size
        if offset != len(payload):
            raise _Corrupt("payload longer than its shapes")
        embeddings = tensors.pop() if fields["embeds"] is not None else None
        kept = tensors[1] if fields["kept"] is not None else None
        ranking = tensors[-3] if fields["ranking"] else None
        return StoredSegment(tensors[0], kept, ranking, tensors[-2], tensors[-1], embeddings)

    # -- writes -----------------------------------------------------------------------

    def put(self, key: SegmentKey, stored: StoredSegment) -> bool:
        """Queue :meth:`save` of ``stored`` (CPU tensors the queue now owns); False when
        the queue is full (``write_dropped``)."""
        size = sum(int(t.numel() * t.element_size()) for t in payload_parts(stored))
        generation = self._generation
        if self._writes.put(lambda: self._save_of(generation, key, stored), size):
            return True
        self.count({"write_dropped": 1})
        return False

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait for every queued write; False if ``timeout_s`` passed first."""
        return self._writes.drain(timeout_s)

    def rebind(self, fingerprint: KVFingerprint) -> None:
        """Serve ``fingerprint`` from now on (the model's weights changed): entries are
        read and written under it only, and writes still queued (KV of the weights
        before) are dropped (``write_stale``), never written under the new one."""
        with self._lock:
            self.fingerprint = fingerprint
            self._fingerprint_fields = fingerprint.fields()
            self._generation += 1

    def _save_of(self, generation: int, key: SegmentKey, stored: StoredSegment) -> bool:
        if generation != self._generation:
            self.count({"write_stale": 1})
            return False
        return self.save(key, stored)

    def save(self, key: SegmentKey, stored: StoredSegment) -> bool:
        """Write ``stored`` under ``key`` unless an intact entry is there (one without
        the embeddings ``stored`` brings is written again, with them). Returns True if
        it is stored now."""
        started = time.perf_counter()
        try:
            return self._save(key, stored)
        finally:
            elapsed = time.perf_counter() - started
            slow = int(elapsed > self.limits.deadline_s)
            self.count({"write_seconds": elapsed, "write_slow": slow})

    def _save(self, key: SegmentKey, stored: StoredSegment) -> bool:
        name = self.entry_name(key)
        embeddings = stored.embeddings
        if embeddings is not None and not self.fingerprint.fits_embeddings(embeddings, key):
            stored = replace(stored, embeddings=None)  # another layout: the KV alone
        try:
            present = self._intact(name, key)
            if present is not None and (
                stored.embeddings is None or present.get("embeds") is not None
            ):
                self.count({"write_skipped": 1})
                self._touch(name)
                return True
            # damaged, its payload went, or without the embeddings we have: written again
            if present is not None or self._exists(name + "_h"):
                if not self._remove_entry(name):
                    self.count({"write_skipped": 1})
                    return False
                self.count({"rewritten": 1})
            parts = [tensor_bytes(t) for t in payload_parts(stored)]
            payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            fields = self._header_fields(key, stored, payload)
            header = encode_header(fields)
            size = int(payload.numel()) + HEADER_BYTES
            if header is None:
                self.count({"write_failed": 1})
                return False
            if not self._admit(name, size):
                return False
            if not (
                self.backend.set(fields["payload"], payload)
                and self.backend.set(name + "_h", header)
            ):
                self.count({"write_failed": 1})
                return False
        except StoreUnavailable:
            self.count({"unavailable": 1, "write_failed": 1})
            return False
        except Exception as error:
            self._error("write", error)
            self.count({"errors": 1, "write_failed": 1})
            return False
        if self.caps is not None:
            self.caps.added(name, size)
        self._mark_damaged(name, False)
        self.count({"writes": 1, "bytes_written": size})
        return True

    def _intact(self, name: str, key: SegmentKey) -> dict | None:
        """The header fields of ``name`` if it is an entry for ``key`` whose payload is
        there in full (and no load found it damaged), else None."""
        with self._lock:
            if name in self._damaged:
                return None
        try:
            found = self._header(name, key)
            if found is None:
                return None
            fields, _ = found
            if self.directory is None:
                whole = bool(self.backend.exists(fields["payload"]))
            else:
                whole = self.directory.size(fields["payload"]) == fields["payload_bytes"]
            return fields if whole else None
        except (_Corrupt, _Mismatched, BadHeader, WrongSize, UnsafeObject):
            return None

    def _exists(self, name: str) -> bool:
        if self.directory is None:
            return bool(self.backend.exists(name))
        try:
            return self.directory.size(name) is not None
        except UnsafeObject:
            return True

    def _remove_entry(self, name: str) -> bool:
        """Remove entry ``name``'s objects; False where the backend cannot."""
        if self.directory is not None:
            self.directory.remove_entry(name)
            self.caps.removed(name)
            return True
        remove = getattr(self.backend, "remove_entry", None)  # Mooncake
        if remove is None:
            return False
        remove(name)
        return True

    def _admit(self, name: str, size: int) -> bool:
        """Room under the caps (old entries give way); False: larger than a cap."""
        largest = getattr(self.backend, "max_object_bytes", None)
        if largest is not None and size - HEADER_BYTES > largest:
            self.count({"too_large": 1})
            return False
        if self.caps is None:
            return True
        done = self.caps.admit(name, size)
        self.count(
            {"evicted": done.evicted, "evicted_bytes": done.evicted_bytes,
             "too_large": int(not done.admitted)}
        )  # fmt: skip
        return done.admitted

    def _touch(self, name: str) -> None:
        """A hit or a skipped write: the entry is recently used (``file``)."""
        if self.directory is None:
            return
        try:
            self.directory.touch(name + "_h")
        except OSError:
            return
        self.caps.touched(name)

    def _header_fields(self, key, stored: StoredSegment, payload: torch.Tensor) -> dict:
        digest = hashlib.sha256(payload.numpy()).hexdigest()
        return {
            "version": FORMAT_VERSION,
            "key": key_fields(key),
            "kv": self._fingerprint_fields,
            "dtype": str(stored.keys.dtype),
            "positions": list(stored.positions.shape),
            "kept": None if stored.kept is None else int(stored.kept.numel()),
            "ranking": stored.ranking is not None,
            "k_shape": list(stored.keys.shape),
            "v_shape": list(stored.values.shape),
            "embeds": None if stored.embeddings is None else list(stored.embeddings.shape),
            "payload_bytes": int(payload.numel()),
            "sha256": digest,
            "payload": payload_name(self.entry_name(key), digest),
        }

    @staticmethod
    def _error(what: str, error: BaseException) -> None:
        logger.warning("sgl_mmkv: L3 segment storage %s failed (%r)", what, error)

    def check(self) -> None:
        """Write (once per storage) and read back a fixed probe object.

        SGLang's backends share one interface, but in 0.5.23 only some implement its
        tensor ``get`` / ``set`` (``file`` does; ``hf3fs`` and ``nixl`` moved to page
        batches, ``sim`` keeps no data; SGLang's ``mooncake`` is zero-copy only, so
        segment storage uses Mooncake's own client). With ``file`` the probe must be
        read back from the directory itself.

        Raises:
            StorageError: the probe did not round-trip.
        """
        probe = torch.frombuffer(bytearray(hashlib.sha256(MAGIC).digest() * 2), dtype=torch.uint8)
        try:
            if not self.backend.exists(_PROBE) and not self.backend.set(_PROBE, probe):
                raise StorageError("writing a probe object failed")
            got = self._get(_PROBE, int(probe.numel()))
            if got is None:
                raise StorageError("the probe object is not where it was written")
        except Exception as error:
            raise StorageError(
                f"{type(self.backend).__name__} does not store and return tensors through "
                f"HiCacheStorage.get / set ({error}); segment storage supports file and "
                "mooncake"
            ) from error
        if got != probe.numpy().tobytes():
            raise StorageError(
                f"{type(self.backend).__name__} returned other bytes than were stored "
                "for a probe object; segment storage supports file and mooncake"
            )


_PROBE = "sgl_mmkv_probe"


def open_storage(
    backend_name: str,
    fingerprint: KVFingerprint,
    directory: str | None = None,
    extra_config: dict[str, Any] | None = None,
    limits: StorageLimits | None = None,
) -> SegmentStorage:
    """A :class:`SegmentStorage` over SGLang's backend ``backend_name``, made by its
    ``StorageBackendFactory`` (``file``: ``directory`` is its ``file_storage_path``),
    checked by a probe round trip (:meth:`SegmentStorage.check`); ``mooncake``: over
    Mooncake's own client (:func:`open_mooncake_storage`).

    Raises:
        StorageError: the factory does not know the backend or could not create it, or
            it does not store and return tensors.
    """
    if backend_name == MOONCAKE:
        return open_mooncake_storage(fingerprint, extra_config or {}, limits)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = dict(extra_config or {})
    if directory:
        extra["file_storage_path"] = directory
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=None,
        extra_config=extra or None,
    )
    try:
        backend = StorageBackendFactory.create_backend(backend_name, config, None)
    except Exception as error:
        raise StorageError(
            f"--mm-segment-storage {backend_name}: SGLang's storage factory could not "
            f"create it ({error})"
        ) from error
    files = FileDirectory(directory, FILE_SUFFIX) if backend_name == "file" and directory else None
    storage = SegmentStorage(backend, fingerprint, limits, files)
    try:
        storage.check()
    except StorageError as error:
        raise StorageError(f"--mm-segment-storage {backend_name}: {error}") from error
    caps = storage.caps
    logger.info(
        "sgl_mmkv: segment storage read deadline %g ms, caps %s",
        storage.limits.deadline_s * 1000,
        "none (no directory)" if caps is None
        else f"{caps.max_bytes} bytes, {caps.namespace_max_bytes} per namespace",
    )  # fmt: skip
    return storage


def open_mooncake_storage(
    fingerprint: KVFingerprint, config: dict[str, Any], limits: StorageLimits | None = None
) -> SegmentStorage:
    """A :class:`SegmentStorage` in Mooncake's store (``config``: the keys of
    :class:`~sgl_mmkv.segments.mooncake_store.MooncakeSettings`). Waits for the
    client's set-up at most its ``connect_timeout_s``, then probes it; a store that
    is not reachable or fails the probe is logged, and its reads and writes are
    counted misses and failures until it is (never a refusal: the master may come
    back). The client is closed when the storage is garbage (the launcher's probe).

    Raises:
        StorageError: a bad config, or Mooncake's client is not installed.
    """
    from sgl_mmkv.segments.mooncake_store import MooncakeObjects, MooncakeSettings, import_client

    try:
        settings = MooncakeSettings.parse(config)
        client_class = import_client()
    except (ValueError, ImportError) as error:
        raise StorageError(f"--mm-segment-storage {MOONCAKE}: {error}") from error
    objects = MooncakeObjects(settings, client_class)
    storage = SegmentStorage(objects, fingerprint, limits)
    weakref.finalize(storage, objects.close).atexit = False  # at exit: Mooncake's own
    master = settings.master_server_address
    if not objects.wait_ready(settings.connect_timeout_s):
        logger.warning(
            "sgl_mmkv: Mooncake master %s not reached in %g s; segment storage counts "
            "misses (unavailable) until it is", master, settings.connect_timeout_s,
        )  # fmt: skip
        return storage
    try:
        storage.check()
    except StorageError as error:
        logger.warning("sgl_mmkv: Mooncake probe failed (%s); reads and writes are "
                       "counted misses and failures while it fails", error)  # fmt: skip
    logger.info("sgl_mmkv: segment storage in Mooncake (master %s, %s), read deadline %g ms",
                master, settings.protocol, storage.limits.deadline_s * 1000)  # fmt: skip
    return storage


def storage_backends() -> list[str]:
    """The backend names SGLang's ``StorageBackendFactory`` knows."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return sorted(StorageBackendFactory._registry)

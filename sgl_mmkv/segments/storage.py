"""Image segments in SGLang's L3 storage (``HiCacheStorage``): the tier below the store.

A segment is written through to a storage backend made by SGLang's own
``StorageBackendFactory`` (``--mm-segment-storage file|mooncake|hf3fs|nixl|...``),
so several server instances pointed at one storage reuse each other's images. An
entry is two backend objects:

- ``<name>_h``: a header of :data:`HEADER_BYTES` bytes: magic, sha256 of its JSON,
  JSON length, then the JSON (format version, the full segment key, the KV
  fingerprint, tensor shapes and dtype, payload size and payload sha256);
- ``<name>_p<sha256[:16]>``: the payload: positions, kept indices, ranking, then
  every layer's K and V of the kept tokens, as raw bytes, named by its checksum (so
  two instances writing one image at once never pair a header with the other's
  payload).

``<name>`` is the sha256 of (format version, namespaced content key, fingerprint),
so salts, extra keys, adapters, models, dtypes and KV layouts never share an entry;
the header repeats key and fingerprint in full and a load checks them. The payload
is written before the header, so a header implies a complete payload on backends
whose writes are atomic per object (``file`` writes a temporary file, then renames).
SGLang's interface has no delete, and ``file`` does not overwrite an object: a
damaged entry stays a (counted) miss until it is removed from the storage.

Nothing here raises into the server: a missing, truncated, corrupt or foreign entry,
or a backend that raises, is a miss (counted); a failed write is counted and dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sgl_mmkv.counters import Counters
from sgl_mmkv.segments.entry_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    KVFingerprint,
    StoredSegment,
    decode_header,
    dtype_of,
    encode_header,
    key_fields,
    payload_name,
    payload_parts,
    tensor_bytes,
)
from sgl_mmkv.segments.key import SegmentKey

logger = logging.getLogger(__name__)

NO_STORAGE = "none"


class StorageError(RuntimeError):
    """The storage backend could not be created (raised at start-up only)."""


@dataclass(slots=True)
class StorageCounters(Counters):
    """Server-wide L3 counts since start."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # bad header / checksum / sizes: treated as a miss
    mismatched: int = 0  # an intact entry for another key or fingerprint: a miss
    errors: int = 0  # the backend raised: a miss or a dropped write
    load_skipped: int = 0  # found, but no free pool slots to load it into
    writes: int = 0
    write_skipped: int = 0  # already stored (by us or another instance)
    write_failed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # inside forwards: lookups, reads, checksums
    write_seconds: float = 0.0  # inside forwards: checksums, writes


class SegmentStorage:
    """Write-through and read-back of segments in one ``HiCacheStorage`` backend.

    Args:
        backend: a ``HiCacheStorage`` (``get(key, target)``, ``set(key, value)``,
            ``exists(key)``).
        fingerprint: this server's :class:`KVFingerprint`.
    """

    def __init__(self, backend, fingerprint: KVFingerprint) -> None:
        self.backend = backend
        self.fingerprint = fingerprint
        self.counters = StorageCounters()
        self._fingerprint_fields = asdict(fingerprint)

    def entry_name(self, key: SegmentKey) -> str:
        """The backend object name stem of ``key`` (hex, safe as a file name)."""
        identity = {"v": FORMAT_VERSION, "key": key_fields(key), "kv": self._fingerprint_fields}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        return f"sgl_mmkv_{digest}"

    def contains(self, key: SegmentKey) -> bool:
        """Whether the backend has ``key``'s header (False if the backend raises)."""
        try:
            return bool(self.backend.exists(self.entry_name(key) + "_h"))
        except Exception as error:
            self._error("exists", error)
            return False

    def save(self, key: SegmentKey, stored: StoredSegment) -> bool:
        """Write ``stored`` under ``key`` unless present. Returns True if it is stored now."""
        started = time.perf_counter()
        try:
            return self._save(key, stored)
        finally:
            self.counters.write_seconds += time.perf_counter() - started

    def _save(self, key: SegmentKey, stored: StoredSegment) -> bool:
        name = self.entry_name(key)
        try:
            if self.backend.exists(name + "_h"):
                self.counters.write_skipped += 1
                return True
            parts = [tensor_bytes(t) for t in payload_parts(stored)]
            payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            fields = self._header_fields(key, stored, payload)
            header = encode_header(fields)
            if header is None:
                self.counters.write_failed += 1
                return False
            if not (
                self.backend.set(fields["payload"], payload)
                and self.backend.set(name + "_h", header)
            ):
                self.counters.write_failed += 1
                return False
        except Exception as error:
            self._error("write", error)
            self.counters.write_failed += 1
            return False
        self.counters.writes += 1
        self.counters.bytes_written += int(payload.numel()) + HEADER_BYTES
        return True

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
            "payload_bytes": int(payload.numel()),
            "sha256": digest,
            "payload": payload_name(self.entry_name(key), digest),
        }

    def load(self, key: SegmentKey) -> StoredSegment | None:
        """The stored segment of ``key``, or None (missing, corrupt, foreign, or the
        backend failed; each counted)."""
        started = time.perf_counter()
        try:
            return self._load(key)
        finally:
            self.counters.load_seconds += time.perf_counter() - started

    def _load(self, key: SegmentKey) -> StoredSegment | None:
        self.counters.lookups += 1
        name = self.entry_name(key)
        try:
            if not self.backend.exists(name + "_h"):
                self.counters.misses += 1
                return None
            fields = decode_header(self._read(name + "_h", HEADER_BYTES))
            if fields is None or fields.get("version") != FORMAT_VERSION:
                return self._corrupt(name, "header")
            if fields.get("key") != key_fields(key) or fields.get("kv") != self._fingerprint_fields:
                self.counters.mismatched += 1
                self.counters.misses += 1
                return None
            layout = self._layout(fields)
            if sum(size for _, _, size in layout) != fields.get("payload_bytes"):
                raise _Corrupt("payload size does not match its shapes")
            if fields.get("payload") != payload_name(name, str(fields.get("sha256"))):
                raise _Corrupt("payload name does not match its checksum")
            payload = self._read(fields["payload"], int(fields["payload_bytes"]))
            if hashlib.sha256(payload).hexdigest() != fields.get("sha256"):
                return self._corrupt(name, "payload checksum")
            stored = self._unpack(fields, layout, payload)
        except _Corrupt as error:
            return self._corrupt(name, str(error))
        except Exception as error:
            self._error("read", error)
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        self.counters.bytes_read += len(payload) + HEADER_BYTES
        return stored

    def _read(self, name: str, size: int) -> bytes:
        """Exactly ``size`` bytes of object ``name`` (:class:`_Corrupt` otherwise)."""
        target = torch.zeros(size, dtype=torch.uint8)
        try:
            got = self.backend.get(name, target)
        except OSError as error:  # file: a truncated object is a short read
            raise _Corrupt(f"{name}: {error}") from error
        if not isinstance(got, torch.Tensor) or got.numel() * got.element_size() != size:
            raise _Corrupt(f"{name}: missing or wrong size")
        return got.contiguous().view(torch.uint8).numpy().tobytes()

    def _layout(self, fields: dict) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
        """``(shape, dtype, bytes)`` of each payload tensor the header describes, checked
        against this server's fingerprint before anything is read (:class:`_Corrupt`)."""
        fp = self.fingerprint
        try:
            dtype = dtype_of(fields["dtype"])
            positions = tuple(int(d) for d in fields["positions"])
            k_shape = tuple(int(d) for d in fields["k_shape"])
            v_shape = tuple(int(d) for d in fields["v_shape"])
            n, m = positions[1], k_shape[1]
            kept = fields["kept"]
            shapes = [(positions, torch.long)]
            if kept is not None:
                shapes.append(((int(kept),), torch.long))
            if fields["ranking"]:
                shapes.append(((n,), torch.float32))
            shapes += [(k_shape, dtype), (v_shape, dtype)]
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise _Corrupt(f"bad layout ({error!r})") from error
        if (
            len(positions) != 2
            or k_shape != (fp.layers, m, fp.heads, fp.head_dim)
            or v_shape != (fp.layers, m, fp.heads, fp.v_head_dim)
            or m != (n if kept is None else kept)
            or min(*positions, m) < 0
        ):
            raise _Corrupt(f"shapes {positions} {k_shape} {v_shape} do not fit the fingerprint")
        out = []
        for shape, kind in shapes:
            count = 1
            for dim in shape:
                count *= dim
            out.append((shape, kind, count * torch.empty(0, dtype=kind).element_size()))
        return out

    @staticmethod
    def _unpack(fields: dict, layout, payload: bytes) -> StoredSegment:
        """The tensors of ``payload`` as laid out by :meth:`save` (``layout``: :meth:`_layout`)."""
        tensors, offset = [], 0
        for shape, kind, size in layout:
            chunk = bytearray(payload[offset : offset + size])
            if len(chunk) != size:
                raise _Corrupt("payload shorter than its shapes")
            tensors.append(torch.frombuffer(chunk, dtype=kind).reshape(shape))
            offset += size
        if offset != len(payload):
            raise _Corrupt("payload longer than its shapes")
        kept = tensors[1] if fields["kept"] is not None else None
        ranking = tensors[-3] if fields["ranking"] else None
        return StoredSegment(tensors[0], kept, ranking, tensors[-2], tensors[-1])

    def _corrupt(self, name: str, what: str) -> None:
        self.counters.corrupt += 1
        self.counters.misses += 1
        logger.warning("sgl_mmkv: L3 segment %s is corrupt (%s); treated as a miss", name, what)
        return None

    def _error(self, what: str, error: BaseException) -> None:
        self.counters.errors += 1
        logger.warning("sgl_mmkv: L3 segment storage %s failed (%r)", what, error)

    def check(self) -> None:
        """Write (once per storage) and read back a fixed probe object.

        SGLang's backends share one interface, but in 0.5.23 only some implement its
        tensor ``get`` / ``set`` (``file`` does; ``mooncake`` is zero-copy only,
        ``hf3fs`` and ``nixl`` moved to page batches, ``sim`` keeps no data).

        Raises:
            StorageError: the probe did not round-trip.
        """
        probe = torch.frombuffer(bytearray(hashlib.sha256(MAGIC).digest() * 2), dtype=torch.uint8)
        try:
            if not self.backend.exists(_PROBE) and not self.backend.set(_PROBE, probe):
                raise StorageError("writing a probe object failed")
            got = self._read(_PROBE, int(probe.numel()))
        except Exception as error:
            raise StorageError(
                f"{type(self.backend).__name__} does not store and return tensors through "
                f"HiCacheStorage.get / set ({error}); segment storage is tested with file"
            ) from error
        if got != probe.numpy().tobytes():
            raise StorageError(
                f"{type(self.backend).__name__} returned other bytes than were stored "
                "for a probe object; segment storage is tested with file"
            )


_PROBE = "sgl_mmkv_probe"


class _Corrupt(Exception):
    """An entry that is not what its header says."""


def open_storage(
    backend_name: str,
    fingerprint: KVFingerprint,
    directory: str | None = None,
    extra_config: dict[str, Any] | None = None,
) -> SegmentStorage:
    """A :class:`SegmentStorage` over SGLang's backend ``backend_name``, made by its
    ``StorageBackendFactory`` (``file``: ``directory`` is its ``file_storage_path``),
    checked by a probe round trip (:meth:`SegmentStorage.check`).

    Raises:
        StorageError: the factory does not know the backend or could not create it, or
            it does not store and return tensors.
    """
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
    storage = SegmentStorage(backend, fingerprint)
    try:
        storage.check()
    except StorageError as error:
        raise StorageError(f"--mm-segment-storage {backend_name}: {error}") from error
    return storage


def storage_backends() -> list[str]:
    """The backend names SGLang's ``StorageBackendFactory`` knows."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return sorted(StorageBackendFactory._registry)

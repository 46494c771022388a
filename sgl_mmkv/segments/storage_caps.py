"""Size caps of the ``file`` segment storage: old entries give way.

The directory is shared by every instance pointed at it, so the caps are checked
against the directory itself: a scan (at the first write, then at most every
:data:`RESCAN_SECONDS`) plus this instance's writes since. Before a write the
oldest entries of its namespace give way until the namespace fits its cap, then
the oldest entries of any namespace until the total fits. An entry's age is its
newest object's mtime; a hit refreshes it (:meth:`StorageCaps.touched`), so the
order is least recently used across instances. Only the writer thread calls in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from sgl_mmkv.segments.file_directory import FileDirectory

RESCAN_SECONDS = 30.0
NAMESPACE = slice(len("sgl_mmkv_"), len("sgl_mmkv_") + 16)  # an entry name's namespace tag


@dataclass(slots=True)
class Admission:
    """What one write's admission did."""

    admitted: bool
    evicted: int = 0  # entries removed to make room
    evicted_bytes: int = 0


class StorageCaps:
    """Args:
    directory: the storage directory.
    max_bytes: every entry together (> 0).
    namespace_max_bytes: the entries of one namespace (> 0).
    """

    def __init__(self, directory: FileDirectory, max_bytes: int, namespace_max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.namespace_max_bytes = namespace_max_bytes
        self._entries: OrderedDict[str, int] = OrderedDict()  # entry -> bytes, oldest first
        self._namespaces: dict[str, int] = {}
        self.total = 0
        self._scanned = -float("inf")

    def _rescan(self) -> None:
        entries: dict[str, list] = {}
        for _, found in self.directory.scan():
            size, mtime = entries.get(found.entry, (0, 0.0))
            entries[found.entry] = (size + found.bytes, max(mtime, found.mtime))
        self._entries = OrderedDict(
            (e, size) for e, (size, _) in sorted(entries.items(), key=lambda kv: kv[1][1])
        )
        self._namespaces, self.total = {}, 0
        for entry, size in self._entries.items():
            self._count(entry, size)
        self._scanned = time.monotonic()

    def _count(self, entry: str, size: int) -> None:
        space = entry[NAMESPACE]
        self._namespaces[space] = self._namespaces.get(space, 0) + size
        self.total += size

    def admit(self, entry: str, size: int) -> Admission:
        """Room for a new entry of ``size`` bytes, made by removing old entries; not
        admitted when it is larger than a cap."""
        if size > self.max_bytes or size > self.namespace_max_bytes:
            return Admission(False)
        if time.monotonic() - self._scanned > RESCAN_SECONDS:
            self._rescan()
        self.removed(entry)
        space = entry[NAMESPACE]
        done = Admission(True)
        for victim in [e for e in self._entries if e[NAMESPACE] == space]:
            if self._namespaces.get(space, 0) + size <= self.namespace_max_bytes:
                break
            self._evict(victim, done)
        for victim in list(self._entries):
            if self.total + size <= self.max_bytes:
                break
            self._evict(victim, done)
        return done

    def _evict(self, entry: str, done: Admission) -> None:
        done.evicted += 1
        done.evicted_bytes += self.directory.remove_entry(entry)
        self.removed(entry)

    def added(self, entry: str, size: int) -> None:
        """A new entry was written (newest)."""
        self.removed(entry)
        self._entries[entry] = size
        self._count(entry, size)

    def removed(self, entry: str) -> None:
        size = self._entries.pop(entry, None)
        if size is not None:
            self._count(entry, -size)

    def touched(self, entry: str) -> None:
        """A hit: ``entry`` is now the most recently used."""
        if entry in self._entries:
            self._entries.move_to_end(entry)

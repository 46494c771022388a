"""The ``file`` storage directory, read as untrusted input.

SGLang's ``HiCacheFile.get`` opens ``<dir>/<key><suffix>.bin`` with ``open()``: it
follows symlinks out of the directory and blocks on a FIFO until a writer appears.
Segment storage reads its own objects here instead: opened relative to the
directory (names are checked, no path separators), with ``O_NOFOLLOW`` and
``O_NONBLOCK``, accepted only as regular files of exactly the size the header
implies. Writes still go through the backend (a temporary file, then a rename).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

# A stored object's name: an entry's header (_h) or payload (_p<checksum>).
ENTRY_NAME = re.compile(r"(sgl_mmkv_[0-9a-f]{16}_[0-9a-f]{64})_(h|p[0-9a-f]{16})")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_]+")
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeObject(OSError):
    """An object that is not a regular file in the directory (a symlink, FIFO, device,
    directory)."""


class WrongSize(ValueError):
    """A regular file of another size than its header implies (truncated, padded)."""


@dataclass(slots=True)
class StoredFile:
    """One object of the directory, as a scan saw it."""

    entry: str  # the entry's name stem (``ENTRY_NAME`` group 1)
    bytes: int
    mtime: float


class FileDirectory:
    """Reads, sizes and removes the objects of one ``file`` backend directory.

    Args:
        path: the backend's directory (resolved once, here).
        suffix: what the backend appends to an object's name before ``.bin``.
    """

    def __init__(self, path: str, suffix: str) -> None:
        self.path = os.path.realpath(path)
        self.suffix = suffix

    def file_name(self, name: str) -> str:
        if not _SAFE_NAME.fullmatch(name):
            raise UnsafeObject(f"{name!r} is not an object name")
        return f"{name}{self.suffix}.bin"

    def _open_dir(self) -> int:
        return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def size(self, name: str) -> int | None:
        """Bytes of object ``name``; None if it is missing.

        Raises:
            UnsafeObject: it is not a regular file.
        """
        try:
            info = os.stat(os.path.join(self.path, self.file_name(name)), follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeObject(f"{name} is not a regular file")
        return info.st_size

    def read(self, name: str, size: int) -> bytes:
        """Exactly ``size`` bytes of object ``name``.

        Raises:
            FileNotFoundError: it is missing.
            UnsafeObject: a symlink, or not a regular file.
            WrongSize: not ``size`` bytes long.
        """
        directory = self._open_dir()
        try:
            fd = os.open(self.file_name(name), _READ_FLAGS, dir_fd=directory)
        except OSError as error:
            if isinstance(error, FileNotFoundError):
                raise
            raise UnsafeObject(f"{name}: {error.strerror}") from error
        finally:
            os.close(directory)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeObject(f"{name} is not a regular file")
            if info.st_size != size:
                raise WrongSize(f"{name} has {info.st_size} bytes, not {size}")
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise WrongSize(f"{name} ended after {got} of {size} bytes")
                got += n
            return bytes(data)
        finally:
            os.close(fd)

    def touch(self, name: str) -> None:
        """Mark object ``name`` recently used (its mtime: every instance sees it)."""
        os.utime(os.path.join(self.path, self.file_name(name)), follow_symlinks=False)

    def remove_entry(self, entry: str) -> int:
        """Unlink every object of entry ``entry`` (symlinks themselves, never their
        targets). Returns the bytes freed."""
        freed = 0
        for file_name, found in self.scan(entry):
            try:
                os.unlink(os.path.join(self.path, file_name))
                freed += found.bytes
            except FileNotFoundError:
                pass
        return freed

    def scan(self, entry: str | None = None) -> list[tuple[str, StoredFile]]:
        """``(file name, StoredFile)`` of every entry object in the directory (of
        ``entry`` only, if given); other files are left alone."""
        out = []
        end = self.suffix + ".bin"
        try:
            listing = os.scandir(self.path)
        except FileNotFoundError:
            return out
        with listing:
            for item in listing:
                if not item.name.endswith(end):
                    continue
                match = ENTRY_NAME.fullmatch(item.name[: -len(end)])
                if match is None or (entry is not None and match.group(1) != entry):
                    continue
                try:
                    info = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((item.name, StoredFile(match.group(1), info.st_size, info.st_mtime)))
        return out

    def free_bytes(self) -> int | None:
        """Bytes free to unprivileged writers on the directory's file system."""
        try:
            info = os.statvfs(self.path)
        except OSError:
            return None
        return info.f_bavail * info.f_frsize

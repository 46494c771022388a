"""Storage I/O off the scheduler's thread: reads waited for at most a deadline,
writes queued and never waited for.

A read runs on a daemon worker thread; the forward waits for it at most
``deadline_s``. One that takes longer is abandoned (the worker is not waited for)
and the storage counts as stalled: reads are refused at once until the abandoned
one returns or :data:`STALL_SECONDS` pass, after which a fresh worker may be
started (at most :data:`MAX_READ_THREADS` ever, so a backend that hangs forever
costs a few threads, never the scheduler). Writes run in order on one daemon
thread from a queue bounded in entries and bytes; a write that finds it full is
refused.

A server started with ``SGL_MMKV_STORAGE_DELAY_FILE=<path>`` sleeps, in each storage
read, the seconds that file holds (:func:`injected_delay`): the tests' slow storage.
Without the variable (every real deployment) it costs one environment lookup.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_READ_THREADS = 4
STALL_SECONDS = 5.0

DONE, TIMEOUT, STALLED = "done", "timeout", "stalled"
DELAY_FILE_ENV = "SGL_MMKV_STORAGE_DELAY_FILE"


def injected_delay() -> None:
    """Sleep the seconds the file named by :data:`DELAY_FILE_ENV` holds (tests only)."""
    path = os.environ.get(DELAY_FILE_ENV)
    if path is None:
        return
    try:
        with open(path) as f:
            seconds = float(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    time.sleep(max(0.0, min(seconds, 60.0)))


@dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None
    finished: bool = False
    abandoned: bool = False


@dataclass(slots=True)
class Outcome:
    """``status``: :data:`DONE` (``value`` or ``error`` set), :data:`TIMEOUT` or
    :data:`STALLED` (not run)."""

    status: str
    value: Any = None
    error: BaseException | None = None


class DeadlineCaller:
    """Runs calls on worker threads, waiting for each at most ``deadline_s`` seconds."""

    def __init__(self, deadline_s: float, name: str = "sgl_mmkv-storage-read") -> None:
        self.deadline_s = deadline_s
        self.name = name
        self._lock = threading.Lock()
        self._calls: deque[_Call] = deque()
        self._ready = threading.Semaphore(0)
        self._threads = 0
        self._idle = 0
        self._abandoned = 0
        self._stalled_at = -float("inf")

    @property
    def threads(self) -> int:
        return self._threads

    def call(self, fn: Callable[[], Any]) -> Outcome:
        """``fn()`` on a worker, or :data:`TIMEOUT` / :data:`STALLED`."""
        with self._lock:
            stalled = self._abandoned and time.monotonic() - self._stalled_at < STALL_SECONDS
            if stalled or (self._idle == 0 and self._threads >= MAX_READ_THREADS):
                return Outcome(STALLED)
            if self._idle == 0:
                self._threads += 1
                self._idle += 1
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
            self._idle -= 1
            call = _Call(fn)
            self._calls.append(call)
        self._ready.release()
        call.done.wait(self.deadline_s)
        with self._lock:
            if not call.finished:
                call.abandoned = True
                self._abandoned += 1
                self._stalled_at = time.monotonic()
                return Outcome(TIMEOUT)
        return Outcome(DONE, call.value, call.error)

    def _work(self) -> None:
        while True:
            self._ready.acquire()
            with self._lock:
                call = self._calls.popleft()
            try:
                call.value = call.fn()
            except BaseException as error:  # handed to the caller, never raised here
                call.error = error
            with self._lock:
                call.finished = True
                self._idle += 1
                if call.abandoned:
                    self._abandoned -= 1
            call.done.set()


class WriteQueue:
    """Runs queued calls in order on one daemon thread: writes first, then the calls
    of a second lane (``put_light``: an entry's touch after a hit), which has its own
    bound, so a burst of hits never takes a write's place.

    Args:
        max_entries: calls waiting at most.
        max_bytes: bytes the waiting and the running call hold at most (their ``size``).
        max_light: light calls waiting at most.
    """

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        name: str = "sgl_mmkv-storage-write",
        max_light: int = 1024,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_light = max_light
        self.name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Callable[[], Any], int]] = deque()
        self._light: deque[tuple[Callable[[], Any], int]] = deque()
        self._bytes = 0
        self._busy = False
        self._thread: threading.Thread | None = None

    def put(self, fn: Callable[[], Any], size: int = 0) -> bool:
        """Queue ``fn``; False (nothing queued) when the queue is full."""
        with self._cond:
            if len(self._queue) >= self.max_entries or self._bytes + size > self.max_bytes:
                return False
            self._queue.append((fn, size))
            self._bytes += size
            self._wake()
        return True

    def put_light(self, fn: Callable[[], Any]) -> bool:
        """Queue ``fn`` in the light lane; False (nothing queued) when it is full."""
        with self._cond:
            if len(self._light) >= self.max_light:
                return False
            self._light.append((fn, 0))
            self._wake()
        return True

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued call has run; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._light or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._light:
                    self._cond.wait()
                fn, size = (self._queue or self._light).popleft()
                self._busy = True
            try:
                fn()
            except BaseException:  # a queued call counts its own failures
                pass
            with self._cond:
                self._bytes -= size
                self._busy = False
                self._cond.notify_all()

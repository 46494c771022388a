"""Start a real SGLang server (stock or sgl_mmkv) as a child process and end it by PID.

Used by the tests and the benchmarks: one server per test module, logs to a file,
and the whole process tree (tokenizer, scheduler, detokenizer) ended on exit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import psutil
import requests

from sgl_mmkv.cpu_support import cpu_environment
from sgl_mmkv.refresh.faults import FAULT_FILE_ENV


def cpu_server_args(max_total_tokens: int = 4096) -> tuple[str, ...]:
    """The small-pool CPU settings shared by both sides of every comparison, with a KV
    pool of ``max_total_tokens`` tokens. An idle SGLang scheduler busy-polls a core
    unless it sleeps on idle (a zmq poll that wakes on the next request): on a 2-core
    machine two servers up at once would slow each other."""
    return (
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--mem-fraction-static",
        "0.2",
        "--max-total-tokens",
        str(max_total_tokens),
        "--random-seed",
        "0",
        "--enable-cache-report",
        "--sleep-on-idle",
    )


CPU_SERVER_ARGS: tuple[str, ...] = cpu_server_args()


def mmkv_stats(base_url: str, timeout_s: float = 60.0) -> dict:
    """sgl_mmkv's counters from ``GET /get_server_info`` (empty for stock or ``off``)."""
    response = requests.get(base_url + "/get_server_info", timeout=timeout_s)
    response.raise_for_status()
    states = response.json().get("internal_states") or [{}]
    return (states[0] or {}).get("sgl_mmkv") or {}


def flush_cache(base_url: str, timeout_s: float = 60.0) -> None:
    """Empty the server's caches. SGLang refuses (400) while a request is still being
    retired after its response was sent, so retry until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = requests.post(base_url + "/flush_cache", timeout=60)
        if response.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"/flush_cache failed: {response.status_code} {response.text}")
        time.sleep(0.2)


# Tests and benchmarks read per-request reuse facts and sgl_mmkv's counters, which a
# server reports only to an operator who asks (off by default: they reveal other
# clients' images).
REPORT_REUSE = "--mm-report-reuse"

BIND_ERROR = "address already in use"


class PortInUse(RuntimeError):
    """The server could not bind its HTTP port (taken between choosing and binding)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stock_cpu_env() -> dict[str, str]:
    """The environment stock ``sglang.launch_server`` needs on this CPU machine.

    The same one ``sgl_mmkv.launch_server`` prepares for itself, so that both
    sides of a comparison run with identical process settings.
    """
    env = cpu_environment(dict(os.environ))
    env.pop("TRITON_INTERPRET", None)  # a test-process setting, not a server one
    return env


FALLBACK_LINE = "sgl_mmkv: refresh path failed"


class UnexpectedFallback(AssertionError):
    """Our path failed mid-forward in a server that was not told to expect it."""


class ServerProcess:
    """One server process tree. Use as a context manager or call :meth:`stop`.

    With :attr:`strict_fallbacks` set (the test suite sets it), leaving the context
    raises :class:`UnexpectedFallback` when our path fell back to stock in this server
    (the answers stay right, so only the log tells) unless ``allow_fallbacks`` or a
    fault file in ``env`` says the test expects it.
    """

    strict_fallbacks: bool = False

    def __init__(
        self,
        module: str,
        model_path: str | Path,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        allow_fallbacks: bool = False,
    ) -> None:
        self._module, self._model_path, self._extra_args = module, model_path, extra_args
        self._chosen_port = port is None
        self._log_path_given = log_path
        self._use_port(port or free_port())
        self._env = env if env is not None else stock_cpu_env()
        self._cwd = cwd
        self._allow_fallbacks = allow_fallbacks or FAULT_FILE_ENV in self._env
        self.process: subprocess.Popen | None = None

    def _use_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = Path(self._log_path_given or f"/tmp/sgl_mmkv_server_{port}.log")
        self.command = [
            sys.executable,
            "-m",
            self._module,
            "--model-path",
            str(self._model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self._extra_args,
        ]

    def start(self, timeout_s: float = 240.0, attempts: int = 3) -> ServerProcess:
        """Start the server and wait for ``/health``; a running server is kept
        (so ``with ServerProcess(...).start()`` does not start a second one).

        A port this class chose can be taken by another socket before the server
        binds it; the server is then stopped and started again on a new free port,
        up to ``attempts`` times."""
        if self.process is not None and self.process.poll() is None:
            return self
        for attempt in range(1, attempts + 1):
            self._spawn()
            try:
                self._wait_ready(timeout_s)
                return self
            except PortInUse:
                self.stop()
                if not self._chosen_port or attempt == attempts:
                    raise
                self._use_port(free_port())
            except BaseException:
                self.stop()
                raise
        return self

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self._env, cwd=self._cwd
        )
        log.close()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}; log tail:\n{self.log_tail()}"
                )
            if BIND_ERROR in self.log_text():
                raise PortInUse(f"port {self.port} taken; log tail:\n{self.log_tail()}")
            try:
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout_s} s; log tail:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("server not started")
        return self.process.pid

    def stop(self, timeout_s: float = 20.0) -> None:
        """End the server and every process it started, by PID.

        The launcher is killed first: asked to end, it (or, when a child ends first,
        its crash handler) waits about 5 s before it ends its children, and a suite
        stops some 80 servers. Its children are then asked to end, and killed after
        ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            parent = psutil.Process(self.process.pid)
            children = parent.children(recursive=True)
            parent.kill()
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.terminate()
        _, alive = psutil.wait_procs(children, timeout=timeout_s)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        self.process.wait(timeout=5)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def fallback_lines(self) -> list[str]:
        """The log lines where our path fell back to stock for a batch."""
        return [line for line in self.log_text().splitlines() if FALLBACK_LINE in line]

    def check_fallbacks(self) -> None:
        """Raise :class:`UnexpectedFallback` if :attr:`strict_fallbacks` is set and the
        log shows a fallback this server was not told to expect."""
        if not self.strict_fallbacks or self._allow_fallbacks:
            return
        lines = self.fallback_lines()
        if lines:
            raise UnexpectedFallback(
                f"{len(lines)} batch(es) fell back to stock in {self.log_path}: {lines[0]}"
            )

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None:
            self.check_fallbacks()


def start_together(servers: Sequence[ServerProcess], timeout_s: float = 240.0) -> None:
    """Start ``servers`` at once: their start-ups overlap (two took 33 s together
    against 48 s one after the other on a 2-core machine). The first one to fail (or
    an interrupt) stops every one at once, so the others' waits end then, not at their
    timeouts; its error is raised."""

    def stop_all() -> None:
        for server in servers:
            server.stop()

    pool = ThreadPoolExecutor(len(servers))
    futures = [pool.submit(server.start, timeout_s) for server in servers]
    first: BaseException | None = None
    ok = False
    try:
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        first = next((f.exception() for f in done if f.exception() is not None), None)
        ok = first is None
    finally:
        if not ok:
            stop_all()
        pool.shutdown(wait=True)
        if not ok:
            stop_all()  # one a port retry spawned after the first stop
    if first is not None:
        raise first


class ServerPool(Mapping[str, ServerProcess]):
    """Servers by name, each started when first asked for, at most ``max_alive`` up
    at once: the least recently asked for is stopped first (and started again, with
    a fresh cache, if asked for later). A test module with many configurations then
    holds the memory of two or three servers, not of all of them.

    Args:
        servers: name -> a server not started yet.
        max_alive: how many may run at once (a test uses at most this many).
        timeout_s: start-up timeout of each.
    """

    def __init__(
        self, servers: dict[str, ServerProcess], max_alive: int = 2, timeout_s: float = 400.0
    ) -> None:
        self._servers, self._max_alive, self._timeout_s = servers, max_alive, timeout_s
        self._order: list[str] = []  # running, least recently asked for first
        self.starts = 0

    def __getitem__(self, name: str) -> ServerProcess:
        server = self._servers[name]
        if name in self._order:
            self._order.remove(name)
        else:
            while len(self._order) >= self._max_alive:
                self._stop(self._order.pop(0))
            server.start(self._timeout_s)
            self.starts += 1
        self._order.append(name)
        return server

    def __iter__(self) -> Iterator[str]:
        return iter(self._servers)

    def __len__(self) -> int:
        return len(self._servers)

    def _stop(self, name: str) -> None:
        server = self._servers[name]
        server.stop()
        server.check_fallbacks()

    def close(self) -> None:
        """Stop every running server (then check their logs for fallbacks)."""
        names, self._order = self._order, []
        for name in names:
            self._servers[name].stop()
        for name in names:
            self._servers[name].check_fallbacks()

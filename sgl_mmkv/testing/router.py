"""Start SGLang's router (``sglang-router``) in front of workers, and end it by PID.

Used by the routing test and ``benchmarks/router_affinity.py``. The router is the
``sglang_router`` package's Rust binary behind ``python -m sglang_router.launch_router``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import requests

from sgl_mmkv.testing.server import free_port


def router_available() -> bool:
    """Whether the ``sglang_router`` package is importable here."""
    return importlib.util.find_spec("sglang_router") is not None


class RouterProcess:
    """``python -m sglang_router.launch_router`` over ``worker_urls``; a context manager."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str,
        log_path: str | Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.command = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            "--log-level",
            "warn",
            *extra_args,
        ]
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> RouterProcess:
        """Start the router and wait until it answers ``/v1/models`` through a worker."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"router exited with {self.process.returncode}:\n{self.log()}")
            try:
                if requests.get(self.base_url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"router not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the router process by its PID."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

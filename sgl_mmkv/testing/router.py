"""Start SGLang's router (``sglang-router``) in front of workers, and sgl_mmkv's
gateway in front of the router, as child processes; end them by PID.

Used by the routing tests and ``benchmarks/router_affinity.py``. The router is the
``sglang_router`` package's Rust binary behind ``python -m sglang_router.launch_router``;
the gateway is ``python -m sgl_mmkv.gateway``.
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


class _HTTPChild:
    """A child process serving HTTP on ``port``, ready when ``/v1/models`` answers
    200; a context manager."""

    def __init__(self, name: str, command: list[str], port: int, log_path: str | Path) -> None:
        self.name = name
        self.command = command
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> _HTTPChild:
        """Start the process and wait until it answers ``/v1/models`` through a worker."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"{self.name} exited with {code}:\n{self.log()}")
            try:
                if requests.get(self.base_url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the process by its PID."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RouterProcess(_HTTPChild):
    """``python -m sglang_router.launch_router`` over ``worker_urls``."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str,
        log_path: str | Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        port = free_port()
        self.prometheus_port = free_port()
        command = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            policy,
            "--log-level",
            "warn",
            "--prometheus-port",
            str(self.prometheus_port),
            *extra_args,
        ]
        super().__init__("router", command, port, log_path)

    def manual_branches(self) -> dict[str, float]:
        """How the ``manual`` policy placed requests so far, from the router's Prometheus
        metrics: ``{vacant: new keys, occupied_hit: known keys, no_routing_id: no key}``."""
        text = requests.get(f"http://127.0.0.1:{self.prometheus_port}/metrics", timeout=10).text
        prefix = 'smg_manual_policy_branch_total{branch="'
        found = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                branch, _, value = line[len(prefix) :].partition('"} ')
                found[branch] = float(value)
        return {branch: n for branch, n in found.items() if n}


class GatewayProcess(_HTTPChild):
    """``python -m sgl_mmkv.gateway`` in front of the router at ``router_url``."""

    def __init__(
        self, router_url: str, log_path: str | Path, extra_args: Sequence[str] = ()
    ) -> None:
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "sgl_mmkv.gateway",
            "--router-url",
            router_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra_args,
        ]
        super().__init__("gateway", command, port, log_path)

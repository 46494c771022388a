"""A Mooncake store on the loopback: ``mooncake_master`` (with its HTTP metadata
service) and a storage process (``mooncake_client``) holding the memory, each on free
ports, each stopped by PID. Used by the tests and by benchmarks/scaleout_mooncake.py.

Every process and client listens on and talks to 127.0.0.1 only
(``MC_TCP_BIND_ADDRESS``: Mooncake's transfer engine would bind to the first
network interface). Mooncake's client must import (``scripts/install.sh`` installs it
and Debian's ``libibverbs1``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"
BIND_ENV = {"MC_TCP_BIND_ADDRESS": LOOPBACK}
os.environ.update(BIND_ENV)  # before any client in this process is set up


def client_class():
    """``MooncakeDistributedStore``; ImportError says what to install."""
    from sgl_mmkv.segments.mooncake_store import import_client

    return import_client()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    import mooncake

    return str(Path(mooncake.__file__).parent / name)


def _wait_port(port: int, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            socket.create_connection((LOOPBACK, port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{process.args[0]} did not listen on {port} in {timeout_s} s")


def _stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


class MooncakeCluster:
    """A master and, with ``storage_bytes``, a storage process holding that much.

    Args:
        log_dir: where the processes' logs go.
        storage_bytes: the storage process's global segment (0: none).
        rpc_port, metadata_port: the master's ports (default: free ones).
    """

    def __init__(
        self,
        log_dir: Path,
        storage_bytes: int = 64 * 2**20,
        rpc_port: int | None = None,
        metadata_port: int | None = None,
    ) -> None:
        client_class()  # fail before starting anything
        self.log_dir = Path(log_dir)
        self.storage_bytes = storage_bytes
        self.rpc_port = rpc_port or free_port()
        self.metadata_port = metadata_port or free_port()
        self.admin_port = free_port()  # the master's HTTP metrics and admin endpoints
        self.master: subprocess.Popen | None = None
        self.storage: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata"

    def config(self, **extra) -> dict:
        """``--mm-segment-storage-config`` of a client that adds no memory."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": LOOPBACK,
            "protocol": "tcp",
            "global_segment_size": 0,
            "local_buffer_size": 16 * 2**20,
            **extra,
        }

    def config_json(self, **extra) -> str:
        return json.dumps(self.config(**extra))

    def start_master(self) -> None:
        args = [
            _binary("mooncake_master"),
            f"-rpc_port={self.rpc_port}",
            f"-rpc_address={LOOPBACK}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_port={self.metadata_port}",
            f"-http_metadata_server_host={LOOPBACK}",
            f"-metrics_port={self.admin_port}",
            f"-metrics_host={LOOPBACK}",
        ]
        with open(self.log_dir / f"master-{self.rpc_port}.log", "ab") as log:
            self.master = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        _wait_port(self.rpc_port, self.master)
        _wait_port(self.metadata_port, self.master)

    def start_storage(self) -> None:
        port = free_port()
        args = [
            _binary("mooncake_client"),
            f"-host={LOOPBACK}",
            f"-port={port}",
            f"-global_segment_size={self.storage_bytes}",
            f"-master_server_address={self.master_address}",
            f"-metadata_server={self.metadata_server}",
            "-protocol=tcp",
        ]
        env = {**os.environ, **BIND_ENV}
        with open(self.log_dir / f"storage-{port}.log", "ab") as log:
            self.storage = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        _wait_port(port, self.storage)

    def start(self) -> MooncakeCluster:
        self.start_master()
        if self.storage_bytes:
            self.start_storage()
        return self

    def keys(self) -> set[str]:
        """Every object name in the store (the master's ``/get_all_keys``)."""
        url = f"http://{LOOPBACK}:{self.admin_port}/get_all_keys"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {line.strip() for line in text.splitlines() if line.strip()}

    def kill_master(self) -> None:
        """SIGKILL the master (a crash), by PID."""
        self.master.kill()
        self.master.wait(10)

    def stop(self) -> None:
        _stop(self.storage)
        _stop(self.master)

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def raw_client(self):
        """A client of the store (adds no memory), as an operator or an attacker
        with access to the store has: it writes any bytes under any name."""
        client = client_class()()
        code = client.setup(
            LOOPBACK, self.metadata_server, 0, 16 * 2**20, "tcp", "", self.master_address
        )
        assert code == 0, code
        return client

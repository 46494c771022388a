"""ServerProcess starts again on a new port when its chosen port is taken before it binds;
it fails its test on a fallback it was not told to expect; ServerPool bounds how many run;
start_together starts servers at once and stops them all when one fails."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import requests

import sgl_mmkv.testing.server as server_module
from sgl_mmkv.refresh.faults import FAULT_FILE_ENV
from sgl_mmkv.testing.server import (
    FALLBACK_LINE,
    PortInUse,
    ServerPool,
    ServerProcess,
    UnexpectedFallback,
    start_together,
)

FAKE_SERVER = """
import argparse, http.server, sys, time
parser = argparse.ArgumentParser()
parser.add_argument("--model-path")
parser.add_argument("--host")
parser.add_argument("--port", type=int)
args = parser.parse_args()

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass

try:
    httpd = http.server.HTTPServer((args.host, args.port), Health)
except OSError:
    # what uvicorn prints, and like it the process does not exit
    print(f"ERROR: [Errno 98] error while attempting to bind on address "
          f"('{args.host}', {args.port}): address already in use", flush=True)
    time.sleep(600)
httpd.serve_forever()
"""


@pytest.fixture()
def fake_server_env(tmp_path):
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_taken_port_is_replaced(tmp_path, fake_server_env, monkeypatch):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    ports = iter([taken])
    real_free_port = server_module.free_port
    monkeypatch.setattr(server_module, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        with ServerProcess(
            "fake_server", "m", env=fake_server_env, log_path=tmp_path / "s.log"
        ) as s:
            assert s.port != taken
            assert s.command[s.command.index("--port") + 1] == str(s.port)
            assert requests.get(s.base_url + "/health", timeout=5).status_code == 200
        assert s.process.poll() is not None  # stopped on exit
    finally:
        blocker.close()


def test_a_port_given_by_the_caller_is_not_replaced(tmp_path, fake_server_env):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    try:
        server = ServerProcess("fake_server", "m", port=taken, env=fake_server_env)
        with pytest.raises(PortInUse, match=str(taken)):
            server.start(timeout_s=30)
        assert server.process.poll() is not None  # the hung child was ended
    finally:
        blocker.close()
    assert sys.executable in server.command


def _log_a_fallback(server: ServerProcess) -> None:
    with open(server.log_path, "a") as log:
        log.write(f"[t] {FALLBACK_LINE} (RuntimeError('x')) for rids ['r']\n")


def test_an_unexpected_fallback_fails_on_exit_an_expected_one_does_not(
    tmp_path, fake_server_env, monkeypatch
):
    monkeypatch.setattr(ServerProcess, "strict_fallbacks", True)
    with pytest.raises(UnexpectedFallback, match="1 batch"):
        with ServerProcess("fake_server", "m", env=fake_server_env, log_path=tmp_path / "a") as s:
            _log_a_fallback(s)
    assert s.process.poll() is not None  # stopped before the check
    expected = [
        {"allow_fallbacks": True, "env": fake_server_env},
        {"env": {**fake_server_env, FAULT_FILE_ENV: str(tmp_path / "faults")}},
    ]
    for i, kwargs in enumerate(expected):
        with ServerProcess("fake_server", "m", log_path=tmp_path / f"b{i}", **kwargs) as s:
            _log_a_fallback(s)
        assert len(s.fallback_lines()) == 1


def test_a_server_pool_keeps_at_most_max_alive_up_least_recently_used_out(
    tmp_path, fake_server_env
):
    pool = ServerPool(
        {
            name: ServerProcess("fake_server", "m", env=fake_server_env, log_path=tmp_path / name)
            for name in "abc"
        },
        max_alive=2,
        timeout_s=30,
    )
    servers = {name: pool._servers[name] for name in pool}

    def running() -> list[str]:
        return sorted(n for n, s in servers.items() if s.process and s.process.poll() is None)

    try:
        pool["a"], pool["b"]
        assert running() == ["a", "b"] and pool.starts == 2
        pool["a"]  # a is now the most recent: c stops b
        pool["c"]
        assert running() == ["a", "c"] and pool.starts == 3
        assert requests.get(pool["b"].base_url + "/health", timeout=5).status_code == 200
        assert running() == ["b", "c"] and pool.starts == 4
    finally:
        pool.close()
    assert running() == [] and len(pool) == 3


def test_start_together_starts_every_server_and_stops_all_when_one_fails(tmp_path, fake_server_env):
    good = [
        ServerProcess("fake_server", "m", env=fake_server_env, log_path=tmp_path / f"g{i}")
        for i in range(2)
    ]
    try:
        start_together(good, timeout_s=30)
        for server in good:
            assert requests.get(server.base_url + "/health", timeout=5).status_code == 200
    finally:
        for server in good:
            server.stop()
    assert all(server.process.poll() is not None for server in good)
    # "no_such_module" exits at once: its start fails, and the good one is stopped too.
    mixed = [
        ServerProcess("fake_server", "m", env=fake_server_env, log_path=tmp_path / "ok"),
        ServerProcess("no_such_module", "m", env=fake_server_env, log_path=tmp_path / "bad"),
    ]
    with pytest.raises(RuntimeError, match="server exited with 1"):
        start_together(mixed, timeout_s=30)
    assert all(server.process.poll() is not None for server in mixed)


SILENT_SERVER = """
import time
time.sleep(600)  # never answers /health
"""


def test_start_together_reports_a_failure_without_waiting_for_the_others(tmp_path, fake_server_env):
    """One server that exits at once beside one that never gets ready: the error comes
    at once (not at the other's timeout) and both are stopped."""
    import time

    (tmp_path / "silent_server.py").write_text(SILENT_SERVER)
    servers = [
        ServerProcess("silent_server", "m", env=fake_server_env, log_path=tmp_path / "silent"),
        ServerProcess("no_such_module", "m", env=fake_server_env, log_path=tmp_path / "bad"),
    ]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="server exited with 1"):
        start_together(servers, timeout_s=120)
    assert time.monotonic() - started < 30
    assert all(server.process.poll() is not None for server in servers)

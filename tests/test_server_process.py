"""ServerProcess starts again on a new port when its chosen port is taken before it binds."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import requests

import sgl_mmkv.testing.server as server_module
from sgl_mmkv.testing.server import PortInUse, ServerProcess

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

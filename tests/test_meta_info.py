"""harness/meta_info.py: one request's stages from SGLang's meta info, shared by
``make demo`` and benchmarks/profile_reuse.py (no SGLang server: a canned one)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from harness.meta_info import chat_with_meta, request_stages

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import profile_reuse  # noqa: E402

META = {
    "request_received_ts": 100.000,
    "api_server_dispatch_finish_ts": 100.020,
    "forward_entry_time": 100.025,
    "prefill_finished_time": 100.060,
    "first_token_latency": 0.065,
    "prompt_tokens": 300,
    "cached_tokens": 12,
}


def test_the_stages_are_the_differences_of_the_timestamps_in_ms():
    got = request_stages(META)
    want = {"tokenizer": 20.0, "queue": 5.0, "prefill_forward": 35.0, "ttft": 65.0}
    assert got == pytest.approx(want | {"after_prefill": 5.0})
    # without first_token_latency the first token is taken at the prefill's end
    no_first = {k: v for k, v in META.items() if k != "first_token_latency"}
    assert request_stages(no_first)["ttft"] == pytest.approx(60.0)
    assert request_stages(no_first)["after_prefill"] == pytest.approx(0.0)
    # profile_reuse's row: the client's time and the server's stages but its TTFT
    row = profile_reuse.stages(META, client_s=0.07)
    assert row == pytest.approx(
        {
            "client_ttft": 70.0,
            "tokenizer": 20.0,
            "queue": 5.0,
            "prefill_forward": 35.0,
            "after_prefill": 5.0,
        }
    )


class _Canned(BaseHTTPRequestHandler):
    status = 200
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        length = int(self.headers["Content-Length"])
        _Canned.bodies.append(json.loads(self.rfile.read(length)))
        reply = {"choices": [{"message": {"content": " a cat \n"}, "meta_info": META}]}
        payload = json.dumps(reply if _Canned.status == 200 else {"error": "bad"}).encode()
        self.send_response(_Canned.status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_chat_with_meta_asks_greedily_for_the_meta_info_and_refuses_a_non_200():
    server = HTTPServer(("127.0.0.1", 0), _Canned)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        reply = chat_with_meta(url, [{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.text == "a cat" and reply.meta == META and reply.client_s > 0
        (body,) = _Canned.bodies
        assert body["return_meta_info"] is True and body["temperature"] == 0.0
        assert body["max_tokens"] == 3
        _Canned.status = 400
        with pytest.raises(RuntimeError, match="HTTP 400"):
            chat_with_meta(url, [{"role": "user", "content": "hi"}], max_tokens=3)
    finally:
        server.shutdown()
        server.server_close()

"""``--enable-mixed-chunk`` and ``--schedule-policy lpm`` with reuse (rows that never
shrink), on real servers.

With mixed chunks SGLang runs a new request's prefill in one batch with the running
requests' decode steps, so a reusing extend carries decode rows. A text request
decodes while a request reusing an image under a new prefix arrives; at budget 1.0
both answers must equal a stock server's with the same flags (text and top-5
first-token logprobs), and the log must show the reusing prefill mixed with a
running request.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from sgl_mmkv.testing.chat import greedy_chat
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
)

TOLERANCE = 1e-3
FLAGS = ("--enable-mixed-chunk", "--schedule-policy", "lpm", "--sleep-on-idle")
MMKV = ("--mm-reuse", "conduit", "--mm-refresh-budget", "1.0", "--mm-reuse-gate", "always")
IMAGE = make_image(1401)
LONG = "Tell a long story about shapes and colours. " * 4


def _chat(server, messages: list[dict], max_tokens: int) -> dict:
    return greedy_chat(server.base_url, messages, max_tokens, timeout_s=300, ignore_eos=True)


def _image_turn(system: str) -> list[dict]:
    return [{"role": "system", "content": system}, user_message("Describe.", [IMAGE])]


def _scenario(server) -> dict:
    """The image read once; then a long decode with the image's reuse arriving during it."""
    flush_cache(server.base_url)
    _chat(server, _image_turn("First."), 1)
    out: dict = {}

    def decode():
        out["decode"] = _chat(server, [{"role": "user", "content": LONG}], 200)

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(0.3)  # the long request is decoding by now (200 tokens take seconds)
    out["reuse"] = _chat(server, _image_turn("A new system prompt while another decodes."), 4)
    thread.join(timeout=300)
    return out


@pytest.fixture(scope="module")
def runs(tiny_vlm, tmp_path_factory) -> dict:
    logs = tmp_path_factory.mktemp("mixed_logs")
    result = {}
    stock_args = [*CPU_SERVER_ARGS, *FLAGS]
    with ServerProcess("sglang.launch_server", tiny_vlm, stock_args, logs / "stock.log") as s:
        result["stock"] = _scenario(s)
    mmkv_args = [*CPU_SERVER_ARGS, *FLAGS, *MMKV, REPORT_REUSE]
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, mmkv_args, logs / "mmkv.log") as m:
        result["mmkv"] = _scenario(m)
        result["log"] = m.log_text()
    return result


def _same(got: dict, want: dict) -> None:
    assert got["text"] == want["text"]
    assert set(got["top"]) == set(want["top"])  # byte-level tokens may share a text
    for token in want["top"]:
        assert abs(got["top"][token] - want["top"][token]) < TOLERANCE, token


def test_a_reuse_mixed_with_a_running_decode_equals_stock(runs):
    assert runs["mmkv"]["reuse"]["reused"] > 0
    _same(runs["mmkv"]["reuse"], runs["stock"]["reuse"])
    _same(runs["mmkv"]["decode"], runs["stock"]["decode"])
    mixed = re.findall(r"Prefill batch, .*#running-req: ([1-9])", runs["log"])
    assert mixed, "no prefill ran next to a running request"

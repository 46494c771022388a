"""The default cost gate on a real ``--mm-reuse conduit`` server: a request that
would compute more with reuse than without runs as stock does, a request that
saves is reused."""

from __future__ import annotations

import pytest

from harness.fidelity import FidelityClient
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

TOKENS_PER_IMAGE = 16


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "sgl_mmkv_gate.log"
    args = [*CPU_SERVER_ARGS, "--mm-reuse", "conduit", "--mm-refresh-budget", "0.1", REPORT_REUSE]
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        yield proc


def _chat(server, system: str, images: list) -> tuple[str, dict]:
    messages = [
        {"role": "system", "content": system},
        user_message("Describe the images.", images),
    ]
    reply = FidelityClient(server.base_url).chat(messages)
    return reply.text, reply.first_top_logprobs


def _delta(after: dict, before: dict, key: str) -> int:
    return after["refresh"][key] - before["refresh"][key]


def test_little_reuse_runs_as_stock_and_much_reuse_is_reused(server):
    stored, *new = (make_image(900 + i) for i in range(5))
    flush = FidelityClient(server.base_url).flush
    flush()
    cold_text, cold_logprobs = _chat(server, "Second context.", [stored, *new])
    flush()
    _chat(server, "First context.", [stored])

    # One stored image before four new ones: scoring and refresh pass would both
    # compute the new images, more than the full prefill.
    before = mmkv_stats(server.base_url)
    text, logprobs = _chat(server, "Second context.", [stored, *new])
    after = mmkv_stats(server.base_url)
    assert _delta(after, before, "declined_reuses") == 1
    assert _delta(after, before, "reused_tokens") == 0
    assert _delta(after, before, "executed_flops") == _delta(after, before, "full_prefill_flops")
    assert text == cold_text
    assert logprobs.keys() == cold_logprobs.keys()
    for token, value in logprobs.items():
        assert abs(value - cold_logprobs[token]) < 1e-4, token

    # All five now stored: reuse saves and is taken.
    before = after
    _chat(server, "Third context.", [stored, *new])
    after = mmkv_stats(server.base_url)
    assert _delta(after, before, "declined_reuses") == 0
    assert _delta(after, before, "reused_tokens") == 5 * TOKENS_PER_IMAGE
    assert _delta(after, before, "refreshed_tokens") == 8  # ceil(0.1 * 80)
    assert _delta(after, before, "executed_flops") < _delta(after, before, "full_prefill_flops")

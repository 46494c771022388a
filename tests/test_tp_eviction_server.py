"""Scored eviction with reuse holes at ``--tp-size 2`` under ``--chunked-prefill-size
64``: the test of ``tests/test_holes_chunked_server.py`` on two ranks.

Each rank ranks a new segment from its own KV heads' parts, summed over the ranks
(``refresh/ranker.py``), so both keep the same tokens; a reused compressed segment
leaves the same holes on both, and both ranks' row compactors shrink the same rows.
A server with every freed and hole slot NaN-poisoned (``SGL_MMKV_POISON_FREED=1``)
must answer as the plain one (equal tokens, finite logprobs within 1e-4): no decode
step on either rank attended a hole. The two TP-2 servers start one at a time.
"""

from __future__ import annotations

import math

import pytest

from sgl_mmkv.segments.poison import POISON_ENV
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess, mmkv_stats
from tests.test_holes_chunked_server import HOLED, _assert_exact_ledger, _holed_requests
from tests.test_tp_cpu_server import REPO, TP, _env

CHUNK = ["--chunked-prefill-size", "64"]


@pytest.fixture(scope="module")
def runs(tiny_vlm, tmp_path_factory) -> dict:
    """Per side (plain, poisoned): the holed requests' replies, the hole counters they
    moved, and the agreement counters, each server stopped before the next starts."""
    logs = tmp_path_factory.mktemp("tp_holes")
    out = {}
    for side, extra_env in (("plain", {}), ("poisoned", {POISON_ENV: "1"})):
        server = ServerProcess(
            "sgl_mmkv.launch_server",
            tiny_vlm,
            [*TP, *HOLED, *CHUNK, *CPU_SERVER_ARGS],
            log_path=logs / f"{side}.log",
            env={**_env(None), **extra_env},
            cwd=REPO,
        )
        with server:
            replies, moved = _holed_requests(server, tiny_vlm)
            stats = mmkv_stats(server.base_url)
            _assert_exact_ledger(server)
        out[side] = (replies, moved, stats)
    return out


def test_tp2_chunked_rows_with_holes_are_compacted_before_any_decode(runs):
    plain, plain_moved, _ = runs["plain"]
    poisoned, moved, _ = runs["poisoned"]
    assert moved == plain_moved
    assert moved["hole_tokens"] > 0 and moved["holed_requests"] > 0
    assert moved["skipped_requests"] == 0 and moved["aborted_requests"] == 0
    assert moved["failures"] == 0 and moved["rank_aborts"] == 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(poisoned, plain, strict=True):
        assert tokens == want_tokens
        assert all(lp is not None and math.isfinite(lp) for lp in logprobs)
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("side", ["plain", "poisoned"])
def test_tp2_ranks_agreed_on_every_ranked_and_reused_image(runs, side):
    stats = runs[side][2]
    refresh = stats["refresh"]
    assert refresh["reused_tokens"] > 0
    assert refresh["fallbacks"] == 0 and refresh["rank_disagreements"] == 0
    assert refresh["rank_collectives"] > 0
    assert stats["store"]["compressions"] > 0

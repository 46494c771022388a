"""Scored eviction with reuse holes at ``--tp-size 2`` under ``--chunked-prefill-size
64``: the test of ``tests/test_holes_chunked_server.py`` on two ranks.

Each rank ranks a new segment from its own KV heads' parts, summed over the ranks
(``refresh/ranker.py``), so both keep the same tokens; a reused compressed segment
leaves the same holes on both, and both ranks' row compactors shrink the same rows.
With every freed and hole slot NaN-poisoned (``SGL_MMKV_POISON_FREED=@<file>``) the
server must answer as it does plain, flushed (equal tokens, finite logprobs within
1e-4): no decode step on either rank attended a hole. Then a fault on rank 1
alone at each stage of the eviction path's tail (ranking, fill, row compaction)
is every rank's: the batch is answered as stock, or its compaction cancelled, on
both ranks, and the server keeps serving. One TP-2 server serves the module.
"""

from __future__ import annotations

import math

import pytest
import requests

from sgl_mmkv.refresh.faults import FAULT_FILE_ENV
from sgl_mmkv.segments.poison import POISON_ENV
from sgl_mmkv.testing.images import data_url, make_image
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess, mmkv_stats
from tests.test_holes_chunked_server import (
    DECODED,
    HOLED,
    _assert_exact_ledger,
    _holed_requests,
    _prompt,
    poisoned_then_plain,
)
from tests.test_tp_cpu_server import REPO, TP, _env

CHUNK = ["--chunked-prefill-size", "64"]
FAULT_STAGES = ("ranking", "fill", "row_compaction")


def _status(server, text: str, images: list, max_new_tokens: int) -> int:
    body = {
        "text": text,
        "image_data": [data_url(image) for image in images],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    return requests.post(server.base_url + "/generate", json=body, timeout=300).status_code


def _faults_on_rank_1(server, model, fault_file) -> dict:
    """Per stage: a request with two new images (ranked and stored) and one reusing
    them, with the fault on rank 1; the counters they moved, and then a request
    without the fault."""
    out = {}
    for k, stage in enumerate(FAULT_STAGES):
        images = [make_image(950 + 10 * k + j) for j in range(2)]
        before = mmkv_stats(server.base_url)
        fault_file.write_text(f"{stage}@1")
        try:
            codes = [
                _status(server, _prompt(model, "You are a helpful assistant.", 2), images, 1),
                _status(server, _prompt(model, "Answer in one word.", 2), images, DECODED),
            ]
        finally:
            fault_file.write_text("")
        after = mmkv_stats(server.base_url)
        fresh = [make_image(990 + k)]
        codes.append(_status(server, _prompt(model, "Go on.", 1), fresh, 2))
        moved = {
            "fallbacks": after["refresh"]["fallbacks"] - before["refresh"]["fallbacks"],
            "rank_cancelled": after["row_compaction"]["rank_cancelled"]
            - before["row_compaction"]["rank_cancelled"],
            "disagreements": after["refresh"]["rank_disagreements"]
            - before["refresh"]["rank_disagreements"],
        }
        out[stage] = (codes, moved)
    return out


@pytest.fixture(scope="module")
def runs(tiny_vlm, tmp_path_factory) -> dict:
    """One TP-2 server: the holed requests poisoned then plain (their replies, the
    hole counters they moved, the agreement counters after each), then the faults."""
    logs = tmp_path_factory.mktemp("tp_holes")
    fault_file, poison = logs / "fault", logs / "poison"
    fault_file.write_text("")
    env = {**_env(None), FAULT_FILE_ENV: str(fault_file), POISON_ENV: f"@{poison}"}
    server = ServerProcess(
        "sgl_mmkv.launch_server",
        tiny_vlm,
        [*TP, *HOLED, *CHUNK, *CPU_SERVER_ARGS],
        log_path=logs / "server.log",
        env=env,
        cwd=REPO,
    )
    out = {}

    def holed(s):
        replies, moved = _holed_requests(s, tiny_vlm)
        return replies, moved, mmkv_stats(s.base_url)

    with server:
        out["poisoned"], out["plain"] = poisoned_then_plain(server, poison, holed)
        _assert_exact_ledger(server)
        out["faults"] = _faults_on_rank_1(server, tiny_vlm, fault_file)
        _assert_exact_ledger(server)  # after the faults too
    return out


def test_tp2_chunked_rows_with_holes_are_compacted_before_any_decode(runs):
    plain, plain_moved, _ = runs["plain"]
    poisoned, moved, _ = runs["poisoned"]
    assert moved == plain_moved
    assert moved["hole_tokens"] > 0 and moved["holed_requests"] > 0
    assert moved["skipped_requests"] == 0 and moved["aborted_requests"] == 0
    assert moved["failures"] == 0 and moved["rank_cancelled"] == 0
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


@pytest.mark.parametrize("stage", FAULT_STAGES)
def test_tp2_a_fault_on_rank_1_in_the_eviction_tail_is_every_rank_s(runs, stage):
    """Ranking and fill: rank 0 follows rank 1 to stock (counted as its fallback) and
    both answer. Row compaction: no rank shrinks a row of the batch (rank 0 counts the
    cancel); the request without holes is answered, the one with holes is refused on
    both ranks (its holes hold no KV). Either way the next request is served and the
    slot ledger is exact after a flush."""
    codes, moved = runs["faults"][stage]
    assert codes[0] == 200 and codes[-1] == 200  # served during and after the fault
    assert moved["disagreements"] == 0
    if stage == "row_compaction":
        assert moved["rank_cancelled"] >= 1 and codes[1] == 400
    else:
        assert codes[1] == 200
        assert moved["fallbacks"] >= 1 and moved["rank_cancelled"] == 0

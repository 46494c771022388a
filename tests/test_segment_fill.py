"""Fill policies of the segment store on real ``--mm-reuse reuse`` servers (budget 0:
a reused image's KV is exactly what the store holds, nothing of it is recomputed).

``canonical`` recomputes a new image alone (after its ``<|vision_start|>``), so the
stored KV, and every later reuse of it, no longer depends on the request that
happened to show the image first; ``first`` copies that request's KV, context
included. Either way the filling request's own output is untouched.
"""

from __future__ import annotations

import pytest

from sgl_mmkv.benchmarking.fidelity import FidelityClient
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess, mmkv_stats

IMAGE = make_image(501)
# Two first contexts that put the image at the same positions after different text
# (equal token counts, checked below): a canonical fill computes identical KV.
FIRST_SEEN_IN = {
    "compare": [
        {"role": "system", "content": "You compare pictures."},
        user_message("Picture album one.", [IMAGE]),
    ],
    "describe": [
        {"role": "system", "content": "You describe photos."},
        user_message("Picture album two.", [IMAGE]),
    ],
}
PROBE = [
    {"role": "system", "content": "Another assistant entirely."},
    user_message("What colour is the largest shape?", [IMAGE]),
]


@pytest.fixture(scope="module", params=["first", "canonical"])
def server(request, tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / f"fill_{request.param}.log"
    args = [
        *("--mm-reuse", "reuse", "--mm-segment-fill", request.param),
        *(REPORT_REUSE, *CPU_SERVER_ARGS),
    ]
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        proc.fill_policy = request.param
        yield proc


def _mmkv(base_url: str) -> dict:
    return mmkv_stats(base_url)


def _probe_after(client: FidelityClient, context: str):
    """The filling request's reply, and the probe's, from a flushed server."""
    client.flush()
    fill = client.chat(FIRST_SEEN_IN[context])
    before = _mmkv(client.base_url)["refresh"]["reused_tokens"]
    probe = client.chat(PROBE)
    assert _mmkv(client.base_url)["refresh"]["reused_tokens"] - before == 16  # from the store
    return fill, probe


_RESULTS: dict[str, dict] = {}


def test_reuse_depends_on_the_first_context_only_under_first_fill(server):
    client = FidelityClient(server.base_url, max_tokens=6)
    runs = {ctx: _probe_after(client, ctx) for ctx in FIRST_SEEN_IN}
    _RESULTS[server.fill_policy] = runs
    fills = [runs[c][0] for c in FIRST_SEEN_IN]
    assert fills[0].prompt_tokens == fills[1].prompt_tokens  # the image at the same rows
    a, b = (runs[c][1].first_top_logprobs for c in FIRST_SEEN_IN)
    if server.fill_policy == "canonical":
        assert a == b  # bit-identical segment KV, whoever showed the image first
    else:
        common = a.keys() & b.keys()
        gap = max((abs(a[t] - b[t]) for t in common), default=float("inf"))
        assert a.keys() != b.keys() or gap > 1e-3, (a, b)  # the context is baked in
    stats = _mmkv(server.base_url)
    assert stats["store"]["fills"] >= 3 and stats["pool"]["free_unique"]


def test_the_filling_request_is_served_the_same_under_both_policies(server):
    if len(_RESULTS) < 2:
        pytest.skip("needs both servers' runs (module parameters run in order)")
    for ctx in FIRST_SEEN_IN:
        first, canonical = _RESULTS["first"][ctx][0], _RESULTS["canonical"][ctx][0]
        assert canonical.text == first.text
        assert canonical.first_top_logprobs == first.first_top_logprobs


def test_flush_returns_every_slot(server):
    FidelityClient(server.base_url).flush()
    ledger = _mmkv(server.base_url)["pool"]
    assert ledger["store"] == 0 and ledger["in_use"] == 0 and ledger["free_unique"]
    assert ledger["available"] == ledger["size"]

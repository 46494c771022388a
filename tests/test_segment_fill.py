"""Fill policies of the segment store on real ``--mm-reuse reuse`` servers (budget 0:
a reused image's KV is exactly what the store holds, nothing of it is recomputed).

``canonical`` recomputes a new image alone (after its ``<|vision_start|>``), so the
stored KV, and every later reuse of it, no longer depends on the request that
happened to show the image first; ``first`` copies that request's KV, context
included. Either way the filling request's own output is untouched. Under chunked
prefill an image that a chunk boundary cuts, that starts a chunk, or that sits in
the cached prefix cannot be computed alone: ``canonical`` does not store it.
"""

from __future__ import annotations

import pytest

from harness.fidelity import FidelityClient
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


def test_every_new_image_is_stored_under_a_shared_system_prompt(server):
    """The second request's exact-prefix match ends at its image's ``<|vision_start|>``
    (the first request showed another image after the same text); ``canonical`` then
    matches one token shorter, so it can compute the image alone and store it."""
    client = FidelityClient(server.base_url, max_tokens=2)
    client.flush()
    before = _mmkv(server.base_url)["store"]
    for seed in (511, 512):
        client.chat(
            [
                {"role": "system", "content": "One shared prompt."},
                user_message(TEXT, [make_image(seed)]),
            ]
        )
    after = _mmkv(server.base_url)["store"]
    assert after["fills"] - before["fills"] == 2
    assert after["canonical_skipped"] == before["canonical_skipped"]


def test_flush_returns_every_slot(server):
    FidelityClient(server.base_url).flush()
    ledger = _mmkv(server.base_url)["pool"]
    assert ledger["store"] == 0 and ledger["in_use"] == 0 and ledger["free_unique"]
    assert ledger["available"] == ledger["size"]


CHUNK = 32
# System prompts that put the image at chosen rows (checked with the tokenizer):
CROSSING = " ".join(["red"] * 13)  # rows 24..40: the boundary at 32 cuts the image
AT_BOUNDARY = " ".join(["red"] * 21)  # rows 32..48: <|vision_start|> ends chunk 0
WHOLE = (" ".join(["red"] * 3), " ".join(["blue"] * 2))  # rows 14..30: inside chunk 0
PROBE_SYSTEM = " ".join(["blue"] * 4)  # rows 16..32
ROWS = {CROSSING: 24, AT_BOUNDARY: 32, WHOLE[0]: 14, WHOLE[1]: 14, PROBE_SYSTEM: 16}
TEXT = "Describe the picture."


def _conversation(system: str) -> list[dict]:
    return [{"role": "system", "content": system}, user_message(TEXT, [IMAGE])]


def _rows(model) -> tuple[dict[str, int], int]:
    """Each system prompt's first image row, and the tokens after the image."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    head = "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n<|vision_start|>"
    rows = {s: len(tokenizer(head.format(s))["input_ids"]) for s in ROWS}
    tail = "<|vision_end|>" + TEXT + "<|im_end|>\n<|im_start|>assistant\n"
    return rows, len(tokenizer(tail)["input_ids"])


def test_canonical_fill_never_stores_an_image_it_cannot_compute_alone(tiny_vlm, tmp_path_factory):
    """Chunks of 32 tokens (from row 0: each case starts from a flushed cache): the
    image cut by a boundary, starting a chunk, or in the cached prefix is not stored;
    the store stays empty until a request shows the image inside one chunk, whose
    canonical KV then serves the probe bit for bit as another context's does."""
    rows, tail = _rows(tiny_vlm)
    assert rows == ROWS
    log = tmp_path_factory.mktemp("logs") / "fill_canonical_chunked.log"
    args = [
        *("--mm-reuse", "reuse", "--mm-segment-fill", "canonical"),
        *("--chunked-prefill-size", str(CHUNK), REPORT_REUSE, *CPU_SERVER_ARGS),
    ]
    with ServerProcess("sgl_mmkv.launch_server", tiny_vlm, args, log_path=log) as proc:
        client = FidelityClient(proc.base_url, max_tokens=6)
        client.flush()
        last = _mmkv(proc.base_url)["store"]

        def stored(fills: int, skipped: int) -> None:
            nonlocal last
            now = _mmkv(proc.base_url)["store"]
            got = (
                now["fills"] - last["fills"],
                now["canonical_skipped"] - last["canonical_skipped"],
            )
            assert got == (fills, skipped)
            last = now

        crossing = client.chat(_conversation(CROSSING))
        assert crossing.prompt_tokens == ROWS[CROSSING] + 16 + tail
        stored(0, 1)
        turn = {"role": "user", "content": "And its colours?"}
        later = client.chat(
            [*_conversation(CROSSING), {"role": "assistant", "content": crossing.text}, turn]
        )
        assert later.cached_tokens >= ROWS[CROSSING] + 16  # the image is in the cached prefix
        stored(0, 1)
        client.flush()
        client.chat(_conversation(AT_BOUNDARY))
        stored(0, 1)
        probes = []
        for i, system in enumerate(WHOLE):
            if i:  # the first fill follows the cases above, the second a flushed cache
                client.flush()
            client.chat(_conversation(system))
            stored(1, 0)
            before = _mmkv(proc.base_url)["refresh"]["reused_tokens"]
            probes.append(client.chat(_conversation(PROBE_SYSTEM)).first_top_logprobs)
            assert _mmkv(proc.base_url)["refresh"]["reused_tokens"] - before == 16
        assert probes[0] == probes[1]  # no context of the requests before entered the store
        ledger = _mmkv(proc.base_url)["pool"]
        assert ledger["free_unique"] and ledger["in_use"] == 0

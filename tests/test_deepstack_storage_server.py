"""Qwen3-VL's DeepStack features served from a segment another instance stored.

Within one instance a warm request takes its image embeddings from SGLang's own
multimodal embedding cache, so the segment's stored encoder output is used only
where that cache does not hold the image: on another instance, or after a restart.
Instance A (Qwen3-VL, ``conduit`` at budget 1.0, ``--mm-segment-storage file``)
reads an image and writes its segment, DeepStack features included, then stops.
Instance B, started on the same directory, reuses it under a new prefix: its vision
tower runs for no image, and its answer equals a stock server's full prefill (the
refresh pass recomputes every image token from the stored features; had they lost
DeepStack's part, the top logprobs would move by 4e-3 to 7e-3,
tests/test_architectures_server.py).
"""

from __future__ import annotations

import os
import re

import pytest

from sgl_mmkv.segments.entry_format import decode_header
from sgl_mmkv.testing.images import make_image
from sgl_mmkv.testing.make_tiny_model import TinyModelSpec, deepstack_visual_indexes
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    ServerProcess,
    mmkv_stats,
    start_together,
)
from tests.test_segment_storage_server import (
    EMBEDDING_WARNINGS,
    _assert_same_answer,
    _chat,
    _mmkv_args,
    _vision,
    _wait_writes,
)

TOKENS_PER_IMAGE = 16  # the tiny Qwen3-VL's: 128 x 128 pixels, 8 x 8 patches, 2 x 2 merge
IMAGE = make_image(1301)
PROBE_SYSTEM = "Instance B asks about a picture it never saw."


def _headers(storage) -> set[str]:
    """The header files of the storage directory's entries."""
    names = os.listdir(storage) if storage.exists() else []
    return {f for f in names if re.search(r"_h[0-9a-f]*__0_1\.bin$", f)}


@pytest.fixture(scope="module")
def deepstack_run(tiny_qwen3_vl, tmp_path_factory) -> dict:
    """Stock's answer; A reads the image and stops once its entry landed; B, started
    after, answers the probe from A's entry."""
    logs = tmp_path_factory.mktemp("deepstack_logs")
    storage = tmp_path_factory.mktemp("deepstack_l3") / "segments"
    stock = ServerProcess(
        "sglang.launch_server", tiny_qwen3_vl, [*CPU_SERVER_ARGS, "--sleep-on-idle"],
        logs / "stock.log",
    )  # fmt: skip
    a = ServerProcess("sgl_mmkv.launch_server", tiny_qwen3_vl, _mmkv_args(storage), logs / "a.log")
    try:
        start_together([stock, a])
        with stock:  # already started: stopped on leaving
            want = _chat(stock, PROBE_SYSTEM, IMAGE)
        with a:
            writes = mmkv_stats(a.base_url)["storage"]["writes"]  # after SGLang's warm-up
            before = _headers(storage)
            assert _chat(a, "Instance A reads.", IMAGE)["reused"] == 0
            a_storage = _wait_writes(a, writes + 1)
            written = sorted(_headers(storage) - before)
    finally:
        for server in (stock, a):
            server.stop()  # by PID, the whole process tree
    b = ServerProcess("sgl_mmkv.launch_server", tiny_qwen3_vl, _mmkv_args(storage), logs / "b.log")
    with b:
        before = mmkv_stats(b.base_url)
        got = _chat(b, PROBE_SYSTEM, IMAGE)
        after = mmkv_stats(b.base_url)
        log = b.log_text()
    return {
        "want": want,
        "got": got,
        "a_storage": a_storage,
        "before": before,
        "after": after,
        "log": log,
        "headers": [decode_header((storage / f).read_bytes()) for f in written],
    }


def test_a_stores_the_image_with_its_deepstack_features(deepstack_run):
    assert deepstack_run["a_storage"]["write_failed"] == 0
    spec = TinyModelSpec()
    width = spec.hidden_size * (1 + len(deepstack_visual_indexes(spec)))
    assert width > spec.hidden_size  # the tiny Qwen3-VL has DeepStack layers
    assert [h["embeds"] for h in deepstack_run["headers"]] == [[TOKENS_PER_IMAGE, width]]


def test_b_skips_the_vision_tower_and_equals_stock_full_prefill(deepstack_run):
    got, after, before = deepstack_run["got"], deepstack_run["after"], deepstack_run["before"]
    assert got["reused"] == TOKENS_PER_IMAGE
    assert after["storage"]["hits"] - before["storage"]["hits"] == 1
    assert _vision(after, before) == {"embeddings_loaded": 1, "skipped": 1, "encoded": 0}
    _assert_same_answer(got, deepstack_run["want"])
    for line in EMBEDDING_WARNINGS:
        assert line not in deepstack_run["log"], line

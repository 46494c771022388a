"""A weight update never serves the old weights' image KV, from memory or from L3.

Instance A (``conduit`` at budget 1.0, ``file`` storage) reads images X and Y on the
old weights, so their entries land in the storage, then ``/update_weights_from_disk``
loads a second checkpoint of the same shape. The same images under a new prefix
and in another order then load nothing from before (no storage hit, no segment
reused), and the answer equals a fresh stock server's on the new weights. A reads Z
on the new weights, which is written under the new identity: instance C, still on
the old weights and on the same directory, loads none of it, while it does load
X, written under its own (the old) weights' identity.
"""

from __future__ import annotations

import shutil

import pytest
import requests

from sgl_mmkv.testing.chat import greedy_chat
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    mmkv_stats,
)
from tests.test_segment_storage_server import _wait_writes

TOLERANCE = 1e-3
X, Y, Z = make_image(1301), make_image(1302), make_image(1303)


def _mmkv_args(storage) -> list[str]:
    return [
        *CPU_SERVER_ARGS,
        "--sleep-on-idle",
        *("--mm-reuse", "conduit", "--mm-refresh-budget", "1.0", "--mm-reuse-gate", "always"),
        *("--mm-segment-storage", "file", "--mm-segment-storage-dir", str(storage)),
        REPORT_REUSE,
    ]


def _chat(server, system: str, images: list) -> dict:
    messages = [{"role": "system", "content": system}, user_message("Describe.", images)]
    return greedy_chat(server.base_url, messages)


@pytest.fixture(scope="module")
def new_weights(tiny_vlm, tmp_path_factory):
    """The tiny Qwen2-VL's files with another seed's weights (same shapes, config and
    tokenizer)."""
    from sgl_mmkv.testing.make_tiny_model import make_tiny_model

    other = make_tiny_model("qwen2_vl", tmp_path_factory.mktemp("seed1") / "m", seed=1)
    out = tmp_path_factory.mktemp("updated") / "tiny-qwen2-vl-new-weights"
    shutil.copytree(tiny_vlm, out)
    for weights in other.glob("*.safetensors"):
        shutil.copy(weights, out / weights.name)
    return out


@pytest.fixture(scope="module")
def runs(tiny_vlm, new_weights, tmp_path_factory):
    logs = tmp_path_factory.mktemp("weight_update_logs")
    storage = tmp_path_factory.mktemp("l3") / "segments"
    after = "A new system prompt, after the update."
    out: dict = {}
    a = ServerProcess("sgl_mmkv.launch_server", tiny_vlm, _mmkv_args(storage), logs / "a.log")
    with a:
        writes = mmkv_stats(a.base_url)["storage"]["writes"]
        out["before"] = _chat(a, "Read on the old weights.", [X, Y])
        _wait_writes(a, writes + 2)
        stats = mmkv_stats(a.base_url)
        out["a_before"] = stats
        r = requests.post(
            a.base_url + "/update_weights_from_disk",
            json={"model_path": str(new_weights)},
            timeout=300,
        )
        assert r.status_code == 200 and r.json()["success"], r.text
        out["a_updated"] = mmkv_stats(a.base_url)
        out["after"] = _chat(a, after, [Y, X])
        _wait_writes(a, out["a_updated"]["storage"]["writes"] + 2)
        out["a_after"] = mmkv_stats(a.base_url)
        writes = out["a_after"]["storage"]["writes"]
        _chat(a, "Z on the new weights.", [Z])
        out["a_z"] = _wait_writes(a, writes + 1)
    stock_args = [*CPU_SERVER_ARGS, "--sleep-on-idle"]
    with ServerProcess("sglang.launch_server", new_weights, stock_args, logs / "s.log") as s:
        out["stock_after"] = _chat(s, after, [Y, X])
    with ServerProcess(
        "sgl_mmkv.launch_server", tiny_vlm, _mmkv_args(storage), logs / "c.log"
    ) as c:
        before = mmkv_stats(c.base_url)["storage"]
        out["c_z"] = _chat(c, "C on the old weights asks for Z.", [Z])
        out["c_z_storage"] = mmkv_stats(c.base_url)["storage"]
        out["c_before"] = before
        out["c_x"] = _chat(c, "C on the old weights asks for X.", [X])
        out["c_x_storage"] = mmkv_stats(c.base_url)["storage"]
    return out


def test_the_update_drops_every_segment(runs):
    before, updated = runs["a_before"]["store"], runs["a_updated"]["store"]
    assert before["segments"] >= 2 and updated["segments"] == 0  # X, Y (and the warm-up)
    assert updated["weight_updates"] == 1 and updated["embedding_bytes"] == 0


def test_nothing_of_the_old_weights_is_loaded_after_the_update(runs):
    before, after = runs["a_before"], runs["a_after"]
    assert after["storage"]["hits"] == before["storage"]["hits"]  # 2 entries, none loaded
    assert after["store"]["loaded"] == before["store"]["loaded"]
    assert runs["after"]["reused"] == 0
    assert after["storage"]["writes"] == before["storage"]["writes"] + 2  # under the new identity


def test_the_answer_equals_a_fresh_server_on_the_new_weights(runs):
    got, want = runs["after"], runs["stock_after"]
    assert got["text"] == want["text"]
    shared = set(got["top"]) & set(want["top"])
    assert len(shared) >= 4
    for token in shared:
        assert abs(got["top"][token] - want["top"][token]) < TOLERANCE, token


def test_an_instance_on_the_old_weights_loads_none_of_the_new_entries(runs):
    before, z = runs["c_before"], runs["c_z_storage"]
    assert z["hits"] == before["hits"] and runs["c_z"]["reused"] == 0
    assert runs["c_x_storage"]["hits"] == z["hits"] + 1  # the old weights' X is its own

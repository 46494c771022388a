"""Tensor parallelism on the CPU: ``--tp-size 2`` with ``--mm-reuse off`` and
``exact`` answers as stock SGLang at TP 2 does.

Stock SGLang 0.5.23 cannot start TP 2 on the CPU by itself (pynccl needs CUDA), so
the stock side is ``sgl_mmkv/testing/stock_tp_server.py``: SGLang's own launcher plus the one
hook sgl_mmkv registers for this (``patches/model_parallel_group_cpu.py``), with
``SGLANG_CPU_OMP_THREADS_BIND=0|1`` set by hand. Our sides get both from
``sgl_mmkv.launch_server``. The servers start one at a time (each TP-2 server is
two scheduler processes on this 2-core machine) and get the same requests: a
two-image chat, then a second turn under the same prefix (its images hit the radix
cache), greedy, 4 tokens, top-5 logprobs.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import openai
import pytest
import requests

from sgl_mmkv.launch_server import OMP_BIND_ENV
from sgl_mmkv.patches.model_parallel_group_cpu import ACTING_LOG_PREFIX
from sgl_mmkv.radix_cache import ACTIVE_LOG_PREFIX
from sgl_mmkv.refresh.faults import FAULT_FILE_ENV, STAGES
from sgl_mmkv.testing.chat import greedy_chat
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    ServerProcess,
    flush_cache,
    mmkv_stats,
    stock_cpu_env,
)
from tests.test_segment_storage_server import _wait_writes

REPO = Path(__file__).resolve().parents[1]
A, B = make_image(41), make_image(42)
FIRST = [user_message("Compare the images.", [A, B])]
TP = ["--tp-size", "2"]


def _second_turn(first_answer: str) -> list[dict]:
    return [
        *FIRST,
        {"role": "assistant", "content": first_answer},
        user_message("Which one is larger?"),
    ]


def _ask(client: openai.OpenAI, messages: list[dict]) -> dict:
    r = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    first = r.choices[0].logprobs.content[0]
    return {
        "text": r.choices[0].message.content,
        "prompt_tokens": r.usage.prompt_tokens,
        "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
        "image_tokens": getattr(r.usage.prompt_tokens_details, "image_tokens", 0) or 0,
        "top5": {t.token: t.logprob for t in first.top_logprobs},
    }


def _env(bind: str | None) -> dict[str, str]:
    env = stock_cpu_env()
    env.pop(OMP_BIND_ENV, None)
    if bind is not None:
        env[OMP_BIND_ENV] = bind
    # This checkout first, in the server and its spawned schedulers.
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *parts])
    return env


def _serve(module: str, model: Path, extra: list[str], log: Path, bind: str | None):
    server = ServerProcess(
        module, model, [*TP, *extra, *CPU_SERVER_ARGS], log_path=log, env=_env(bind), cwd=REPO
    )
    with server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        first = _ask(client, FIRST)
        second = _ask(client, _second_turn(first["text"]))
        return [first, second], server.log_text()


SIDES = {
    "stock": ("sgl_mmkv.testing.stock_tp_server", [], "0|1"),
    "exact": ("sgl_mmkv.launch_server", ["--mm-reuse", "exact"], None),
    "off": ("sgl_mmkv.launch_server", ["--mm-reuse", "off"], None),
}
# `off` at TP 2 is our launcher's hook and environment over a stock cache, which
# `exact` runs too: its server (a minute here) starts in the slow tests only.
SLOW_SIDES = ("off",)


@pytest.fixture(scope="module")
def runs(tiny_vlm, tmp_path_factory):
    """Each side's answers and log, its server started (one at a time) when a test
    first asks for it."""
    logs = tmp_path_factory.mktemp("tp_cpu_logs")
    done: dict[str, tuple[list[dict], str]] = {}

    def side(name: str) -> tuple[list[dict], str]:
        if name not in done:
            module, extra, bind = SIDES[name]
            done[name] = _serve(module, tiny_vlm, extra, logs / f"{name}.log", bind)
        return done[name]

    return side


def _modes(*names: str) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SIDES else n for n in names]


def test_stock_tp2_answers_and_hits_the_images(runs):
    first, second = runs("stock")[0]
    assert first["image_tokens"] == 32 and second["image_tokens"] == 32
    assert second["cached_tokens"] >= first["prompt_tokens"] - 1  # both images cached


@pytest.mark.parametrize("mode", _modes("exact", "off"))
def test_tp2_equals_stock_tp2(runs, mode):
    for want, got in zip(runs("stock")[0], runs(mode)[0], strict=True):
        assert got["text"] == want["text"]
        assert got["prompt_tokens"] == want["prompt_tokens"]
        assert got["cached_tokens"] == want["cached_tokens"]
        assert got["top5"].keys() == want["top5"].keys()
        for token, logprob in want["top5"].items():
            assert got["top5"][token] == pytest.approx(logprob, abs=1e-3), token


@pytest.mark.parametrize("mode", _modes("stock", "exact", "off"))
def test_every_rank_ran_this_checkouts_hook(runs, mode):
    """Both ranks' groups were built over gloo by this checkout's hook (not another
    installed copy), and our launcher split the two cores between the ranks."""
    log = runs(mode)[1]
    acting = [line for line in log.splitlines() if ACTING_LOG_PREFIX in line]
    assert any("TP0" in line for line in acting) and any("TP1" in line for line in acting)
    assert all(f"file={REPO}/sgl_mmkv/" in line for line in acting), acting[0]
    if mode != "stock":
        assert f"sgl_mmkv: {OMP_BIND_ENV}=0|1: 2 CPU ranks" in log
    if mode == "exact":
        assert f"{ACTIVE_LOG_PREFIX}: class=MMKVRadixCache mode=exact" in log
        assert f"file={REPO}/sgl_mmkv/radix_cache.py" in log
    else:
        assert ACTIVE_LOG_PREFIX not in log


# --- refresh modes at TP 2 -------------------------------------------------------
#
# Each rank scores over its own KV heads and keeps its own segment store; the ranks
# agree on plans, failures and statistics (``refresh/rank_agreement.py``). At budget
# 1.0 every reused token is refreshed, so a reused request must answer as ``off``
# does at TP 2 (stock SGLang's cache). The ``off`` server answers every probe first
# and stops; then one conduit server serves the reuse and fault tests.

TOKENS_PER_IMAGE = 16
IMAGES = [make_image(100 + i) for i in range(3)]
NEW_IMAGE = make_image(203)
STORE = "You are a helpful assistant."
REFRESH_ARGS = ["--mm-reuse-gate", "always", "--mm-report-reuse"]
# what the stored conversation is asked before each probe, and the probes
PROBES = {
    "changed_prefix": ("Answer in one word.", IMAGES),
    "reordered": ("Answer in one word.", IMAGES[::-1]),
}
FAULT_STAGES = [s for s in STAGES if s != "row_compaction"]  # no row compactor here


def _conversation(system: str, images: list, question: str = "Describe the images.") -> list:
    return [{"role": "system", "content": system}, user_message(question, images)]


def _turns(reply: str) -> tuple[list[dict], list[dict]]:
    """A first turn with two images, and a second under a changed system prompt that
    shows them again with a new one."""
    first = [user_message("Look at these.", IMAGES[:2])]
    second = [
        {"role": "system", "content": "Now answer briefly."},
        *first,
        {"role": "assistant", "content": reply},
        user_message("And with this one, which is brightest?", [NEW_IMAGE]),
    ]
    return first, second


def _chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, dict[str, float]]:
    answer = _ask(client, messages)
    return answer["text"], answer["top5"]


def _assert_same(got: tuple, want: tuple, tol: float = 2e-2) -> None:
    assert got[0] == want[0]
    shared = set(got[1]) & set(want[1])
    assert len(shared) >= 4
    for token in shared:
        assert abs(got[1][token] - want[1][token]) < tol, token


def _refresh_server(model: Path, log: Path, extra: list[str], env: dict | None = None):
    return ServerProcess(
        "sgl_mmkv.launch_server",
        model,
        [*TP, *REFRESH_ARGS, *extra, *CPU_SERVER_ARGS],
        log_path=log,
        env=env or _env(None),
        cwd=REPO,
    )


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def off_answers(tiny_vlm, tmp_path_factory) -> dict:
    """``--mm-reuse off`` at TP 2: the stored conversation, every probe, both turns."""
    log = tmp_path_factory.mktemp("tp_off") / "off.log"
    server = ServerProcess(
        "sgl_mmkv.launch_server",
        tiny_vlm,
        [*TP, "--mm-reuse", "off", *CPU_SERVER_ARGS],
        log_path=log,
        env=_env(None),
        cwd=REPO,
    )
    with server:
        client = _client(server)
        answers = {"store": _chat(client, _conversation(STORE, IMAGES))}
        for name, (system, images) in PROBES.items():
            answers[name] = _chat(client, _conversation(system, images))
        first, _ = _turns("")
        answers["first_turn"] = _chat(client, first)
        answers["second_turn"] = _chat(client, _turns(answers["first_turn"][0])[1])
        return answers


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp_faults") / "stage"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def conduit(tiny_vlm, tmp_path_factory, off_answers, fault_file):
    """A TP-2 conduit server at budget 1.0 (the fault file empty unless a test fills
    it); started after the ``off`` answers, so that one TP-2 server runs at a time."""
    log = tmp_path_factory.mktemp("tp_conduit") / "conduit.log"
    env = {**_env(None), FAULT_FILE_ENV: str(fault_file)}
    args = ["--mm-reuse", "conduit", "--mm-refresh-budget", "1.0"]
    with _refresh_server(tiny_vlm, log, args, env) as server:
        yield server


def _delta(before: dict, after: dict, part: str, field: str) -> int | float:
    return after[part][field] - before[part][field]


def _reuses(server: ServerProcess) -> dict:
    """The stored conversation, then the reordered probe: its counter deltas."""
    client = _client(server)
    _chat(client, _conversation(STORE, IMAGES))
    before = mmkv_stats(server.base_url)
    body = {
        "model": "default",
        "messages": _conversation(*PROBES["reordered"]),
        "max_tokens": 4,
        "temperature": 0,
    }
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    after = mmkv_stats(server.base_url)
    fields = ("reused_tokens", "refreshed_tokens", "fallbacks", "rank_disagreements")
    return {f: _delta(before, after, "refresh", f) for f in fields}


@pytest.mark.slow
def test_tp2_conduit_at_budget_0_1_reuses(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp_conduit01") / "conduit01.log"
    args = ["--mm-reuse", "conduit", "--mm-refresh-budget", "0.1"]
    with _refresh_server(tiny_vlm, log, args) as server:
        counts = _reuses(server)
    reused = 3 * TOKENS_PER_IMAGE
    assert counts == {
        "reused_tokens": reused,
        "refreshed_tokens": math.ceil(0.1 * reused),
        "fallbacks": 0,
        "rank_disagreements": 0,
    }


def test_tp2_staleprobe_auto_reuses(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp_staleprobe") / "staleprobe.log"
    args = ["--mm-reuse", "staleprobe", "--mm-refresh-budget", "auto"]
    with _refresh_server(tiny_vlm, log, args) as server:
        counts = _reuses(server)
    assert counts["reused_tokens"] == 3 * TOKENS_PER_IMAGE
    assert 0 <= counts["refreshed_tokens"] <= counts["reused_tokens"]
    assert counts["fallbacks"] == 0 and counts["rank_disagreements"] == 0


@pytest.mark.parametrize("probe", list(PROBES))
def test_tp2_conduit_at_budget_one_answers_as_off(conduit, off_answers, probe):
    client = _client(conduit)
    system, images = PROBES[probe]
    flush_cache(conduit.base_url)
    _assert_same(_chat(client, _conversation(STORE, IMAGES)), off_answers["store"])
    before = mmkv_stats(conduit.base_url)
    got = _chat(client, _conversation(system, images))
    after = mmkv_stats(conduit.base_url)
    _assert_same(got, off_answers[probe])
    reused = len(images) * TOKENS_PER_IMAGE
    assert _delta(before, after, "store", "hits") == len(images)
    assert _delta(before, after, "refresh", "reused_tokens") == reused
    assert _delta(before, after, "refresh", "refreshed_tokens") == reused
    assert _delta(before, after, "refresh", "fallbacks") == 0
    assert _delta(before, after, "refresh", "rank_disagreements") == 0
    # one reusing extend: plan, copy, scoring (flag + statistics), selection, finish,
    # and the images' embedding build (which stored embeddings every rank holds)
    assert _delta(before, after, "refresh", "rank_collectives") == 7


def test_tp2_conduit_second_turn_answers_as_off(conduit, off_answers):
    client = _client(conduit)
    flush_cache(conduit.base_url)
    first, _ = _turns("")
    reply = _chat(client, first)
    _assert_same(reply, off_answers["first_turn"])
    before = mmkv_stats(conduit.base_url)
    got = _chat(client, _turns(reply[0])[1])
    after = mmkv_stats(conduit.base_url)
    _assert_same(got, off_answers["second_turn"])
    assert _delta(before, after, "store", "hits") == 2
    assert _delta(before, after, "refresh", "reused_tokens") == 2 * TOKENS_PER_IMAGE


@pytest.mark.parametrize("stage", FAULT_STAGES)
def test_tp2_a_fault_on_rank_1_only_answers_as_stock_on_both(
    conduit, off_answers, fault_file, stage
):
    """Rank 1 fails at ``stage``; rank 0 (whose counters the server reports) follows it
    to stock, both answer as ``off``, and the server keeps serving and reusing."""
    client = _client(conduit)
    flush_cache(conduit.base_url)
    before = mmkv_stats(conduit.base_url)
    fault_file.write_text(f"{stage}@1")
    try:
        _assert_same(_chat(client, _conversation(STORE, IMAGES)), off_answers["store"])
        _assert_same(_chat(client, _conversation(*PROBES["reordered"])), off_answers["reordered"])
    finally:
        fault_file.write_text("")
    after = mmkv_stats(conduit.base_url)
    # rank 0 answered a batch as stock because rank 1 failed (a fault after the
    # stock extend of a batch that reused nothing leaves rank 1's store without the
    # images: the next plans differ and neither rank reuses them)
    followed = _delta(before, after, "refresh", "fallbacks")
    assert followed + _delta(before, after, "refresh", "rank_disagreements") >= 1
    assert requests.get(conduit.base_url + "/health", timeout=30).status_code == 200
    # and without the fault the same probe reuses again
    flush_cache(conduit.base_url)
    _chat(client, _conversation(STORE, IMAGES))
    before = mmkv_stats(conduit.base_url)
    _assert_same(
        _chat(client, _conversation(*PROBES["changed_prefix"])), off_answers["changed_prefix"]
    )
    after = mmkv_stats(conduit.base_url)
    assert _delta(before, after, "refresh", "reused_tokens") == 3 * TOKENS_PER_IMAGE
    assert _delta(before, after, "refresh", "fallbacks") == 0


def test_tp2_canonical_fill_and_mmshiftkv_ranking_answer_as_off(
    tiny_vlm, tmp_path_factory, off_answers
):
    """``--mm-segment-fill canonical`` (a pass per batch of new images, the model's
    all-reduces in it) and ``--mm-evict mmshiftkv`` (each rank's votes over its KV
    heads, summed before the ranking) at TP 2: the ranks fill and rank the same
    images, and a reused, fully refreshed request answers as ``off``."""
    log = tmp_path_factory.mktemp("tp_canonical") / "canonical.log"
    args = ["--mm-reuse", "conduit", "--mm-refresh-budget", "1.0"]
    args += ["--mm-segment-fill", "canonical", "--mm-evict", "mmshiftkv"]
    with _refresh_server(tiny_vlm, log, args) as server:
        client = _client(server)
        before = mmkv_stats(server.base_url)
        _assert_same(_chat(client, _conversation(STORE, IMAGES)), off_answers["store"])
        filled = mmkv_stats(server.base_url)
        _assert_same(_chat(client, _conversation(*PROBES["reordered"])), off_answers["reordered"])
        after = mmkv_stats(server.base_url)
    assert _delta(before, filled, "store", "fills") == len(IMAGES)
    assert _delta(before, filled, "store", "ranked_fills") == len(IMAGES)
    assert _delta(before, filled, "store", "canonical_skipped") == 0
    assert _delta(filled, after, "store", "hits") == len(IMAGES)
    reused = len(IMAGES) * TOKENS_PER_IMAGE
    assert _delta(filled, after, "refresh", "reused_tokens") == reused
    assert _delta(before, after, "refresh", "fallbacks") == 0
    assert _delta(before, after, "refresh", "rank_disagreements") == 0


@pytest.mark.slow
def test_tp2_qwen3_vl_moe_conduit_at_budget_one_answers_as_off(tiny_qwen3_vl_moe, tmp_path_factory):
    """Qwen3-VL MoE at TP 2 (experts sharded over the ranks, SGLang's native MoE on the
    CPU): a reused, fully refreshed request answers as ``off`` at TP 2 does."""
    logs = tmp_path_factory.mktemp("tp_moe")
    off = ServerProcess(
        "sgl_mmkv.launch_server",
        tiny_qwen3_vl_moe,
        [*TP, "--mm-reuse", "off", *CPU_SERVER_ARGS],
        log_path=logs / "off.log",
        env=_env(None),
        cwd=REPO,
    )
    with off:
        client = _client(off)
        want = {"store": _chat(client, _conversation(STORE, IMAGES))}
        for name, (system, images) in PROBES.items():
            want[name] = _chat(client, _conversation(system, images))
    args = ["--mm-reuse", "conduit", "--mm-refresh-budget", "1.0"]
    with _refresh_server(tiny_qwen3_vl_moe, logs / "conduit.log", args) as server:
        client = _client(server)
        for name, (system, images) in PROBES.items():
            flush_cache(server.base_url)
            _assert_same(_chat(client, _conversation(STORE, IMAGES)), want["store"])
            before = mmkv_stats(server.base_url)
            _assert_same(_chat(client, _conversation(system, images)), want[name])
            after = mmkv_stats(server.base_url)
            assert _delta(before, after, "store", "hits") == len(images), name
            reused = len(images) * TOKENS_PER_IMAGE
            assert _delta(before, after, "refresh", "reused_tokens") == reused, name
            assert _delta(before, after, "refresh", "refreshed_tokens") == reused, name
            assert _delta(before, after, "refresh", "fallbacks") == 0, name
            assert _delta(before, after, "refresh", "rank_disagreements") == 0, name


@pytest.mark.slow
def test_tp2_instances_share_file_storage_per_tenant_and_tp1_loads_none(tiny_vlm, tmp_path_factory):
    """Instance A (TP 2) stores an image under tenant A's salt; instance B (TP 2, the
    same directory) reuses it for tenant A only; a TP-1 instance on that directory
    loads none of the TP-2 entries (another layout: its fingerprint and names)."""
    root = tmp_path_factory.mktemp("tp_storage")
    args = [
        *("--mm-reuse", "conduit", "--mm-refresh-budget", "1.0"),
        *("--mm-segment-storage", "file", "--mm-segment-storage-dir", str(root / "segments")),
    ]
    image = make_image(1401)

    def ask(server: ServerProcess, system: str, **extra) -> dict:
        return greedy_chat(server.base_url, _conversation(system, [image]), **extra)

    with _refresh_server(tiny_vlm, root / "a.log", args) as a:
        before = mmkv_stats(a.base_url)["storage"]  # the server's warmup wrote its image
        assert ask(a, "A reads.", cache_salt="tenant-A")["reused"] == 0
        after = _wait_writes(a, before["writes"] + 1)
        assert after["writes"] - before["writes"] == 1 and after["write_failed"] == 0
    with _refresh_server(tiny_vlm, root / "b.log", args) as b:
        before = mmkv_stats(b.base_url)["storage"]
        assert ask(b, "Nobody's tenant.")["reused"] == 0
        assert ask(b, "Tenant B.", cache_salt="tenant-B")["reused"] == 0
        assert ask(b, "Tenant A, in B.", cache_salt="tenant-A")["reused"] == TOKENS_PER_IMAGE
        assert mmkv_stats(b.base_url)["storage"]["hits"] - before["hits"] == 1
    tp1 = ServerProcess(
        "sgl_mmkv.launch_server",
        tiny_vlm,
        [*REFRESH_ARGS, *args, *CPU_SERVER_ARGS],
        log_path=root / "c.log",
        env=_env(None),
        cwd=REPO,
    )
    with tp1 as c:
        before = mmkv_stats(c.base_url)["storage"]
        assert ask(c, "Tenant A at TP 1.", cache_salt="tenant-A")["reused"] == 0
        after = mmkv_stats(c.base_url)["storage"]
        assert after["hits"] == before["hits"] and after["lookups"] - before["lookups"] == 1

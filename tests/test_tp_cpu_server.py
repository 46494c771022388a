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

import os
from pathlib import Path

import openai
import pytest

from sgl_mmkv.launch_server import OMP_BIND_ENV
from sgl_mmkv.patches.model_parallel_group_cpu import ACTING_LOG_PREFIX
from sgl_mmkv.radix_cache import ACTIVE_LOG_PREFIX
from sgl_mmkv.testing.images import make_image, user_message
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess, stock_cpu_env

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

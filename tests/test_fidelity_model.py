"""The committed trained model in real SGLang, and the fidelity benchmark end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_mmkv.testing.evaluate_fidelity_model import (
    SUBSET_SIZE,
    accuracy_report,
    full_prefill_answers,
)
from sgl_mmkv.testing.fidelity_bench import (
    FidelityClient,
    PromptLayout,
    measure,
    summarise,
)
from sgl_mmkv.testing.fidelity_task import make_split
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "fidelity-qwen2-vl"
RECORDED = json.loads((MODEL / "accuracy.json").read_text())
MARGIN = 0.1  # 32 examples: one wrong answer is 0.03


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "fidelity_exact.log"
    with ServerProcess(
        "sgl_mmkv.launch_server", MODEL, ["--mm-reuse", "exact", *CPU_SERVER_ARGS], log_path=log
    ) as proc:
        yield proc


def test_committed_model_reaches_its_recorded_accuracy(server):
    examples = make_split("test", SUBSET_SIZE)
    report = accuracy_report(examples, full_prefill_answers(server.base_url, examples))
    assert report["accuracy"] >= RECORDED["subset_accuracy"] - MARGIN, report
    assert RECORDED["accuracy"] >= 0.9  # the model was committed at >= 90 % on test[0:200]


def test_exact_reuse_agrees_with_full_prefill_and_stock_reuses_no_moved_image(server):
    examples = make_split("test", 3, num_images=3)
    records = measure(FidelityClient(server.base_url), PromptLayout(str(MODEL)), examples)
    by = {s.scenario: s for s in summarise("exact", records)}
    repeat = [r for r in records if r.scenario == "repeat"]
    assert by["repeat"].first_token_agreement == 1.0
    assert all(r.probe_cached_tokens == r.prompt_tokens - 1 for r in repeat)
    assert all(r.probe_cached_image_tokens == r.image_tokens == 48 for r in repeat)
    # The same images under another prefix or order: exact-prefix reuse gets none.
    for scenario in ("changed_prefix", "reordered"):
        assert by[scenario].mean_cached_image_tokens == 0
        assert by[scenario].first_token_agreement == 1.0  # the probe is a full prefill
    # Multi-turn: the first turn's images are an exact prefix of the second turn.
    turns = [r for r in records if r.scenario == "multi_turn"]
    assert all(r.probe_cached_image_tokens == 32 for r in turns)


def test_benchmark_script_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fidelity.py"),
            "--modes",
            "exact",
            "--num-examples",
            "2",
            "--scenarios",
            "repeat,changed_prefix",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "fidelity.json").read_text())
    rows = {(s["mode"], s["scenario"]): s for s in data["summaries"]}
    assert set(rows) == {("exact", "repeat"), ("exact", "changed_prefix")}
    assert all(s["n"] == 2 for s in rows.values())
    assert (tmp_path / "fidelity.png").stat().st_size > 10_000
    assert "changed_prefix" in result.stdout

"""The committed trained model loads in SGLang on the CPU and reaches its recorded accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_mmkv.benchmarking.fidelity_task import model_split
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess
from training.evaluate_fidelity_model import (
    SUBSET_SIZE,
    accuracy_report,
    full_prefill_answers,
)

MODELS = Path(__file__).resolve().parent.parent / "models"
MARGIN = 0.1  # 3 of 32 answers: CPU kernels may flip a near tie


@pytest.mark.parametrize("name", ["fidelity-qwen2-vl", "fidelity-qwen2-vl-marked"])
def test_committed_model_reaches_its_recorded_subset_accuracy(tmp_path, name):
    model = MODELS / name
    recorded = json.loads((model / "accuracy.json").read_text())
    examples = model_split(model, "test", SUBSET_SIZE)
    log = tmp_path / "stock.log"
    with ServerProcess("sglang.launch_server", model, CPU_SERVER_ARGS, log_path=log) as server:
        answers = full_prefill_answers(server.base_url, examples)
    report = accuracy_report(examples, answers)
    assert report["n"] == SUBSET_SIZE
    assert report["accuracy"] >= recorded["subset_accuracy"] - MARGIN
    assert report["accuracy"] == pytest.approx(recorded["subset_accuracy"], abs=MARGIN)

"""The committed trained model loads in SGLang on the CPU and reaches its recorded accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.fidelity_task import model_split
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess
from training.evaluate_fidelity_model import (
    SUBSET_SIZE,
    accuracy_report,
    full_prefill_answers,
    staleness_report,
)

MODELS = Path(__file__).resolve().parent.parent / "models"
MARGIN = 0.1  # 3 of 32 answers: CPU kernels may flip a near tie


@pytest.mark.parametrize(
    "name",
    [
        "fidelity-qwen2-vl",
        "fidelity-qwen2-vl-marked",
        # the staleness check below holds their full-prefill accuracy too
        pytest.param("fidelity-qwen2-vl-next", marks=pytest.mark.slow),
        pytest.param("fidelity-qwen2-vl-turns", marks=pytest.mark.slow),
        pytest.param("fidelity-qwen2-vl-page", marks=pytest.mark.slow),
        pytest.param("fidelity-qwen2-vl-page-heldout", marks=pytest.mark.slow),
        pytest.param("fidelity-qwen2-vl-page-seed2", marks=pytest.mark.slow),
    ],
)
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


@pytest.mark.slow  # re-measures figures accuracy.json recorded (a benchmark of the model)
@pytest.mark.parametrize(
    "name, scenarios",
    [
        ("fidelity-qwen2-vl-next", ("reordered", "image_prefix")),
        ("fidelity-qwen2-vl-turns", ("reordered", "turn_reordered")),
        ("fidelity-qwen2-vl-page", ("reordered", "image_prefix")),
        ("fidelity-qwen2-vl-page-heldout", ("reordered", "image_prefix")),
        ("fidelity-qwen2-vl-page-seed2", ("reordered", "image_prefix")),
    ],
)
def test_the_staleness_models_answer_worse_from_stale_image_kv(name, scenarios):
    """Plain reuse (refresh budget 0) of images first shown in another order, after
    another dotted image, or in an earlier turn in another order, loses what
    accuracy.json recorded on the test subset."""
    model = MODELS / name
    recorded = json.loads((model / "accuracy.json").read_text())["staleness"]
    examples = model_split(model, "test", SUBSET_SIZE)
    measured = staleness_report(model, examples, scenarios)
    for scenario, got in measured.items():
        want = recorded[scenario]
        assert got["subset_full"] == pytest.approx(want["subset_full"], abs=MARGIN), scenario
        assert got["subset_reuse"] == pytest.approx(want["subset_reuse"], abs=MARGIN), scenario
        assert got["subset_full"] - got["subset_reuse"] >= 0.1, scenario  # stale KV costs

"""The fidelity benchmark end to end through a real sgl_mmkv server.

Run on the tiny random-weight VLM: what is asserted here (cache hits, agreement
of exact reuse with full prefill, the script's outputs) does not depend on the
model answering well. Accuracy claims need the trained model (issue 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.fidelity import (
    COLD,
    FidelityClient,
    PromptLayout,
    ReferenceReplies,
    measure,
)
from harness.fidelity_summary import summarise
from harness.fidelity_task import make_split
from sgl_mmkv.testing.server import CPU_SERVER_ARGS, REPORT_REUSE, ServerProcess
from training.evaluate_fidelity_model import accuracy_report, full_prefill_answers

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tiny_vlm, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "fidelity_exact.log"
    with ServerProcess(
        "sgl_mmkv.launch_server",
        tiny_vlm,
        ["--mm-reuse", "exact", REPORT_REUSE, *CPU_SERVER_ARGS],
        log_path=log,
    ) as proc:
        yield proc


def test_full_prefill_answers_are_scored_per_type(server):
    examples = make_split("test", 6)
    answers = full_prefill_answers(server.base_url, examples)
    report = accuracy_report(examples, answers)
    assert len(answers) == report["n"] == 6
    assert set(report["per_qtype"]) == {e.qtype for e in examples}
    # Random weights: whatever it answers, the score is the exact-match count.
    assert (
        report["accuracy"]
        == sum(
            a.strip().rstrip(".").lower() == e.answer
            for a, e in zip(answers, examples, strict=True)
        )
        / 6
    )


def test_exact_reuse_agrees_with_full_prefill_and_stock_reuses_no_moved_image(server, tiny_vlm):
    examples = make_split("test", 3, num_images=3)
    records = measure(FidelityClient(server.base_url), PromptLayout(str(tiny_vlm)), examples)
    by = {s.scenario: s for s in summarise("exact", records)}
    repeat = [r for r in records if r.scenario == "repeat"]
    assert by["repeat"].first_token_agreement == 1.0
    assert by["repeat"].reply_agreement == 1.0
    assert all(r.probe_cached_tokens == r.prompt_tokens - 1 for r in repeat)
    assert all(r.probe_cached_image_tokens == r.image_tokens == 48 for r in repeat)
    # The same images under another prefix or order: exact-prefix reuse gets none.
    for scenario in ("changed_prefix", "reordered"):
        assert by[scenario].mean_cached_image_tokens == 0
        assert by[scenario].first_token_agreement == 1.0  # the probe is a full prefill
    # Multi-turn: the first turn's images are an exact prefix of the second turn.
    turns = [r for r in records if r.scenario == "multi_turn"]
    assert all(r.probe_cached_image_tokens == 32 for r in turns)


def test_concurrent_probes_measure_what_one_at_a_time_measures(server, tiny_vlm):
    examples = make_split("test", 4, num_images=2)
    client, layout = FidelityClient(server.base_url), PromptLayout(str(tiny_vlm))
    scenarios = ["repeat", "image_prefix"]
    alone = measure(client, layout, examples, scenarios)
    together = measure(client, layout, examples, scenarios, concurrency=4)
    key = lambda r: (r.uid, r.scenario)  # noqa: E731
    assert sorted(map(key, together)) == sorted(map(key, alone)) and len(alone) == 8
    for a, b in zip(sorted(alone, key=key), sorted(together, key=key), strict=True):
        # Text prefixes may be shared across a chunk's probes; images never are.
        assert (b.probe, b.reference) == (a.probe, a.reference)
        image_hits = 32 if a.scenario == "repeat" else 0
        assert a.probe_cached_image_tokens == b.probe_cached_image_tokens == image_hits
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        measure(client, layout, examples, scenarios, concurrency=0)


@pytest.mark.slow  # the benchmark script end to end
def test_benchmark_script_runs_end_to_end(tmp_path, tiny_vlm):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fidelity.py"),
            "--model-path",
            str(tiny_vlm),
            "--modes",
            "exact",
            "--conduit-ablations",
            "layers_1",
            "--budgets",
            "0.5",
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
    ablation = "conduit-layers_1"
    assert set(rows) == {(m, s) for m in ("exact", ablation) for s in ("repeat", "changed_prefix")}
    assert all(s["n"] == 2 for s in rows.values())
    assert rows[(ablation, "repeat")]["budget"] == 0.5
    assert set(data["records"]) == {"exact", f"{ablation}@0.5"}
    assert (tmp_path / "fidelity.png").stat().st_size > 10_000
    assert "changed_prefix" in result.stdout


def test_cold_probes_take_their_references_from_another_client_once(server, tiny_vlm):
    class Counting(FidelityClient):
        chats = 0

        def chat(self, messages):
            Counting.chats += 1
            return super().chat(messages)

    references = ReferenceReplies(Counting(server.base_url))
    examples = make_split("test", 2, num_images=2)
    layout = PromptLayout(str(tiny_vlm))
    client = FidelityClient(server.base_url)
    for _ in range(2):  # the second pass is answered from the stored references
        records = measure(client, layout, examples, [COLD], references)
    assert Counting.chats == 2
    (summary,) = summarise("cold", records)
    assert summary.reply_agreement == 1.0 and summary.first_token_agreement == 1.0
    assert all(r.probe_cached_tokens == 0 for r in records)

"""Paired bootstrap intervals of the fidelity summaries."""

from __future__ import annotations

import math

import pytest

from harness.bootstrap import paired_intervals
from harness.fidelity import ProbeRecord
from harness.fidelity_summary import format_table, summarise


def test_a_constant_outcome_has_a_zero_width_interval():
    ci = paired_intervals([1.0] * 50, [1.0] * 50)
    assert ci == {"accuracy": (1.0, 1.0), "relative_accuracy": (1.0, 1.0)}


def test_the_interval_has_the_binomial_width():
    probe = [1.0] * 140 + [0.0] * 60
    ci = paired_intervals([1.0] * 200, probe)
    lo, hi = ci["accuracy"]
    assert lo < 0.7 < hi
    assert hi - lo == pytest.approx(2 * 1.96 * math.sqrt(0.7 * 0.3 / 200), abs=0.02)
    assert ci["relative_accuracy"] == ci["accuracy"]  # the reference is always right


def test_pairs_are_resampled_together():
    # The probe is right exactly where the reference is: the ratio never moves.
    outcomes = [1.0, 0.0] * 50
    ci = paired_intervals(outcomes, outcomes)
    assert ci["relative_accuracy"] == (1.0, 1.0)
    assert ci["accuracy"][0] < 0.5 < ci["accuracy"][1]


def test_same_seed_same_interval_and_mismatch_refused():
    probe = [1.0, 0.0, 1.0] * 20
    assert paired_intervals([1.0] * 60, probe) == paired_intervals([1.0] * 60, probe)
    with pytest.raises(ValueError, match="3 reference outcomes for 2 probes"):
        paired_intervals([1.0] * 3, [1.0] * 2)


def _record(correct: bool) -> ProbeRecord:
    return ProbeRecord(
        uid="u", qtype="colour", num_images=2, scenario="reordered", answer="red",
        reference="red", probe="red" if correct else "blue", reference_correct=True,
        probe_correct=correct, first_token_agree=correct, first_token_kl=0.0,
        prompt_tokens=10, reference_cached_tokens=0, probe_cached_tokens=0, image_tokens=4,
        probe_cached_image_tokens=0, probe_latency_s=0.1,
    )  # fmt: skip


def test_summaries_carry_the_intervals_into_the_table():
    (summary,) = summarise("reuse", [_record(i % 4 != 0) for i in range(40)], 0.0)
    assert summary.accuracy == 0.75
    lo, hi = summary.accuracy_ci
    assert lo < 0.75 < hi and summary.relative_accuracy_ci == (lo, hi)
    assert f"[{lo:.3f},{hi:.3f}]" in format_table([summary])

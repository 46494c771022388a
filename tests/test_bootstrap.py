"""Paired bootstrap intervals of the fidelity summaries."""

from __future__ import annotations

import json
import math

import pytest

from harness.bootstrap import gap_share, paired_intervals
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


def test_gap_share_is_the_closed_part_of_the_floor_to_ceiling_gap():
    n = 100
    floor = [1.0] * 20 + [0.0] * 80  # 0.2
    ceiling = [1.0] * 60 + [0.0] * 40  # 0.6
    method = [1.0] * 40 + [0.0] * 60  # 0.4: half of the gap
    share, (lo, hi) = gap_share(floor, method, ceiling)
    assert share == pytest.approx(0.5) and lo < 0.5 < hi
    assert gap_share(floor, ceiling, ceiling) == (pytest.approx(1.0), (1.0, 1.0))
    assert gap_share(floor, floor, ceiling) == (pytest.approx(0.0), (0.0, 0.0))
    worse = [0.0] * n  # below the floor: a negative share
    assert gap_share(floor, worse, ceiling)[0] == pytest.approx(-0.5)
    assert math.isnan(gap_share(ceiling, method, ceiling)[0])  # no gap, no share
    with pytest.raises(ValueError, match="100, 100 and 3 outcomes"):
        gap_share(floor, method, [1.0] * 3)


def _compare_methods():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_methods.py"
    spec = importlib.util.spec_from_file_location("compare_methods", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gap_rows_pair_reuse_a_method_and_the_ceiling_by_prompt(tmp_path):
    def run(**methods):
        return {
            label: [
                {"uid": f"u{i}", "scenario": "reordered", "probe_correct": bool(c)}
                for i, c in enumerate(outcomes)
            ]
            for label, outcomes in methods.items()
        }

    reuse, oracle, mine = [1, 0, 0, 0] * 10, [1, 1, 1, 0] * 10, [1, 1, 0, 0] * 10
    first = run(**{"reuse@0.0": reuse, "oracle@0.1": oracle})
    later = run(**{"reuse@0.0": [0] * 40, "mine@0.1": mine})
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, records in zip(paths, (first, later), strict=True):
        path.write_text(json.dumps({"records": records}))
    module = _compare_methods()
    records = module.load_records(paths)
    assert records["reuse@0.0"] == first["reuse@0.0"]  # the first run's floor
    (row,) = module.gap_rows(records, "oracle", 0.1)
    assert (row["method"], row["n"], row["gap_share"]) == ("mine@0.1", 40, 0.5)
    assert (row["floor_accuracy"], row["accuracy"], row["ceiling_accuracy"]) == (0.25, 0.5, 0.75)
    with pytest.raises(SystemExit, match="oracle@0.1 is in more than one"):
        module.load_records([paths[0], paths[0]])

"""training/probe_choice.py: the salience, the one-pass variant against repair_study's
stalepatch, and the two-pass variant's FLOPs by hand."""

from __future__ import annotations

import pytest
import torch

from harness.fidelity_task import model_split
from training.probe_choice import (
    CHOSEN,
    attentions_of,
    fill_salience,
    one_pass,
    oracle_salience,
    tail_salience,
    two_pass,
)
from training.repair_study import (
    MODEL,
    Runner,
    plain_fn,
    positions_of,
    probe_images,
    probe_offsets,
)


@pytest.fixture(scope="module")
def runner():
    torch.set_num_threads(1)
    return Runner(MODEL)


@pytest.fixture(scope="module")
def cases(runner):
    built = runner.cases("validation", 1, ("reordered", "changed_prefix"))
    return built["reordered"][0], built["changed_prefix"][0]


def test_tail_salience_by_hand():
    att = torch.zeros(2, 6, 6)  # 2 heads, 6 rows
    att[0, 4, 1], att[1, 4, 2], att[0, 5, 2] = 1.0, 1.0, 1.0
    (first,) = tail_salience([att, att], [(1, 3)], slice(4, 6))
    # rows 4-5 and heads 0-1: token 1 gets 1 of 4 (row, head) pairs, token 2 gets 2
    assert torch.allclose(first, torch.tensor([0.25, 0.5]))


def test_salience_reads_each_image_and_restores_attention(runner, cases):
    reordered, _ = cases
    own = runner.model.config._attn_implementation
    oracle = oracle_salience(runner, reordered)
    example = model_split(MODEL, "validation", 1)[0]
    fill = fill_salience(runner, example, reordered)
    assert runner.model.config._attn_implementation == own
    assert [s.numel() for s in oracle] == [e - s for s, e in reordered.spans]
    assert [s.numel() for s in fill] == [e - s for s, e in reordered.spans]
    assert all(float(s.min()) >= 0 and float(s.sum()) > 0 for s in oracle + fill)
    # the eager attention's rows are distributions
    rows = attentions_of(runner, reordered.inputs)[0].sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-4)


def test_one_pass_on_the_grid_is_repair_studys_stalepatch(runner, cases):
    reordered, _ = cases
    grid = {j: probe_offsets(reordered.grids[j], CHOSEN.probes) for j in probe_images(reordered)}
    ok, flops = one_pass(runner, reordered, grid)
    want_ok, want_flops, _ = runner.run(reordered, "stalepatch", CHOSEN)
    assert ok == want_ok and flops == pytest.approx(want_flops)


def test_two_pass_flops_by_hand(runner, cases):
    seconds = 0
    for case in cases:
        _, flops = two_pass(runner, case, 4)
        rows = case.fresh_rows()
        for j in probe_images(case):
            rows[case.spans[j][0] + probe_offsets(case.grids[j], 1)[0]] = True
        first = runner.shape.pass_flops(positions_of(rows)) / runner.full(case)
        last = max(e for _, e in case.spans)
        tail = runner.shape.pass_flops(torch.arange(last, case.prompt_len)) / runner.full(case)
        # at least the first pass; with a second, at most the question and P rows per
        # probed image again, plus a little elementwise patch work
        assert flops >= first - 1e-12
        if flops > first + 1e-12:
            seconds += 1
            assert first + tail < flops < first + tail + 0.02 + 0.003 * 4 * len(case.spans)
    assert seconds == 1  # the reordered case has a stale image, the changed prefix none


def test_layer0_salience_needs_no_fresh_image_kv(runner, cases):
    """salient-layer0 is servable before the pass: at layer 0 the question reads the
    same attention over the stale rows as over the full prefill's."""
    reordered, _ = cases
    full = attentions_of(runner, reordered.inputs)[0]
    stale = attentions_of(runner, reordered.inputs, plain_fn(reordered))[0]
    assert torch.allclose(full, stale, atol=1e-5)
    deeper = attentions_of(runner, reordered.inputs, plain_fn(reordered))[2]
    assert not torch.allclose(attentions_of(runner, reordered.inputs)[2], deeper, atol=1e-3)

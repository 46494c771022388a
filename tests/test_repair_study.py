"""training/repair_study.py: the offline repair simulation's invariants, with numbers
that can fail (exactness at the extremes, FLOPs by hand)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sgl_mmkv.refresh.flops import DecoderShape
from training.repair_study import (
    MODEL,
    PatchConfig,
    Runner,
    _extrapolate,
    answer_logits,
    first_masks,
    kamera_patch,
    kamera_patch_bytes,
    keep_fn,
    kv_bytes,
    layered_flops,
    oracle_rank_fn,
    paired_against,
    parse_label,
    plain_fn,
    probe_images,
    probe_offsets,
    stalepatch_fn,
    vlcache_rows,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def runner():
    torch.set_num_threads(1)
    return Runner(MODEL)


@pytest.fixture(scope="module")
def cases(runner):
    built = runner.cases("validation", 1, ("reordered", "changed_prefix"))
    return built["reordered"][0], built["changed_prefix"][0]


def _logits(runner, case, fn=None):
    return answer_logits(runner.model, runner.hook, case, fn)


def test_layout_of_a_reordered_case(cases):
    reordered, changed = cases
    n = len(reordered.spans)
    assert n >= 2 and all(e - s == 64 for s, e in reordered.spans)
    # every image moved by its own shift: every one is probed; a changed prefix moves
    # them together: only the first
    assert probe_images(reordered) == list(range(n))
    assert probe_images(changed) == [0]
    assert reordered.prefix_len > 0 and changed.prefix_len < reordered.prefix_len


def test_stale_kv_changes_the_answer_rows(runner, cases):
    reordered, _ = cases
    full, plain = _logits(runner, reordered), _logits(runner, reordered, plain_fn(reordered))
    assert (full - plain).abs().max() > 1e-2  # the stale KV matters here


def test_stalepatch_with_every_row_a_probe_is_full_prefill(runner, cases):
    reordered, _ = cases
    fn, _ = stalepatch_fn(reordered, PatchConfig(probes=64, form="mean", tau=0.0))
    assert torch.allclose(_logits(runner, reordered, fn), _logits(runner, reordered), atol=ATOL)


def test_stalepatch_without_probes_or_patch_is_plain_reuse(runner, cases):
    reordered, _ = cases
    plain = _logits(runner, reordered, plain_fn(reordered))
    fn, _ = stalepatch_fn(reordered, PatchConfig(probes=0, form="mean", tau=0.0))
    assert torch.equal(_logits(runner, reordered, fn), plain)
    # probes kept, zero patch: differs from plain reuse only through the probes' rows
    fn, _ = stalepatch_fn(reordered, PatchConfig(probes=2, form="none", tau=0.0))
    assert not torch.equal(_logits(runner, reordered, fn), plain)


def test_patch_forms_reproduce_a_constant_change():
    generator = torch.Generator().manual_seed(0)
    stale = torch.randn(64, 16, generator=generator)
    delta = torch.randn(1, 16, generator=generator).expand(8, 16)
    loadings = torch.randn(64, 2, generator=generator)
    offs = [3, 10, 20, 28, 35, 44, 52, 60]  # well over regress / basis's 3 coefficients
    for form in ("mean", "kernel", "regress", "basis"):
        got = _extrapolate(PatchConfig(probes=8, form=form), stale, offs, delta, loadings)
        # regress / basis: a small ridge shrinks the least-squares fit a little
        rtol = 5e-2 if form in ("regress", "basis") else 1e-5
        assert torch.allclose(got, delta[:1].expand(64, 16), rtol=rtol, atol=1e-4), form
    zero = _extrapolate(PatchConfig(probes=3, form="none"), stale, offs, delta)
    assert torch.equal(zero, torch.zeros(64, 16))


def test_kamera_full_rank_is_plain_reuse_rank_zero_is_alone(runner, cases):
    reordered, _ = cases
    plain = _logits(runner, reordered, plain_fn(reordered))
    served = kamera_patch(reordered, 64)
    fn = keep_fn(reordered, lambda j, layer: None, base=lambda j, layer: served[j][layer])
    assert torch.allclose(_logits(runner, reordered, fn), plain, atol=ATOL)
    alone = kamera_patch(reordered, 0)
    for j, per_layer in enumerate(alone):
        ak, av = reordered.alone[reordered.image_index[j]][2]
        assert torch.equal(per_layer[2][0], ak) and torch.equal(per_layer[2][1], av)


def test_vlcache_extremes_and_oracle_full_rank(runner, cases):
    reordered, _ = cases
    full = _logits(runner, reordered)
    everything = keep_fn(reordered, first_masks(reordered, [1.0] * 4))
    nothing = keep_fn(reordered, first_masks(reordered, [0.0] * 4))
    assert torch.allclose(_logits(runner, reordered, everything), full, atol=ATOL)
    assert torch.equal(
        _logits(runner, reordered, nothing), _logits(runner, reordered, plain_fn(reordered))
    )
    assert torch.allclose(
        _logits(runner, reordered, oracle_rank_fn(reordered, 64)), full, atol=ATOL
    )
    with pytest.raises(ValueError):
        first_masks(reordered, [0.5, 1.0, 1.0, 1.0])  # must shrink with depth


def test_flops_by_hand():
    shape = DecoderShape(2, 8, 16, 2, 1, 4, 32)
    per_layer_linear = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16)
    head = 2 * 8 * 32
    # rows 0, 1, 2 at layer 0, row 2 alone at layer 1
    attn = 4 * 2 * 4
    want = 3 * per_layer_linear + attn * (1 + 2 + 3) + per_layer_linear + attn * 3 + head
    assert layered_flops(shape, [torch.tensor([0, 1, 2]), torch.tensor([2])]) == want
    # the same rows at every layer: one ordinary pass
    rows = torch.tensor([3, 4, 9])
    assert layered_flops(shape, [rows, rows]) == shape.pass_flops(rows)


def test_case_flops_by_hand(runner, cases):
    reordered, _ = cases
    shape = runner.shape
    fresh = reordered.fresh_rows()
    image_rows = sum(e - s for s, e in reordered.spans)
    assert int(fresh.sum()) == reordered.prompt_len - reordered.prefix_len - image_rows
    ok, f, _ = runner.run(reordered, "reuse")
    assert f == pytest.approx(
        shape.pass_flops(fresh.nonzero().flatten())
        / shape.extend_flops(reordered.prefix_len, reordered.prompt_len)
    )
    # vlcache at ratio r adds ceil(r n) rows per image at every layer
    rows = vlcache_rows(reordered, [0.25] * 4)
    assert all(r.numel() == int(fresh.sum()) + len(reordered.spans) * math.ceil(16) for r in rows)
    # stalepatch: one pass over text + P probes per probed image, plus the patch work
    cfg = PatchConfig(probes=2, form="mean", tau=0.0)
    _, f_patch, _ = runner.run(reordered, "stalepatch", cfg)
    probes = 2 * len(probe_images(reordered))
    assert len(probe_offsets(reordered.grids[0], 2)) == 2
    base = fresh.clone()
    for j in probe_images(reordered):
        for o in probe_offsets(reordered.grids[j], 2):
            base[reordered.spans[j][0] + o] = True
    assert int(base.sum()) == int(fresh.sum()) + probes
    full = shape.extend_flops(reordered.prefix_len, reordered.prompt_len)
    one_pass = shape.pass_flops(base.nonzero().flatten()) / full
    assert one_pass < f_patch < one_pass + 0.01  # the patch's elementwise work is small


def test_labels_parse_back_and_paired_ratios():
    for cfg in (PatchConfig(4, "kernel", 0.0), PatchConfig(2, "mean", 0.4)):
        assert parse_label(cfg.label) == cfg
    with pytest.raises(ValueError):
        parse_label("kamera[m=16]")
    cells = {
        "full": {"method": "full", "outcomes": [1] * 4},
        "stalepatch[P=4,kernel,tau=0]": {"method": "stalepatch", "outcomes": [1, 1, 1, 1]},
        "reuse": {"method": "reuse", "outcomes": [1, 1, 0, 0]},
        "oracle-rank2": {"method": "oracle-rank", "outcomes": [1, 0, 0, 0]},
    }
    report = {"chosen": "stalepatch[P=4,kernel,tau=0]", "test": {"s": cells}}
    paired = paired_against(report)
    # only the servable others, as stalepatch over them: right on every prompt against
    # half, a ratio of at least 1 in every resample, 2 or more in some (the other way
    # round it would be at most 1)
    assert list(paired) == ["s"] and list(paired["s"]) == ["reuse"]
    low, high = paired["s"]["reuse"]
    assert low >= 1.0 and high >= 2.0


def test_kamera_patch_bytes_by_hand():
    # the page model's shape: the sizes docs/repair-design.md quotes
    shape = DecoderShape.from_config(json.loads((MODEL / "config.json").read_text()))
    # 4 layers x (64 x 16 + 16 x 128) bf16 values, against 4 x 64 x 128 of KV
    assert kamera_patch_bytes(shape, 64, 16) == 4 * (64 * 16 + 16 * 128) * 2 == 24_576
    assert kv_bytes(shape, 64) == 4 * 64 * 128 * 2 == 65_536
    assert kamera_patch_bytes(shape, 64, 0) == 0

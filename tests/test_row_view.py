"""RowView: a row with holes read as the compacted row of the positions that hold KV.

Attention over the compacted row equals attention over the full row with the holes
masked out (the reference), so the holes' contents (NaN here) are never read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_mmkv.kernels.scattered_attention import scattered_attention
from sgl_mmkv.refresh.row_view import RowView

PREFIX, SEQ = 4, 20
HOLES = [9, 10, 13]  # row positions


def _plan(holes=HOLES):
    mask = torch.zeros(SEQ - PREFIX, dtype=torch.bool)
    mask[torch.tensor(holes, dtype=torch.long) - PREFIX] = True
    return SimpleNamespace(prefix_len=PREFIX, seq_len=SEQ, hole_mask=lambda: mask)


def test_no_holes_no_view():
    assert RowView.of(_plan([])) is None


def test_positions_and_spans_map_both_ways():
    view = RowView.of(_plan())
    kept = [p for p in range(SEQ) if p not in HOLES]
    assert view.kept.tolist() == kept
    assert view.compact(torch.tensor([0, 8, 11, 19])).tolist() == [0, 8, 9, 16]
    assert view.expand(torch.tensor([9, 16])).tolist() == [11, 19]
    assert view.span(8, 15) == (8, 12)  # 8, 11, 12, 14 kept
    assert view.span(9, 11) == (9, 9)  # all holes: empty
    with pytest.raises(ValueError, match="inside a hole"):
        view.compact(torch.tensor([10]))
    rows = view.rows((torch.arange(SEQ),))
    assert rows[0].tolist() == kept


def test_attention_through_the_view_never_reads_a_hole():
    torch.manual_seed(0)
    h_q, h_kv, d = 4, 2, 8
    k_buffer = torch.randn(64, h_kv, d)
    v_buffer = torch.randn(64, h_kv, d)
    row = torch.randperm(64)[:SEQ]
    k_buffer[row[HOLES]] = float("nan")
    v_buffer[row[HOLES]] = float("nan")
    view = RowView.of(_plan())
    queries = torch.tensor([11, 12, 19])
    q = torch.randn(queries.numel(), h_q, d)
    out = scattered_attention(q, k_buffer, v_buffer, row[view.kept], view.compact(queries))
    assert torch.isfinite(out).all()
    clean_k, clean_v = k_buffer.clone(), v_buffer.clone()
    clean_k[row[HOLES]] = 0.0
    clean_v[row[HOLES]] = 0.0
    # Reference: each query over the full row, keys at or before it that are no hole.
    keys, values = clean_k[row].repeat_interleave(2, 1), clean_v[row].repeat_interleave(2, 1)
    for i, p in enumerate(queries.tolist()):
        visible = [j for j in range(p + 1) if j not in HOLES]
        weights = torch.softmax(torch.einsum("hd,khd->hk", q[i], keys[visible]) / d**0.5, -1)
        expected = torch.einsum("hk,khd->hd", weights, values[visible])
        assert torch.allclose(out[i], expected, atol=1e-5)
    every_row = scattered_attention(q, clean_k, clean_v, row, queries)
    assert not torch.allclose(out, every_row, atol=1e-3)  # the holes did count there

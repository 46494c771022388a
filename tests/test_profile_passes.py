"""benchmarks/profile_passes.py puts each py-spy stack in its pass and operation."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_passes  # noqa: E402

FORWARD = "Scheduler.run_batch (s.py:1);ModelRunner.forward (m.py:2)"
EXTEND = f"{FORWARD};RefreshExecutor.execute_extend (e.py:3)"
LINEAR = "Qwen2MLP.forward (q.py:4);ColumnParallelLinear.forward (l.py:5)"
RAW = "\n".join(
    [
        f"{FORWARD};Qwen2Model.forward (q.py:1);{LINEAR} 40",  # stock's forward
        f"{FORWARD};TorchNativeAttnBackend.forward_extend (t.py:1) 10",
        # the scoring pass runs run_pass too: it is still the scoring pass
        f"{EXTEND};RefreshExecutor._reuse (e.py:9);TokenSelector.select (s.py:1);"
        f"run_pass (p.py:1);{LINEAR} 6",
        f"{EXTEND};RefreshExecutor._reuse (e.py:9);TokenSelector.select (s.py:1);"
        "run_pass (p.py:1);RefreshAttentionBackend.forward_extend (a.py:1);"
        "LayerStatistics.reduce (l.py:1);attention_mass (a.py:2) 2",
        f"{EXTEND};RefreshExecutor._reuse (e.py:11);run_pass (p.py:1);"
        "refresh_attention_sdpa (r.py:1);scattered_attention_sdpa (r.py:2) 4",
        f"{EXTEND};RefreshExecutor._reuse (e.py:8);SegmentCopier.copy (k.py:1);"
        "gather_rotate_kv (g.py:1) 2",
        "Scheduler.event_loop (s.py:1);Scheduler.recv_requests (s.py:2) 100",  # idle
        "",
    ]
)


def test_each_stack_lands_in_its_pass_and_operation(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(RAW)
    got = profile_passes.breakdown(raw, rate=100, num_requests=2)  # 1 sample = 5 ms
    assert got == {
        "forward": {"attention": 50.0, "linear": 200.0},
        "scoring pass": {"linear": 30.0, "scoring reduction": 10.0},
        "refresh pass": {"attention": 20.0},
        "rest of the extend": {"segment copy": 10.0},
    }


def test_the_table_has_a_row_per_side_and_pass():
    results = {
        "stock": {"passes": {"forward": {"linear": 200.0}}},
        "conduit": {"passes": {"scoring pass": {"linear": 30.0, "attention": 12.4}}},
    }
    table = profile_passes.format_table(results).splitlines()
    assert table[0] == "| side, pass (ms per request) | attention | linear | total |"
    assert table[2:] == [
        "| stock, forward | 0 | 200 | 200 |",
        "| conduit, scoring pass | 12 | 30 | 42 |",
    ]


def test_the_reuse_facts_of_a_chunked_prefill_are_summed_over_its_entries():
    meta = {
        "prompt_tokens": 4187,
        "cached_tokens": 4,
        "sgl_mmkv": [
            {"method": "conduit", "reused_tokens": 70, "refreshed_tokens": 7},
            {"method": "conduit", "reused_tokens": 2000, "refreshed_tokens": 200},
        ],
    }
    assert profile_passes.reuse_tokens(meta) == {
        "prompt_tokens": 4187,
        "cached_tokens": 4,
        "reused_tokens": 2070,
        "refreshed_tokens": 207,
    }
    assert profile_passes.reuse_tokens({"prompt_tokens": 9, "cached_tokens": 0}) == {
        "prompt_tokens": 9,
        "cached_tokens": 0,
    }

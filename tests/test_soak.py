"""The short version of ``benchmarks/soak.py``: every request shape at once against
one server with every feature on (refresh, holes, small chunks under the overlap
scheduler, memory pressure, L3 storage, poisoned freed slots); the long one (1,000
requests) is in the docs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "benchmarks" / "soak.py"


def _kinds() -> dict:
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KINDS


def test_a_short_soak_passes(tiny_vlm, tmp_path):
    command = [
        sys.executable,
        str(SOAK),
        *("--requests", "200", "--concurrency", "8", "--seed", "1", "--probes", "8"),
        *("--model-path", str(tiny_vlm), "--out-dir", str(tmp_path)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "soak.json").read_text())
    assert record["failures"] == [] and record["alive"]
    assert set(record["outcomes"]) == set(_kinds())  # every shape was sent
    assert sum(sum(c.values()) for c in record["outcomes"].values()) == 200
    assert record["refresh"]["reused_tokens"] > 0  # reuse happened under the traffic
    holes = record["row_compaction"]
    assert holes["hole_tokens"] > 0 and holes["skipped_requests"] == 0  # holes, all compacted
    assert record["store"]["compressions"] > 0  # segments compressed at fill
    pool = record["pool_after_flush"]
    assert pool["available"] == pool["size"] and pool["free_unique"]
    assert record["probes_compared"] == 8 and record["probes_differing"] == []


def test_a_short_soak_at_tp2_passes(tiny_vlm, tmp_path):
    """The same traffic against a TP-2 server over gloo (scored eviction, holes and
    compression at fill on, as at TP 1), its deterministic subset against stock
    SGLang at TP 2."""
    command = [
        sys.executable,
        str(SOAK),
        *("--requests", "200", "--concurrency", "8", "--seed", "1", "--probes", "8"),
        *("--model-path", str(tiny_vlm), "--out-dir", str(tmp_path), "--tp-size", "2"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "soak.json").read_text())
    assert record["tp_size"] == 2 and record["failures"] == [] and record["alive"]
    assert sum(sum(c.values()) for c in record["outcomes"].values()) == 200
    assert record["refresh"]["reused_tokens"] > 0
    assert record["refresh"]["rank_disagreements"] == 0
    holes = record["row_compaction"]
    assert holes["hole_tokens"] > 0 and holes["skipped_requests"] == 0
    assert holes["rank_cancelled"] == 0
    assert record["store"]["compressions"] > 0
    pool = record["pool_after_flush"]
    assert pool["available"] == pool["size"] and pool["free_unique"]
    assert record["probes_compared"] == 8 and record["probes_differing"] == []

"""benchmarks/fidelity.py's servers: both sides get the same KV pool, sized to the model."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity as bench  # noqa: E402


def _pool(server) -> int:
    return int(server.command[server.command.index("--max-total-tokens") + 1])


def test_every_server_of_a_run_gets_the_pool_it_was_given(tmp_path):
    model = ROOT / "models" / "fidelity-qwen2-vl-next"
    servers = [
        bench.server_for("stock", model, None, tmp_path, pool_tokens=12345),
        bench.server_for("conduit", model, 0.1, tmp_path, pool_tokens=12345),
        bench.server_for("conduit", model, 0.1, tmp_path, ablation="no_value_norm",
                         pool_tokens=12345),
        bench.eviction_server_for("aircache", 0.5, model, tmp_path, 0.1, 12345),
        bench.decode_compression_server_for("aircache", 0.5, model, tmp_path, 12345),
    ]  # fmt: skip
    for server in servers:
        assert server.command.count("--max-total-tokens") == 1
        assert _pool(server) == 12345
    assert _pool(bench.server_for("conduit", model, 0.1, tmp_path)) == 4096

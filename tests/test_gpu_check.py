"""scripts/gpu_check.sh end to end in its dry mode: the CPU, no sglang, seconds.

The device machine has torch and Triton but no sglang; here an ``sglang`` that
fails to import stands in for that, so the check proves the script needs none.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_dry_on_the_cpu_without_sglang(tmp_path):
    blocker = tmp_path / "site" / "sglang"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no sglang on the device machine')\n")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPU_CHECK_DRY": "1",
        "OUT": str(out),
        "PYTHONPATH": str(blocker.parent),
        "KERNEL_TESTS": "tests/test_refresh_attention.py -k sdpa_path "
        "tests/test_refresh_attention_backend.py",
    }
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    device = (out / "device.txt").read_text()
    assert "dry run" in device
    assert "pytest rc=0" in device, (out / "pytest.log").read_text()
    assert "gpu_kernels rc=0" in device, (out / "gpu_kernels.log").read_text()
    assert "train skipped" in device
    assert "gpu_refresh_path rc=0" in device, (out / "gpu_refresh_path.log").read_text()
    path = json.loads((out / "gpu_refresh_path.json").read_text())
    stages = path["stages"]["torch.float32"]
    assert set(stages) == {"plan", "copy", "selection", "attention_triton", "attention_sdpa"}
    assert all(stage["ok"] for stage in stages.values())
    assert stages["selection"]["selected"] > 0
    fp8_stages = path["stages"]["torch.float8_e4m3fn"]  # per-tensor scales 0.37, 2.5
    assert set(fp8_stages) == set(stages) and all(s["ok"] for s in fp8_stages.values())
    log = (out / "pytest.log").read_text()
    assert " passed" in log and "1 skipped" in log  # the backend tests need sglang

    record = json.loads((out / "gpu_kernels.json").read_text())
    assert record["dry_run"] is True and record["failures"] == []
    kinds = [entry["kernel"] for entry in record["results"]]
    assert (
        kinds
        == ["refresh_attention", "refresh_attention", "rows", "gather_rotate_kv"] + ["fp8"] * 2
    )
    single, batch = record["results"][0], record["results"][1]
    assert (single["requests"], batch["requests"]) == (1, 4)
    assert single["queries_per_request"] == int(0.1 * single["image_tokens"]) + 8
    for entry in (single, batch):
        assert len(entry["configs"]) == 2
        assert all(c["max_abs_err"] < 1e-4 and c["ms"] > 0 for c in entry["configs"])
        assert entry["sdpa_max_abs_err"] < 1e-4
        assert entry["ratio"] == entry["triton_ms"] / entry["flash_prefill_ms"]
    target = record["target"]["fp32"]
    assert target["at_most"] == 0.15 and target["ratio"] == single["ratio"]
    assert record["results"][3]["v_exact"] is True
    fp8 = record["results"][4:]
    assert [entry["dtype"] for entry in fp8] == ["fp8_e4m3", "fp8_e5m2"]
    for entry in fp8:
        assert entry["max_abs_err"] < 1e-4 and entry["sdpa_max_abs_err"] < 1e-4
        assert 0 < entry["gather_k_max_rel_err"] <= entry["gather_k_bound_rel"]
        assert entry["gather_v_exact"] is True
    assert "refresh attention fp32:" in device

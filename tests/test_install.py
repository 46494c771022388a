"""What the README's install gives a user beyond the package: SGLang's own benchmark
client starts (it imports ``datasets``, from the ``bench`` extra)."""

from __future__ import annotations

import subprocess
import sys


def test_sglangs_benchmark_client_starts():
    done = subprocess.run(
        [sys.executable, "-m", "sglang.benchmark.serving", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--dataset-name" in done.stdout

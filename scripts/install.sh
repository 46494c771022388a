#!/usr/bin/env bash
# Install sgl_mmkv and what it needs into the current Python environment.
#   GPU machine (nvidia-smi present): sglang 0.5.23 with its normal dependency list.
#   CPU-only machine: sglang 0.5.23 without its CUDA-only dependencies (see
#   requirements-cpu.txt), plus sgl_mmkv's CPU shim of sgl_kernel (in the package).
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }

start=$(date +%s)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] GPU found: sglang with its full dependency list"
    pip_install -e ".[gpu,test,bench,mooncake]"
else
    echo "[install] no GPU: sglang without its CUDA-only dependencies"
    pip_install -r requirements-cpu.txt
    pip_install --no-deps "sglang==0.5.23"
    pip_install -r requirements-test.txt -r requirements-bench.txt -r requirements-mooncake.txt
    pip_install --no-deps -e .
fi
# Mooncake's store client (--mm-segment-storage mooncake) links libibverbs, also for TCP.
if ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "[install] Debian's libibverbs1 (Mooncake's client links it)"
        { apt-get update -qq && apt-get install -y -qq libibverbs1; } >/dev/null \
            || echo "[install] apt-get install libibverbs1 failed: the Mooncake tests skip"
    else
        echo "[install] libibverbs1 is missing and this is not root with apt-get: the" \
            "Mooncake tests skip (as root: apt-get install -y libibverbs1)"
    fi
fi
"$PYTHON" - <<'PY'
import importlib.metadata as md
import sglang, sgl_mmkv  # noqa: F401
import datasets  # noqa: F401  (python -m sglang.benchmark.serving)
import sglang_router  # noqa: F401  (SGLang's router: tests/test_routing_server.py)
assert md.version("sglang") == "0.5.23", md.version("sglang")
eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "sgl_mmkv"]
assert eps, "sgl_mmkv's sglang.srt.plugins entry point is not installed"
print(f"[install] sglang {md.version('sglang')}, torch {md.version('torch')}, plugin {eps[0].value}")
try:
    from mooncake.store import MooncakeDistributedStore  # noqa: F401
    print(f"[install] Mooncake {md.version('mooncake-transfer-engine-non-cuda')}: client imports")
except ImportError as error:
    print(f"[install] Mooncake's client does not import ({error}): its tests skip")
PY
echo "[install] done in $(( $(date +%s) - start )) s"

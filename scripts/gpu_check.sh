#!/usr/bin/env bash
# One device run (at most 10 minutes on one H100 from a bare machine: the timeouts
# below add up to 600 s at the default TRAIN_SECONDS=90): the kernel
# tests on CUDA (the fp8 KV kernels among them: tests/test_fp8_kernels.py), kernel
# error + timings against the torch references (the refresh attention's time ratio
# to a flash prefill, and the fp8 KV cases, among them), the refresh path end to end
# over the project's stand-ins on the device (plain and fp8 KV), and a GPU training
# probe of the fidelity model. Results go to $OUT (or ./gpu-check). The device machine has
# torch and triton but no sglang, so the repository root is put on PYTHONPATH by
# hand (the package and training/) and tests that need sglang skip themselves.
#
# GPU_CHECK_DRY=1: the same steps on the CPU (Triton under TRITON_INTERPRET=1, tiny
# benchmark shapes, no training unless TRAIN_SECONDS is set), to check this script.
# KERNEL_TESTS: the pytest arguments of the kernel tests.
set -u
OUT=${OUT:-gpu-check}
DRY=${GPU_CHECK_DRY:-0}
KERNEL_TESTS=${KERNEL_TESTS:-tests/test_gather_rotate.py tests/test_scattered_attention.py tests/test_refresh_attention.py tests/test_kernel_self_check.py tests/test_fp8_kernels.py}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    TRAIN_SECONDS=${TRAIN_SECONDS:-0}
    BENCH_ARGS=--dry-run
    echo "dry run: CPU, TRITON_INTERPRET=1" >"$OUT/device.txt"
else
    TRAIN_SECONDS=${TRAIN_SECONDS:-90}
    BENCH_ARGS=
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/device.txt" 2>&1
fi
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >>"$OUT/device.txt" 2>&1

# shellcheck disable=SC2086
timeout 120 python3 -m pytest -q -p no:cacheprovider $KERNEL_TESTS >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >>"$OUT/device.txt"

# shellcheck disable=SC2086
timeout 150 python3 benchmarks/gpu_kernels.py $BENCH_ARGS --out-dir "$OUT" >"$OUT/gpu_kernels.log" 2>&1
echo "gpu_kernels rc=$?" >>"$OUT/device.txt"
grep "^refresh attention" "$OUT/gpu_kernels.log" >>"$OUT/device.txt"
grep '"kernel": "fp8"' "$OUT/gpu_kernels.log" | cut -c1-400 >>"$OUT/device.txt"

# The refresh path end to end over the stand-ins (plan, copy, selection, refresh
# attention), each stage on the device against the CPU in float32.
# shellcheck disable=SC2086
timeout 90 python3 benchmarks/gpu_refresh_path.py $BENCH_ARGS --out-dir "$OUT" >"$OUT/gpu_refresh_path.log" 2>&1
echo "gpu_refresh_path rc=$?" >>"$OUT/device.txt"
grep "^refresh path" "$OUT/gpu_refresh_path.log" >>"$OUT/device.txt"

# Training probe: a 40-step run measures the step rate, then one run sized to
# TRAIN_SECONDS (OneCycle needs its step count up front). TRAIN_STYLE=marked
# (default) trains the question style that learns retrieval on a CPU
# (training/retrieval_probes.py); keyed is the committed model's.
if [ "$TRAIN_SECONDS" -le 0 ]; then
    echo "train skipped (TRAIN_SECONDS=$TRAIN_SECONDS)" >>"$OUT/device.txt"
    exit 0
fi
TRAIN_STYLE=${TRAIN_STYLE:-marked}
DEVICE=cuda
[ "$DRY" = 1 ] && DEVICE=cpu
ARGS="--device $DEVICE --workers 12 --batch-size 64 --lr 1e-3 --curriculum-steps 300 --follow-ups 0 --style $TRAIN_STYLE"
timeout 90 python3 -m training.train_fidelity_model --out /tmp/rate --steps 40 \
    --log-every 20 $ARGS >"$OUT/train_rate.log" 2>&1
STEPS=$(python3 -c "
import json; r = json.load(open('/tmp/rate/training.json'))['phases'][-1]
print(max(200, int(40 / max(r['train_seconds'], 1) * $TRAIN_SECONDS)))" 2>>"$OUT/train_rate.log")
echo "train steps=${STEPS:-none}" >>"$OUT/device.txt"
if [ -n "${STEPS:-}" ]; then
    timeout $((TRAIN_SECONDS + 60)) python3 -m training.train_fidelity_model \
        --out /tmp/fidelity-gpu --steps "$STEPS" --log-every 100 $ARGS >"$OUT/train.log" 2>&1
    echo "train rc=$?" >>"$OUT/device.txt"
    tar -C /tmp -czf "$OUT/fidelity-gpu.tgz" fidelity-gpu
fi

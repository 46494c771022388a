#!/usr/bin/env bash
# One device run: the kernel tests on CUDA, kernel error + timings against the torch
# references, and a GPU training probe of the fidelity model. Results go to $OUT
# (or ./gpu-check). The device machine has torch and triton but no sglang, so the
# repository root is put on PYTHONPATH by hand (the package and training/) and tests
# that need sglang skip themselves.
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/device.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >>"$OUT/device.txt" 2>&1

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gather_rotate.py \
    tests/test_scattered_attention.py >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >>"$OUT/device.txt"

timeout 180 python3 benchmarks/gpu_kernels.py --out-dir "$OUT" >"$OUT/gpu_kernels.log" 2>&1
echo "gpu_kernels rc=$?" >>"$OUT/device.txt"

# Training probe: a 40-step run measures the step rate, then one run sized to
# TRAIN_SECONDS (OneCycle needs its step count up front). TRAIN_STYLE=marked
# (default) trains the question style that learns retrieval on a CPU
# (training/retrieval_probes.py); keyed is the committed model's.
TRAIN_SECONDS=${TRAIN_SECONDS:-270}
TRAIN_STYLE=${TRAIN_STYLE:-marked}
ARGS="--device cuda --workers 12 --batch-size 64 --lr 1e-3 --curriculum-steps 300 --follow-ups 0 --style $TRAIN_STYLE"
timeout 120 python3 -m training.train_fidelity_model --out /tmp/rate --steps 40 \
    --log-every 20 $ARGS >"$OUT/train_rate.log" 2>&1
STEPS=$(python3 -c "
import json; r = json.load(open('/tmp/rate/training.json'))['phases'][-1]
print(max(200, int(40 / max(r['train_seconds'], 1) * $TRAIN_SECONDS)))" 2>>"$OUT/train_rate.log")
echo "train steps=${STEPS:-none}" >>"$OUT/device.txt"
if [ -n "${STEPS:-}" ]; then
    timeout $((TRAIN_SECONDS + 90)) python3 -m training.train_fidelity_model \
        --out /tmp/fidelity-gpu --steps "$STEPS" --log-every 100 $ARGS >"$OUT/train.log" 2>&1
    echo "train rc=$?" >>"$OUT/device.txt"
    tar -C /tmp -czf "$OUT/fidelity-gpu.tgz" fidelity-gpu
fi

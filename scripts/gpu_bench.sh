#!/usr/bin/env bash
# GPU checks in one go, for a machine with a CUDA device: the CUDA tests, a quick bench on the tiny preset, then
# `vocalis bench` at the official 0.5B shapes on the GPU (fp32, bf16, fp16; CUDA-graph decode). Logs, JSON and
# the plot go to $OUT (default ./gpu-out). Usage: scripts/gpu_bench.sh [python]
set -u
PY=${1:-python3}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/gpu.txt"
$PY -c "import tensorrt" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
timeout 150 $PY -m pytest -q -s tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.log" | grep -v "^INFO" | tail -30
timeout 120 $PY -m vocalis bench --device cuda --preset tiny --quick --precision fp32,fp16 --threads 4 \
    --json "$OUT/bench_tiny.json" --plot '' 2>"$OUT/bench_tiny.err" | tee "$OUT/bench_tiny.txt"
tail -3 "$OUT/bench_tiny.err"
timeout "${BENCH_TIMEOUT:-420}" $PY -m vocalis bench --device cuda --precision fp32,bf16,fp16 --threads 4 \
    --json "$OUT/bench_cuda.json" --plot "$OUT/bench_cuda.png" 2>"$OUT/bench_cuda.err" | tee "$OUT/bench_cuda.txt"
tail -5 "$OUT/bench_cuda.err"

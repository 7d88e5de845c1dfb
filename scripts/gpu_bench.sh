#!/usr/bin/env bash
# The GPU run in one go, within 8 minutes on one GPU: the CUDA tests, then benchmarks/gpu_report.py (`vocalis bench`
# for CosyVoice 2 and 3 at fp32, bf16 and fp16, 1/4/16/64 streams, decode at batch 1 and 16, peak GPU memory, and
# HiFT's precision choice), every stage under a time limit. Everything goes to $OUT (default ./gpu-out):
# gpu.txt (device, torch, tensorrt), cuda_tests.log, bench_*.json and their logs, hift.json, gpu_report.json (the
# figures under fixed keys) and gpu_report.md (the table).
#   OUT=dir scripts/gpu_bench.sh [python]              on a machine with a CUDA GPU (0.5B shapes, random weights)
#   OUT=dir scripts/gpu_bench.sh --rehearse [python]   on the CPU: the same steps at tiny shapes (CUDA tests skip)
set -u
MODE=""
if [ "${1:-}" = "--rehearse" ]; then MODE="--rehearse"; shift; fi
PY=${1:-python3}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    $PY -c "import tensorrt; print('tensorrt', tensorrt.__version__)" 2>&1 | tail -1
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout "${TEST_LIMIT:-70}" $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py > "$OUT/cuda_tests.log" 2>&1
echo "CUDA tests: exit $? ($(tail -1 "$OUT/cuda_tests.log"))"
$PY benchmarks/gpu_report.py --out "$OUT" $MODE
rc=$?
echo "gpu_bench: $(( $(date +%s) - start )) s, report in $OUT/gpu_report.md"
exit $rc

#!/usr/bin/env bash
# On the GPU machine, after onnxruntime-gpu is staged (DEVELOPERS.md / ../shared/device/ort-gpu-prepare.sh):
# runs the CUDA kernel and CUDA-EP bridge tests on the real GPU, the FPLUT benchmark, and compute-sanitizer.
set -uo pipefail
export PYTHONPATH=/tmp/ortgpu/site:.:tests PYTHONUNBUFFERED=1 ONNX_LOWBIT_REAL_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_fplut_cuda.py tests/test_bridge_cuda.py tests/test_bridge_cpu.py 2>&1 | tail -5
python3 benchmarks/fplut_gpu.py --json "$OUT/fplut.json" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn
for v in s32; do
  compute-sanitizer --tool memcheck python3 benchmarks/fplut_ncu.py $v 4099 2>&1 | grep -E "ERROR SUMMARY|ok|MISMATCH" | head -3
  compute-sanitizer --tool racecheck python3 benchmarks/fplut_ncu.py $v 4099 2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|ok|MISMATCH" | head -3
done

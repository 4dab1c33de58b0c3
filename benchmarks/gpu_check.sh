#!/usr/bin/env bash
# On the GPU machine, after onnxruntime-gpu is staged (../shared/device/ort-gpu-prepare.sh, then
# `stage.sh add NN` ... `stage.sh install`): runs every CUDA kernel test and CUDA-EP bridge test on the real
# GPU, the benchmarks, and compute-sanitizer on edge shapes. Prints a short log; full JSON under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/ortgpu/site:.:tests PYTHONUNBUFFERED=1 ONNX_LOWBIT_REAL_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== tests on the GPU"
python3 -m pytest -q -p no:cacheprovider tests/test_fplut_cuda.py tests/test_bridge_cuda.py tests/test_bridge_cpu.py \
  tests/test_nf4_kernels.py tests/test_awq_kernels.py 2>&1 | tail -6
echo "== FPLUT benchmark"
python3 benchmarks/fplut_gpu.py --json "$OUT/fplut.json" ${BENCH_ARGS:-} 2>&1 | grep -v -i warn | tail -16
echo "== NF4 benchmark"
python3 benchmarks/nf4_gpu.py 2>&1 | grep -v -i warn | grep -v "bit-exact\|OK$" | tail -14
if [ -f benchmarks/awq_gpu.py ]; then echo "== AWQ benchmark"; python3 benchmarks/awq_gpu.py 2>&1 | grep -v -i warn | tail -20; fi
echo "== compute-sanitizer"
compute-sanitizer --tool memcheck python3 benchmarks/fplut_ncu.py s32 4099 2>&1 | grep -E "ERROR SUMMARY|ok|MISMATCH" | head -2
compute-sanitizer --tool racecheck python3 benchmarks/fplut_ncu.py s32 4099 2>&1 | grep -E "RACECHECK SUMMARY|ok|MISMATCH" | head -2
compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider tests/test_nf4_kernels.py -k "cuda_kernel" 2>&1 | grep -E "ERROR SUMMARY|passed|failed" | head -3

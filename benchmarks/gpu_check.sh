#!/usr/bin/env bash
# On the GPU machine, after onnxruntime-gpu is staged (../shared/device/ort-gpu-prepare.sh, then
# `stage.sh add NN` ... `stage.sh install`), with onnx-graphsurgeon installed into /tmp/gs:
#   bash benchmarks/gpu_check.sh tests     every CUDA kernel / CUDA-EP test on the real GPU + memcheck of some
#   bash benchmarks/gpu_check.sh sanitize  memcheck + racecheck of every kernel family (SAN_ONLY="ffn gru" for a subset)
#   bash benchmarks/gpu_check.sh bench     side-by-side onnxruntime session benchmarks (benchmarks/session_gpu.py)
#   bash benchmarks/gpu_check.sh attn      RotaryKV / KVAttention on the GPU: their tests, memcheck + racecheck of the
#                                          KVAttention kernel, benchmarks/kvattention_gpu.py
#   bash benchmarks/gpu_check.sh llama     the end-to-end LLaMA-style decode step (samples/llama_decode.py)
#   bash benchmarks/gpu_check.sh profile   where that step's time goes, per kernel (benchmarks/llama_profile.py)
# Prints a short log; JSON / PNG under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/ortgpu/site:/tmp/gs:.:tests PYTHONUNBUFFERED=1 ONNX_LOWBIT_REAL_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GPU_TESTS="tests/test_fplut_cuda.py tests/test_bridge_cuda.py tests/test_bridge_cpu.py tests/test_nf4_kernels.py
  tests/test_awq_kernels.py tests/test_native_plans_cuda.py tests/test_ffn_cuda.py tests/test_ffn4_kernels.py
  tests/test_gru_cuda.py tests/test_nan_cuda.py tests/test_concurrency.py tests/test_rotary_kernels.py
  tests/test_rmsnorm_kernels.py tests/test_rotarykv_kernels.py tests/test_kvattention_kernels.py"
case "${1:-tests}" in
tests)
  echo "== tests on the GPU"
  timeout 420 python3 -m pytest -q -p no:cacheprovider -x $GPU_TESTS 2>&1 | tail -8
  echo "== compute-sanitizer (memcheck; racecheck for shared-memory kernels), edge shapes"
  timeout 60 compute-sanitizer --tool memcheck python3 benchmarks/fplut_ncu.py s32 4099 2>&1 | grep -E "ERROR SUMMARY|MISMATCH" | head -2
  timeout 60 compute-sanitizer --tool racecheck python3 benchmarks/fplut_ncu.py s32 4099 2>&1 | grep -E "RACECHECK SUMMARY|MISMATCH" | head -2
  for t in "tests/test_nf4_kernels.py -k cuda_kernel" "tests/test_awq_kernels.py -k cuda_matmul_vs_reference" \
           "tests/test_ffn_cuda.py" "tests/test_ffn4_kernels.py -k cuda" "tests/test_gru_cuda.py -k kernel_bit_exact"; do
    echo "-- memcheck: $t"
    timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider -x $t 2>&1 \
      | grep -E "ERROR SUMMARY|passed|failed|Invalid" | head -4
  done
  ;;
sanitize)
  # every CUDA kernel with shared memory under racecheck, and memcheck of each family (issue 7); the fused 4-bit
  # tests compile slowly under the sanitizer: give them time. A subset: SAN_ONLY="ffn4 gru" (names below).
  declare -A SETS=([ffn]="tests/test_ffn_cuda.py" [ffn4]="tests/test_ffn4_kernels.py -k cuda"
                   [gru]="tests/test_gru_cuda.py -k kernel_bit_exact" [awq]="tests/test_awq_kernels.py -k cuda_matmul_vs_reference"
                   [nf4]="tests/test_nf4_kernels.py -k cuda_kernel")
  for name in ${SAN_ONLY:-ffn ffn4 gru awq nf4}; do
    t=${SETS[$name]}
    for tool in ${SAN_TOOLS:-memcheck racecheck}; do
      echo "-- $tool: $t"
      timeout ${SAN_TIMEOUT:-280} compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider -x $t 2>&1 \
        | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Invalid|Error|Race" | head -6
    done
  done
  ;;
attn)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_rotarykv_kernels.py tests/test_kvattention_kernels.py \
    2>&1 | tail -5
  for tool in memcheck racecheck; do
    echo "-- $tool: tests/test_kvattention_kernels.py -k cuda_kernel"
    timeout 200 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider -x \
      tests/test_kvattention_kernels.py -k "cuda_kernel and not object" 2>&1 \
      | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Invalid|Race" | head -4
  done
  python3 benchmarks/kvattention_gpu.py --json "$OUT/attention.json" 2>&1 | grep -v -i warn | tail -12
  ;;
bench)
  python3 benchmarks/session_gpu.py --json "$OUT/session.json" 2>&1 | grep -v -i warn | tail -45
  ;;
llama)
  python3 samples/llama_decode.py --device cuda --out /tmp/llama ${LLAMA_ARGS:-} 2>&1 \
    | grep -v -E "Warning|warn|self\.(keys|values)|if not self|torch.onnx.export\(" | tail -40
  cp /tmp/llama/bench-cuda*.png /tmp/llama/bench-cuda*.json "$OUT/" 2>/dev/null
  ;;
profile)
  [ -f /tmp/llama/llama_decode.nf4.onnx ] || python3 samples/llama_decode.py --device cuda --out /tmp/llama --no-bench \
    2>&1 | tail -3
  python3 benchmarks/llama_profile.py /tmp/llama/llama_decode.onnx /tmp/llama/llama_decode.nf4.onnx \
    --json "$OUT/profile.json" 2>&1 | grep -v -i warn | tail -60
  ;;
esac

#!/usr/bin/env bash
# On the GPU machine, after onnxruntime-gpu is staged (../shared/device/ort-gpu-prepare.sh, then
# `stage.sh add NN` ... `stage.sh install`), with onnx-graphsurgeon installed into /tmp/gs:
#   bash benchmarks/gpu_check.sh tests     every CUDA kernel / CUDA-EP test on the real GPU + memcheck of some
#   bash benchmarks/gpu_check.sh sanitize  memcheck + racecheck of every kernel family (SAN_ONLY="ffn gru" for a subset)
#   bash benchmarks/gpu_check.sh edges     memcheck + racecheck of the 4-bit and FFN kernels at edge shapes through
#                                          their host runners (benchmarks/kernel_once.py; EDGES_ONLY="awq nf4wide")
#   bash benchmarks/gpu_check.sh stalls    ncu: FusedFFNNF4's default M = 1 kernel at LLaMA-7B gate+up, its stall
#                                          reasons per issued instruction, shared-memory wavefronts, DRAM bytes
#   bash benchmarks/gpu_check.sh bench     side-by-side onnxruntime session benchmarks (benchmarks/session_gpu.py)
#   bash benchmarks/gpu_check.sh attn      RotaryKV / KVAttention on the GPU: their tests, memcheck + racecheck of the
#                                          KVAttention kernel, benchmarks/decoder_ops_gpu.py --op kvattention
#   bash benchmarks/gpu_check.sh llama     the end-to-end LLaMA-style decode step (samples/llama_decode.py)
#   bash benchmarks/gpu_check.sh profile   where that step's time goes, per kernel (benchmarks/llama_profile.py)
#   bash benchmarks/gpu_check.sh genai     onnxruntime-genai's generation loop: genai fp16 and int4 folders of the
#                                          llama_decode config against `onnx-lowbit genai` rewrites of them
#                                          (benchmarks/genai_models.py, genai_loop.py). Needs .whl/genai/ carried:
#                                          onnxruntime-genai-cuda's wheel and onnxruntime-gpu's libonnxruntime.so.1.31.1.xz
#   bash benchmarks/gpu_check.sh genai-profile   the same folders (int4, int4 rewritten, fp16): per-kernel GPU time of
#                                          a decode token under torch's profiler (benchmarks/genai_profile.py)
# Prints a short log; JSON / PNG under $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/ortgpu/site:/tmp/gs:.:tests PYTHONUNBUFFERED=1 ONNX_LOWBIT_REAL_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# every test file that runs kernels or CUDA-EP sessions when there is a GPU (the others never touch it), by name
# pattern, so a new *_cuda / *_kernels test file is picked up without editing this list
GPU_TESTS=$(ls tests/test_*cuda*.py tests/test_*_kernels.py tests/test_bridge_*.py tests/test_concurrency.py \
  tests/test_direct.py tests/test_plans.py 2>/dev/null | sort -u | tr '\n' ' ')
case "${1:-tests}" in
tests)
  echo "== tests on the GPU"
  timeout 560 python3 -m pytest -q -p no:cacheprovider -x $GPU_TESTS 2>&1 | tail -8
  echo "== compute-sanitizer (memcheck; racecheck for shared-memory kernels), edge shapes"
  timeout 60 compute-sanitizer --tool memcheck python3 benchmarks/kernel_once.py fplut 4099 2>&1 | grep -E "ERROR SUMMARY|MISMATCH" | head -2
  timeout 60 compute-sanitizer --tool racecheck python3 benchmarks/kernel_once.py fplut 4099 2>&1 | grep -E "RACECHECK SUMMARY|MISMATCH" | head -2
  for t in "tests/test_nf4_kernels.py -k cuda_kernel" "tests/test_awq_kernels.py -k cuda_matmul_vs_reference" \
           "tests/test_ffn_cuda.py" "tests/test_ffn4_kernels.py -k cuda" "tests/test_gru_cuda.py -k kernel_bit_exact"; do
    echo "-- memcheck: $t"
    timeout 120 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider -x $t 2>&1 \
      | grep -E "ERROR SUMMARY|passed|failed|Invalid" | head -4
  done
  ;;
sanitize)
  # memcheck and racecheck of every kernel family, through the family's kernel tests (each set runs the routed
  # kernels on small shapes: partial tiles, several K splits, NaN rows). The sets run side by side (one process
  # each; the GPU and the host's cores have room), each log under $OUT/san-<family>-<tool>.log; a subset:
  # SAN_ONLY="ffn gru", SAN_TOOLS=memcheck, SAN_TIMEOUT seconds per set.
  declare -A SETS=(
    [fplut]="tests/test_fplut_cuda.py -k kernel_matches_reference or multi_block"
    [nf4]="tests/test_nf4_kernels.py tests/test_nf4tc_cuda.py tests/test_nf4warp_cuda.py tests/test_nf4mma_cuda.py -k matmul_cuda_kernel or m1_kernel or m2_decode or dequant_cuda_kernel or tc_kernel_vs_reference or warpcols_swiglu or mma_kernel_vs_reference"
    [awq]="tests/test_awq_cuda.py tests/test_matmulawq1_cuda.py -k matmul_vs_reference or dequant_bit_exact or gemv1_vs_reference or gemv1_ffn"
    [ffn]="tests/test_ffn_cuda.py tests/test_ffn_tc_cuda.py tests/test_ffn4_kernels.py -k vs_reference or tc_vs_reference or nf4_cuda_kernel or awq_cuda_kernel"
    [gru]="tests/test_gru_cuda.py -k kernel_bit_exact"
    [attention]="tests/test_rotary_kernels.py tests/test_rotarykv_kernels.py tests/test_rmsnorm_kernels.py tests/test_kvattention_kernels.py -k cuda_kernel_bit_exact or test_cuda_kernel")
  pids=()
  for name in ${SAN_ONLY:-fplut nf4 awq ffn gru attention}; do
    files=${SETS[$name]%% -k *}; sel=${SETS[$name]#* -k }
    for tool in ${SAN_TOOLS:-memcheck racecheck}; do
      ( timeout ${SAN_TIMEOUT:-420} compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q \
          -p no:cacheprovider $files -k "$sel" > "$OUT/san-$name-$tool.log" 2>&1 ) &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
  for f in "$OUT"/san-*.log; do
    printf '%-28s %s | %s\n' "$(basename "$f" .log)" \
      "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -1)" "$(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"
  done
  ;;
edges)
  # Edge shapes of the kernels the tests reach only at a few sizes: partial last column tiles and steps, one K split
  # and several, row chunks, thread groups. Each line: family, tool, kernel_once.py arguments (M=rows for awq).
  # (Folded from awq8_sanitize.sh, ffn_kn_sanitize.sh, ffn_tc_check.sh, nf4tc_sanitize.sh, nf4wide_sanitize.sh.)
  rc=0
  while read -r fam tool m args; do
    [ -z "$fam" ] && continue
    case " ${EDGES_ONLY:-awq ffn_kn ffn_tc nf4tc nf4wide} " in *" $fam "*) ;; *) continue ;; esac
    echo "-- $tool: $fam M=$m $args"
    eval "set -- $args"
    M=$m timeout ${SAN_TIMEOUT:-280} compute-sanitizer --tool $tool --print-limit 5 --error-exitcode 9 \
      python3 benchmarks/kernel_once.py "$@" </dev/null 2>&1 \
      | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|HAZARD|rel |rc |groups |matmul |finite|MISMATCH|Error" | head -4
    [ "${PIPESTATUS[0]}" = "0" ] || rc=1
  done <<'CASES'
awq memcheck 3 awq mm1 688 1000 "wpl=1"
awq memcheck 8 awq ffn1 688 1000 "wpl=1"
awq memcheck 5 awq mm1 4096 11008 "wpl=2"
awq memcheck 2 awq ffn1 4096 11008 "wpl=1"
awq memcheck 13 awq mm1 688 1000 "wpl=1"
awq memcheck 16 awq ffn1 688 1000 "wpl=1"
awq memcheck 9 awq ffn1 4096 11008 "wpl=1"
awq racecheck 6 awq ffn1 688 1000 "wpl=1"
awq racecheck 12 awq ffn1 688 1000 "wpl=1"
ffn_kn memcheck 1 ffn_kn 1 4096 776 float16 float16
ffn_kn memcheck 1 ffn_kn 2 37 264 float16 float16
ffn_kn memcheck 1 ffn_kn 1 9000 24 float32 float16
ffn_kn memcheck 1 ffn_kn 2 520 300 float32 float32
ffn_kn memcheck 1 ffn_kn 2 300 8 float16 float32
ffn_kn memcheck 1 ffn_kn 3 4104 200 float16 float16
ffn_kn memcheck 1 ffn_kn 13 40 72 float16 float16
ffn_kn memcheck 1 ffn_kn 9 520 1000 float16 float16
ffn_kn racecheck 1 ffn_kn 1 4096 776 float16 float16
ffn_kn racecheck 1 ffn_kn 2 37 264 float16 float16
ffn_kn racecheck 1 ffn_kn 1 9000 24 float32 float16
ffn_kn racecheck 1 ffn_kn 2 520 300 float32 float32
ffn_kn racecheck 1 ffn_kn 2 300 8 float16 float32
ffn_kn racecheck 1 ffn_kn 3 4104 200 float16 float16
ffn_kn racecheck 1 ffn_kn 13 40 72 float16 float16
ffn_kn racecheck 1 ffn_kn 9 520 1000 float16 float16
ffn_tc memcheck 1 ffn_tc 37 136 33 "mt=2, kw=4, ring=2, mfast=True"
ffn_tc memcheck 1 ffn_tc 5 264 17 "mt=1, kw=4, ring=4"
ffn_tc memcheck 1 ffn_tc 11 8 40 "mt=2, kw=2, ring=2"
ffn_tc memcheck 1 ffn_tc 3 520 9 "mt=1, kw=4, ring=4"
ffn_tc racecheck 1 ffn_tc 37 136 33 "mt=2, kw=4, ring=2, mfast=True"
nf4tc memcheck 1 nf4tc 13 192 40
nf4tc memcheck 1 nf4tc 16 4096 1000
nf4tc racecheck 1 nf4tc 11 256 72
nf4wide memcheck 1 nf4wide_ffn 1 4096 1000 3
nf4wide memcheck 1 nf4wide_ffn 1 512 37 3
nf4wide racecheck 1 nf4wide_ffn 1 512 200 3
nf4wide memcheck 1 nf4wide_mm 1 4096 1000
nf4wide memcheck 1 nf4wide_mm 1 8192 37
nf4wide racecheck 1 nf4wide_mm 1 4096 200
nf4wide memcheck 1 nf4wide_mm 2 4096 1000
nf4wide memcheck 1 nf4wide_mm 5 4096 37
nf4wide racecheck 1 nf4wide_mm 2 8192 40
CASES
  exit $rc
  ;;
stalls)
  # (Folded from nf4ffn_stalls.sh.) ncu metrics of the second launch (the first compiles and warms up).
  S=smsp__average_warps_issue_stalled
  MET=l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
  MET=$MET,dram__bytes_read.sum,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
  MET=$MET,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
  for r in mio_throttle long_scoreboard short_scoreboard lg_throttle barrier wait math_pipe_throttle not_selected \
           selected tex_throttle dispatch_stall no_instruction drain; do MET=$MET,${S}_${r}_per_issue_active.ratio; done
  ncu --metrics $MET -k regex:decode --launch-skip 1 --launch-count 1 \
      python3 benchmarks/kernel_once.py nf4 ffn ${STALLS_K:-4096} ${STALLS_N:-11008} 2>&1 \
    | grep -E "decode|smsp__|l1tex__|dram__|gpu__|sm__|rel " | sed -e 's/smsp__average_warps_issue_stalled_//'
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
  python3 benchmarks/decoder_ops_gpu.py --op kvattention --json "$OUT/attention.json" 2>&1 | grep -v -i warn | tail -12
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
genai|genai-profile)
  cap=/tmp/ortgpu/site/onnxruntime/capi
  if [ ! -e $cap/libonnxruntime.so.1.31.1 ]; then
    xz -dc .whl/genai/libonnxruntime.so.1.31.1.xz > $cap/libonnxruntime.so.1.31.1 || exit 1
    ln -sf libonnxruntime.so.1.31.1 $cap/libonnxruntime.so.1; ln -sf libonnxruntime.so.1.31.1 $cap/libonnxruntime.so
    python3 -m pip install -q --no-deps --no-index --target /tmp/genai .whl/genai/onnxruntime_genai_cuda-*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/genai:$PYTHONPATH LD_LIBRARY_PATH=$cap:${LD_LIBRARY_PATH:-}
  [ -d /tmp/gm/genai_int4.lowbit ] || timeout 400 python3 benchmarks/genai_models.py /tmp/gm ${GENAI_MODEL_ARGS:-} 2>&1 \
    | grep -v -i -E "warn|it/s\]" | tail -20
  if [ "$1" = genai-profile ]; then
    timeout ${GENAI_TIMEOUT:-400} python3 benchmarks/genai_profile.py /tmp/gm/genai_int4 /tmp/gm/genai_int4.lowbit \
      /tmp/gm/genai_fp16 ${GENAI_PROFILE_ARGS:-} --json "$OUT/genai_profile.json" 2>&1 | grep -v -i warn | tail -80
    exit 0
  fi
  timeout ${GENAI_TIMEOUT:-400} python3 benchmarks/genai_loop.py /tmp/gm/genai_fp16 /tmp/gm/genai_int4 /tmp/gm/genai_fp16.lowbit \
    /tmp/gm/genai_int4.lowbit ${GENAI_LOOP_ARGS:---prompt 128 --new 128 --rounds 3} --json "$OUT/genai.json" 2>&1 \
    | grep -v -i warn | tail -25
  ;;
esac

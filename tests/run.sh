#!/usr/bin/env bash
# The test command (README.md): installs onnx-lowbit with its CPU runtime and test tools into a fresh virtual
# environment (.venv-test) and runs the whole suite. CUDA kernels run under Numba's CUDA simulator unless
# ONNX_LOWBIT_REAL_GPU=1 (then they run on the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-test}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[cpu,test]"
# AutoAWQ's packing code is the reference the AWQ format tests compare with; its own dependencies (transformers,
# accelerate, triton) are not needed for that and are left out.
"$VENV/bin/python" -m pip install -q --no-deps autoawq==0.2.9
# Workers (pytest-xdist): one per CPU core, at most 4 (each imports torch and compiles its own kernels), under the
# simulator; none on a real GPU (the GPU tests share one device). ONNX_LOWBIT_TEST_WORKERS=0 runs in-process.
if [ "${ONNX_LOWBIT_REAL_GPU:-0}" != "1" ]; then
    export NUMBA_ENABLE_CUDASIM=1
    CORES=$(nproc 2>/dev/null || echo 1)
    WORKERS=${ONNX_LOWBIT_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}
else
    WORKERS=${ONNX_LOWBIT_TEST_WORKERS:-0}
fi
# Numba's disk cache in a folder named after a hash of the kernels' sources (tests/numba_cache_dir.py: its cache
# does not notice a changed callee in another module, and tests would run stale code)
if [ -z "${NUMBA_CACHE_DIR:-}" ]; then
    export NUMBA_CACHE_DIR=$("$VENV/bin/python" tests/numba_cache_dir.py "${XDG_CACHE_HOME:-$HOME/.cache}/onnx-lowbit-numba")
fi
XDIST=()
# --dist loadgroup: the tests conftest.py groups (those that compile QuantGRU's CPU kernels) run on one worker, the
# rest test by test on any
# OpenBLAS single-threaded in the workers: numpy's small matmuls (QuantGRU's calibration search runs the numpy
# reference step by step) with every worker's BLAS threads spinning on the same cores took 13x longer (two
# concurrent GRU rewrites of the denoiser: 3 min 37 s against 16 s; in CI two such tests took ~9 min each)
if [ "$WORKERS" -gt 1 ]; then XDIST=(-n "$WORKERS" --dist loadgroup); export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}; fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${XDIST[@]}" "$@"

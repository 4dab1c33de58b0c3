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
if [ "${ONNX_LOWBIT_REAL_GPU:-0}" != "1" ]; then export NUMBA_ENABLE_CUDASIM=1; fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"

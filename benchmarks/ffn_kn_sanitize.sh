#!/bin/bash
# compute-sanitizer (memcheck, racecheck) on FusedFFN's K-major kernels (weights_kn = 1): the decode kernel
# (custom_ops/fusedffn_kn_cuda.py; M = 1 / 2) and the tensor-core kernel (fusedffn_kn_tc_cuda.py; M = 3..16) through
# fusedffn_cuda.run_arrays, at edge shapes: a partial last column tile, partial last steps, one split and several
# (tile counters and partials), partial row tiles, fp16 and fp32 X / W; GPU machine:
#   PYTHONPATH=/tmp/site:.:benchmarks bash benchmarks/ffn_kn_sanitize.sh ["M K N xtype wtype" ...]  (default: all)
code='
import sys
import numpy as np
from onnx_lowbit import ffn
from onnx_lowbit.custom_ops import fusedffn_cuda as fc
m, k, n, xd, wd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
path = "decode" if m <= 2 else "tc"
r = np.random.default_rng(0)
x = r.standard_normal((m, k)).astype(xd)
w1, w3 = (r.standard_normal((k, n)) / np.sqrt(k)).astype(wd), (r.standard_normal((k, n)) / np.sqrt(k)).astype(wd)
b = r.standard_normal(n).astype(xd)
for _ in range(2):           # the second call finds the tile counters the first left
    y = fc.run_arrays(x, w1, w3, b, None, kn=True, path=path)
ref = ffn.swiglu_ref(x, w1, w3, b, None, kn=True)
print(m, k, n, xd, wd, path, "rel err", float(np.abs(y - ref).max() / np.abs(ref).max()))
'
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=("1 4096 776 float16 float16" "2 37 264 float16 float16" "1 9000 24 float32 float16"
                                   "2 520 300 float32 float32" "2 300 8 float16 float32" "3 4104 200 float16 float16"
                                   "13 40 72 float16 float16" "9 520 1000 float16 float16")
rc=0
for tool in memcheck racecheck; do
  for shape in "${shapes[@]}"; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -c "$code" $shape 2>&1 |
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|rel err|Error" || rc=1
    [ "${PIPESTATUS[0]}" = "0" ] || rc=1
  done
done
exit $rc

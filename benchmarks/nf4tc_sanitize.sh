#!/bin/bash
# compute-sanitizer on the NF4 tensor-core kernel (nf4tc_cuda) with both row chunks in one block (M >= 9), one and
# two weights, through its host runner; GPU machine:
#   PYTHONPATH=/tmp/site:.:benchmarks bash benchmarks/nf4tc_sanitize.sh
run='
import sys
import numpy as np
from onnx_lowbit import nf4
from onnx_lowbit.custom_ops import nf4tc_cuda as tc
m, k, n = (int(v) for v in sys.argv[1:4])
r = np.random.default_rng(0)
w = sum((nf4.quantize(r.standard_normal((k, n)).astype(np.float32), "nf4", 64) for _ in range(2)), ())
x = r.standard_normal((m, k)).astype(np.float16)
s = tc.run(x, *w, nf4.code("nf4"), 64, k, n, r.standard_normal(n).astype(np.float16), None)
y = tc.run(x, w[0], w[1], None, None, nf4.code("nf4"), 64, k, n)
print("rc", tc.row_chunks(m), "finite", bool(np.isfinite(s).all() and np.isfinite(y).all()))
'
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$run" 13 192 40 2>&1 | grep -E "ERROR SUMMARY|rc "
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$run" 16 4096 1000 2>&1 | grep -E "ERROR SUMMARY|rc "
compute-sanitizer --tool racecheck --print-limit 5 python3 -c "$run" 11 256 72 2>&1 | grep -E "RACECHECK SUMMARY|rc "

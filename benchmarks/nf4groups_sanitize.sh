#!/bin/bash
# compute-sanitizer on FusedFFNNF4's wide decode with thread groups sharing one table (fusedffnnf4_cuda.GROUPS),
# through its host runner; GPU machine:
#   PYTHONPATH=/tmp/site:.:benchmarks bash benchmarks/nf4groups_sanitize.sh
run='
import sys
import numpy as np
from onnx_lowbit import nf4
from onnx_lowbit.custom_ops import fusedffnnf4_cuda as f
m, k, n, g = (int(v) for v in sys.argv[1:5])
r = np.random.default_rng(0)
w = sum((nf4.quantize(r.standard_normal((k, n)).astype(np.float32), "nf4", 64) for _ in range(2)), ())
x = r.standard_normal((m, k)).astype(np.float16)
s = f.run_arrays(x, *w, "nf4", 64, k, n, r.standard_normal(n).astype(np.float16), None, h2=4, wide=True, groups=g)
print("groups", g, "finite", bool(np.isfinite(s).all()))
'
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$run" 1 4096 1000 3 2>&1 | grep -E "ERROR SUMMARY|groups "
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$run" 1 512 37 4 2>&1 | grep -E "ERROR SUMMARY|groups "
compute-sanitizer --tool racecheck --print-limit 5 python3 -c "$run" 1 512 200 3 2>&1 | grep -E "RACECHECK SUMMARY|groups "

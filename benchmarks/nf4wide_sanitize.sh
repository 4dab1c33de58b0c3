#!/bin/bash
# compute-sanitizer on the NF4 M = 1 wide decodes (16 bytes per thread and row, chains of 4) through their host
# runners: FusedFFNNF4's with thread groups sharing one table (fusedffnnf4_cuda.GROUPS) and MatMulNF4's
# (matmulnf4_cuda.M1_WIDE_MIN_K; N = 1000 and 37: partial last steps), and MatMulNF4's two-row decode at M = 2 and 5
# (matmulnf4_cuda.M2_DECODE, M2_MAX_M raised to 5: row chunks); GPU machine:
#   PYTHONPATH=/tmp/site:.:benchmarks bash benchmarks/nf4wide_sanitize.sh [ffn|mm]   (default: both)
ffn='
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
mm='
import sys
import numpy as np
from onnx_lowbit import nf4
from onnx_lowbit.custom_ops import matmulnf4_cuda as mc
m, k, n = (int(v) for v in sys.argv[1:4])
mc.M2_MAX_M = max(mc.M2_MAX_M, m)
r = np.random.default_rng(0)
q, am = nf4.quantize(r.standard_normal((k, n)).astype(np.float32), "nf4", 64)
a = r.standard_normal((m, k)).astype(np.float16)
y = mc.run_arrays(a, q, am, nf4.code("nf4").astype(np.float32), k, n, 64, r.standard_normal(n).astype(np.float16))
print("matmul m", m, "wide", mc.m1_wide(np.float16, k), "two-row", mc.m2_path(m, k, np.float16),
      "finite", bool(np.isfinite(y).all()))
'
if [ "${1:-}" != mm ]; then
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$ffn" 1 4096 1000 3 2>&1 | grep -E "ERROR SUMMARY|groups "
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$ffn" 1 512 37 4 2>&1 | grep -E "ERROR SUMMARY|groups "
compute-sanitizer --tool racecheck --print-limit 5 python3 -c "$ffn" 1 512 200 3 2>&1 | grep -E "RACECHECK SUMMARY|groups "
fi
[ "${1:-}" == ffn ] && exit 0
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$mm" 1 4096 1000 2>&1 | grep -E "ERROR SUMMARY|matmul "
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$mm" 1 8192 37 2>&1 | grep -E "ERROR SUMMARY|matmul "
compute-sanitizer --tool racecheck --print-limit 5 python3 -c "$mm" 1 4096 200 2>&1 | grep -E "RACECHECK SUMMARY|matmul "
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$mm" 2 4096 1000 2>&1 | grep -E "ERROR SUMMARY|matmul "
compute-sanitizer --tool memcheck --print-limit 5 python3 -c "$mm" 5 4096 37 2>&1 | grep -E "ERROR SUMMARY|matmul "
compute-sanitizer --tool racecheck --print-limit 5 python3 -c "$mm" 2 8192 40 2>&1 | grep -E "RACECHECK SUMMARY|matmul "

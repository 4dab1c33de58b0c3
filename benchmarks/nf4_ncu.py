"""Launch the NF4 M=1 kernels once per shape (for ncu / compute-sanitizer): FusedFFNNF4's decode kernel and
MatMulNF4's M=1 kernel, fp16 x, random NF4 bytes (block 64), each launched twice (profile the second:
``--launch-skip 1``) and checked against the CPU face.

    ncu --section SpeedOfLight --section WarpStateStats -k regex:decode python3 benchmarks/nf4_ncu.py ffn 2048 8192
    python3 benchmarks/nf4_ncu.py mm 8192 2048
    python3 benchmarks/nf4_ncu.py ffn 4096 11008 "h2=2, wide=True"     # run_arrays options of a variant
"""
import sys

import numpy as np
from numba import cuda

from onnx_lowbit.custom_ops import fusedffnnf4_cpu, fusedffnnf4_cuda, matmulnf4_cpu, matmulnf4_cuda, nf4_common

BS = 64
cuda.current_context()      # the context first (matmulnf4_cuda asks the driver for the SM count)
what, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kw = eval("dict(" + sys.argv[4] + ")") if len(sys.argv) > 4 else {}     # run_arrays options, e.g. "h2=2"  # noqa: S307
rng = np.random.default_rng(0)
code = nf4_common.parse_attrs({"quant_type": "nf4", "block_size": BS, "K": k, "N": n})[4]
x = (rng.standard_normal((1, k)) * 0.5).astype(np.float16)
w = [(rng.integers(0, 256, k * n // 2, dtype=np.uint8), (rng.random(k * n // BS) * 0.1 + 0.01).astype(np.float32))
     for _ in range(2)]
if what == "ffn":
    for _ in range(2):
        y = fusedffnnf4_cuda.run_arrays(x, w[0][0], w[0][1], w[1][0], w[1][1], "nf4", BS, k, n, **kw)
    ref = fusedffnnf4_cpu.swiglu(x.astype(np.float32), w[0][0], w[0][1], w[1][0], w[1][1], code, k, n, BS)
else:
    for _ in range(2):
        y = matmulnf4_cuda.run_arrays(x, w[0][0], w[0][1], code, k, n, BS)
    ref = matmulnf4_cpu.matmul(x.astype(np.float32), w[0][0], w[0][1], code, k, n, BS)
ref = np.asarray(ref, np.float64).reshape(y.shape)
err = np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(ref))
print(what, k, n, "ok" if err < 2e-3 else "MISMATCH", f"rel {err:.1e}")

"""Launch the AWQ M=1 kernels once per shape (for ncu / compute-sanitizer): MatMulAWQ's fp32 decode kernel
(``mm``), its M = 1 tensor-core kernel (``mm1``, ``ffn1`` with two weights; options as a 4th argument, e.g.
"wpl=1, probe=2") or FusedFFNAWQ's (``ffn``), fp16 x, random int4 weights (group 128), each launched twice
(profile the second: ``--launch-skip 1``) and checked against the CPU reference. ``M=`` in the environment: rows
of x (``mm1`` / ``ffn1``: up to 8, the 8-row kernel from 2 on).

    ncu --section SpeedOfLight --section WarpStateStats -k regex:gemv --launch-skip 1 --launch-count 1 \\
        python3 benchmarks/awq_ncu.py mm 4096 11008
"""
import os
import sys

import numpy as np
from numba import cuda

from onnx_lowbit import awq
from onnx_lowbit.custom_ops import fusedffnawq_cuda, matmulawq1_cuda, matmulawq_cuda

G = 128
cuda.current_context()      # the context first (the launchers ask the driver for the SM count)
what, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kw = eval("dict(" + sys.argv[4] + ")") if len(sys.argv) > 4 else {}     # run_arrays options  # noqa: S307
rng = np.random.default_rng(0)
m = int(os.environ.get("M", "1"))    # rows of x (mm1 / ffn1 take up to 8)
x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)


def weights():
    kp = -(-k // G) * G         # AutoAWQ pads K to a whole number of groups
    return (rng.integers(-2 ** 31, 2 ** 31, (kp, n // 8), dtype=np.int64).astype(np.int32),
            rng.integers(-2 ** 31, 2 ** 31, (kp // G, n // 8), dtype=np.int64).astype(np.int32),
            (rng.random((kp // G, n)) * 0.004 + 0.001).astype(np.float16))


w1, w3 = weights(), weights()
if what == "ffn1":
    for _ in range(2):
        y = matmulawq1_cuda.run(x, w1, w3, None, None, G, k, n, **kw)
    g = awq.matmul(x, *w1, G, k, n).astype(np.float64)
    ref = g / (1 + np.exp(-g)) * awq.matmul(x, *w3, G, k, n).astype(np.float64)
elif what == "ffn":
    for _ in range(2):
        y = fusedffnawq_cuda.run_arrays(x, w1, w3, G, k, n, **kw)
    g = awq.matmul(x, *w1, G, k, n).astype(np.float64)
    ref = g / (1 + np.exp(-g)) * awq.matmul(x, *w3, G, k, n).astype(np.float64)
else:
    run = matmulawq1_cuda.run_arrays if what == "mm1" else matmulawq_cuda.run_arrays
    for _ in range(2):
        y = run(x, *w1, G, k, n, **kw)
    ref = awq.matmul(x, *w1, G, k, n).astype(np.float64)
err = np.max(np.abs(y.astype(np.float64) - ref)) / np.max(np.abs(ref))
print(what, f"M={m}", k, n, kw, "ok" if err < 2e-3 else "MISMATCH", f"rel {err:.1e}")

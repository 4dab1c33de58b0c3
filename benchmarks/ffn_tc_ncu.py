"""Launch FusedFFN's tensor-core kernel twice at one configuration (for ncu / compute-sanitizer), fp16 x[M, K],
W1/W3 [N, K], biases, checked against float64 after the launches.

    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy -k regex:kern --launch-skip 1 \\
        --launch-count 1 python3 benchmarks/ffn_tc_ncu.py 32 4096 11008 "mt=4, kw=4, ring=2"
    compute-sanitizer --tool memcheck python3 benchmarks/ffn_tc_ncu.py 37 136 33 "mt=2, kw=4, ring=2, mfast=True"
"""
import sys

import numpy as np

from onnx_lowbit.custom_ops import fusedffn_tc_cuda as tc

m, k, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
opts = eval("dict(" + sys.argv[4] + ")") if len(sys.argv) > 4 else {}     # run_arrays options  # noqa: S307
rng = np.random.default_rng(0)
x = rng.standard_normal((m, k)).astype(np.float16)
w1 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
w3 = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
b1, b3 = rng.standard_normal(n).astype(np.float16), rng.standard_normal(n).astype(np.float16)
for _ in range(2):
    y = tc.run_arrays(x, w1, w3, b1, b3, **opts)
xd = x.astype(np.float64)
g = xd @ w1.astype(np.float64).T + b1
ref = g / (1 + np.exp(-g)) * (xd @ w3.astype(np.float64).T + b3)
err = float(np.abs(y - ref).max() / np.abs(ref).max())
print(f"M={m} K={k} N={n} {opts}: max rel error {err:.2e}")
sys.exit(0 if err < 1e-3 else 1)

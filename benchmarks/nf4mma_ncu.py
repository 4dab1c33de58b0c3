"""One launch of the balanced NF4 tensor-core GEMV (custom_ops/nf4mma_cuda.py) for ncu, LLaMA-7B gate/up shape:
    ncu --kernel-name regex:nf4mma --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
        python3 benchmarks/nf4mma_ncu.py [nw] [warps] [M] [K] [N]
"""
import sys

import numpy as np

from onnx_lowbit.custom_ops import nf4mma_cuda
from onnx_lowbit import nf4

nw = int(sys.argv[1]) if len(sys.argv) > 1 else 1
warps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
m = int(sys.argv[3]) if len(sys.argv) > 3 else 1
K = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
N = int(sys.argv[5]) if len(sys.argv) > 5 else 11008
BS = 64
rng = np.random.default_rng(0)
q = [rng.integers(0, 256, K * N // 2, dtype=np.uint8) for _ in range(2)]
am = [(rng.random(K * N // BS) * 0.1 + 0.01).astype(np.float32) for _ in range(2)]
x = rng.standard_normal((m, K)).astype(np.float16)
code = nf4.code("nf4")
y = nf4mma_cuda.run(x, q[0], am[0], q[1] if nw == 2 else None, am[1] if nw == 2 else None, code, BS, K, N,
                    warps=warps, repeat=3)
print("ok", y.shape, float(np.abs(y.astype(np.float32)).max()))

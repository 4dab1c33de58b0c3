"""The ring variant of the wide h2 NF4 decode (fusedffnnf4_cuda, ``ring``) against the default on the GPU: outputs
bit for bit at LLaMA-size and edge shapes (the same arithmetic; only how the words travel differs).

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/ring_check.py [KxNxM ...]
"""
from __future__ import annotations

import sys

import numpy as np

from onnx_lowbit.custom_ops import fusedffnnf4_cuda as f


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1:]] or [(4096, 11008, 1), (4096, 11008, 2),
                                                                            (4096, 36, 1), (2048, 100, 1), (256, 37, 2)]
    rng = np.random.default_rng(1)
    for k, n, m in shapes:
        x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
        q1, q3 = (rng.integers(0, 256, k * n // 2, dtype=np.uint8) for _ in range(2))
        am1, am3 = ((rng.random(k * n // 64) + 0.1).astype(np.float32) for _ in range(2))
        a = f.run_arrays(x, q1, am1, q3, am3, "nf4", 64, k, n, h2=4, wide=True)
        b = f.run_arrays(x, q1, am1, q3, am3, "nf4", 64, k, n, h2=4, wide=True, ring=True, repeat=3)
        same = np.array_equal(a.view(np.uint16), b.view(np.uint16))
        print(f"{k}x{n} M={m}: ring {'bit-identical to' if same else 'DIFFERS from'} the default", flush=True)
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()

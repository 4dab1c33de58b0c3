"""FusedFFN CPU kernel: accuracy vs the float64 reference (onnx_lowbit.ffn.swiglu_ref) and wall time vs numpy's
unfused fp32 computation (x @ W1, x @ W3 through BLAS, then SiLU * u), on this machine's cores.

Data as tests/test_ffn_kernels.py: x ~ N(0, 1), W ~ N(0, 1/K), biases ~ N(0, 0.01), seed = M.
Error: max |s - ref| / max |ref| over the output. Time: mean of 10 calls after one warm-up (ms).

    PYTHONPATH=.:tests python benchmarks/ffn_cpu.py [--time]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from onnx_lowbit import ffn
from onnx_lowbit.custom_ops.ffn import fusedffn_cpu

SHAPES = [(64, 176), (512, 1376), (2048, 5504)]
TYPES = [(np.float32, np.float32), (np.float16, np.float16), (np.float32, np.float16)]


def data(K, N, xd, wd, m, seed):  # noqa: N803
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, K)).astype(xd)
    w1 = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(wd)
    w3 = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(wd)
    b1 = (rng.standard_normal(N) * 0.1).astype(xd)
    b3 = (rng.standard_normal(N) * 0.1).astype(xd)
    return x, w1, w3, b1, b3


def wall(f, n=10):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--time", action="store_true", help="also time the kernel against numpy's unfused fp32")
    a = p.parse_args()
    print(f"cores: {os.cpu_count()}")
    print("| X / W | K x N | M | max err / max |ref| |" + (" fused ms | numpy fp32 unfused ms |" if a.time else ""))
    for xd, wd in TYPES:
        for K, N in SHAPES:  # noqa: N806
            for m in (1, 16, 64):
                x, w1, w3, b1, b3 = data(K, N, xd, wd, m, m)
                s = fusedffn_cpu.swiglu(x, w1, w3, b1, b3)
                ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
                err = np.abs(s.astype(np.float64) - ref).max() / np.abs(ref).max()
                row = f"| {np.dtype(xd).name} / {np.dtype(wd).name} | {K} x {N} | {m} | {err:.2e} |"
                if a.time:
                    w1f, w3f = np.ascontiguousarray(w1.T, np.float32), np.ascontiguousarray(w3.T, np.float32)
                    xf, b1f, b3f = x.astype(np.float32), b1.astype(np.float32), b3.astype(np.float32)

                    def unfused():
                        g = xf @ w1f + b1f
                        return g / (1 + np.exp(-g)) * (xf @ w3f + b3f)
                    row += (f" {wall(lambda: fusedffn_cpu.swiglu(x, w1, w3, b1, b3)):.2f} |"  # noqa: B023
                            f" {wall(unfused):.2f} |")
                print(row, flush=True)


if __name__ == "__main__":
    main()

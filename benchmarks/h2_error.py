"""Rounding error of the NF4 decode kernels' packed-fp16 arithmetic (``h2``), emulated in numpy (CPU, no GPU):
x W^T for one row of X against float64, for the fp32 decode (exact products, fp32 sums), fp16 code values with
exact products, and chains of 2 / 4 bytes (fma.rn.f16x2 into an fp16 partial sum, then fp32), as
decode_cuda.make_decode(h2=c) computes them (X scaled by a power of two so that |x p| < 2^12), with the
levels as plain fp16 and as fp16 of a * level (half2.h2_scale: what the kernels' tables hold).

Three kinds of X: zero-mean N(0, 1), mean-shifted N(0.2, 1), and N(0, 1) with 8 outlier channels x 30 (as hidden
states with massive activations). NF4 weights of N(0, 1) values, block 64. Prints the RMS of the error over the
outputs relative to the outputs' RMS, and the largest error relative to the largest output.

    python3 benchmarks/h2_error.py [K] [N]
"""
from __future__ import annotations

import sys

import numpy as np

from onnx_lowbit import nf4
from onnx_lowbit.custom_ops.device import half2


def chains(codes16, xs16, c):
    """One 16-byte unit (32 elements) per row: sum of code * x in fp16 fma chains of c bytes (the two halves of a
    half2: even and odd elements), each chain converted to fp32 and summed in fp32."""
    n = codes16.shape[0]
    unit = np.zeros(n, np.float32)
    for b0 in range(0, 32, 2 * c):
        for lane in (0, 1):
            h = np.zeros(n, np.float16)
            for j in range(c):
                e = b0 + 2 * j + lane
                h = (codes16[:, e].astype(np.float64) * np.float64(xs16[e]) + h.astype(np.float64)).astype(np.float16)
            unit += h.astype(np.float32)
    return unit


def run(codes, amk, xp, p, c, k, n):
    """x W^T by the h2 decode: per 16-byte unit the chains' fp32 sum times the absmax, over p."""
    tot = np.zeros(n, np.float64)
    for u0 in range(0, k, 32):
        tot += chains(codes[:, u0:u0 + 32], xp[u0:u0 + 32], c).astype(np.float64) * amk[:, u0]
    return tot / p


def main():
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    bs = 64
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, am = nf4.quantize_flat(w.reshape(-1), "nf4", bs)
    codes = np.asarray(nf4.code("nf4"), np.float64)[nf4.unpack_indices(q, n * k)].reshape(n, k)
    amk = np.repeat(np.asarray(am, np.float64).reshape(n, k // bs), bs, axis=1)
    wq = codes * amk
    xs = {"zero-mean": rng.standard_normal(k), "mean 0.2": rng.standard_normal(k) + 0.2}
    xo = rng.standard_normal(k)
    xo[rng.choice(k, 8, replace=False)] *= 30
    xs["8 outlier channels x30"] = xo
    print(f"K={k} N={n} NF4 block {bs}; error of x W^T: RMS relative to the outputs' RMS / max relative to the largest")
    for name, x in xs.items():
        x16 = x.astype(np.float16)
        ref = wq @ x16.astype(np.float64)
        xm = np.max(np.abs(x16.astype(np.float32)))
        p = 2.0 ** (11 - np.floor(np.log2(xm)))
        xp = (x16.astype(np.float32) * np.float32(p)).astype(np.float16)
        c16 = codes.astype(np.float16)
        a = np.float64(half2.h2_scale(nf4.code("nf4")))
        ca16 = (codes.astype(np.float32) * np.float32(a)).astype(np.float16)
        rows = {"fp32 decode": ((codes * amk).astype(np.float32) @ x16.astype(np.float32)).astype(np.float64),
                "fp16 code values": (c16.astype(np.float64) * amk) @ x16.astype(np.float64),
                "fp16 code values x a": (ca16.astype(np.float64) / a * amk) @ x16.astype(np.float64)}
        for c in (2, 4):
            rows[f"h2 chains of {c}, plain levels"] = run(c16, amk, xp, p, c, k, n)
            rows[f"h2 chains of {c} (levels x a)"] = run(ca16, amk, xp, p * a, c, k, n)
        line = [f"{name:24s}"]
        for label, y in rows.items():
            e = y - ref
            line.append(f"{label}: {np.sqrt(np.mean(e ** 2) / np.mean(ref ** 2)):.1e} / "
                        f"{np.max(np.abs(e)) / np.max(np.abs(ref)):.1e}")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()

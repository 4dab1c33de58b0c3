"""Scalar arithmetic helpers of the elementwise CUDA kernels (Rotary, RotaryKV, KVAttention), GPU and CUDA-simulator
versions: fp32 ``mul`` / ``add`` rounded to nearest (never contracted into a fused multiply-add, as separate ONNX ops
compute them) and ``divmod_`` (a 64-bit quotient and remainder through a float64 reciprocal)."""
from __future__ import annotations

import numpy as np
from numba import float64, int64
from numba.cuda import libdevice

from .target import SIM, device

if SIM:
    def mul(a, b):
        with np.errstate(all="ignore"):
            return np.float32(np.float32(a) * np.float32(b))

    def add(a, b):
        with np.errstate(all="ignore"):
            return np.float32(np.float32(a) + np.float32(b))
else:
    @device
    def mul(a, b):
        return libdevice.fmul_rn(a, b)

    @device
    def add(a, b):
        return libdevice.fadd_rn(a, b)


@device
def divmod_(a, d, inv):
    """(a // d, a % d) for 0 <= a < 2^52 through a float64 reciprocal (``inv`` = 1 / d) and one correction step:
    64-bit integer division costs ~80 dependent instructions on the GPU, several per thread here."""
    q = int64(float64(a) * inv)
    r = a - q * d
    if r < 0:
        q -= 1
        r += d
    elif r >= d:
        q += 1
        r -= d
    return q, r

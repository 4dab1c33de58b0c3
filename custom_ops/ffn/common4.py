"""Shared pieces of the fused 4-bit SwiGLU kernels (FusedFFNNF4, FusedFFNAWQ), both faces: the SwiGLU epilogue
S = SiLU(G + B1) * (U + B3) of the CPU faces (``swiglu_f32``, whose ``silu_mul`` the native entries call too) and
``opt`` (an optional input). Their X / bias checks are device/inputs.py's ``check_x_biases`` (the 4-bit kernels'
host runners in nf4/ and awq/ use them too)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, boundscheck=False)
def silu_mul(g, u):
    """g[i, j] = SiLU(g[i, j]) * u[i, j] (float32 [rows, cols], in place): z / (1 + exp(-z)) * u evaluated in
    float64 (math.exp) and rounded to float32 once, as the reference (onnx_lowbit.ffn) computes it in float64.
    Non-finite values as the unfused graph: SiLU(+inf) = +inf, SiLU(-inf) = -inf / inf = NaN, a very negative z
    gives -0.0; 0 * inf = NaN. The Python path and the native entries call this one compiled function, so both give
    the same bytes (element by element; LLVM vectorises this loop only with a vector math library, SVML, whose exp
    could differ from the scalar one in the last bit of a float64, which a float32 result almost never shows)."""
    for i in range(g.shape[0]):
        gi, ui = g[i], u[i]
        for j in range(gi.shape[0]):
            z = np.float64(gi[j])
            gi[j] = np.float32(z / (1.0 + math.exp(-z)) * np.float64(ui[j]))


def swiglu_f32(g, u, b1=None, b3=None):
    """S = SiLU(g + b1) * (u + b3) (g, u float32 [M, N], modified in place; the bias sums in fp32, silu_mul)."""
    if b1 is not None:
        g += b1.astype(np.float32)
    if b3 is not None:
        u += b3.astype(np.float32)
    silu_mul(g, u)
    return g


def opt(inputs, i):
    return inputs[i] if i < len(inputs) else None

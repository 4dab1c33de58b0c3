"""Shared pieces of the fused 4-bit SwiGLU kernels (FusedFFNNF4, FusedFFNAWQ), both faces: the fp32 SwiGLU epilogue
S = SiLU(G + B1) * (U + B3) of the CPU faces and ``opt`` (an optional input). Their X / bias checks are
device/inputs.py's ``check_x_biases`` (the 4-bit kernels' host runners in nf4/ and awq/ use them too)."""
from __future__ import annotations

import numpy as np


def swiglu_f32(g, u, b1=None, b3=None):
    """S = SiLU(g + b1) * (u + b3), all fp32 (g, u float32 [M, N], modified in place)."""
    if b1 is not None:
        g += b1.astype(np.float32)
    if b3 is not None:
        u += b3.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        g /= np.float32(1.0) + np.exp(-g)
        g *= u
    return g


def opt(inputs, i):
    return inputs[i] if i < len(inputs) else None

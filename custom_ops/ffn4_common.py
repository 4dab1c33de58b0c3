"""Shared pieces of the fused 4-bit SwiGLU kernels (FusedFFNNF4, FusedFFNAWQ), both faces: the X / bias checks
(KernelError naming the input) and the fp32 SwiGLU epilogue S = SiLU(G + B1) * (U + B3) of the CPU faces."""
from __future__ import annotations

import numpy as np

from .bridge import KernelError


def type_name(t) -> str:
    if hasattr(t, "type_name"):
        return t.type_name
    return {"float32": "float", "float16": "float16"}.get(np.dtype(t.dtype).name, np.dtype(t.dtype).name)


def check_x_biases(x, b1, b3, k, n, b1_index, b3_index) -> int:
    """X [..., K] float/float16; B1, B3 [N] of X's type. Returns M (product of X's leading dims)."""
    if x is None:
        raise KernelError("input 0 'X' is missing")
    xt = type_name(x)
    if xt not in ("float", "float16"):
        raise KernelError(f"input 0 'X' must be float or float16, got {xt}")
    if len(x.shape) < 1 or x.shape[-1] != k:
        raise KernelError(f"input 0 'X' must have last dimension K={k}, got shape {list(x.shape)}")
    for b, idx, name in ((b1, b1_index, "B1"), (b3, b3_index, "B3")):
        if b is None:
            continue
        if type_name(b) != xt:
            raise KernelError(f"input {idx} '{name}' must have X's type {xt}, got {type_name(b)}")
        if tuple(b.shape) != (n,):
            raise KernelError(f"input {idx} '{name}' must have shape [{n}] (N), got {list(b.shape)}")
    m = 1
    for d in x.shape[:-1]:
        m *= int(d)
    return m


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

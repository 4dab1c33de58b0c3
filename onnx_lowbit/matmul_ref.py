"""The reference product shared by the 4-bit MatMul ops (MatMulNF4, MatMulAWQ): Y[..., N] = A[..., K] @ W (+ bias),
products and sums in float64, one rounding to A's dtype (float32 or float16)."""
from __future__ import annotations

import numpy as np


def check_a(a, K: int) -> np.ndarray:
    """A as an array, or ValueError: float32 / float16 with last dimension K."""
    a = np.asarray(a)
    if a.dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise ValueError(f"A must be float32 or float16, got {a.dtype}")
    if a.ndim < 1 or a.shape[-1] != int(K):
        raise ValueError(f"A's last dimension must be K={K}, got shape {a.shape}")
    return a


def add_bias(y: np.ndarray, N: int, bias) -> np.ndarray:
    """y (float64 [..., N]) + bias (shape (N,), or None), or ValueError for another shape."""
    if bias is None:
        return y
    b = np.asarray(bias)
    if b.shape != (int(N),):
        raise ValueError(f"bias must have shape ({N},), got {b.shape}")
    return y + b.astype(np.float64)


def matmul(a, K: int, N: int, bias, weight) -> np.ndarray:
    """``weight()`` returns W [K, N] (any float dtype); it is called only after A has been checked."""
    a = check_a(a, K)
    y = add_bias(a.astype(np.float64) @ np.asarray(weight(), dtype=np.float64), N, bias)
    with np.errstate(over="ignore"):
        return y.astype(a.dtype)

"""RMS normalisation with an optional residual add (reference semantics of the RMSNorm op).

    H = X + skip                                   (in T, rounded to T; H = X without skip)
    Y = gamma * T( float32(H) / sqrt(mean(float32(H)^2) + epsilon) )

over the last axis of X [..., D]; gamma [D] of type T. This is LLaMA-family RMSNorm as transformers writes it
(``LlamaRMSNorm``: the hidden state widened to fp32, normalised, narrowed back to the input type, then scaled by
the weight in that type) together with the residual add in front of it, which exports spell as Add, Cast, Pow,
ReduceMean, Add, Sqrt, Div, Mul, Cast, Mul. The op returns Y and, as a second output, H (the residual stream the
next layer adds to).

Arithmetic: the mean of squares is a float32 sum (the kernels' order differs from numpy's: the scale agrees to a
few fp32 ulps, so an fp16 Y may differ from this reference by up to two fp16 ulps: one in the narrowed normalised
value, one more after the weight product); H is rounded to T exactly as the separate Add rounds it (bit-exact).
"""
from __future__ import annotations

import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class RMSNormError(ValueError):
    """Shapes or types the op does not accept."""


def check(x_shape, x_dtype, gamma_shape, gamma_dtype, skip_shape=None, skip_dtype=None) -> None:
    if np.dtype(x_dtype) not in DTYPES:
        raise RMSNormError(f"X must be float or float16, got {np.dtype(x_dtype)}")
    if len(x_shape) == 0:
        raise RMSNormError("X must have at least one axis (the normalised one)")
    if np.dtype(gamma_dtype) != np.dtype(x_dtype):
        raise RMSNormError(f"gamma must have X's type {np.dtype(x_dtype)}, got {np.dtype(gamma_dtype)}")
    if tuple(gamma_shape) != (x_shape[-1],):
        raise RMSNormError(f"gamma must have shape [{x_shape[-1]}] (X's last axis), got {list(gamma_shape)}")
    if skip_shape is not None:
        if np.dtype(skip_dtype) != np.dtype(x_dtype):
            raise RMSNormError(f"skip must have X's type {np.dtype(x_dtype)}, got {np.dtype(skip_dtype)}")
        if tuple(skip_shape) != tuple(x_shape):
            raise RMSNormError(f"skip must have X's shape {list(x_shape)}, got {list(skip_shape)}")


def apply(x: np.ndarray, gamma: np.ndarray, skip: np.ndarray | None = None, epsilon: float = 1e-6):
    """(Y, H) in X's type."""
    x, gamma = np.asarray(x), np.asarray(gamma)
    check(x.shape, x.dtype, gamma.shape, gamma.dtype, None if skip is None else np.shape(skip),
          None if skip is None else np.asarray(skip).dtype)
    with np.errstate(all="ignore"):
        h = x if skip is None else (x + np.asarray(skip)).astype(x.dtype)
        hf = h.astype(np.float32)
        ms = np.mean(hf * hf, axis=-1, keepdims=True, dtype=np.float32)
        r = np.float32(1.0) / np.sqrt(ms + np.float32(epsilon))
        y = (hf * r).astype(x.dtype)
        return (gamma * y).astype(x.dtype), h

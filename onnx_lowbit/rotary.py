"""Rotary position embedding, half-rotation form (reference semantics of the Rotary op).

    Y = X * cos + rotate_half(X) * sin,    rotate_half(X) = concat(-X[..., h:], X[..., :h]),  h = D / 2

over the last axis of X [..., D] (D even); cos and sin broadcast to X's shape (numpy / ONNX rules, never to a
larger shape) and have X's type. This is what LLaMA-family models (transformers' ``apply_rotary_pos_emb``,
GPT-NeoX style) compute for q and k, and what their ONNX exports spell as Mul, Slice, Slice, Neg, Concat, Mul,
Add. Each product and the sum are rounded to X's type, as those separate ONNX ops round them (float16: the
products of two fp16 values are exact in fp32, so rounding them once to fp16 and adding in fp32 gives the fp16
ops' results bit for bit). The op's kernels reproduce this exactly: the fused graph equals the unfused one.

``layout`` reduces a (X shape, cos shape, sin shape) triple to the fixed form both kernels take: X as
[d0, d1, d2, d3, D] and, for cos and sin, element strides of the four leading axes and of the last one (0 where
the axis is broadcast), after merging leading axes that index all three tensors alike (any X of rank <= 5 fits).
"""
from __future__ import annotations

import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
LEAD = 4        # leading axes (after merging) the kernels index


class RotaryError(ValueError):
    """Shapes or types the op does not accept."""


def rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def check(x_shape, x_dtype, cos_shape, cos_dtype, sin_shape, sin_dtype) -> None:
    """Raises RotaryError naming the problem, else returns None."""
    if np.dtype(x_dtype) not in DTYPES:
        raise RotaryError(f"X must be float or float16, got {np.dtype(x_dtype)}")
    for name, dt in (("cos", cos_dtype), ("sin", sin_dtype)):
        if np.dtype(dt) != np.dtype(x_dtype):
            raise RotaryError(f"{name} must have X's type {np.dtype(x_dtype)}, got {np.dtype(dt)}")
    if len(x_shape) == 0:
        raise RotaryError("X must have at least one axis (the rotated one)")
    if x_shape[-1] % 2:
        raise RotaryError(f"X's last axis must have an even length, got {x_shape[-1]}")
    for name, s in (("cos", cos_shape), ("sin", sin_shape)):
        if len(s) > len(x_shape) or any(d not in (1, xd) for d, xd in zip(s[::-1], x_shape[::-1])):
            raise RotaryError(f"{name} of shape {list(s)} does not broadcast to X's shape {list(x_shape)}")


def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Y = X * cos + rotate_half(X) * sin in X's type, each operation rounded to it (numpy's float16 operations
    round every result, as onnxruntime's do)."""
    x, cos, sin = np.asarray(x), np.asarray(cos), np.asarray(sin)
    check(x.shape, x.dtype, cos.shape, cos.dtype, sin.shape, sin.dtype)
    with np.errstate(all="ignore"):
        return (x * cos + rotate_half(x) * sin).astype(x.dtype, copy=False)


def _strides(shape, rank):
    """Element strides of a contiguous tensor of ``shape`` left-padded to ``rank``, 0 on broadcast axes."""
    shape = (1,) * (rank - len(shape)) + tuple(shape)
    out, s = [0] * rank, 1
    for i in range(rank - 1, -1, -1):
        out[i] = s if shape[i] != 1 else 0
        s *= shape[i]
    return out


def layout(x_shape, cos_shape, sin_shape):
    """(dims [d0..d3], D, cos strides [c0..c3, c_last], sin strides [s0..s3, s_last]) for the kernels, or
    RotaryError when the leading axes cannot be merged into LEAD (broadcasting that alternates over more runs of
    axes)."""
    r = len(x_shape)
    cs, ss = _strides(cos_shape, r), _strides(sin_shape, r)
    lead = []   # merged leading axes: [dim, cos stride, sin stride]
    for i in range(r - 1):
        d = int(x_shape[i])
        if d == 1:
            continue
        if lead and lead[-1][1] == cs[i] * d and lead[-1][2] == ss[i] * d:
            lead[-1][0] *= d                      # the previous axis steps over this one in both tensors
            lead[-1][1], lead[-1][2] = cs[i], ss[i]
        else:
            lead.append([d, cs[i], ss[i]])
    if len(lead) > LEAD:
        raise RotaryError(f"cos {list(cos_shape)} / sin {list(sin_shape)} broadcast over X {list(x_shape)} in more "
                          f"than {LEAD} separate runs of axes")
    lead = [[1, 0, 0]] * (LEAD - len(lead)) + lead
    dims = [a[0] for a in lead]
    return dims, int(x_shape[-1]), [a[1] for a in lead] + [cs[-1]], [a[2] for a in lead] + [ss[-1]]

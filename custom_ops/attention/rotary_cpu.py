"""Rotary, CPU face: Y = X * cos + rotate_half(X) * sin (onnx_lowbit.rotary), one Numba pass over X.

X is taken as [d0, d1, d2, d3, D] and cos / sin through their strides (rotary.layout: 0 on broadcast axes). Each
pair (j, j + D/2) of a row is read once and both outputs written. fp32: two products and a sum in fp32 (no fused
multiply-add). fp16: values widened to fp32 (exact), each product rounded to fp16 and the sum rounded to fp16
(integer round-to-nearest-even code shared with the FPLUT kernels), so results equal the unfused fp16 ops bit for
bit. Rows run in parallel above PARALLEL_MIN elements.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from onnx_lowbit import rotary

from ..device.half_cpu import f2h, h2f
from ..device.jit import njit_variant
from ..runtime.kernels import Kernel, KernelError

PARALLEL_MIN = 1 << 16


@njit(inline="always")
def r16(v):
    """v rounded to fp16 precision (as float32)."""
    return h2f(f2h(v))


@njit(inline="always")
def _bases(r, dims, cst, sst):
    """Offsets of row r of X in cos and sin. Nothing derived from r by assignment is reassigned: inlined into a
    prange body r is the loop index, and Numba's parfor pass refuses an overwritten index (and its copies)."""
    cb = sb = 0
    step = 1
    for a in range(3, -1, -1):
        i = (r // step) % dims[a]
        step *= dims[a]
        cb += i * cst[a]
        sb += i * sst[a]
    return cb, sb


def _rot16(x, c, s, y, dims, h, cst, sst):
    rows = dims[0] * dims[1] * dims[2] * dims[3]
    cl, sl = cst[4], sst[4]
    for r in prange(rows):
        xb = r * 2 * h
        cb, sb = _bases(r, dims, cst, sst)
        for j in range(h):
            x1 = h2f(x[xb + j])
            x2 = h2f(x[xb + j + h])
            y[xb + j] = f2h(r16(x1 * h2f(c[cb + j * cl])) + r16(-x2 * h2f(s[sb + j * sl])))
            y[xb + j + h] = f2h(r16(x2 * h2f(c[cb + (j + h) * cl])) + r16(x1 * h2f(s[sb + (j + h) * sl])))


def _rot32(x, c, s, y, dims, h, cst, sst):
    rows = dims[0] * dims[1] * dims[2] * dims[3]
    cl, sl = cst[4], sst[4]
    for r in prange(rows):
        xb = r * 2 * h
        cb, sb = _bases(r, dims, cst, sst)
        for j in range(h):
            x1 = x[xb + j]
            x2 = x[xb + j + h]
            y[xb + j] = x1 * c[cb + j * cl] + (-x2) * s[sb + j * sl]
            y[xb + j + h] = x2 * c[cb + (j + h) * cl] + x1 * s[sb + (j + h) * sl]


def _compile(fn, parallel):
    return njit_variant(fn, parallel, cache=True, nogil=True, boundscheck=False)


# element type -> (serial, parallel, storage dtype)
KERNELS = {10: (_compile(_rot16, False), _compile(_rot16, True), np.uint16),
           1: (_compile(_rot32, False), _compile(_rot32, True), np.float32)}


def run(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, y: np.ndarray | None = None) -> np.ndarray:
    """The CPU kernel on numpy arrays, into ``y`` (contiguous, X's shape and type) or a new array."""
    rotary.check(x.shape, x.dtype, cos.shape, cos.dtype, sin.shape, sin.dtype)
    dims, d, cst, sst = rotary.layout(x.shape, cos.shape, sin.shape)
    serial, parallel, st = KERNELS[10 if x.dtype == np.float16 else 1]
    y = np.empty(x.shape, x.dtype) if y is None else y
    if x.size:
        flat = lambda a: np.ascontiguousarray(a).reshape(-1).view(st)  # noqa: E731
        fn = parallel if x.size >= PARALLEL_MIN else serial
        fn(flat(x), flat(cos), flat(sin), y.reshape(-1).view(st), np.asarray(dims, np.int64), d // 2,
           np.asarray(cst, np.int64), np.asarray(sst, np.int64))
    return y


class RotaryKernel(Kernel):
    def compute(self, ctx, inputs):
        x, c, s = (self.check_input(inputs, i) for i in range(3))
        xa, ca, sa = x.numpy(), c.numpy(), s.numpy()
        try:
            rotary.check(xa.shape, xa.dtype, ca.shape, ca.dtype, sa.shape, sa.dtype)
            rotary.layout(xa.shape, ca.shape, sa.shape)
        except rotary.RotaryError as e:
            raise KernelError(str(e)) from None
        run(xa, ca, sa, ctx.output_numpy(0, x.shape, xa.dtype))


KERNEL = RotaryKernel

"""RMSNorm, CPU face: H = X + skip, Y = gamma * T(float32(H) / sqrt(mean(float32(H)^2) + eps)) (onnx_lowbit.rmsnorm),
one Numba pass per row (rows in parallel above PARALLEL_MIN elements). In sessions a native entry (``_native_rows``,
runtime/plans.py "CPU kernels") runs the rows over onnxruntime's intra-op pool with no Python after a shape's first
call: one [1, 1, 576] row with its residual add, median us per session run against onnxruntime's
SkipSimplifiedLayerNormalization (benchmarks/rmsnorm_cpu.py, 2-core Intel Xeon, 2026-12-01, five runs): fp32
10.6-17.7 against 9.9-16.5 (level within this host's noise), fp16 23.7-30.1 against 16.9-17.9 (1.4-1.7x slower:
this kernel's scalar fp16 conversions); through the Python path before, ~100 us (BENCHMARKS.md).

fp16: values widened to fp32 (exact), H and the final product rounded to fp16 with the integer round-to-nearest-even
code shared with the FPLUT kernels (so H and the weight product round as the separate fp16 ops do); the mean of
squares is a sequential fp32 sum per row.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from onnx_lowbit import rmsnorm

from ..device import native
from ..device.half_cpu import f2h, h2f
from ..device.jit import njit_variant
from ..runtime.kernels import Kernel, KernelError

PARALLEL_MIN = 1 << 16


def _norm16(x, skip, g, y, hout, rows, d, has_skip, has_h, eps):
    for r in prange(rows):
        b = r * d
        acc = np.float32(0.0)
        for i in range(d):
            v = h2f(x[b + i])
            if has_skip:
                hb = f2h(v + h2f(skip[b + i]))
                v = h2f(hb)
                if has_h:
                    hout[b + i] = hb
            elif has_h:
                hout[b + i] = x[b + i]
            acc += v * v
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(d) + eps)
        for i in range(d):
            v = h2f(x[b + i])
            if has_skip:
                v = h2f(f2h(v + h2f(skip[b + i])))
            y[b + i] = f2h(h2f(g[i]) * h2f(f2h(v * inv)))


def _norm32(x, skip, g, y, hout, rows, d, has_skip, has_h, eps):
    for r in prange(rows):
        b = r * d
        acc = np.float32(0.0)
        for i in range(d):
            v = x[b + i]
            if has_skip:
                v = v + skip[b + i]
            if has_h:
                hout[b + i] = v
            acc += v * v
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(d) + eps)
        for i in range(d):
            v = x[b + i]
            if has_skip:
                v = v + skip[b + i]
            y[b + i] = g[i] * (v * inv)


def _compile(fn, parallel):
    return njit_variant(fn, parallel, cache=True, nogil=True, boundscheck=False)


KERNELS = {10: (_compile(_norm16, False), _compile(_norm16, True), np.uint16),
           1: (_compile(_norm32, False), _compile(_norm32, True), np.float32)}


def run(x, gamma, skip=None, epsilon=1e-6, y=None, h=None):
    """The CPU kernel on numpy arrays: Y into ``y`` (or a new array), H into ``h`` when given (contiguous, X's
    shape and type); returns (y, h)."""
    rmsnorm.check(x.shape, x.dtype, gamma.shape, gamma.dtype, None if skip is None else skip.shape,
                  None if skip is None else skip.dtype)
    serial, parallel, st = KERNELS[10 if x.dtype == np.float16 else 1]
    y = np.empty(x.shape, x.dtype) if y is None else y
    want_h = h is not None
    if x.size:
        d = x.shape[-1]
        flat = lambda a: np.ascontiguousarray(a).reshape(-1).view(st)  # noqa: E731
        xs = flat(x)
        fn = parallel if x.size >= PARALLEL_MIN else serial
        fn(xs, flat(skip) if skip is not None else xs, flat(gamma), y.reshape(-1).view(st),
           h.reshape(-1).view(st) if want_h else xs, x.size // d, d, skip is not None, want_h, np.float32(epsilon))
    return y, h


class RMSNormKernel(Kernel):
    native_plans = True  # the native entry (below): recorded once per shape, replayed by the shim

    def __init__(self, **kw):
        super().__init__(**kw)
        self.eps = np.float32(self.attrs["epsilon"])
        self.eps_cell = np.array([self.eps], np.float32)     # the native entry reads epsilon here

    def compute(self, ctx, inputs):
        x, g = self.check_input(inputs, 0), self.check_input(inputs, 1)
        s = inputs[2] if len(inputs) > 2 else None
        if ctx.native and self._native(ctx, x, g, s):
            return
        xa, ga = x.numpy(), g.numpy()
        sa = s.numpy() if s is not None else None
        try:
            rmsnorm.check(xa.shape, xa.dtype, ga.shape, ga.dtype, None if sa is None else sa.shape,
                          None if sa is None else sa.dtype)
        except rmsnorm.RMSNormError as e:
            raise KernelError(str(e)) from None
        y = ctx.output_numpy(0, x.shape, xa.dtype)
        h = ctx.output_numpy(1, x.shape, xa.dtype) if ctx.output_count() > 1 else None
        run(xa, ga, sa, self.eps, y, h)

    def _native(self, ctx, x, g, s):
        """The call through the native entry (rows over onnxruntime's intra-op pool); False where the shapes are
        not the op's (the Python path then names the problem)."""
        dt = np.float16 if self.in_types[0] == 10 else np.float32
        try:
            rmsnorm.check(x.shape, dt, g.shape, dt, None if s is None else s.shape, None if s is None else dt)
        except rmsnorm.RMSNormError:
            return False
        y = ctx.output(0, x.shape)
        h = ctx.output(1, x.shape) if ctx.output_count() > 1 else 0
        d = int(x.shape[-1])
        rows = x.size // d if d else 0      # no rows: a plan of no work (replayed without Python too)
        flags = int(dt == np.float16) | (2 if s is not None else 0) | (4 if h else 0)
        values = [x.ptr, s.ptr if s is not None else x.ptr, g.ptr, y, h if h else y, d, flags,
                  self.eps_cell.ctypes.data]
        return ctx.run_native(native.compile_entry(_native_rows), rows, max(1, GRAIN // max(d, 1)), values,
                              (0, 1, 2, 3, 4))


KERNEL = RMSNormKernel


# ---- native entry point (runtime/plans.py, "CPU kernels"): params = [X, skip (X when absent), gamma, Y, H (Y when
# absent), D, flags (1: fp16, 2: skip, 4: H), &epsilon], items = rows
GRAIN = 1 << 15  # elements per task of onnxruntime's thread pool
_SERIAL16, _SERIAL32 = KERNELS[10][0], KERNELS[1][0]


def _native_rows(p, begin, end):
    d, flags = np.int64(p[5]), np.int64(p[6])
    n = end * d
    lo = begin * d
    eps = native.vector(p[7], 1, np.float32)[0]
    has_skip, has_h = (flags & 2) != 0, (flags & 4) != 0
    rows = end - begin
    if flags & 1:
        _SERIAL16(native.vector(p[0], n, np.uint16)[lo:], native.vector(p[1], n, np.uint16)[lo:],
                  native.vector(p[2], d, np.uint16), native.vector(p[3], n, np.uint16)[lo:],
                  native.vector(p[4], n, np.uint16)[lo:], rows, d, has_skip, has_h, eps)
    else:
        _SERIAL32(native.vector(p[0], n, np.float32)[lo:], native.vector(p[1], n, np.float32)[lo:],
                  native.vector(p[2], d, np.float32), native.vector(p[3], n, np.float32)[lo:],
                  native.vector(p[4], n, np.float32)[lo:], rows, d, has_skip, has_h, eps)
    return 0

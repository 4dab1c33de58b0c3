"""Rotary, CUDA face: Y = X * cos + rotate_half(X) * sin (onnx_lowbit.rotary) in one launch.

One thread per pair (j, j + D/2) of a row of X [d0, d1, d2, d3, D] (rotary.layout; cos and sin read through their
strides, 0 on broadcast axes): it reads x[j], x[j + D/2] and the four cos / sin values and writes both outputs.
Grid-stride loop over the pairs, BLOCK threads per block, at most GRID_PER_SM blocks per SM. fp32: products and
the sum with round-to-nearest intrinsics (never contracted into a fused multiply-add, as separate ONNX Mul / Add
ops compute them). fp16: values widened to fp32 (exact), each product rounded to fp16 and the sum rounded to fp16,
bit for bit the unfused fp16 ops. In a LLaMA decode step this replaces twelve small kernels per layer (two Slices
or a Split, two Negs, two Concats, four Muls, two Adds) by two launches.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from onnx_lowbit import rotary

from ..device import host
from ..device.arith import add, divmod_, mul
from ..device.fp16 import r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16, ld32, st16, st32
from ..device.target import SIM
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route

BLOCK = 256
GRID_PER_SM = 8


def _make(f16):
    ld, st, rnd = (ld16, st16, r16) if f16 else (ld32, st32, same)

    @cuda.jit
    def kernel(x, c, s, y, d0, d1, d2, d3, h, c0, c1, c2, c3, cl, s0, s1, s2, s3, sl, ih, i3d, i2d, i1d):
        n = d0 * d1 * d2 * d3 * h
        p = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        step = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
        while p < n:
            r, j = divmod_(p, h, ih)
            xb = r * 2 * h
            r, i3 = divmod_(r, d3, i3d)
            r, i2 = divmod_(r, d2, i2d)
            i0, i1 = divmod_(r, d1, i1d)
            cb = i0 * c0 + i1 * c1 + i2 * c2 + i3 * c3
            sb = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3
            x1 = ld(x, xb + j)
            x2 = ld(x, xb + j + h)
            a1 = rnd(mul(x1, ld(c, cb + j * cl)))
            b1 = rnd(mul(-x2, ld(s, sb + j * sl)))
            a2 = rnd(mul(x2, ld(c, cb + (j + h) * cl)))
            b2 = rnd(mul(x1, ld(s, sb + (j + h) * sl)))
            st(y, xb + j, add(a1, b1))
            st(y, xb + j + h, add(a2, b2))
            p += step

    return kernel


# Which kernel serves which call (routing.py): one kernel per element type.
ROUTES = (
    Route("rotary16", "fp16 X, cos, sin", lambda c: c.dtype == "float16",
          "BENCHMARKS.md, Kernels: Rotary, RotaryKV, KVAttention, RMSNorm (H100 2026-11-25)"),
    Route("rotary32", "fp32 X, cos, sin", always,
          "bit-exactness with the unfused fp32 graph (tests/test_rotary_kernels.py); its speed is not measured"),
)
KERNELS = {"rotary16": _make(True), "rotary32": _make(False)}
STORAGE = {"rotary16": np.uint16, "rotary32": np.float32}
DTYPES = {10: "float16", 1: "float32"}


def _signature(name):
    a = Array(STORAGE[name])
    return [a, a, a, a] + ["int64"] * 15 + ["float64"] * 4


_launchers = {}


def launcher(name):
    """The direct-launch wrapper of ROUTES kernel ``name`` (compiled once per process); under the simulator
    launch.SimLauncher."""
    if name not in _launchers:
        _launchers[name] = (SimLauncher if SIM else Launcher)(KERNELS[name], _signature(name))
    return _launchers[name]


def grid_for(pairs, sms):
    return max(1, min(-(-pairs // BLOCK), sms * GRID_PER_SM))


def launch(elem, stream, sms, shapes, ptrs):
    """The kernel object's launch for X / cos / sin of ``shapes`` at device pointers ``ptrs`` (x, cos, sin, y): the
    routing Case (X's element type, M = its rotated pairs), the kernel ROUTES names, one launch; nothing for an
    empty X. Raises rotary.RotaryError for shapes the op does not take."""
    xs, cs, ss = shapes
    dims, d, cst, sst = rotary.layout(xs, cs, ss)
    n = int(np.prod(xs, dtype=np.int64))
    if n == 0:
        return
    name = route(ROUTES, Case(DTYPES[elem], n // 2)).kernel
    sizes = (n, int(np.prod(cs, dtype=np.int64)), int(np.prod(ss, dtype=np.int64)), n)
    arrays = [(p, (k,)) for p, k in zip(ptrs, sizes)]
    recips = [1.0 / v for v in (d // 2, dims[3], dims[2], dims[1])]
    launcher(name).launch(grid_for(n // 2, sms), BLOCK, stream, *arrays, *dims, d // 2, *cst, *sst, *recips)


class RotaryCudaKernel(Kernel):
    """Per call: validates the shapes, one launch (``launch``); ``sms`` sets the grid (tests lower it to reach the
    grid-stride loop on small tensors)."""
    native_plans = True  # one launch whose parameters depend only on the input shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        launcher(route(ROUTES, Case(DTYPES[self.elem], 0)).kernel)     # compiled at session creation
        self.sms = host.sm_count()

    def compute(self, ctx, inputs):
        x, c, s = (self.check_input(inputs, i) for i in range(3))
        dt = np.float16 if self.elem == 10 else np.float32
        try:
            rotary.check(x.shape, dt, c.shape, dt, s.shape, dt)
            rotary.layout(x.shape, c.shape, s.shape)
        except rotary.RotaryError as e:
            raise KernelError(str(e)) from None
        y = ctx.output(0, x.shape)
        launch(self.elem, ctx.stream, self.sms, (x.shape, c.shape, s.shape), (x.ptr, c.ptr, s.ptr, y))


KERNEL = RotaryCudaKernel

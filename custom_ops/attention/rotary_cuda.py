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
from numba import config, cuda, int64

from onnx_lowbit import rotary

from ..device import launch as cuda_launch
from ..device.arith import add, divmod_, mul
from ..device.fp16 import r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16, ld32, st16, st32
from ..runtime.kernels import Kernel, KernelError

SIM = bool(config.ENABLE_CUDASIM)
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


KERNELS = {10: _make(True), 1: _make(False)}
STORAGE = {10: np.uint16, 1: np.float32}


def _signature(elem):
    a = Array(STORAGE[elem])
    return [a, a, a, a] + ["int64"] * 15 + ["float64"] * 4


_launchers = {}


def launcher(elem):
    """The direct-launch wrapper of the kernel for fp16 (10) or fp32 (1) (compiled once per process); under the
    simulator launch.SimLauncher."""
    if elem not in _launchers:
        _launchers[elem] = (SimLauncher if SIM else Launcher)(KERNELS[elem], _signature(elem))
    return _launchers[elem]


def grid_for(pairs, sms):
    return max(1, min(-(-pairs // BLOCK), sms * GRID_PER_SM))


def launch(lau, stream, sms, shapes, ptrs):
    """One launch for X / cos / sin of ``shapes`` at device pointers ``ptrs`` (x, cos, sin, y); nothing for an
    empty X. Raises rotary.RotaryError for shapes the op does not take."""
    xs, cs, ss = shapes
    dims, d, cst, sst = rotary.layout(xs, cs, ss)
    n = int(np.prod(xs, dtype=np.int64))
    if n == 0:
        return
    sizes = (n, int(np.prod(cs, dtype=np.int64)), int(np.prod(ss, dtype=np.int64)), n)
    arrays = [(p, (k,)) for p, k in zip(ptrs, sizes)]
    recips = [1.0 / v for v in (d // 2, dims[3], dims[2], dims[1])]
    lau.launch(grid_for(n // 2, sms), BLOCK, stream, *arrays, *dims, d // 2, *cst, *sst, *recips)


def run_arrays(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, sms: int | None = None) -> np.ndarray:
    """The kernel on host arrays (tests): copied to the device, launched as a session launches it, copied back."""
    rotary.check(x.shape, x.dtype, cos.shape, cos.dtype, sin.shape, sin.dtype)
    elem = 10 if x.dtype == np.float16 else 1
    st = STORAGE[elem]
    flat = lambda a: np.ascontiguousarray(a).reshape(-1).view(st)  # noqa: E731
    y = np.zeros(x.size, st)
    if SIM:     # host memory is the simulator's device memory
        bufs = [flat(x), flat(cos), flat(sin), y]
        ptrs = [b.ctypes.data for b in bufs]
        launch(launcher(elem), 0, sms or 2, (x.shape, cos.shape, sin.shape), ptrs)
        return y.view(x.dtype).reshape(x.shape)
    dev = [cuda.to_device(flat(a) if a.size else np.zeros(1, st)) for a in (x, cos, sin)]
    dy = cuda.to_device(y if y.size else np.zeros(1, st))
    ptrs = [d.device_ctypes_pointer.value for d in dev + [dy]]
    launch(launcher(elem), 0, sms or cuda_launch.sm_count(cuda_launch.current_device()), (x.shape, cos.shape, sin.shape),
           ptrs)
    cuda.synchronize()
    return dy.copy_to_host()[: x.size].view(x.dtype).reshape(x.shape)


class RotaryCudaKernel(Kernel):
    native_plans = True  # one launch whose parameters depend only on the input shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        self.launcher = launcher(self.elem)
        self.sms = 2 if SIM else cuda_launch.sm_count(cuda_launch.current_device())

    def compute(self, ctx, inputs):
        x, c, s = (self.check_input(inputs, i) for i in range(3))
        dt = np.float16 if self.elem == 10 else np.float32
        try:
            rotary.check(x.shape, dt, c.shape, dt, s.shape, dt)
            rotary.layout(x.shape, c.shape, s.shape)
        except rotary.RotaryError as e:
            raise KernelError(str(e)) from None
        y = ctx.output(0, x.shape)
        launch(self.launcher, ctx.stream, self.sms, (x.shape, c.shape, s.shape), (x.ptr, c.ptr, s.ptr, y))


KERNEL = RotaryCudaKernel

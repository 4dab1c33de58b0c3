"""RMSNorm, CUDA face: H = X + skip, Y = gamma * T(float32(H) / sqrt(mean(float32(H)^2) + eps))
(onnx_lowbit.rmsnorm) in one launch.

One block per row (grid-stride over rows). Rows up to EPT * MAX_BLOCK (4096) elements stay in registers: each thread loads
its EPT elements (element k at t + k * block: coalesced, all loads in flight at once), forms H (rounded to T,
written when the node has the H output) and its fp32 sum of squares; the block sums them in a fixed order (warp
shuffles, then the warps' partials in shared memory), so results are reproducible; then Y from the registers.
Longer rows take a two-pass kernel that re-reads the row. fp16 values go through fp32 (exact) with the hardware's
round-to-nearest-even conversions. In a LLaMA decode step one launch replaces the residual Add and onnxruntime's
fused LayerNormalization kernel. Measured (H100, d = 2048, fp16): the first, two-pass-only version took 5.8 us
per call, twice onnxruntime's LayerNormalization (2.7 us): its eight dependent loads per thread were the cost.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint64

from onnx_lowbit import rmsnorm

from ..device import host
from ..device.fp16 import r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16, ld32, st16, st32
from ..device.target import SIM, device
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, options, route

BLOCK = 256             # threads of the two-pass kernel
FULL = np.uint32(0xFFFFFFFF)
U0, U5, U31 = np.uint64(0), np.uint64(5), np.uint64(31)


if SIM:
    def _inv(v):
        return np.float32(np.float32(1.0) / np.sqrt(np.float32(v)))

    def _block_sum(part, red, t, nt):
        """Simulator (no warp shuffles): every thread's partial through shared memory, summed by thread 0."""
        red[t] = part
        cuda.syncthreads()
        if t == 0:
            s = np.float32(0.0)
            for k in range(nt):
                s = np.float32(s + red[k])
            red[0] = s
        cuda.syncthreads()
        s = red[0]
        cuda.syncthreads()
        return s
else:
    import math

    @device
    def _inv(v):
        return float32(1.0) / math.sqrt(v)

    @device
    def _block_sum(part, red, t, nt):
        for off in (16, 8, 4, 2, 1):
            part += cuda.shfl_down_sync(FULL, part, off)
        if (t & U31) == U0:
            red[t >> U5] = part
        cuda.syncthreads()
        s = float32(0.0)
        for w in range((nt + U31) >> U5):
            s += red[w]
        cuda.syncthreads()
        return s


def _make(f16, ept, has_skip, has_h):
    """``ept`` > 0: the row held in registers, ``ept`` elements per thread (element k of thread t at t + k * block,
    so each load instruction is coalesced and all of a thread's loads are in flight together; rows of at most
    ept * block elements). ``ept`` = 0: any row length, two strided passes. ``has_skip`` / ``has_h``: compiled in
    (no per-element branch); indices are unsigned (no negative-index fix-up per access)."""
    ld, st, rnd = (ld16, st16, r16) if f16 else (ld32, st32, same)
    red_size = MAX_BLOCK if SIM else MAX_BLOCK // 32
    nvals = max(ept, 1)

    @device
    def load_h(x, skip, i):
        """H at flat index i: X, plus skip rounded to T."""
        v = ld(x, i)
        if has_skip:
            v = rnd(v + ld(skip, i))
        return v

    @cuda.jit
    def kernel(x, skip, g, y, hout, rows, d, eps):
        red = cuda.shared.array(red_size, float32)
        vals = cuda.local.array(nvals, float32)
        t = uint64(cuda.threadIdx.x)
        nt = uint64(cuda.blockDim.x)
        du, rows_u = uint64(d), uint64(rows)
        r = uint64(cuda.blockIdx.x)
        while r < rows_u:
            b = r * du
            acc = float32(0.0)
            if ept:
                for k in range(ept):
                    i = t + uint64(k) * nt
                    if i < du:
                        vals[k] = load_h(x, skip, b + i)
                for k in range(ept):
                    i = t + uint64(k) * nt
                    if i < du:
                        v = vals[k]
                        if has_h:
                            st(hout, b + i, v)
                        acc += v * v
            else:
                i = t
                while i < du:
                    v = load_h(x, skip, b + i)
                    if has_h:
                        st(hout, b + i, v)
                    acc += v * v
                    i += nt
            total = _block_sum(acc, red, t, nt)
            inv = _inv(total / float32(d) + eps)
            if ept:
                for k in range(ept):
                    i = t + uint64(k) * nt
                    if i < du:
                        st(y, b + i, ld(g, i) * rnd(vals[k] * inv))
            else:
                i = t
                while i < du:
                    st(y, b + i, ld(g, i) * rnd(load_h(x, skip, b + i) * inv))
                    i += nt
            r += uint64(cuda.gridDim.x)

    return kernel


EPT = 8                 # elements per thread of the register kernel
MAX_BLOCK = 512         # its largest block: rows up to EPT * MAX_BLOCK = 4096 elements; longer rows: two passes
                        # (1024 threads x 66-72 registers of the fp16 variants exceed an SM's 64K registers)
STORAGE = {10: np.uint16, 1: np.float32}
DTYPES = {10: "float16", 1: "float32"}

# Which kernel serves which call (routing.py). Case: M = rows, K = D (row length); opts: block (a two-pass block
# size forced by tests, else None). Each kernel is compiled per element type and per node (skip given, H wanted).
ROUTES = (
    Route("register", f"rows of at most EPT * MAX_BLOCK = {EPT * MAX_BLOCK} elements: the row in registers, the "
          "fewest warps that hold it", lambda c: c.k <= EPT * MAX_BLOCK and c.opt("block") is None,
          "rmsnorm_cuda's docstring: the two-pass kernel alone took 5.8 us at D = 2048 (H100), twice onnxruntime's "
          "LayerNormalization; BENCHMARKS.md, Kernels: Rotary, RotaryKV, KVAttention, RMSNorm"),
    Route("twopass", f"longer rows (or a block size forced by tests): two strided passes, {BLOCK} threads", always,
          "the only kernel for rows past 4096 elements; BENCHMARKS.md, same section (4 x 512 x 4096)"),
)
_launchers = {}


def geometry(d, block=None):
    """(ept, block) for rows of d elements: the kernel ROUTES names (``block``: a forced two-pass block size), the
    register kernel with the fewest warps that hold the row, else the two-pass kernel with ``block`` (default
    BLOCK) threads."""
    name = route(ROUTES, Case("", 0, d, opts=options(block=block))).kernel
    if name == "register":
        return EPT, max(32, -(-d // (EPT * 32)) * 32)
    return 0, block or BLOCK


def launcher(elem, ept, has_skip, has_h):
    """The direct-launch wrapper for fp16 (10) or fp32 (1), ``ept`` (EPT: the register kernel, 0: two passes) and
    the optional input / output present (compiled once per process and variant); under the simulator
    launch.SimLauncher."""
    key = (elem, ept, bool(has_skip), bool(has_h))
    if key not in _launchers:
        a = Array(STORAGE[elem])
        sig = [a, a, a, a, a, "int64", "int64", "float32"]
        _launchers[key] = (SimLauncher if SIM else Launcher)(_make(elem == 10, *key[1:]), sig)
    return _launchers[key]


def grid_for(rows, sms):
    return max(1, min(rows, sms * 16))


def launch(elem, stream, sms, shape, ptrs, has_skip, has_h, eps, block=None):
    """The kernel object's launch for X of ``shape`` at ``ptrs`` (x, skip or 0, gamma, y, h or 0): the kernel
    ROUTES names (``geometry``), one launch; nothing for an empty X. ``block``: force the two-pass kernel with that
    many threads (tests: short rows through it)."""
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return
    d = int(shape[-1])
    ept, nt = geometry(d, block)
    px, ps, pg, py, ph = ptrs
    rows = n // d
    launcher(elem, ept, has_skip, has_h).launch(
        grid_for(rows, sms), nt, stream, (px, (n,)), (ps if has_skip else px, (n,)), (pg, (d,)), (py, (n,)),
        (ph if has_h else py, (n,)), rows, d, float(eps))


class RMSNormCudaKernel(Kernel):
    """Per call: validates the shapes, one launch (``launch``). ``sms`` sets the grid, ``block`` (None) forces the
    two-pass kernel with that many threads: tests set them to reach the grid-stride loop and the two-pass kernel
    on small tensors."""
    native_plans = True  # one launch whose parameters depend only on the input shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        self.eps = float(np.float32(self.attrs["epsilon"]))
        self.sms = host.sm_count()
        self.block = None

    def compute(self, ctx, inputs):
        x, g = self.check_input(inputs, 0), self.check_input(inputs, 1)
        s = inputs[2] if len(inputs) > 2 else None
        dt = np.float16 if self.elem == 10 else np.float32
        try:
            rmsnorm.check(x.shape, dt, g.shape, dt, None if s is None else s.shape, None if s is None else dt)
        except rmsnorm.RMSNormError as e:
            raise KernelError(str(e)) from None
        y = ctx.output(0, x.shape)
        h = ctx.output(1, x.shape) if ctx.output_count() > 1 else 0
        launch(self.elem, ctx.stream, self.sms, x.shape, (x.ptr, s.ptr if s is not None else 0, g.ptr, y, h),
               s is not None, bool(h), self.eps, self.block)


KERNEL = RMSNormCudaKernel

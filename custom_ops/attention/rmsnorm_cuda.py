"""RMSNorm, CUDA face: H = X + skip, Y = gamma * T(float32(H) / sqrt(mean(float32(H)^2) + eps))
(onnx_lowbit.rmsnorm) in one launch, one block per row (grid-stride over rows). Three kernels (ROUTES):

- ``vector``: fp16 rows of a multiple of 8 elements up to VEC_MAX, buffers 16-byte aligned (genai's norms after the
  ortnorm pass, LLaMA-style decode rows): thread t holds the row's 16-byte chunk t, one vector load each of X, skip
  and gamma, one vector store each of H and Y. As a programmatic dependent launch it loads gamma (a constant),
  waits for the kernel before, and lets the next kernel start at once (``pdl.trigger`` right after the wait): the
  next product's blocks stream their first weights while the norm runs. In genai's loop (H200, 2026-12-01) that
  trigger placement gave 0.584-0.585 ms per token against 0.602 with the trigger after the block sum and 0.605
  after the stores (d = 2048 int4 config, 128-token prompt; BENCHMARKS.md, genai's loop).
- ``register``: other rows up to EPT * MAX_BLOCK (4096) elements in registers: each thread loads its EPT elements
  (element k at t + k * block: coalesced, all loads in flight at once); triggers the next kernel after its stores.
- ``twopass``: longer rows, two strided passes that re-read the row.

Each forms H (rounded to T, written when the node has the H output) and its fp32 sum of squares; the block sums
them in a fixed order (warp shuffles, then the warps' partials in shared memory), so results are reproducible.
fp16 values go through fp32 (exact) with the hardware's round-to-nearest-even conversions. History: the first,
two-pass-only version took 5.8 us per call at d = 2048 on an H100, twice onnxruntime's LayerNormalization; the
register kernel as a PDL launch was still ~1.8 us per norm slower than onnxruntime's SkipSimplifiedLayerNormalization
in genai's loop (docs/lab-log.md).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint64

from onnx_lowbit import rmsnorm

from ..device import host, pdl
from ..device.fp16 import h2f, pack_h2, r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16, ld32, make_ld4, make_st, st16, st32
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
        gv = cuda.local.array(nvals, float32)
        t = uint64(cuda.threadIdx.x)
        nt = uint64(cuda.blockDim.x)
        du, rows_u = uint64(d), uint64(rows)
        if ept:             # gamma (a constant where PDL launches this) before the wait: in flight with the row's loads
            for k in range(ept):
                i = t + uint64(k) * nt
                if i < du:
                    gv[k] = ld(g, i)
        pdl.wait()          # X, skip (what the kernel before wrote) from here on (device/pdl.py)
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
                        st(y, b + i, gv[k] * rnd(vals[k] * inv))
            else:
                i = t
                while i < du:
                    st(y, b + i, ld(g, i) * rnd(load_h(x, skip, b + i) * inv))
                    i += nt
            r += uint64(cuda.gridDim.x)
        pdl.trigger()       # the next kernel's blocks once this one's rows are written: let in earlier, its weight
        #                     loads slowed this row's (docs/lab-log.md, "onnxruntime's norms replaced by our RMSNorm")

    return kernel


VEC_MAX = 8 * 1024       # fp16 rows of the vector kernel: one 16-byte chunk (8 elements) per thread
_ld4 = make_ld4("ld.global.nc.v4.u32")   # X and skip are read-only in this launch; gamma is a constant
_st4 = make_st(4)
M16 = np.uint32(0xFFFF)
U16 = np.uint32(16)


@device
def _lo(w):
    return h2f(w & M16)


@device
def _hi(w):
    return h2f(w >> U16)


def _make_vec(has_skip, has_h):
    """fp16 rows of d % 8 == 0 elements, at most VEC_MAX: thread t holds the row's 16-byte chunk t (one vector load
    of X, of skip and of gamma, one vector store of H and of Y), so a row is one load round trip, a block sum and
    one store; gamma is loaded before pdl.wait. The sum of squares: the thread's 8 values in order, then the
    block sum of the register kernel (_block_sum), so results are reproducible."""
    red_size = 1024 if SIM else 32

    @device
    def hval(xw, sw):
        """The two fp16 values of word pair (x, skip) as H (X + skip rounded to fp16), low first."""
        if has_skip:
            return r16(_lo(xw) + _lo(sw)), r16(_hi(xw) + _hi(sw))
        return _lo(xw), _hi(xw)

    @device
    def yword(a, b, gw, inv):
        return pack_h2(_lo(gw) * r16(a * inv), _hi(gw) * r16(b * inv))

    @cuda.jit
    def kernel(x, skip, g, y, hout, rows, d, eps):
        red = cuda.shared.array(red_size, float32)
        t = uint64(cuda.threadIdx.x)
        nt = uint64(cuda.blockDim.x)
        nc = uint64(d) >> uint64(3)
        own = t < nc
        tc = t if own else uint64(0)     # idle threads read chunk 0 and store nothing
        g0, g1, g2, g3 = _ld4(g, tc)
        pdl.wait()          # X, skip (what the kernel before wrote) from here on (device/pdl.py)
        pdl.trigger()       # the next product may stream its weights now (the module docstring's measurement)
        r = uint64(cuda.blockIdx.x)
        rows_u = uint64(rows)
        while r < rows_u:
            c = r * nc + tc
            x0, x1, x2, x3 = _ld4(x, c)
            s0, s1, s2, s3 = _ld4(skip, c) if has_skip else (x0, x1, x2, x3)
            a0, b0 = hval(x0, s0)
            a1, b1 = hval(x1, s1)
            a2, b2 = hval(x2, s2)
            a3, b3 = hval(x3, s3)
            acc = float32(0.0)
            if own:
                acc = (a0 * a0 + b0 * b0 + a1 * a1 + b1 * b1) + (a2 * a2 + b2 * b2 + a3 * a3 + b3 * b3)
                if has_h:
                    _st4(hout, c * uint64(8), pack_h2(a0, b0), pack_h2(a1, b1), pack_h2(a2, b2), pack_h2(a3, b3))
            total = _block_sum(acc, red, t, nt)
            inv = _inv(total / float32(d) + eps)
            if own:
                _st4(y, c * uint64(8), yword(a0, b0, g0, inv), yword(a1, b1, g1, inv), yword(a2, b2, g2, inv),
                     yword(a3, b3, g3, inv))
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
    Route("vector", f"fp16 rows of a multiple of 8 elements, at most VEC_MAX = {VEC_MAX}, buffers 16-byte aligned: one "
          "16-byte chunk per thread (one vector load of X, skip and gamma, one vector store of H and Y)",
          lambda c: c.dtype == "float16" and c.k % 8 == 0 and 0 < c.k <= VEC_MAX and c.aligned
          and c.opt("block") is None,
          "BENCHMARKS.md, genai's loop (H200 2026-12-01, d = 2048 int4 config, genai's norms through the ortnorm "
          "pass, the trigger right after the wait): decode 0.582 / 0.628 ms per token after 128 / 1024 tokens, "
          "1.56x / 1.54x genai int4, where onnxruntime's norms gave 1.47x / 1.47x in the same run; the register "
          "kernel there was ~1.8 us per norm slower than onnxruntime's (docs/lab-log.md)"),
    Route("register", f"rows of at most EPT * MAX_BLOCK = {EPT * MAX_BLOCK} elements: the row in registers, the "
          "fewest warps that hold it", lambda c: c.k <= EPT * MAX_BLOCK and c.opt("block") is None,
          "rmsnorm_cuda's docstring: the two-pass kernel alone took 5.8 us at D = 2048 (H100), twice onnxruntime's "
          "LayerNormalization; BENCHMARKS.md, Kernels: Rotary, RotaryKV, KVAttention, RMSNorm"),
    Route("twopass", f"longer rows (or a block size forced by tests): two strided passes, {BLOCK} threads", always,
          "the only kernel for rows past 4096 elements; BENCHMARKS.md, same section (4 x 512 x 4096)"),
)
_launchers = {}


def geometry(d, block=None, f16=False, aligned=False):
    """(ept, block) for rows of d elements: the kernel ROUTES names (``block``: a forced two-pass block size;
    ``f16``, ``aligned``: the call's element type and its buffers' 16-byte alignment), the vector kernel (ept -1)
    with a thread per 8 elements, the register kernel with the fewest warps that hold the row, else the two-pass
    kernel with ``block`` (default BLOCK) threads."""
    name = route(ROUTES, Case("float16" if f16 else "float32", 0, d, aligned=aligned, opts=options(block=block))).kernel
    if name == "vector":
        return -1, max(32, -(-d // 256) * 32)
    if name == "register":
        return EPT, max(32, -(-d // (EPT * 32)) * 32)
    return 0, block or BLOCK


def launcher(elem, ept, has_skip, has_h):
    """The direct-launch wrapper for fp16 (10) or fp32 (1), ``ept`` (-1: the vector kernel, fp16 only; EPT: the
    register kernel; 0: two passes) and
    the optional input / output present (compiled once per process and variant); under the simulator
    launch.SimLauncher."""
    key = (elem, ept, bool(has_skip), bool(has_h))
    if key not in _launchers:
        a = Array(STORAGE[elem])
        sig = [a, a, a, a, a, "int64", "int64", "float32"]
        fn = _make_vec(*key[2:]) if ept == -1 else _make(elem == 10, *key[1:])
        # a programmatic dependent launch: reads gamma before pdl.wait, so launched as one only where gamma is a
        # constant (launch's ``pdl``)
        _launchers[key] = SimLauncher(fn, sig) if SIM else Launcher(fn, sig, pdl=True)
    return _launchers[key]


def grid_for(rows, sms):
    return max(1, min(rows, sms * 16))


def launch(elem, stream, sms, shape, ptrs, has_skip, has_h, eps, block=None, pdl=False):
    """The kernel object's launch for X of ``shape`` at ``ptrs`` (x, skip or 0, gamma, y, h or 0): the kernel
    ROUTES names (``geometry``), one launch; nothing for an empty X. ``block``: force the two-pass kernel with that
    many threads (tests: short rows through it). ``pdl``: gamma is a constant, so the launch may be a programmatic
    dependent one (device/pdl.py)."""
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return
    d = int(shape[-1])
    px, ps, pg, py, ph = ptrs
    ept, nt = geometry(d, block, elem == 10, all(p % 16 == 0 for p in ptrs if p))
    rows = n // d
    launcher(elem, ept, has_skip, has_h).launch(
        grid_for(rows, sms), nt, stream, (px, (n,)), (ps if has_skip else px, (n,)), (pg, (d,)), (py, (n,)),
        (ph if has_h else py, (n,)), rows, d, float(eps), pdl=pdl)


class RMSNormCudaKernel(Kernel):
    """Per call: validates the shapes, one launch (``launch``). ``sms`` sets the grid, ``block`` (None) forces the
    two-pass kernel with that many threads: tests set them to reach the grid-stride loop and the two-pass kernel
    on small tensors."""
    native_plans = True  # one launch whose parameters depend on the input shapes and the buffers' alignment (the
    #                      plans' key holds the inputs'; the outputs are onnxruntime's allocations, always aligned)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        self.eps = float(np.float32(self.attrs["epsilon"]))
        self.sms = host.sm_count()
        self.block = None
        self.pdl = 1 in self.constants      # gamma read before pdl.wait

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
               s is not None, bool(h), self.eps, self.block, self.pdl)


KERNEL = RMSNormCudaKernel

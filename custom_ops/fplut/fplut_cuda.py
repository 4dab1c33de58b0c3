"""FPLUT, CUDA face: Numba CUDA kernels evaluating the expanded fp16->fp16 map.

The op is a map of 16-bit patterns: fp16 -> fp16 (fp32 inputs are rounded to fp16 first, the result widened
back), and for bf16 inputs the composed map bf16 -> bf16. Each block stages that 65,536-entry map (128 KiB) in
shared memory once, then walks the tensor in 8-byte words (4 fp16/bf16 or 2 fp32 values per load), UNROLL
independent words in flight per thread; one shared-memory gather per element. Grid: one block per SM (fewer for
small tensors). Bit-exact with onnx_lowbit.fplut by construction; fp32<->fp16 conversions use the hardware's
round-to-nearest-even (libdevice), or the identical integer code under the CUDA simulator.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, int32, uint16, uint32, uint64
from numba.cuda import libdevice

from onnx_lowbit import fplut, halfbits

from ..device import launch as cuda_launch
from ..device.launch import Array, Launcher, SimLauncher
from ..device.target import SIM
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route

BLOCK = 32 if SIM else 1024          # the simulator runs a Python thread per CUDA thread: fewer there
TABLE_WORDS = 16384                  # the 65,536-entry map as uint64 words (four 16-bit entries each)
SHARED_BYTES = TABLE_WORDS * 8
STAGE_ROUNDS = TABLE_WORDS // BLOCK  # table words each thread stages (loads issued back to back)
UNROLL = 4                           # independent 8-byte words in flight per thread

U0, U32 = np.uint64(0), np.uint64(32)
M32 = np.uint64(0xFFFFFFFF)

if SIM:
    # The simulator has no libdevice conversions: use the integer RNE code (exhaustively tested against numpy).
    _f32_to_f16 = cuda.jit(device=True, inline=True)(halfbits.f32bits_to_f16bits)
    _f16_to_f32 = cuda.jit(device=True, inline=True)(halfbits.f16bits_to_f32bits)
else:
    @cuda.jit(device=True, inline=True)
    def _f32_to_f16(u):
        return uint64(libdevice.float2half_rn(libdevice.int_as_float(int32(u))) & 0xFFFF)

    @cuda.jit(device=True, inline=True)
    def _f16_to_f32(h):
        r = uint32(libdevice.float_as_int(libdevice.half2float(uint16(h))))
        if (r & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # keep the NaN's payload as the reference does
            r = ((uint32(h) & np.uint32(0x8000)) << np.uint32(16)) | np.uint32(0x7FC00000) | (
                (uint32(h) & np.uint32(0x3FF)) << np.uint32(13))
        return uint64(r)


@cuda.jit(device=True, inline=True)
def _look32(sm32, h):
    """Lookup on the map staged as uint32 words (two entries each), 32-bit index math."""
    w = sm32[h >> np.uint32(1)]
    return (w >> ((h & np.uint32(1)) << np.uint32(4))) & np.uint32(0xFFFF)


@cuda.jit(device=True, inline=True)
def _pair16(sm32, v):
    return _look32(sm32, v & np.uint32(0xFFFF)) | (_look32(sm32, v >> np.uint32(16)) << np.uint32(16))


@cuda.jit(device=True, inline=True)
def _word16(sm, w):
    """4 16-bit lanes of a word through the map (fp16 map for fp16, bf16 map for bf16), 32-bit arithmetic and
    32-bit shared-memory accesses."""
    lo = _pair16(sm, uint32(w & M32))
    hi = _pair16(sm, uint32(w >> U32))
    return uint64(lo) | (uint64(hi) << U32)


@cuda.jit(device=True, inline=True)
def _one16(sm, h):
    return uint64(_look32(sm, uint32(h)))



@cuda.jit(device=True, inline=True)
def _one32(sm32, u):
    return _f16_to_f32(_look32(sm32, uint32(_f32_to_f16(u))))


@cuda.jit(device=True, inline=True)
def _word32(sm32, w):
    """2 fp32 lanes of a word."""
    return _one32(sm32, w & M32) | (_one32(sm32, w >> U32) << U32)


def _make(word, one, per_word):
    """Kernel over ``n`` elements: xw/ow are the tensors as 8-byte words, xe/oe as elements (for the tail).

    Software-pipelined: the next ``unroll`` words of a thread are loaded before the current ones are looked up
    and stored, and the first batch is loaded before the table is staged, so loads stay in flight throughout."""
    per = np.uint64(per_word)
    unroll = UNROLL
    unroll_u = np.uint64(unroll)

    @cuda.jit
    def kernel(xw, ow, xe, oe, table, n):
        sm64 = cuda.shared.array(0, dtype=uint64)
        t = uint64(cuda.threadIdx.x)
        nt = uint64(cuda.blockDim.x)
        stride = uint64(cuda.gridDim.x) * nt
        i = uint64(cuda.blockIdx.x) * nt + t
        nw = uint64(n) // per
        cur = cuda.local.array(unroll, dtype=uint64)
        nxt = cuda.local.array(unroll, dtype=uint64)
        for u in range(unroll):
            k = i + uint64(u) * stride
            cur[u] = xw[k] if k < nw else U0
        for r in range(STAGE_ROUNDS):  # constant trip count: unrolled, all loads in flight together
            k = t + uint64(r) * nt
            if k < TABLE_WORDS:
                sm64[k] = table[k]
        k = uint64(STAGE_ROUNDS) * nt + t
        while k < TABLE_WORDS:  # only when the block is smaller than BLOCK
            sm64[k] = table[k]
            k += nt
        cuda.syncthreads()
        sm = cuda.shared.array(0, dtype=uint32)   # the map as uint32 words from here on: 32-bit lookups
        while i < nw:
            nexti = i + unroll_u * stride
            for u in range(unroll):
                k = nexti + uint64(u) * stride
                nxt[u] = xw[k] if k < nw else U0
            for u in range(unroll):
                k = i + uint64(u) * stride
                if k < nw:
                    ow[k] = word(sm, cur[u])
            for u in range(unroll):
                cur[u] = nxt[u]
            i = nexti
        j = nw * per + uint64(cuda.blockIdx.x) * nt + t
        if j < uint64(n):
            oe[j] = one(sm, uint64(xe[j]))

    return kernel


# Which kernel serves which call (routing.py): one kernel per width of X's values. Both stage the map as uint32
# words and look it up with 32-bit arithmetic, UNROLL = 4 words in flight per thread; the variants measured
# against them (64-bit shared words, unroll 2 / 8) are gone (docs/lab-log.md, "Removed kernel variants").
ROUTES = (
    Route("fplut16", "fp16 or bf16 X (bf16 through the composed bf16 map): 4 values per 8-byte word",
          lambda c: c.dtype in ("float16", "bfloat16"),
          "BENCHMARKS.md, Kernels: FPLUT (H200 2026-11-28); 64-bit shared words and unroll 2 / 8 against it: "
          "docs/lab-log.md, FPLUT (issue 2)"),
    Route("fplut32", "fp32 X: 2 values per word, each rounded to fp16, mapped and widened back", always,
          "BENCHMARKS.md, Kernels: FPLUT (H200 2026-11-28)"),
)
KERNELS = {"fplut16": (_make(_word16, _one16, 4), np.uint16, 4),   # kernel, element storage, elements per word
           "fplut32": (_make(_word32, _one32, 2), np.uint32, 2)}
DTYPES = {10: "float16", 16: "bfloat16", 1: "float32"}          # X's ONNX element type -> Case.dtype


def expanded(cut_points, values, elem):
    """The 65,536-entry map the kernel stages: fp16->fp16 for fp16/fp32 inputs, bf16->bf16 for bf16."""
    if elem == 16:
        return fplut.apply(np.arange(65536, dtype=np.uint32).astype(np.uint16), cut_points, values, bf16=True)
    return fplut.expand_table(cut_points, values)


def grid_for(n, per_word, sms, block=BLOCK):
    """One block per SM, fewer when each would get less than one unrolled pass of words."""
    words = max(n // per_word, 1)
    return max(1, min(sms, math.ceil(words / (block * UNROLL))))


def case(elem, n):
    """The routing Case of a call: X's element type and its element count (M)."""
    return Case(DTYPES[elem], n)


_launchers = {}


def launcher(name):
    """The direct-launch wrapper of ROUTES kernel ``name`` (compiled once per process); under the simulator
    launch.SimLauncher."""
    if name not in _launchers:
        kernel, edt, _ = KERNELS[name]
        sig = [Array(np.uint64), Array(np.uint64), Array(edt), Array(edt), Array(np.uint64), "int64"]
        _launchers[name] = SimLauncher(kernel, sig) if SIM else Launcher(kernel, sig, dynamic_shared=SHARED_BYTES)
    return _launchers[name]


class FPLUTCudaKernel(Kernel):
    """Per call: one launch of the kernel ROUTES names for X's element type, on the node's map (uploaded once)."""
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        try:
            table = expanded(self.attrs["cut_points"], self.attrs["table"], self.elem)
        except fplut.TableError as e:
            raise KernelError(f"bad attribute: {e}") from None
        self.table = cuda.to_device(table.view(np.uint64))  # once, at session creation
        self.table_ptr = cuda_launch.device_ptr(self.table)
        launcher(route(ROUTES, case(self.elem, 0)).kernel)              # compiled at session creation
        self.sms = 2 if SIM else cuda_launch.sm_count(cuda_launch.current_device())

    def compute(self, ctx, inputs):
        x = self.check_input(inputs, 0)
        n = x.size
        out = ctx.output(0, x.shape)
        if n == 0:
            return
        if (x.ptr | out) & 7:
            raise KernelError("input 0 'X' and the output must be 8-byte aligned device buffers")
        name = route(ROUTES, case(self.elem, n)).kernel
        per = KERNELS[name][2]
        nw = n // per
        grid = grid_for(n, per, self.sms)
        launcher(name).launch(grid, BLOCK, ctx.stream, (x.ptr, (max(nw, 1),)), (out, (max(nw, 1),)), (x.ptr, (n,)),
                              (out, (n,)), (self.table_ptr, (TABLE_WORDS,)), n, shmem=SHARED_BYTES)


KERNEL = FPLUTCudaKernel

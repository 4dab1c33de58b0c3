"""FPLUT, CPU face: Numba kernels evaluating the expanded fp16->fp16 map (onnx_lowbit.fplut.expand_table).

fp16 inputs index the map directly; fp32 and bf16 inputs are rounded to fp16 first (RNE) and the fp16 result is
widened / rounded back to the input dtype. Bit-exact with the reference by construction.

The work goes in chunks of CHUNK elements, three passes per chunk so that two of them vectorise:
  1. fp32 (or bf16 widened to fp32) -> fp16 bit pattern of the map's index, branch-free (device/half_cpu's
     ``f16_index``: the float-arithmetic RNE rounding of Maratyszcza's FP16 library, exact for every input; LLVM
     vectorises it);
  2. the gather table[index] (scalar loads: LLVM does not emit gathers for AMD targets, and they are no faster);
  3. fp16 result -> fp32 bits (half_cpu's ``f32_bits``: shifts and one multiply by 2**112, vectorised) or bf16.
The per-element branchy integer conversion of device/half_cpu (kept for other kernels) cost 4x more.
From PARALLEL_MIN elements the tensor is split into one contiguous part per Numba thread (``split``;
``numba.get_num_threads()``: NUMBA_NUM_THREADS / numba.set_num_threads).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from onnx_lowbit import fplut

from ..device import native, threads
from ..device.half_cpu import f16_index, f32_bits, f32_to_bf16
from ..runtime.kernels import Kernel, KernelError

PARALLEL_MIN = 1 << 20  # from here the tensor is split over threads (a hand-off costs ~50 us)
CHUNK = 512             # elements per three-pass chunk (index and result buffers stay in L1)


@njit(inline="always")
def _chunk32(xb, xf, table, ob, i0, n, idx, res):
    for k in range(n):
        idx[k] = f16_index(xb[i0 + k], xf[i0 + k])
    for k in range(n):
        res[k] = table[idx[k]]
    for k in range(n):
        ob[i0 + k] = f32_bits(res[k])


@njit(inline="always")
def _chunkbf16(xb, table, ob, i0, n, idx, res):
    for k in range(n):
        w = np.uint32(np.uint32(xb[i0 + k]) << np.uint32(16))
        idx[k] = f16_index(w, np.uint32(w).view(np.float32))
    for k in range(n):
        res[k] = table[idx[k]]
    for k in range(n):
        ob[i0 + k] = f32_to_bf16(f32_bits(res[k]))


@njit(inline="always")
def _range16(x, table, out, i0, i1):
    for i in range(i0, i1):
        out[i] = table[x[i]]


@njit(inline="always")
def _range32(x, table, out, i0, i1):
    """Whole chunks with a constant trip count, then the rest (a trip count of min(...) kept LLVM from
    vectorising the passes: 2.3x slower)."""
    idx = np.empty(CHUNK, np.uint32)
    res = np.empty(CHUNK, np.uint16)
    xf = x.view(np.float32)
    full = (i1 - i0) // CHUNK
    for c in range(full):
        _chunk32(x, xf, table, out, i0 + c * CHUNK, CHUNK, idx, res)
    _chunk32(x, xf, table, out, i0 + full * CHUNK, i1 - i0 - full * CHUNK, idx, res)


@njit(inline="always")
def _rangebf16(x, table, out, i0, i1):
    idx = np.empty(CHUNK, np.uint32)
    res = np.empty(CHUNK, np.uint16)
    full = (i1 - i0) // CHUNK
    for c in range(full):
        _chunkbf16(x, table, out, i0 + c * CHUNK, CHUNK, idx, res)
    _chunkbf16(x, table, out, i0 + full * CHUNK, i1 - i0 - full * CHUNK, idx, res)


def _lut16(x, table, out):
    """out[i] = table[x[i]]: x, out uint16 bits (fp16), table the 65,536-entry map."""
    _range16(x, table, out, 0, x.size)


def _lut32(x, table, out):
    """x, out uint32 bits of float32; table the fp16 map."""
    _range32(x, table, out, 0, x.size)


def _lutbf16(x, table, out):
    """x, out uint16 bits of bfloat16; table the fp16 map."""
    _rangebf16(x, table, out, 0, x.size)


def _compile(fn):
    return njit(cache=True, nogil=True, boundscheck=False)(fn)


def split(kernel):
    """``kernel`` (x, table, out) over contiguous ranges claimed by the Numba thread count's threads
    (device/threads.py: serial calls on a small pool of Python threads; Numba's prange ran this body 2.5-3x slower
    per element)."""
    def run(x, table, out):
        threads.run_ranges(kernel, lambda lo, hi: (x[lo:hi], table, out[lo:hi]), threads.split(x.size, CHUNK))
    return run


_SERIAL = {np.dtype(np.float16): _compile(_lut16), np.dtype(np.float32): _compile(_lut32), "bf16": _compile(_lutbf16)}
# dtype of the input bits -> (serial kernel, parallel kernel, storage); both take (x bits, fp16 map, out bits)
KERNELS = {
    np.dtype(np.float16): (_SERIAL[np.dtype(np.float16)], split(_SERIAL[np.dtype(np.float16)]), np.uint16),
    np.dtype(np.float32): (_SERIAL[np.dtype(np.float32)], split(_SERIAL[np.dtype(np.float32)]), np.uint32),
    "bf16": (_SERIAL["bf16"], split(_SERIAL["bf16"]), np.uint16),
}


class FPLUTKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        cuts, values = self.attrs["cut_points"], self.attrs["table"]
        try:
            self.table = fplut.expand_table(cuts, values)
        except fplut.TableError as e:
            raise KernelError(f"bad attribute: {e}") from None
        self.bf16 = self.in_types[0] == 16
        self.bits = np.uint16 if self.in_types[0] in (10, 16) else np.uint32

    native_plans = True  # the native entries (below): recorded once per shape, replayed by the shim

    def compute(self, ctx, inputs):
        x = self.check_input(inputs, 0)
        if ctx.native:
            entry = native.compile_entry(NATIVE[self.in_types[0]])
            if ctx.run_native(entry, x.size, GRAIN, [x.ptr, ctx.output(0, x.shape), self.table.ctypes.data], (0, 1)):
                return
        xa = x.numpy().reshape(-1)
        out = ctx.output_numpy(0, x.shape, xa.dtype).reshape(-1)
        if xa.size:
            serial, parallel, bits = KERNELS["bf16" if self.bf16 else xa.dtype]
            (parallel if xa.size >= PARALLEL_MIN else serial)(xa.view(bits), self.table, out.view(bits))


KERNEL = FPLUTKernel


# ---- native entry points (runtime/plans.py, "CPU kernels"): params = [X, Y, map], items = elements
GRAIN = 1 << 15  # elements per task of onnxruntime's thread pool


def _native16(p, begin, end):
    x, y = native.vector(p[0], end, np.uint16), native.vector(p[1], end, np.uint16)
    _SERIAL16(x[begin:end], native.vector(p[2], 65536, np.uint16), y[begin:end])
    return 0


def _native32(p, begin, end):
    x, y = native.vector(p[0], end, np.uint32), native.vector(p[1], end, np.uint32)
    _SERIAL32(x[begin:end], native.vector(p[2], 65536, np.uint16), y[begin:end])
    return 0


def _nativebf16(p, begin, end):
    x, y = native.vector(p[0], end, np.uint16), native.vector(p[1], end, np.uint16)
    _SERIALBF16(x[begin:end], native.vector(p[2], 65536, np.uint16), y[begin:end])
    return 0


_SERIAL16, _SERIAL32, _SERIALBF16 = (KERNELS[k][0] for k in (np.dtype(np.float16), np.dtype(np.float32), "bf16"))
NATIVE = {10: _native16, 1: _native32, 16: _nativebf16}  # by ONNX element type

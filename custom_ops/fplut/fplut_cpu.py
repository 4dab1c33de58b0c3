"""FPLUT, CPU face: Numba kernels evaluating the expanded fp16->fp16 map (onnx_lowbit.fplut.expand_table).

fp16 inputs index the map directly; fp32 and bf16 inputs are rounded to fp16 first (RNE, integer bit code
shared with the CUDA face), and the fp16 result is widened / rounded back to the input dtype.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from onnx_lowbit import fplut

from ..device.half_cpu import f16_to_f32, f32_to_bf16, f32_to_f16
from ..device import native
from ..runtime.kernels import Kernel, KernelError

PARALLEL_MIN = 1 << 17  # below this many elements a single thread is faster than waking the pool


def _lut16(x, table, out):
    for i in prange(x.size):
        out[i] = table[x[i]]


def _lut32(x, table, out):
    for i in prange(x.size):
        out[i] = f16_to_f32(table[f32_to_f16(x[i])])


def _lutbf16(x, table, out):
    for i in prange(x.size):
        h = f32_to_f16(np.uint32(x[i]) << 16)
        out[i] = f32_to_bf16(f16_to_f32(table[h]))


def _compile(fn, parallel):
    return njit(parallel=parallel, cache=True, nogil=True, boundscheck=False)(fn)


# dtype of the input bits -> (serial kernel, parallel kernel)
KERNELS = {
    np.dtype(np.float16): (_compile(_lut16, False), _compile(_lut16, True), np.uint16),
    np.dtype(np.float32): (_compile(_lut32, False), _compile(_lut32, True), np.uint32),
    "bf16": (_compile(_lutbf16, False), _compile(_lutbf16, True), np.uint16),
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

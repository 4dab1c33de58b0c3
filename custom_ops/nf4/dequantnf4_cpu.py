"""DequantNF4, CPU face: W [K, N] (or W^T [N, K] with transposed=1) in absmax's dtype. On AVX-512 CPUs W^T is
decoded flat by the vector permute of nf4decode_cpu (then transposed for [K, N]); elsewhere the parallel table
lookups below."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device import native
from ..device.jit import variant
from ..runtime.kernels import Kernel
from . import common as nf4_common
from .matmulnf4_cpu import dequant_t
from .nf4decode_cpu import FAST, decode_blocks


@njit(parallel=True, cache=True, nogil=True)
def dequant_rows(q, absmax, code, total, bs, out):
    """out[i] = element i of W^T (flat, float32)."""
    for i in prange(total):
        byte = np.int64(q[i >> 1])
        nib = (byte >> 4) if (i & 1) == 0 else (byte & 15)
        out[i] = code[nib] * absmax[i // bs]


@njit(cache=True, nogil=True, boundscheck=False)
def decode_flat(q, absmax, code, total, bs, out):
    """out[i] = element i of W^T (flat, float32): whole blocks by the vector permute (nf4decode_cpu, AVX-512),
    the last partial block by table lookups."""
    full = total // bs
    if full:
        decode_blocks(q[:full * bs // 2], code, absmax[:full], out[:full * bs], bs // 2, full)
    for i in range(full * bs, total):
        byte = np.int64(q[i >> 1])
        out[i] = code[(byte >> 4) if (i & 1) == 0 else (byte & 15)] * absmax[full]


def dequantize(q, absmax, code, k, n, bs, transposed=False):
    """Host-array entry: float32 result in absmax's dtype."""
    am = absmax.reshape(-1).astype(np.float32)
    if FAST:                        # W^T decoded flat by the vector permute; [K, N] is its transpose
        wt = np.empty(k * n, np.float32)
        decode_flat(np.ascontiguousarray(q).reshape(-1), am, code, k * n, bs, wt)
        wt = wt.reshape(n, k)
        return (wt if transposed else wt.T).astype(absmax.dtype)
    if transposed:
        w = np.empty(k * n, np.float32)
        dequant_rows(q.reshape(-1), am, code, k * n, bs, w)
        w = w.reshape(n, k)
    else:
        w = np.empty((k, n), np.float32)
        dequant_t(q.reshape(-1), am, code, k, n, bs, w)
    return w.astype(absmax.dtype)


class DequantNF4Kernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, self.code = nf4_common.parse_attrs(self.attrs)
        self.transposed = nf4_common.parse_transposed(self.attrs)

    native_plans = True  # the native entry (below)

    def compute(self, ctx, inputs):
        q, absmax = inputs[0], inputs[1]
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs, 0, 1)
        if ctx.native:
            k, n, bs = self.k, self.n, self.bs.size
            w = ctx.output(0, (n, k) if self.transposed else (k, n))
            unit = 1 if self.transposed else bs // math.gcd(k, bs)     # items: blocks, or columns starting a block
            items = -(-k * n // bs) if self.transposed else -(-n // unit)
            per_item = bs if self.transposed else unit * k
            values = [q.ptr, absmax.ptr, w, self.code.ctypes.data, k, n, bs, int(absmax.elem_type == 10),
                      int(self.transposed), unit]
            if ctx.run_native(native.compile_entry(_native_dequant), items, max(1, TASK_ELEMENTS // per_item),
                              values, (0, 1, 2)):
                return
        w = dequantize(q.numpy(), absmax.numpy(), self.code, self.k, self.n, self.bs.size, self.transposed)
        out = ctx.output_numpy(0, w.shape, w.dtype)
        out[...] = w


KERNEL = DequantNF4Kernel


# ---- native entry (runtime/plans.py, "CPU kernels"): items are absmax blocks (transposed) or columns in units that
# start a block (W [K, N]); on AVX-512 CPUs decode_flat (the vector permute) on a task's range, as dequantize,
# elsewhere the table-lookup kernels' bodies compiled once more single-threaded.
# params: Q, absmax, W, code, K, N, block size, absmax / W are fp16, transposed, columns per item
TASK_ELEMENTS = 1 << 16
rows_serial = njit(cache=True, nogil=True)(variant(dequant_rows.py_func, "serial"))   # own caches: device/jit
cols_serial = njit(cache=True, nogil=True)(variant(dequant_t.py_func, "serial"))


def _native_dequant(p, begin, end):
    k, n, bs, f16, unit = native.arg(p, 4), native.arg(p, 5), native.arg(p, 6), native.arg(p, 7), native.arg(p, 9)
    total = k * n
    q = native.vector(p[0], (total + 1) // 2, np.uint8)
    code = native.vector(p[3], 16, np.float32)
    nb = (total + bs - 1) // bs
    if native.arg(p, 8):                 # W^T, flat: blocks [begin, end)
        e0, e1 = begin * bs, min(end * bs, total)
        if e1 <= e0:
            return 0
        am = native.slice_f32(p[1], begin, min(end, nb) - begin, f16)
        res = np.empty((1, e1 - e0), np.float32)
        if FAST:                         # as dequantize: the vector permute (e0 starts a block: bs is even)
            decode_flat(q[e0 >> 1:], am, code, e1 - e0, bs, res[0])
        else:
            rows_serial(q[e0 >> 1:], am, code, e1 - e0, bs, res[0])
        native.store_cols(res, p[2], total, e0, f16)
        return 0
    n0, n1 = begin * unit, min(end * unit, n)
    if n1 <= n0:
        return 0
    b0 = (n0 * k) // bs
    am = native.slice_f32(p[1], b0, (n1 * k + bs - 1) // bs - b0, f16)
    if FAST:                             # as dequantize: rows n0..n1 of W^T decoded flat, stored transposed
        wt = np.empty((n1 - n0) * k, np.float32)
        decode_flat(q[(n0 * k) >> 1:], am, code, (n1 - n0) * k, bs, wt)
        native.store_cols(wt.reshape((n1 - n0, k)).T, p[2], n, n0, f16)
        return 0
    res = np.empty((k, n1 - n0), np.float32)
    cols_serial(q[(n0 * k) >> 1:], am, code, k, n1 - n0, bs, res)
    native.store_cols(res, p[2], n, n0, f16)
    return 0

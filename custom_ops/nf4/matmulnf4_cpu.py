"""MatMulNF4, CPU face: Y = A x W (+ bias), W dequantised on the fly from bitsandbytes NF4/FP4 blocks.

M <= 16 (decode): one pass over the packed weight per output column, parallel over N, per-block partial sums
scaled by the block's absmax (fp32 accumulation), both nibbles of a byte from one load. Larger M: dequantise W^T
to fp32 once per call (serially: Numba's worker threads next to OpenBLAS's spinning ones made a 256 x 512 product
at M = 17 take 8 ms instead of 0.45 ms on 2 cores) and use BLAS."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device import native
from ..runtime import plans
from ..runtime.kernels import Kernel
from . import common as nf4_common

SMALL_M = 16


@njit(parallel=True, cache=True, nogil=True)
def gemv(a, q, absmax, code, k_dim, n_dim, bs, out):
    """out[m, n] = sum_k a[m, k] * code[nib(n*K+k)] * absmax[(n*K+k) // bs]; a float32 [M, K]."""
    m_dim = a.shape[0]
    for n in prange(n_dim):
        base = n * k_dim
        for m in range(m_dim):
            out[m, n] = 0.0
        k = 0
        while k < k_dim:
            b = (base + k) // bs
            kend = min(k_dim, (b + 1) * bs - base)
            s = absmax[b]
            for m in range(m_dim):
                part = np.float32(0.0)
                kk = k
                if (base + kk) & 1:        # the block starts on a byte's low nibble (odd K)
                    part += code[np.int64(q[(base + kk) >> 1]) & 15] * a[m, kk]
                    kk += 1
                while kk + 1 < kend:       # whole bytes: both nibbles from one load, no parity test
                    byte = np.int64(q[(base + kk) >> 1])
                    part += code[byte >> 4] * a[m, kk] + code[byte & 15] * a[m, kk + 1]
                    kk += 2
                if kk < kend:              # a last high nibble
                    part += code[np.int64(q[(base + kk) >> 1]) >> 4] * a[m, kk]
                out[m, n] += part * s
            k = kend


@njit(parallel=True, cache=True, nogil=True)
def dequant_t(q, absmax, code, k_dim, n_dim, bs, out):
    """out[k, n] = W[k, n] (float32 [K, N]) from the W^T-ordered blocks."""
    for n in prange(n_dim):
        base = n * k_dim
        for k in range(k_dim):
            i = base + k
            byte = np.int64(q[i >> 1])
            nib = (byte >> 4) if (i & 1) == 0 else (byte & 15)
            out[k, n] = code[nib] * absmax[i // bs]


@njit(cache=True, nogil=True)
def dequant_rows(q, absmax, code, n_dim, bs, out):
    """out (float32 [N, K], flat) = W^T, element i from byte i >> 1 and block i // bs: contiguous writes, so that
    the BLAS product reads it transposed instead of a strided [K, N] fill."""
    total = out.size
    nb = (total + bs - 1) // bs
    for b in range(nb):
        s = absmax[b]
        i = b * bs
        end = min(total, i + bs)
        while i < end:
            byte = np.int64(q[i >> 1])
            out[i] = code[(byte >> 4) if (i & 1) == 0 else (byte & 15)] * s
            i += 1


def product(a2, q, absmax, code, k, n, bs):
    """a2 float32 [M, K] @ W -> float32 [M, N]: the Numba GEMV for M <= SMALL_M, else W dequantised to fp32 and
    numpy's BLAS (also used by FusedFFNNF4's CPU face)."""
    m = a2.shape[0]
    if m <= SMALL_M:
        out = np.empty((m, n), np.float32)
        if m:
            gemv(a2, q.reshape(-1), absmax.reshape(-1), code, k, n, bs, out)
        return out
    wt = np.empty(n * k, np.float32)
    dequant_rows(q.reshape(-1), absmax.reshape(-1), code, n, bs, wt)
    return a2 @ wt.reshape(n, k).T


def matmul(a, q, absmax, code, k, n, bs, bias=None):
    """Host-array entry (also used by tests): a [..., K] float32/float16 -> [..., N] of a's dtype."""
    lead = a.shape[:-1]
    a2 = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, k)
    out = product(a2, q, absmax, code, k, n, bs)
    if bias is not None:
        out += bias.astype(np.float32)
    return out.astype(a.dtype).reshape(*lead, n)


class MatMulNF4Kernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, self.code = nf4_common.parse_attrs(self.attrs)

    native_plans = True  # M <= SMALL_M: the native entry (below); larger M: the Python path (BLAS) every call

    def compute(self, ctx, inputs):
        a, q, absmax = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs)
        m = nf4_common.check_a(a, self.k, bias, self.n)
        if ctx.native and m <= SMALL_M:
            y = ctx.output(0, a.shape[:-1] + (self.n,))
            unit = self.bs.size // math.gcd(self.k, self.bs.size)   # columns whose weights start a block
            values = [a.ptr, q.ptr, absmax.ptr, bias.ptr if bias is not None else 0, y, self.code.ctypes.data, m,
                      self.k, self.n, self.bs.size, int(a.elem_type == 10), int(bias is not None), unit]
            grain = max(1, -(-max(1, TASK_MACS // max(1, m * self.k)) // unit))
            if ctx.run_native(native.compile_entry(_native_matmul), -(-self.n // unit), grain, values, (0, 1, 2, 3, 4)):
                return
        elif ctx.native:
            plans.not_replayable()
        y = matmul(a.numpy(), q.numpy(), absmax.numpy(), self.code, self.k, self.n, self.bs.size,
                   None if bias is None else bias.numpy())
        out = ctx.output_numpy(0, a.shape[:-1] + (self.n,), y.dtype)
        out[...] = y


KERNEL = MatMulNF4Kernel


# ---- native entry (runtime/plans.py, "CPU kernels"): M <= SMALL_M, the columns split into tasks of whole blocks.
# params: A, Q, absmax, bias (0: none), Y, code, M, K, N, block size, A is fp16, has bias, columns per item
TASK_MACS = 1 << 16                                       # multiply-adds per task, at least
gemv_serial = njit(cache=True, nogil=True)(gemv.py_func)  # gemv's body, one thread (a task's columns)


def _native_matmul(p, begin, end):
    m, k, n, bs = native.arg(p, 6), native.arg(p, 7), native.arg(p, 8), native.arg(p, 9)
    f16, unit = native.arg(p, 10), native.arg(p, 12)
    n0, n1 = begin * unit, min(end * unit, n)
    if n1 <= n0 or m == 0:
        return 0
    total = k * n
    a = native.load_f32(p[0], m, k, f16)
    q = native.vector(p[1], (total + 1) // 2, np.uint8)
    am = native.vector(p[2], (total + bs - 1) // bs, np.float32)
    res = np.empty((m, n1 - n0), np.float32)
    gemv_serial(a, q[(n0 * k) >> 1:], am[(n0 * k) // bs:], native.vector(p[5], 16, np.float32), k, n1 - n0, bs, res)
    if p[11]:
        native.add_bias(res, p[3], n0, f16)
    native.store_cols(res, p[4], n, n0, f16)
    return 0

"""DequantNF4, CPU face: W [K, N] (or W^T [N, K] with transposed=1) in absmax's dtype. On AVX-512 CPUs W^T is
decoded flat by the vector permute of nf4decode_cpu (then transposed for [K, N]); elsewhere the parallel table
lookups below."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

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

    def compute(self, ctx, inputs):
        q, absmax = inputs[0], inputs[1]
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs, 0, 1)
        w = dequantize(q.numpy(), absmax.numpy(), self.code, self.k, self.n, self.bs.size, self.transposed)
        out = ctx.output_numpy(0, w.shape, w.dtype)
        out[...] = w


KERNEL = DequantNF4Kernel

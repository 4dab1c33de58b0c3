"""MatMulNF4's warp-per-column kernels (matmulnf4_cuda routes to them):

``GEMV16`` (``fast``: M <= 16, K % 16 == 0, M * K * 4 bytes of x in shared memory): one warp per output column n
walks that column's packed row of W^T in 8-byte words (16 nibbles, always inside one absmax block since block sizes
are multiples of 16), four words in flight per lane, decodes nibbles through the 16-entry code table in shared
memory, multiplies with x (staged once per block in shared memory, transposed), scales each word's partial sum by
its block's absmax, and reduces across the warp with shuffles. The fp16/fp32 weight is never written.
``GENERIC`` (any K, any M): the same warp-per-column scheme, element by element; correct, not tuned (prefill)."""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.ptx import warp_sum

WARPS_PER_BLOCK = 8
MAX_M_FAST = 16
RED_SIZE = 1024
U0, U1, U4, U15 = (np.uint64(v) for v in (0, 1, 4, 15))


@cuda.jit(device=True, inline=True)
def _word_dot(w, sm_code, xs, xb, wpr):
    """sum_e code[nib_e(w)] * x[16 w + e] for the 16 nibbles of a little-endian word (even element = high nibble),
    x read from the transposed shared copy: x[16 w + e] = xs[xb + e * wpr]."""
    lo = uint32(w & np.uint64(0xFFFFFFFF))
    hi = uint32(w >> np.uint64(32))
    acc = float32(0.0)
    for t in range(4):
        b = (lo >> uint32(8 * t)) & uint32(0xFF)
        acc += sm_code[b >> uint32(4)] * xs[xb + uint64(2 * t) * wpr]
        acc += sm_code[b & uint32(15)] * xs[xb + uint64(2 * t + 1) * wpr]
    for t in range(4):
        b = (hi >> uint32(8 * t)) & uint32(0xFF)
        acc += sm_code[b >> uint32(4)] * xs[xb + uint64(2 * t + 8) * wpr]
        acc += sm_code[b & uint32(15)] * xs[xb + uint64(2 * t + 9) * wpr]
    return acc


def _make_fast():
    @cuda.jit
    def gemv16(a, q64, absmax, code, bias, has_bias, y, m_dim, k_dim, n_dim, bs_shift):
        """a [M*K] (f32/f16), q64 [N*K/16] words, absmax [N*K/bs], y [M*N]; bs_shift: BlockSize.log2_words.

        x is staged once per block in shared memory, transposed to xs[m*K + e*wpr + w] (w: word in the row,
        e: element in the word) so that the 32 lanes, which read 32 consecutive words, hit 32 banks. Blocks are
        persistent (grid-stride over columns) so x is staged only a few times per SM."""
        sm_code = cuda.shared.array(16, dtype=float32)
        red = cuda.shared.array(RED_SIZE, dtype=float32)
        xs = cuda.shared.array(0, dtype=float32)
        tid = cuda.threadIdx.x
        if tid < 16:
            sm_code[tid] = code[tid]
        k64 = uint64(k_dim)
        wpr = k64 >> U4                      # words per row
        total = uint64(m_dim) * k64
        idx = uint64(tid)
        while idx < total:
            m = idx // k64
            k = idx - m * k64
            xs[m * k64 + (k & U15) * wpr + (k >> U4)] = float32(a[idx])
            idx += uint64(cuda.blockDim.x)
        cuda.syncthreads()
        lane = uint64(tid & 31)
        warp = uint64(tid >> 5)
        acc = cuda.local.array(MAX_M_FAST, dtype=float32)
        nb = uint64(cuda.blockIdx.x) * uint64(WARPS_PER_BLOCK)
        nstep = uint64(cuda.gridDim.x) * uint64(WARPS_PER_BLOCK)
        while nb < uint64(n_dim):            # block-uniform trip count: every warp reaches every reduction
            n = nb + warp
            active = n < uint64(n_dim)
            wlim = wpr if active else U0
            row = n * wpr
            for m in range(m_dim):
                acc[m] = float32(0.0)
            j = lane
            while j + uint64(96) < wlim:     # 4 words per lane in flight
                w0 = q64[row + j]
                w1 = q64[row + j + uint64(32)]
                w2 = q64[row + j + uint64(64)]
                w3 = q64[row + j + uint64(96)]
                s0 = absmax[(row + j) >> uint64(bs_shift)]
                s1 = absmax[(row + j + uint64(32)) >> uint64(bs_shift)]
                s2 = absmax[(row + j + uint64(64)) >> uint64(bs_shift)]
                s3 = absmax[(row + j + uint64(96)) >> uint64(bs_shift)]
                for m in range(m_dim):
                    xb = uint64(m) * k64 + j
                    acc[m] += (_word_dot(w0, sm_code, xs, xb, wpr) * s0
                               + _word_dot(w1, sm_code, xs, xb + uint64(32), wpr) * s1
                               + _word_dot(w2, sm_code, xs, xb + uint64(64), wpr) * s2
                               + _word_dot(w3, sm_code, xs, xb + uint64(96), wpr) * s3)
                j += uint64(128)
            while j < wlim:
                w0 = q64[row + j]
                s0 = absmax[(row + j) >> uint64(bs_shift)]
                for m in range(m_dim):
                    acc[m] += _word_dot(w0, sm_code, xs, uint64(m) * k64 + j, wpr) * s0
                j += uint64(32)
            for m in range(m_dim):
                v = warp_sum(acc[m], red, tid)
                if lane == U0 and active:
                    if has_bias:
                        v += float32(bias[n])
                    y[uint64(m) * uint64(n_dim) + n] = v
            nb += nstep

    return gemv16


def _make_generic():
    @cuda.jit
    def generic(a, q8, absmax, code, bias, has_bias, y, m_dim, k_dim, n_dim, bs):
        """q8 [N*K/2] bytes; bs: BlockSize.size."""
        sm_code = cuda.shared.array(16, dtype=float32)
        red = cuda.shared.array(RED_SIZE, dtype=float32)
        tid = cuda.threadIdx.x
        if tid < 16:
            sm_code[tid] = code[tid]
        cuda.syncthreads()
        lane = uint64(tid & 31)
        n = uint64(cuda.blockIdx.x) * uint64(WARPS_PER_BLOCK) + uint64(tid >> 5)
        active = n < uint64(n_dim)
        k64 = uint64(k_dim) if active else U0
        base = n * k64
        for m in range(m_dim):
            acc = float32(0.0)
            k = lane
            while k < k64:
                i = base + k
                byte = uint64(q8[i >> U1])
                nib = (byte >> U4) if (i & U1) == U0 else (byte & U15)
                acc += sm_code[nib] * float32(absmax[i // uint64(bs)]) * float32(a[uint64(m) * k64 + k])
                k += uint64(32)
            v = warp_sum(acc, red, tid)
            if lane == U0 and active:
                if has_bias:
                    v += float32(bias[n])
                y[uint64(m) * uint64(n_dim) + n] = v

    return generic


GEMV16 = _make_fast()
GENERIC = _make_generic()

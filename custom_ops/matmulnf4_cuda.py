"""MatMulNF4, CUDA face.

Decode kernel (K % 16 == 0, M <= 16): one warp per output column n walks that column's packed row of W^T in
8-byte words (16 nibbles, always inside one absmax block since block sizes are multiples of 16), four words in
flight per lane, decodes nibbles through the 16-entry code table in shared memory, multiplies with x (read
through L1; x is tiny and shared by all warps), scales each word's partial sum by its block's absmax, and
reduces across the warp with shuffles. The fp16/fp32 weight is never written.
Generic kernel (any K, any M): same warp-per-column scheme, element by element; correct, not tuned (prefill).
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda, float32, uint64

from . import nf4_common
from .kernels import Kernel

WARPS_PER_BLOCK = 8
MAX_M_FAST = 16
U0, U1, U4, U15, U16, U32 = (np.uint64(v) for v in (0, 1, 4, 15, 16, 32))
FULL = np.uint32(0xFFFFFFFF)


if config.ENABLE_CUDASIM:
    # The simulator has no warp shuffles: reduce through shared memory (every thread of the block calls this).
    @cuda.jit(device=True)
    def _warp_sum(v, red, tid):
        red[tid] = v
        cuda.syncthreads()
        s = float32(0.0)
        if (tid & 31) == 0:
            for i in range(32):
                s += red[tid + i]
        cuda.syncthreads()
        return s
else:
    @cuda.jit(device=True, inline=True)
    def _warp_sum(v, red, tid):
        v += cuda.shfl_down_sync(FULL, v, 16)
        v += cuda.shfl_down_sync(FULL, v, 8)
        v += cuda.shfl_down_sync(FULL, v, 4)
        v += cuda.shfl_down_sync(FULL, v, 2)
        v += cuda.shfl_down_sync(FULL, v, 1)
        return v


@cuda.jit(device=True, inline=True)
def _word_dot(w, sm_code, a, abase):
    """sum_j code[nib_j(w)] * a[abase + j] for the 16 nibbles of a little-endian word (even element = high nibble)."""
    acc = float32(0.0)
    for t in range(8):
        byte = (w >> (uint64(t) << np.uint64(3))) & np.uint64(0xFF)
        acc += sm_code[byte >> U4] * float32(a[abase + uint64(2 * t)])
        acc += sm_code[byte & U15] * float32(a[abase + uint64(2 * t + 1)])
    return acc


def _make_fast():
    @cuda.jit
    def gemv16(a, q64, absmax, code, bias, has_bias, y, m_dim, k_dim, n_dim, bs_shift):
        """a [M*K] (f32/f16), q64 [N*K/16] words, absmax [N*K/bs], y [M*N]; bs_shift = log2(block_size) - 4."""
        sm_code = cuda.shared.array(16, dtype=float32)
        red = cuda.shared.array(32 * WARPS_PER_BLOCK, dtype=float32)
        tid = cuda.threadIdx.x
        if tid < 16:
            sm_code[tid] = code[tid]
        cuda.syncthreads()
        lane = uint64(tid & 31)
        n = uint64(cuda.blockIdx.x) * uint64(WARPS_PER_BLOCK) + uint64(tid >> 5)
        active = n < uint64(n_dim)   # whole warps are active or not; no early return (the reduction needs all)
        k64 = uint64(k_dim)
        wpr = k64 >> U4 if active else U0     # words per row
        row = n * wpr
        acc = cuda.local.array(MAX_M_FAST, dtype=float32)
        for m in range(m_dim):
            acc[m] = float32(0.0)
        j = lane
        while j + uint64(96) < wpr:           # 4 words per lane in flight
            w0 = q64[row + j]
            w1 = q64[row + j + uint64(32)]
            w2 = q64[row + j + uint64(64)]
            w3 = q64[row + j + uint64(96)]
            s0 = absmax[(row + j) >> uint64(bs_shift)]
            s1 = absmax[(row + j + uint64(32)) >> uint64(bs_shift)]
            s2 = absmax[(row + j + uint64(64)) >> uint64(bs_shift)]
            s3 = absmax[(row + j + uint64(96)) >> uint64(bs_shift)]
            for m in range(m_dim):
                ab = uint64(m) * k64 + (j << U4)
                acc[m] += (_word_dot(w0, sm_code, a, ab) * s0 + _word_dot(w1, sm_code, a, ab + uint64(512))
                           * s1 + _word_dot(w2, sm_code, a, ab + uint64(1024)) * s2
                           + _word_dot(w3, sm_code, a, ab + uint64(1536)) * s3)
            j += uint64(128)
        while j < wpr:
            w0 = q64[row + j]
            s0 = absmax[(row + j) >> uint64(bs_shift)]
            for m in range(m_dim):
                acc[m] += _word_dot(w0, sm_code, a, uint64(m) * k64 + (j << U4)) * s0
            j += uint64(32)
        for m in range(m_dim):
            v = _warp_sum(acc[m], red, tid)
            if lane == U0 and active:
                if has_bias:
                    v += float32(bias[n])
                y[uint64(m) * uint64(n_dim) + n] = v

    return gemv16


def _make_generic():
    @cuda.jit
    def generic(a, q8, absmax, code, bias, has_bias, y, m_dim, k_dim, n_dim, bs):
        sm_code = cuda.shared.array(16, dtype=float32)
        red = cuda.shared.array(32 * WARPS_PER_BLOCK, dtype=float32)
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
            v = _warp_sum(acc, red, tid)
            if lane == U0 and active:
                if has_bias:
                    v += float32(bias[n])
                y[uint64(m) * uint64(n_dim) + n] = v

    return generic


GEMV16 = _make_fast()
GENERIC = _make_generic()


def fast_path(m, k):
    return m <= MAX_M_FAST and k % 16 == 0


def grid(n):
    return math.ceil(n / WARPS_PER_BLOCK)


def run_arrays(a, q, absmax, code, k, n, bs, bias=None):
    """Runs the CUDA kernel on host arrays (tests): dispatcher under the simulator, Launcher on a GPU."""
    from numba import config
    lead = a.shape[:-1]
    a2 = np.ascontiguousarray(a).reshape(-1)
    m = a2.size // k
    y = np.zeros(m * n, a.dtype)
    if m == 0:
        return y.reshape(*lead, n)
    b = np.ascontiguousarray(bias if bias is not None else np.zeros(1, a.dtype), dtype=a.dtype)
    fast = fast_path(m, k)
    qa = q.reshape(-1).view(np.uint64) if fast else q.reshape(-1)
    last = bs.bit_length() - 5 if fast else bs
    args = [cuda.to_device(a2), cuda.to_device(qa), cuda.to_device(absmax.reshape(-1).astype(np.float32)),
            cuda.to_device(code), cuda.to_device(b), int(bias is not None), cuda.to_device(y), m, k, n, last]
    if config.ENABLE_CUDASIM:
        (GEMV16 if fast else GENERIC)[grid(n), 32 * WARPS_PER_BLOCK](*args)
    else:
        launcher = _launcher(fast, a.dtype)
        ptr = lambda d: d.device_ctypes_pointer.value  # noqa: E731
        launcher.launch(grid(n), 32 * WARPS_PER_BLOCK, 0, *[(ptr(x), x.shape) if hasattr(x, "device_ctypes_pointer")
                                                              else x for x in args])
        cuda.synchronize()
    return args[6].copy_to_host().reshape(*lead, n)


_launchers = {}


def _launcher(fast, dtype):
    from .cuda_launch import Array, Launcher
    key = (fast, np.dtype(dtype).str)
    if key not in _launchers:
        qdt = np.uint64 if fast else np.uint8
        sig = [Array(dtype), Array(qdt), Array(np.float32), Array(np.float32), Array(dtype), "int32", Array(dtype),
               "int64", "int64", "int64", "int64"]
        _launchers[key] = Launcher(GEMV16 if fast else GENERIC, sig)
    return _launchers[key]


class MatMulNF4CudaKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.dtype = np.float32 if self.in_types[0] == 1 else np.float16
        self.code = cuda.to_device(code)  # once, at session creation
        self.code_ptr = self.code.device_ctypes_pointer.value
        self.fast = _launcher(True, self.dtype)
        self.generic = _launcher(False, self.dtype)

    def compute(self, ctx, inputs):
        a, q, absmax = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs)
        m = nf4_common.check_a(a, self.k, bias, self.n)
        y = ctx.output(0, a.shape[:-1] + (self.n,))
        if m == 0:
            return
        fast = fast_path(m, self.k)
        nq = (self.k * self.n) // 16 if fast else q.size
        bptr = bias.ptr if bias is not None else y  # never read without has_bias
        args = [(a.ptr, (m * self.k,)), (q.ptr, (nq,)), (absmax.ptr, (absmax.size,)), (self.code_ptr, (16,)),
                (bptr, (self.n,)), int(bias is not None), (y, (m * self.n,)), m, self.k, self.n,
                self.bs.bit_length() - 5 if fast else self.bs]
        (self.fast if fast else self.generic).launch(grid(self.n), 32 * WARPS_PER_BLOCK, ctx.stream, *args)


KERNEL = MatMulNF4CudaKernel

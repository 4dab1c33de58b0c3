"""MatMulNF4, CPU face: Y = A x W (+ bias), W dequantised on the fly from bitsandbytes NF4/FP4 blocks.

Every M runs Numba kernels over the packed weight, the output columns split over threads (device/threads.py);
no BLAS (numpy's OpenBLAS pool kept spinning after the former M > 16 path's product and slowed the onnxruntime
work that followed). Accumulation in fp32.

* ``gemv1_fast_cols`` (M = 1 where gemv_fast_cols applies): a fused decode and dot per column, no stores.
* ``gemv_fast_cols`` (AVX-512 CPUs, K a multiple of the block size, block size a multiple of 32): four rows of
  W^T at a time are decoded into fp32 with a vector permute (nf4decode_cpu), then every row of A takes four dot
  products over them (vectorised sums: fastmath reassoc / contract, no nnan / ninf).
* ``gemv_cols`` (any shape): per output column, per block partial sums scaled by the block's absmax, both
  nibbles of a byte from one load (scalar table lookups).

With the attribute accuracy_level = 4 (and K % 32 == 0) the node runs matmulnf4_int8_cpu instead: A quantised to
int8, VNNI integer dot products (onnx_lowbit.nf4_int8 defines the result); a node whose Q and absmax are constant
initializers has them repacked once into column lanes on VNNI CPUs (nf4col_cpu; a copy of N x K / 2 bytes plus the
absmax per group, kept by the kernel object) and takes those kernels at every M."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device import native, threads
from ..runtime import plans
from ..runtime.kernels import Kernel
from . import common as nf4_common
from . import matmulnf4_int8_cpu as int8
from .nf4decode_cpu import FAST, absmax32, decode_blocks, dot_blocks

PARALLEL_MIN_MACS = 1 << 21   # from here the columns are split over threads (a hand-off costs ~50 us)
KC = 1024                     # elements of the four decoded rows per chunk (16 KB)


@njit(cache=True, nogil=True, boundscheck=False)
def gemv_cols(a, q, absmax, code, k_dim, bs, n0, n1, out):
    """out[m, n] = sum_k a[m, k] * code[nib(n*K+k)] * absmax[(n*K+k) // bs] for n in [n0, n1); a float32 [M, K]."""
    m_dim = a.shape[0]
    for n in range(n0, n1):
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


@njit(cache=True, nogil=True, boundscheck=False)
def gemv(a, q, absmax, code, k_dim, n_dim, bs, out):
    """out[m, n] = sum_k a[m, k] * W[k, n] for every column (one thread, scalar path); a float32 [M, K]."""
    gemv_cols(a, q, absmax, code, k_dim, bs, 0, n_dim, out)


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def gemv_fast_cols(a, q, absmax, code, k_dim, bs, n0, n1, out):
    """gemv_cols for K % bs == 0, bs % 32 == 0 on AVX-512 CPUs (FAST): rows of W^T decoded four at a time, in
    chunks of whole blocks (~KC elements, so that the four decoded rows stay in L1), into fp32 by the vector
    permute; every row of A adds four partial dot products per chunk, sharing its loads."""
    m_dim = a.shape[0]
    half = k_dim // 2
    nbr = k_dim // bs
    kc = bs * max(1, KC // bs)
    w = np.zeros((4, kc), np.float32)
    w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
    acc = np.zeros((m_dim, 4), np.float32)
    for n in range(n0, n1, 4):
        nr = min(4, n1 - n)
        acc[:, :] = 0.0
        for k0 in range(0, k_dim, kc):
            kn = min(kc, k_dim - k0)
            for r in range(nr):
                nn = n + r
                b0 = nn * nbr + k0 // bs
                decode_blocks(q[nn * half + k0 // 2:nn * half + (k0 + kn) // 2], code, absmax[b0:b0 + kn // bs],
                              w[r], bs // 2, kn // bs)
            m = 0
            while m + 1 < m_dim:           # two rows of A x four rows of W: 6 loads per 8 FMAs
                x0s = a[m, k0:k0 + kn]
                x1s = a[m + 1, k0:k0 + kn]
                s0 = np.float32(0.0)
                s1 = np.float32(0.0)
                s2 = np.float32(0.0)
                s3 = np.float32(0.0)
                t0 = np.float32(0.0)
                t1 = np.float32(0.0)
                t2 = np.float32(0.0)
                t3 = np.float32(0.0)
                for k in range(kn):
                    x = x0s[k]
                    y = x1s[k]
                    v0, v1, v2, v3 = w0[k], w1[k], w2[k], w3[k]
                    s0 += x * v0
                    s1 += x * v1
                    s2 += x * v2
                    s3 += x * v3
                    t0 += y * v0
                    t1 += y * v1
                    t2 += y * v2
                    t3 += y * v3
                acc[m, 0] += s0
                acc[m, 1] += s1
                acc[m, 2] += s2
                acc[m, 3] += s3
                acc[m + 1, 0] += t0
                acc[m + 1, 1] += t1
                acc[m + 1, 2] += t2
                acc[m + 1, 3] += t3
                m += 2
            if m < m_dim:
                am = a[m, k0:k0 + kn]
                s0 = np.float32(0.0)
                s1 = np.float32(0.0)
                s2 = np.float32(0.0)
                s3 = np.float32(0.0)
                for k in range(kn):
                    x = am[k]
                    s0 += x * w0[k]
                    s1 += x * w1[k]
                    s2 += x * w2[k]
                    s3 += x * w3[k]
                acc[m, 0] += s0
                acc[m, 1] += s1
                acc[m, 2] += s2
                acc[m, 3] += s3
        for m in range(m_dim):
            for r in range(nr):
                out[m, n + r] = acc[m, r]


@njit(cache=True, nogil=True, boundscheck=False)
def gemv1_fast_cols(ae, ao, q, absmax, code, k_dim, bs, n0, n1, out):
    """M = 1 on the fast path: out[0, n] = one fused decode-and-dot per column (nf4decode_cpu.dot_blocks), A split
    into its even and odd elements (``ae``, ``ao``) once per call; nothing decoded is stored."""
    half = k_dim // 2
    nbr = k_dim // bs
    for n in range(n0, n1):
        out[0, n] = dot_blocks(q[n * half:(n + 1) * half], code, absmax[n * nbr:(n + 1) * nbr], ae, ao, bs // 2, nbr)


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


def fast_path(k, bs):
    """Whether gemv_fast_cols serves this weight (AVX-512, blocks aligned with the rows of W^T, 32 | bs)."""
    return FAST and k % bs == 0 and bs % 32 == 0


def pieces_path(k, bs):
    """Whether the fast kernels serve this weight with one absmax per 32-element piece (``absmax32``): AVX-512,
    blocks straddling the rows of W^T (K % bs != 0) but 32 | K and 32 | bs, so that no piece straddles a block
    (e.g. K = 352 with blocks of 64: the scalar gemv_cols took 5x the time of K = 384)."""
    return FAST and k % bs != 0 and k % 32 == 0 and bs % 32 == 0


def product(a2, q, absmax, code, k, n, bs):
    """a2 float32 [M, K] @ W -> float32 [M, N] (also used by FusedFFNNF4's CPU face): gemv_fast_cols where
    ``fast_path`` holds (or ``pieces_path``: with one absmax per 32 elements), else gemv_cols; columns split over
    threads from PARALLEL_MIN_MACS multiply-adds."""
    m = a2.shape[0]
    out = np.empty((m, n), np.float32)
    if m == 0:
        return out
    a2 = np.ascontiguousarray(a2, dtype=np.float32)
    q1 = np.ascontiguousarray(q).reshape(-1)
    am = np.ascontiguousarray(absmax, dtype=np.float32).reshape(-1)
    rs = [(0, n)] if m * k * n < PARALLEL_MIN_MACS else threads.split(n, 4)
    if pieces_path(k, bs):
        am, bs = absmax32(am, 0, n * k // 32, bs), 32
    if m == 1 and fast_path(k, bs):
        ae, ao = np.ascontiguousarray(a2[0, 0::2]), np.ascontiguousarray(a2[0, 1::2])
        threads.run_ranges(gemv1_fast_cols, lambda lo, hi: (ae, ao, q1, am, code, k, bs, lo, hi, out), rs)
        return out
    kern = gemv_fast_cols if fast_path(k, bs) else gemv_cols
    threads.run_ranges(kern, lambda lo, hi: (a2, q1, am, code, k, bs, lo, hi, out), rs)
    return out


def matmul(a, q, absmax, code, k, n, bs, bias=None):
    """Host-array entry (also used by tests): a [..., K] float32/float16 -> [..., N] of a's dtype."""
    lead = a.shape[:-1]
    a2 = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, k)
    out = product(a2, q, absmax, code, k, n, bs)
    if bias is not None:
        out += bias.astype(np.float32)
    return out.astype(a.dtype).reshape(*lead, n)


class MatMulNF4Kernel(Kernel):
    """accuracy_level 4 (where K % 32 == 0): matmulnf4_int8_cpu (int8 activations); else the float kernels here."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, self.code = nf4_common.parse_attrs(self.attrs)
        self.l4 = int8.Level4.make(nf4_common.parse_level(self.attrs), self.qt, self.k, self.bs.size)
        # level 4 with constant Q and absmax on a VNNI CPU: the weight repacked once (matmulnf4_int8_cpu)
        self.packed, self.packed_from = (self.l4.pack_constant(self.constants, 1, 2, self.n) if self.l4 is not None
                                         else (None, None))

    native_plans = True  # M <= SMALL_M: the native entry (below); larger M: the Python path every call

    def compute(self, ctx, inputs):
        a, q, absmax = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs)
        m = nf4_common.check_a(a, self.k, bias, self.n)
        if self.l4 is not None:
            return self.compute8(ctx, a, q, absmax, bias, m)
        if ctx.native and m <= SMALL_M:
            y = ctx.output(0, a.shape[:-1] + (self.n,))
            unit = self.bs.size // math.gcd(self.k, self.bs.size)   # columns whose weights start a block
            values = [a.ptr, q.ptr, absmax.ptr, bias.ptr if bias is not None else 0, y, self.code.ctypes.data, m,
                      self.k, self.n, self.bs.size, int(a.elem_type == 10), int(bias is not None), unit]
            grain = max(1, -(-max(1, TASK_MACS // max(1, m * self.k)) // unit))
            if fast_path(self.k, self.bs.size) or pieces_path(self.k, self.bs.size):
                grain = -(-grain // 4) * 4                      # gemv_fast_cols runs four columns at a time
            if ctx.run_native(native.compile_entry(_native_matmul), -(-self.n // unit), grain, values, (0, 1, 2, 3, 4)):
                return
        elif ctx.native:
            plans.not_replayable()
        y = matmul(a.numpy(), q.numpy(), absmax.numpy(), self.code, self.k, self.n, self.bs.size,
                   None if bias is None else bias.numpy())
        out = ctx.output_numpy(0, a.shape[:-1] + (self.n,), y.dtype)
        out[...] = y

    def compute8(self, ctx, a, q, absmax, bias, m):
        """accuracy_level 4: matmulnf4_int8_cpu's native entry at M <= its SMALL_M, else its Python path."""
        k, n, bs = self.k, self.n, self.bs.size
        pk = self.packed if self.packed_from == (q.ptr, absmax.ptr) else None
        if pk is not None:
            return self.compute8_packed(ctx, a, bias, m, pk)
        if ctx.native and m <= int8.SMALL_M:
            y = ctx.output(0, a.shape[:-1] + (n,))
            unit = bs // math.gcd(k, bs)
            values = [a.ptr, q.ptr, absmax.ptr, bias.ptr if bias is not None else 0, y, self.l4.tbl.ctypes.data, m, k,
                      n, bs, int(a.elem_type == 10), int(bias is not None), unit, self.l4.g]
            if ctx.run_native(native.compile_entry(int8.native_matmul), -(-n // unit), self.l4.grain(m, k, unit),
                              values, (0, 1, 2, 3, 4)):
                return
        elif ctx.native:
            plans.not_replayable()
        y = int8.matmul(a.numpy(), q.numpy(), absmax.numpy(), self.l4.tbl, k, n, bs,
                        None if bias is None else bias.numpy())
        out = ctx.output_numpy(0, a.shape[:-1] + (n,), y.dtype)
        out[...] = y

    def compute8_packed(self, ctx, a, bias, m, pk):
        """accuracy_level 4, constant weight packed into column lanes: the packed native entry at M <= its
        PACKED_MAX_M, else the packed Python path (the same operations per column: the same bytes at every M)."""
        n = self.n
        if ctx.native and m <= int8.PACKED_MAX_M:
            y = ctx.output(0, a.shape[:-1] + (n,))
            values = [a.ptr, *self.packed_from, bias.ptr if bias is not None else 0, y, self.l4.tbl.ctypes.data, m,
                      self.k, n, self.bs.size, int(a.elem_type == 10), int(bias is not None), pk.lg, pk.g,
                      pk.qk.ctypes.data, pk.sk.ctypes.data, *self.packed_from, 0, int8.chunk_tiles(pk.tiles)]
            if ctx.run_native(native.compile_entry(int8.native_matmul_packed), int8.claim_tasks(pk.tiles, values[-1]),
                              1, values, (0, 1, 2, 3, 4)):
                return
        elif ctx.native:
            plans.not_replayable()
        y = int8.matmul_packed(a.numpy(), pk, self.l4.tbl, None if bias is None else bias.numpy())
        out = ctx.output_numpy(0, a.shape[:-1] + (n,), y.dtype)
        out[...] = y


KERNEL = MatMulNF4Kernel


# ---- native entry (runtime/plans.py, "CPU kernels"): M <= SMALL_M, the columns split into tasks of whole blocks;
# a task runs the kernel ``product`` would pick (gemv1_fast_cols / gemv_fast_cols where fast_path holds, else
# gemv_cols) on its columns: per column the same operations as the Python path, so the same bytes.
# params: A, Q, absmax, bias (0: none), Y, code, M, K, N, block size, A is fp16, has bias, columns per item
SMALL_M = 16                                              # larger M: the Python path every call (as before the merge)
TASK_MACS = 1 << 16                                       # multiply-adds per task, at least


@njit(cache=True, nogil=True)
def even_odd(a):
    """(a[0]'s even elements, its odd ones) as C arrays at M = 1 (gemv1_fast_cols' operands), empty otherwise."""
    if a.shape[0] == 1:
        return np.ascontiguousarray(a[0, 0::2]), np.ascontiguousarray(a[0, 1::2])
    return np.empty(0, np.float32), np.empty(0, np.float32)


@njit(cache=True, nogil=True, boundscheck=False)
def cols_product(a, ae, ao, q, absmax, code, k_dim, bs, n0, n1, res):
    """res[:, :n1 - n0] = a @ W[:, n0:n1] (a float32 [M, K]; n0 * K a multiple of bs: the columns start a block) by
    the kernel ``product`` picks for this shape, on views of the weight starting at column n0: per column the
    operations of ``product``, so the same bytes. ``ae``, ``ao``: a[0]'s even and odd elements (read at M = 1 on
    the fast path only). The native entries' product (MatMulNF4's, FusedFFNNF4's)."""
    qs = q[(n0 * k_dim) >> 1:]
    if FAST and k_dim % bs != 0 and k_dim % 32 == 0 and bs % 32 == 0:     # pieces_path(k, bs)
        ams = absmax32(absmax, n0 * k_dim, (n1 - n0) * (k_dim // 32), bs)
        if a.shape[0] == 1:
            gemv1_fast_cols(ae, ao, qs, ams, code, k_dim, 32, 0, n1 - n0, res)
        else:
            gemv_fast_cols(a, qs, ams, code, k_dim, 32, 0, n1 - n0, res)
        return
    ams = absmax[(n0 * k_dim) // bs:]
    if FAST and k_dim % bs == 0 and bs % 32 == 0:          # fast_path(k, bs)
        if a.shape[0] == 1:
            gemv1_fast_cols(ae, ao, qs, ams, code, k_dim, bs, 0, n1 - n0, res)
        else:
            gemv_fast_cols(a, qs, ams, code, k_dim, bs, 0, n1 - n0, res)
    else:
        gemv_cols(a, qs, ams, code, k_dim, bs, 0, n1 - n0, res)


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
    code = native.vector(p[5], 16, np.float32)
    ae, ao = even_odd(a)
    res = np.empty((m, n1 - n0), np.float32)
    cols_product(a, ae, ao, q, am, code, k, bs, n0, n1, res)
    if p[11]:
        native.add_bias(res, p[3], n0, f16)
    native.store_cols(res, p[4], n, n0, f16)
    return 0

"""FusedFFN, CPU face: S[..., N] = SiLU(X W1^T + B1) * (X W3^T + B3), W1/W3 [N, K] (reference: onnx_lowbit.ffn);
with the attribute weights_kn=1, W1/W3 [K, N] (the MatMul weights as they are): S = SiLU(X W1 + B1) * (X W3 + B3).

X float32 or float16 (S has X's type), W1/W3 float32 or float16 (float16 weights with float32 X: the mixed mode),
B1/B3 optional [N] of X's type. M = product of X's leading dimensions (M = 0 gives an empty S).
Accumulation, bias and SiLU are fp32; one rounding to X's type at the end.

* M <= 16 (decode): Numba, parallel over output features n: both weight rows are read once (fp16 weights widened
  without a table, _h2f_row), dotted with every row of X in fp32 (reassociated for SIMD), and SiLU(g) * u written.
* M > 16: numpy's BLAS sgemm per chunk of weight rows (fp16 weights widened to fp32 by a parallel table lookup,
  in chunks <= CHUNK_BYTES),
  then SiLU * up in fp32.
* [K, N] weights (weights_kn=1), never copied or transposed per call: M <= 16 parallel over blocks of columns
  (``kn_block``), each block's weight row segments read once (fp16 widened the same way), four rows of K at a
  time, and accumulated into the block's columns for every row of X in fp32; M > 16 BLAS sgemm on the [K, N]
  weight in place, per chunk of columns.

Non-finite values propagate as in the unfused graph (MatMul, Sigmoid, Mul, Mul): SiLU(g) = g * (1 / (1 + exp(-g))),
so SiLU(+inf) = +inf, SiLU(-inf) = -inf * 0 = NaN, and NaN in a row of X or a weight row gives NaN where it enters.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from onnx_lowbit import ffn

from ..device import native
from ..runtime import plans
from ..runtime.kernels import Kernel, KernelError

SMALL_M = 16
CHUNK_BYTES = 32 << 20
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_P112 = np.float32(2.0 ** 112)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)
FB = 8                            # output features per parallel task of the [N, K] fp16 GEMV (one scratch each)
_FM = {"reassoc", "contract"}  # SIMD sums; no nnan/ninf: NaN and Inf keep their IEEE meaning


@njit(inline="always")
def _silu_mul(g, u):
    return g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g))) * u


@njit(inline="always")
def _h2f_row(h, tmp, out):
    """out[k] = the float32 value of the fp16 bit pattern h[k], exact for every pattern (zeros, subnormals, inf,
    NaN); tmp: uint32 scratch of h's length (C-contiguous). No table: exponent and mantissa shifted into a float32's
    place give 2**-112 times the fp16 value (subnormals too), one multiply by 2**112 finishes them, exponent 31
    becomes inf / NaN, the sign comes last. Two passes LLVM vectorises, where a 64K-entry table takes a gather per
    element (fp16 GEMV at 4096 x 11008, M = 1, 2 cores: 24.5 -> 20.0 ms)."""
    tv = tmp.view(np.float32)
    for k in range(h.shape[0]):
        tmp[k] = (np.uint32(h[k]) & np.uint32(0x7FFF)) << np.uint32(13)
    for k in range(h.shape[0]):
        hk = np.uint32(h[k])
        v = tv[k] * _P112
        if (hk & np.uint32(0x7C00)) == np.uint32(0x7C00):
            v = _INF if (hk & np.uint32(0x3FF)) == np.uint32(0) else _NAN
        out[k] = -v if (hk & np.uint32(0x8000)) != np.uint32(0) else v


@njit(parallel=True, cache=True, nogil=True, boundscheck=False, fastmath=_FM)
def gemv_f32(x, w1, w3, b1, b3, out):
    """x f32 [M, K], w1/w3 f32 [N, K], b1/b3 f32 [N] (zeros when absent), out f32 [M, N]."""
    m_dim, k_dim = x.shape
    for n in prange(w1.shape[0]):
        for m in range(m_dim):
            a1 = np.float32(0.0)
            a3 = np.float32(0.0)
            for k in range(k_dim):
                xv = x[m, k]
                a1 += xv * w1[n, k]
                a3 += xv * w3[n, k]
            out[m, n] = _silu_mul(a1 + b1[n], a3 + b3[n])


@njit(parallel=True, cache=True, nogil=True, boundscheck=False, fastmath=_FM)
def gemv_f16(x, w1, w3, b1, b3, out):
    """As gemv_f32 with w1/w3 the uint16 bit patterns of fp16 weights, each row widened once (_h2f_row); tasks of
    FB features share their scratch rows."""
    m_dim, k_dim = x.shape
    n_dim = w1.shape[0]
    for blk in prange((n_dim + FB - 1) // FB):
        tmp = np.empty(k_dim, np.uint32)
        r1 = np.empty(k_dim, np.float32)
        r3 = np.empty(k_dim, np.float32)
        for n in range(blk * FB, min(blk * FB + FB, n_dim)):
            _h2f_row(w1[n], tmp, r1)
            _h2f_row(w3[n], tmp, r3)
            for m in range(m_dim):
                a1 = np.float32(0.0)
                a3 = np.float32(0.0)
                for k in range(k_dim):
                    xv = x[m, k]
                    a1 += xv * r1[k]
                    a3 += xv * r3[k]
                out[m, n] = _silu_mul(a1 + b1[n], a3 + b3[n])


@njit(inline="always")
def _kn_rows4(x, k, p0, p1, p2, p3, q0, q1, q2, q3, a1, a3):
    """a1[m, :] += x[m, k:k+4] @ [p0; p1; p2; p3] for every row m of x (p, q: 1-D weight row segments), a3 with q.
    Four rows per pass: a quarter of the accumulator loads and stores."""
    for m in range(x.shape[0]):
        x0, x1, x2, x3 = x[m, k], x[m, k + 1], x[m, k + 2], x[m, k + 3]
        c1 = a1[m]
        c3 = a3[m]
        for j in range(c1.shape[0]):
            c1[j] += x0 * p0[j] + x1 * p1[j] + x2 * p2[j] + x3 * p3[j]
            c3[j] += x0 * q0[j] + x1 * q1[j] + x2 * q2[j] + x3 * q3[j]


@njit(inline="always")
def _kn_row(x, k, p, q, a1, a3):
    for m in range(x.shape[0]):
        xv = x[m, k]
        c1 = a1[m]
        c3 = a3[m]
        for j in range(c1.shape[0]):
            c1[j] += xv * p[j]
            c3[j] += xv * q[j]


@njit(inline="always")
def _kn_finish(a1, a3, b1, b3, n0, out):
    for m in range(a1.shape[0]):
        for j in range(a1.shape[1]):
            out[m, n0 + j] = _silu_mul(a1[m, j] + b1[n0 + j], a3[m, j] + b3[n0 + j])


@njit(parallel=True, cache=True, nogil=True, boundscheck=False, fastmath=_FM)
def gemv_kn_f32(x, w1, w3, b1, b3, bw, out):
    """As gemv_f32 with w1/w3 f32 [K, N]: parallel over blocks of ``bw`` columns; each weight row segment is read
    once and accumulated into the block's columns for every row of x (1-D row views: LLVM vectorises the inner
    loop, which it does not do for 2-D indexing)."""
    m_dim, k_dim = x.shape
    n_dim = w1.shape[1]
    k4 = k_dim - k_dim % 4
    for blk in prange((n_dim + bw - 1) // bw):
        n0 = blk * bw
        n1 = min(n0 + bw, n_dim)
        a1 = np.zeros((m_dim, n1 - n0), np.float32)
        a3 = np.zeros((m_dim, n1 - n0), np.float32)
        for k in range(0, k4, 4):
            _kn_rows4(x, k, w1[k, n0:n1], w1[k + 1, n0:n1], w1[k + 2, n0:n1], w1[k + 3, n0:n1],
                      w3[k, n0:n1], w3[k + 1, n0:n1], w3[k + 2, n0:n1], w3[k + 3, n0:n1], a1, a3)
        for k in range(k4, k_dim):
            _kn_row(x, k, w1[k, n0:n1], w3[k, n0:n1], a1, a3)
        _kn_finish(a1, a3, b1, b3, n0, out)


@njit(parallel=True, cache=True, nogil=True, boundscheck=False, fastmath=_FM)
def gemv_kn_f16(x, w1, w3, b1, b3, bw, out):
    """As gemv_kn_f32 with w1/w3 the uint16 bit patterns of fp16 weights [K, N], widened four rows of the block at
    a time (_h2f_row)."""
    m_dim, k_dim = x.shape
    n_dim = w1.shape[1]
    k4 = k_dim - k_dim % 4
    for blk in prange((n_dim + bw - 1) // bw):
        n0 = blk * bw
        n1 = min(n0 + bw, n_dim)
        a1 = np.zeros((m_dim, n1 - n0), np.float32)
        a3 = np.zeros((m_dim, n1 - n0), np.float32)
        r1 = np.empty((4, n1 - n0), np.float32)
        r3 = np.empty((4, n1 - n0), np.float32)
        tmp = np.empty(n1 - n0, np.uint32)
        for k in range(0, k_dim, 4):
            rows = 4 if k < k4 else k_dim - k
            for i in range(rows):
                _h2f_row(w1[k + i, n0:n1], tmp, r1[i])
                _h2f_row(w3[k + i, n0:n1], tmp, r3[i])
            if rows == 4:
                _kn_rows4(x, k, r1[0], r1[1], r1[2], r1[3], r3[0], r3[1], r3[2], r3[3], a1, a3)
            else:
                for i in range(rows):
                    _kn_row(x, k + i, r1[i], r3[i], a1, a3)
        _kn_finish(a1, a3, b1, b3, n0, out)


@njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def widen_f16(bits, lut, out):
    """out[r, k] = float32 value of the fp16 bit pattern bits[r, k] (a parallel lookup in ``lut``, F16_TO_F32: on
    the strided column chunks of [K, N] weights it beat _h2f_row 3.9 against 6.7-11.9 ms per 4096 x 2048)."""
    for r in prange(bits.shape[0]):
        for k in range(bits.shape[1]):
            out[r, k] = lut[bits[r, k]]


def weights_kn(attrs: dict) -> bool:
    """The node's optional attribute 'weights_kn' (onnx_lowbit.ffn.parse_kn); KernelError for a bad value."""
    try:
        return ffn.parse_kn(attrs)
    except ValueError as e:
        raise KernelError(str(e)) from None


def check(x, w1, w3, b1, b3, kn=False):
    """Shapes / dtypes of host arrays (weights [N, K], or [K, N] with ``kn``); returns (M, K, N). Raises KernelError
    naming the problem."""
    layout = "[K, N]" if kn else "[N, K]"
    if x.dtype not in (np.float32, np.float16):
        raise KernelError(f"input 0 'X' must be float or float16, got {x.dtype}")
    if w1.ndim != 2 or w3.ndim != 2:
        raise KernelError(f"W1 and W3 must be 2-D {layout}, got shapes {list(w1.shape)} and {list(w3.shape)}")
    if w1.shape != w3.shape:
        raise KernelError(f"W1 {list(w1.shape)} and W3 {list(w3.shape)} must have the same shape {layout}")
    if w1.dtype != w3.dtype or w1.dtype not in (np.float32, np.float16):
        raise KernelError(f"W1 and W3 must both be float or both float16, got {w1.dtype} and {w3.dtype}")
    k, n = w1.shape if kn else w1.shape[::-1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise KernelError(f"input 0 'X' must have last dimension K={k} (W1 is {layout} = {list(w1.shape)}), "
                          f"got shape {list(x.shape)}")
    for name, b in (("B1", b1), ("B3", b3)):
        if b is not None and (b.shape != (n,) or b.dtype != x.dtype):
            raise KernelError(f"{name} must be [{n}] of X's type {x.dtype}, got {list(b.shape)} {b.dtype}")
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    return m, k, n


def swiglu(x, w1, w3, b1=None, b3=None, kn=False):
    """Host-array entry (tests and the kernel): S of X's dtype, shape x.shape[:-1] + (N,); weights [K, N] with
    ``kn``."""
    x, w1, w3 = np.asarray(x), np.asarray(w1), np.asarray(w3)
    m, k, n = check(x, w1, w3, b1, b3, kn)
    out = np.empty(x.shape[:-1] + (n,), x.dtype)
    if m:
        _compute(x.reshape(m, k), w1, w3, b1, b3, out.reshape(m, n), kn)
    return out


def _compute(x2, w1, w3, b1, b3, out2, kn=False):
    m, k = x2.shape
    n = w1.shape[1 if kn else 0]
    xf = np.ascontiguousarray(x2, dtype=np.float32)
    b1f = np.zeros(n, np.float32) if b1 is None else b1.astype(np.float32)
    b3f = np.zeros(n, np.float32) if b3 is None else b3.astype(np.float32)
    if kn:
        _compute_kn(xf, w1, w3, b1f, b3f, out2)
        return
    if m <= SMALL_M:
        res = out2 if out2.dtype == np.float32 and out2.flags.c_contiguous else np.empty((m, n), np.float32)
        if w1.dtype == np.float32:
            gemv_f32(xf, np.ascontiguousarray(w1), np.ascontiguousarray(w3), b1f, b3f, res)
        else:
            gemv_f16(xf, np.ascontiguousarray(w1).view(np.uint16), np.ascontiguousarray(w3).view(np.uint16),
                     b1f, b3f, res)
        if res is not out2:
            with np.errstate(over="ignore"):
                out2[...] = res
        return
    rows = min(n, max(1, CHUNK_BYTES // (4 * max(k, 1))))
    if w1.dtype != np.float32:
        b1w, b3w = np.ascontiguousarray(w1).view(np.uint16), np.ascontiguousarray(w3).view(np.uint16)
        buf1, buf3 = np.empty((rows, k), np.float32), np.empty((rows, k), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for n0 in range(0, n, rows):
            n1 = min(n0 + rows, n)
            if w1.dtype == np.float32:
                c1, c3 = w1[n0:n1], w3[n0:n1]
            else:
                c1, c3 = buf1[: n1 - n0], buf3[: n1 - n0]
                widen_f16(b1w[n0:n1], F16_TO_F32, c1)
                widen_f16(b3w[n0:n1], F16_TO_F32, c3)
            g = xf @ c1.T
            g += b1f[n0:n1]
            u = xf @ c3.T
            u += b3f[n0:n1]
            s = g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g))) * u
            out2[:, n0:n1] = s


def kn_block(n: int) -> int:
    """Columns per parallel task of the [K, N] decode kernels: about two tasks per thread, 64 .. 1024 (wide blocks
    read longer runs of each weight row), a multiple of 16."""
    per = -(-n // (2 * numba.get_num_threads()))
    return min(1024, max(64, -(-per // 16) * 16))


def _compute_kn(xf, w1, w3, b1f, b3f, out2):
    """_compute for [K, N] weights (xf float32 [M, K], biases float32)."""
    m, k = xf.shape
    n = w1.shape[1]
    f16 = w1.dtype != np.float32
    w1, w3 = np.ascontiguousarray(w1), np.ascontiguousarray(w3)  # (no copy for the tensors onnxruntime gives)
    if f16:
        w1, w3 = w1.view(np.uint16), w3.view(np.uint16)
    if m <= SMALL_M:
        res = out2 if out2.dtype == np.float32 and out2.flags.c_contiguous else np.empty((m, n), np.float32)
        if f16:
            gemv_kn_f16(xf, w1, w3, b1f, b3f, kn_block(n), res)
        else:
            gemv_kn_f32(xf, w1, w3, b1f, b3f, kn_block(n), res)
        if res is not out2:
            with np.errstate(over="ignore"):
                out2[...] = res
        return
    cols = min(n, max(1, CHUNK_BYTES // (4 * max(k, 1))))
    if f16:
        buf1, buf3 = np.empty((k, cols), np.float32), np.empty((k, cols), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for n0 in range(0, n, cols):
            n1 = min(n0 + cols, n)
            if f16:
                c1, c3 = buf1[:, : n1 - n0], buf3[:, : n1 - n0]
                widen_f16(w1[:, n0:n1], F16_TO_F32, c1)
                widen_f16(w3[:, n0:n1], F16_TO_F32, c3)
            else:
                c1, c3 = w1[:, n0:n1], w3[:, n0:n1]  # strided views: BLAS reads them in place
            g = xf @ c1
            g += b1f[n0:n1]
            u = xf @ c3
            u += b3f[n0:n1]
            s = g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g))) * u
            out2[:, n0:n1] = s


class FusedFFNKernel(Kernel):
    native_plans = True  # M <= SMALL_M: the native entry (below); larger M: the Python path (BLAS) every call
    def __init__(self, **kw):
        super().__init__(**kw)
        self.kn = weights_kn(self.attrs)

    def compute(self, ctx, inputs):
        x = self.check_input(inputs, 0)
        w1 = self.check_input(inputs, 1, ranks=(2,))
        w3 = self.check_input(inputs, 2, ranks=(2,))
        b1 = inputs[3] if len(inputs) > 3 else None
        b3 = inputs[4] if len(inputs) > 4 else None
        xv, w1v, w3v = x.numpy(), w1.numpy(), w3.numpy()
        b1v = None if b1 is None else b1.numpy()
        b3v = None if b3 is None else b3.numpy()
        m, k, n = check(xv, w1v, w3v, b1v, b3v, self.kn)
        if ctx.native and m <= SMALL_M and native.parallel_ok():
            values = [x.ptr, w1.ptr, w3.ptr, b1.ptr if b1 is not None else 0, b3.ptr if b3 is not None else 0,
                      ctx.output(0, tuple(x.shape[:-1]) + (n,)), m, k, n, int(x.elem_type == 10),
                      int(w1.elem_type == 10), int(self.kn), int(b1 is not None), int(b3 is not None),
                      kn_block(n) if self.kn else 0]
            if ctx.run_native(native.compile_entry(_native_ffn), 1, 1, values, (0, 1, 2, 3, 4, 5)):
                return
        elif ctx.native:
            plans.not_replayable()   # M > SMALL_M (BLAS) or Numba's workqueue layer: the Python path
        out = ctx.output_numpy(0, tuple(x.shape[:-1]) + (n,), xv.dtype)
        if m:
            _compute(xv.reshape(m, k), w1v, w3v, b1v, b3v, out.reshape(m, n), self.kn)


KERNEL = FusedFFNKernel


# ---- native entry (runtime/plans.py, "CPU kernels"): M <= SMALL_M as one task calling the same decode kernels as
# the Python path (Numba's pool inside them; the same compiled functions, so the same bytes).
# params: X, W1, W3, B1 (0: none), B3 (0: none), S, M, K, N, X is fp16, W is fp16, weights_kn, has B1, has B3,
# columns per task of the [K, N] kernels
def _native_ffn(p, begin, end):
    m, k, n = native.arg(p, 6), native.arg(p, 7), native.arg(p, 8)
    xf16, wf16, kn, bw = native.arg(p, 9), native.arg(p, 10), native.arg(p, 11), native.arg(p, 14)
    if m == 0:
        return 0
    x = native.load_f32(p[0], m, k, xf16)
    b1 = native.slice_f32(p[3], 0, n, xf16) if native.arg(p, 12) else np.zeros(n, np.float32)
    b3 = native.slice_f32(p[4], 0, n, xf16) if native.arg(p, 13) else np.zeros(n, np.float32)
    res = np.empty((m, n), np.float32) if xf16 else native.array(p[5], (m, n), np.float32)
    shape = (k, n) if kn else (n, k)
    if wf16:
        w1, w3 = native.array(p[1], shape, np.uint16), native.array(p[2], shape, np.uint16)
        if kn:
            gemv_kn_f16(x, w1, w3, b1, b3, bw, res)
        else:
            gemv_f16(x, w1, w3, b1, b3, res)
    else:
        v1, v3 = native.array(p[1], shape, np.float32), native.array(p[2], shape, np.float32)
        if kn:
            gemv_kn_f32(x, v1, v3, b1, b3, bw, res)
        else:
            gemv_f32(x, v1, v3, b1, b3, res)
    if xf16:
        native.store_cols(res, p[5], n, 0, 1)
    return 0

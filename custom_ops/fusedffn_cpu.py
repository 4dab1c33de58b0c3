"""FusedFFN, CPU face: S[..., N] = SiLU(X W1^T + B1) * (X W3^T + B3), W1/W3 [N, K] (reference: onnx_lowbit.ffn).

X float32 or float16 (S has X's type), W1/W3 float32 or float16 (float16 weights with float32 X: the mixed mode),
B1/B3 optional [N] of X's type. M = product of X's leading dimensions (M = 0 gives an empty S).
Accumulation, bias and SiLU are fp32; one rounding to X's type at the end.

* M <= 16 (decode): Numba, parallel over output features n: both weight rows are read once (fp16 weights widened
  through a 64K-entry table), dotted with every row of X in fp32 (reassociated for SIMD), and SiLU(g) * u written.
* M > 16: numpy's BLAS sgemm per chunk of weight rows (fp16 weights widened to fp32 by a parallel table lookup,
  in chunks <= CHUNK_BYTES),
  then SiLU * up in fp32.

Non-finite values propagate as in the unfused graph (MatMul, Sigmoid, Mul, Mul): SiLU(g) = g * (1 / (1 + exp(-g))),
so SiLU(+inf) = +inf, SiLU(-inf) = -inf * 0 = NaN, and NaN in a row of X or a weight row gives NaN where it enters.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .bridge import KernelError
from .kernels import Kernel

SMALL_M = 16
CHUNK_BYTES = 32 << 20
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_FM = {"reassoc", "contract"}  # SIMD sums; no nnan/ninf: NaN and Inf keep their IEEE meaning


@njit(inline="always")
def _silu_mul(g, u):
    return g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g))) * u


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
def gemv_f16(x, w1, w3, lut, b1, b3, out):
    """As gemv_f32 with w1/w3 the uint16 bit patterns of fp16 weights, widened through ``lut``."""
    m_dim, k_dim = x.shape
    n_dim = w1.shape[0]
    for n in prange(n_dim):
        r1 = np.empty(k_dim, np.float32)
        r3 = np.empty(k_dim, np.float32)
        for k in range(k_dim):
            r1[k] = lut[w1[n, k]]
            r3[k] = lut[w3[n, k]]
        for m in range(m_dim):
            a1 = np.float32(0.0)
            a3 = np.float32(0.0)
            for k in range(k_dim):
                xv = x[m, k]
                a1 += xv * r1[k]
                a3 += xv * r3[k]
            out[m, n] = _silu_mul(a1 + b1[n], a3 + b3[n])


@njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def widen_f16(bits, lut, out):
    """out[r, k] = float32 value of the fp16 bit pattern bits[r, k] (a parallel table lookup)."""
    for r in prange(bits.shape[0]):
        for k in range(bits.shape[1]):
            out[r, k] = lut[bits[r, k]]


def check(x, w1, w3, b1, b3):
    """Shapes / dtypes of host arrays; returns (M, K, N). Raises KernelError naming the problem."""
    if x.dtype not in (np.float32, np.float16):
        raise KernelError(f"input 0 'X' must be float or float16, got {x.dtype}")
    if w1.ndim != 2 or w3.ndim != 2:
        raise KernelError(f"W1 and W3 must be 2-D [N, K], got shapes {list(w1.shape)} and {list(w3.shape)}")
    if w1.shape != w3.shape:
        raise KernelError(f"W1 {list(w1.shape)} and W3 {list(w3.shape)} must have the same shape [N, K]")
    if w1.dtype != w3.dtype or w1.dtype not in (np.float32, np.float16):
        raise KernelError(f"W1 and W3 must both be float or both float16, got {w1.dtype} and {w3.dtype}")
    n, k = w1.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise KernelError(f"input 0 'X' must have last dimension K={k} (W1 is [N, K] = {[n, k]}), "
                          f"got shape {list(x.shape)}")
    for name, b in (("B1", b1), ("B3", b3)):
        if b is not None and (b.shape != (n,) or b.dtype != x.dtype):
            raise KernelError(f"{name} must be [{n}] of X's type {x.dtype}, got {list(b.shape)} {b.dtype}")
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    return m, k, n


def swiglu(x, w1, w3, b1=None, b3=None):
    """Host-array entry (tests and the kernel): S of X's dtype, shape x.shape[:-1] + (N,)."""
    x, w1, w3 = np.asarray(x), np.asarray(w1), np.asarray(w3)
    m, k, n = check(x, w1, w3, b1, b3)
    out = np.empty(x.shape[:-1] + (n,), x.dtype)
    if m:
        _compute(x.reshape(m, k), w1, w3, b1, b3, out.reshape(m, n))
    return out


def _compute(x2, w1, w3, b1, b3, out2):
    m, k = x2.shape
    n = w1.shape[0]
    xf = np.ascontiguousarray(x2, dtype=np.float32)
    b1f = np.zeros(n, np.float32) if b1 is None else b1.astype(np.float32)
    b3f = np.zeros(n, np.float32) if b3 is None else b3.astype(np.float32)
    if m <= SMALL_M:
        res = out2 if out2.dtype == np.float32 and out2.flags.c_contiguous else np.empty((m, n), np.float32)
        if w1.dtype == np.float32:
            gemv_f32(xf, np.ascontiguousarray(w1), np.ascontiguousarray(w3), b1f, b3f, res)
        else:
            gemv_f16(xf, np.ascontiguousarray(w1).view(np.uint16), np.ascontiguousarray(w3).view(np.uint16),
                     F16_TO_F32, b1f, b3f, res)
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


class FusedFFNKernel(Kernel):
    def compute(self, ctx, inputs):
        x = self.check_input(inputs, 0)
        w1 = self.check_input(inputs, 1, ranks=(2,))
        w3 = self.check_input(inputs, 2, ranks=(2,))
        b1 = inputs[3] if len(inputs) > 3 else None
        b3 = inputs[4] if len(inputs) > 4 else None
        xv, w1v, w3v = x.numpy(), w1.numpy(), w3.numpy()
        b1v = None if b1 is None else b1.numpy()
        b3v = None if b3 is None else b3.numpy()
        m, k, n = check(xv, w1v, w3v, b1v, b3v)
        out = ctx.output_numpy(0, tuple(x.shape[:-1]) + (n,), xv.dtype)
        if m:
            _compute(xv.reshape(m, k), w1v, w3v, b1v, b3v, out.reshape(m, n))


KERNEL = FusedFFNKernel

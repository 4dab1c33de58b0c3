"""MatMulAWQ, CPU face: Y[..., N] = A[..., K] x W (+ bias), W in AutoAWQ GEMM layout (see dequantawq_cpu).

A is float32 or float16 (Y has A's type); M = product of A's leading dimensions (M = 0 gives an empty Y).
Accumulation is fp32 throughout.

* M <= 16 (decode): Numba, parallel over tiles of 16 column groups (128 columns: one 64-byte line of each
  qweight row), never materialising W; the inner loops run over the tile's 16 words with one shift amount
  (SIMD). Per group of G rows it accumulates sum_k x*q and sum_k x and applies
  the zero and the scale once: y += s * (sum x*q - z * sum x).
* M > 16: W is dequantised to float32 in row chunks (<= CHUNK_BYTES) and multiplied with numpy's BLAS sgemm.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..device import native
from ..device.half_cpu import h2f
from ..runtime import plans
from ..runtime.kernels import Kernel
from .dequantawq_cpu import ORDER_NP, check_a_bias, check_weights, dequant_rows_f32, parse_attrs

SMALL_M = 16
TILE = 16                 # column groups per parallel work item (128 output columns)
CHUNK_BYTES = 32 << 20    # fp32 W chunk for the M > 16 path


@njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def gemv(a, qw, qz, sc, order, g_size, k_dim, out):
    """out[m, n] = sum_k a[m, k] * W[k, n]; a float32 [M, K], sc float32 [Kp/G, N], out float32 [M, N].

    Accumulators are laid out [m][nibble j][word cc] so that the innermost loops run over TILE consecutive
    qweight words with one shift amount (SIMD-friendly); the AutoAWQ column order is applied once at the end."""
    m_dim = a.shape[0]
    ng = qw.shape[1]
    ntiles = (ng + TILE - 1) // TILE
    groups = (k_dim + g_size - 1) // g_size
    for t in prange(ntiles):
        c0 = t * TILE
        nc = min(TILE, ng - c0)
        acc = np.zeros((m_dim, 8, TILE), np.float32)
        aq = np.empty((m_dim, 8, TILE), np.float32)
        qf = np.empty((8, TILE), np.float32)
        sx = np.empty(m_dim, np.float32)
        for g in range(groups):
            k0 = g * g_size
            k1 = min(k0 + g_size, k_dim)
            aq[:, :, :] = 0.0
            sx[:] = 0.0
            for k in range(k0, k1):
                for j in range(8):
                    sh = 4 * j
                    for cc in range(nc):
                        qf[j, cc] = np.float32((qw[k, c0 + cc] >> sh) & 15)
                for m in range(m_dim):
                    xv = a[m, k]
                    sx[m] += xv
                    for j in range(8):
                        for cc in range(nc):
                            aq[m, j, cc] += xv * qf[j, cc]
            for j in range(8):
                sh = 4 * j
                for cc in range(nc):
                    zj = np.float32((qz[g, c0 + cc] >> sh) & 15)
                    s = sc[g, (c0 + cc) * 8 + order[j]]
                    for m in range(m_dim):
                        acc[m, j, cc] += s * (aq[m, j, cc] - zj * sx[m])
        for m in range(m_dim):
            for j in range(8):
                for cc in range(nc):
                    out[m, (c0 + cc) * 8 + order[j]] = acc[m, j, cc]


def matmul(a, qweight, qzeros, scales, group_size, K, N, bias=None):  # noqa: N803 - the format's names
    """Host-array entry (tests and the kernel): a [..., K] float32/float16 -> [..., N] of a's dtype."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_weights(qweight, qzeros, scales, sh, first=1)
    m = check_a_bias(a, bias, sh)
    return _matmul(a, qweight, qzeros, scales, sh, m, bias)


def product(a2, qweight, qzeros, scales, sh):
    """a2 float32 [M, K] @ W -> float32 [M, N] with exact (q - z) * s weights: the Numba GEMV for M <= SMALL_M,
    else fp32 dequantisation in row chunks (<= CHUNK_BYTES) + numpy's BLAS (also used by FusedFFNAWQ's CPU
    face)."""
    m, k, n = a2.shape[0], sh.K, sh.N
    qw, qz = np.ascontiguousarray(qweight), np.ascontiguousarray(qzeros)
    sc = np.asarray(scales).astype(np.float32)
    if m <= SMALL_M:
        out = np.empty((m, n), np.float32)
        gemv(a2, qw, qz, sc, ORDER_NP, sh.group_size, k, out)
        return out
    rows = max(sh.group_size, (CHUNK_BYTES // (4 * n)) // sh.group_size * sh.group_size)
    w = np.empty((min(rows, k), n), np.float32)
    out = np.zeros((m, n), np.float32)
    for k0 in range(0, k, rows):
        k1 = min(k0 + rows, k)
        dequant_rows_f32(qw, qz, sc, ORDER_NP, sh.group_size, k0, k1, w)
        out += a2[:, k0:k1] @ w[: k1 - k0]
    return out


def _matmul(a, qweight, qzeros, scales, sh, m, bias):
    k, n = sh.K, sh.N
    lead = tuple(a.shape[:-1])
    if m == 0:
        return np.empty(lead + (n,), a.dtype)
    out = product(np.ascontiguousarray(a.reshape(m, k), dtype=np.float32), qweight, qzeros, scales, sh)
    if bias is not None:
        out += bias.astype(np.float32)
    return out.astype(a.dtype, copy=False).reshape(lead + (n,))


def operands(inputs, sh):
    """(A, (qweight, qzeros, scales), bias or None, M) of a MatMulAWQ call's inputs (bridge Tensors), checked
    (KernelError naming the input); the CUDA face's too."""
    a, qw, qz, sc = (inputs[i] if i < len(inputs) else None for i in range(4))
    bias = inputs[4] if len(inputs) > 4 else None
    check_weights(qw, qz, sc, sh, first=1)
    return a, (qw, qz, sc), bias, check_a_bias(a, bias, sh)


class MatMulAWQKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.sh = parse_attrs(self.attrs)

    native_plans = True  # M <= SMALL_M: the native entry (below); larger M: the Python path (BLAS) every call

    def compute(self, ctx, inputs):
        a, (qw, qz, sc), bias, m = operands(inputs, self.sh)
        if ctx.native and m <= SMALL_M:
            sh = self.sh
            y = ctx.output(0, tuple(a.shape[:-1]) + (sh.N,))
            values = [a.ptr, qw.ptr, qz.ptr, sc.ptr, bias.ptr if bias is not None else 0, y, m, sh.K, sh.N,
                      sh.group_size, int(a.elem_type == 10), int(bias is not None)]
            tiles = -(-sh.NG // TILE)
            grain = max(1, TASK_MACS // max(1, m * sh.K * 8 * TILE))
            if ctx.run_native(native.compile_entry(_native_matmul), tiles, grain, values, (0, 1, 2, 3, 4, 5)):
                return
        elif ctx.native:
            plans.not_replayable()
        av = a.numpy()
        out = ctx.output_numpy(0, tuple(a.shape[:-1]) + (self.sh.N,), av.dtype)
        if m:
            out[...] = _matmul(av, qw.numpy(), qz.numpy(), sc.numpy(), self.sh, m,
                               None if bias is None else bias.numpy())


KERNEL = MatMulAWQKernel


# ---- native entry (runtime/plans.py, "CPU kernels"): M <= SMALL_M; items are gemv's tiles of TILE column groups,
# a task runs gemv's body (compiled once more single-threaded) on its tiles' columns.
# params: A, qweight, qzeros, scales, bias (0: none), Y, M, K, N, group size, A is fp16, has bias
TASK_MACS = 1 << 16
gemv_serial = njit(cache=True, nogil=True, boundscheck=False)(gemv.py_func)


def _native_matmul(p, begin, end):
    m, k, n, g = native.arg(p, 6), native.arg(p, 7), native.arg(p, 8), native.arg(p, 9)
    f16 = native.arg(p, 10)
    ng = n // 8
    c0, c1 = begin * TILE, min(end * TILE, ng)
    if c1 <= c0 or m == 0:
        return 0
    groups = (k + g - 1) // g
    a = native.load_f32(p[0], m, k, f16)
    qw = native.array(p[1], (groups * g, ng), np.int32)
    qz = native.array(p[2], (groups, ng), np.int32)
    sc16 = native.array(p[3], (groups, n), np.uint16)
    sc = np.empty((groups, 8 * (c1 - c0)), np.float32)
    for r in range(groups):
        for j in range(8 * (c1 - c0)):
            sc[r, j] = h2f(sc16[r, 8 * c0 + j])
    res = np.empty((m, 8 * (c1 - c0)), np.float32)
    gemv_serial(a, qw[:, c0:c1], qz[:, c0:c1], sc, ORDER_NP, g, k, res)
    if native.arg(p, 11):
        native.add_bias(res, p[4], 8 * c0, f16)
    native.store_cols(res, p[5], n, 8 * c0, f16)
    return 0

"""MatMulAWQ, CPU face: Y[..., N] = A[..., K] x W (+ bias), W in AutoAWQ GEMM layout (see dequantawq_cpu).

A is float32 or float16 (Y has A's type); M = product of A's leading dimensions (M = 0 gives an empty Y).
Accumulation is fp32 throughout.

Every M runs the Numba kernel ``gemv_cols`` (tiles of 16 qweight words = 128 columns; the nibbles of KB rows
converted to float32 once per tile and block of MB rows of A, then FMAs over 128 lanes; per group of G rows it
accumulates sum_k x*q and sum_k x and applies the zero and the scale once: y += s * (sum x*q - z * sum x)), the
columns split over threads by device/threads.py. No BLAS: numpy's OpenBLAS pool kept spinning after the M > 16
products of the former path and slowed the onnxruntime work that followed.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..device import native, threads
from ..device.half_cpu import f32_bits, widen_f16
from ..runtime import plans
from ..runtime.kernels import Kernel
from .dequantawq_cpu import ORDER_NP, check_a_bias, check_weights, parse_attrs

MB = 8                    # rows of A per pass over the weight (their accumulators stay in L1 and L2)
PARALLEL_MIN_MACS = 1 << 21   # from here the columns are split over threads (a hand-off costs ~50 us)
TW = 16                   # qweight words per thread part: a multiple of this
CW = 256                  # qweight words per tile (2048 output columns; per row of A two 8 KB accumulators)


@njit(inline="always")
def _conv(wjj, row, sh, nc):
    """wjj[c] = nibble plane ``sh`` of row as float32 (``sh`` constant at the call site: 32-bit lanes)."""
    for c in range(nc):
        wjj[c] = np.float32((row[c] >> sh) & 15)


@njit(inline="always")
def _acc4(aqj, w0, w1, w2, w3, x0, x1, x2, x3, nc):
    for c in range(nc):
        aqj[c] += (x0 * w0[c] + x1 * w1[c]) + (x2 * w2[c] + x3 * w3[c])


@njit(inline="always")
def _acc4x2(aqj, bqj, w0, w1, w2, w3, x0, x1, x2, x3, y0, y1, y2, y3, nc):
    for c in range(nc):
        v0, v1, v2, v3 = w0[c], w1[c], w2[c], w3[c]
        aqj[c] += (x0 * v0 + x1 * v1) + (x2 * v2 + x3 * v3)
        bqj[c] += (y0 * v0 + y1 * v1) + (y2 * v2 + y3 * v3)


@njit(inline="always")
def _xs(a, m, k, kr):
    """a[m, k..k+3], zeros past the kr rows there are."""
    z = np.float32(0.0)
    return (a[m, k], a[m, k + 1] if kr > 1 else z, a[m, k + 2] if kr > 2 else z, a[m, k + 3] if kr > 3 else z)


@njit(inline="always")
def _plane4(aqj, r0, r1, r2, r3, x0, x1, x2, x3, sh, nc):
    """aqj[c] += sum over 4 rows of x * nibble plane ``sh`` (a constant at each call site, so that LLVM keeps the
    shift, mask and conversion in 32-bit lanes: 16 per AVX-512 vector instead of 8)."""
    for c in range(nc):
        aqj[c] += ((x0 * np.float32((r0[c] >> sh) & 15) + x1 * np.float32((r1[c] >> sh) & 15))
                   + (x2 * np.float32((r2[c] >> sh) & 15) + x3 * np.float32((r3[c] >> sh) & 15)))


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"contract"})
def gemv_cols(a, qw, qz, sc, order, g_size, k_dim, c0, c1, out):
    """out[m, 8c:8c+8] for the qweight word columns c in [c0, c1): out[m, n] = sum_k a[m, k] * W[k, n]; a float32
    [M, K], sc float32 [Kp/G, N], out float32 [M, N]. Serial (device/threads.py runs column parts at once).

    Per tile of up to CW words (8 * CW columns, held nibble-major: [j][word], so every inner loop is a long 1-D
    loop over consecutive words with one shift amount, which LLVM vectorises; 2-D indexing and 16-word loops
    stayed scalar) and row k: the 8 nibble planes of the row are converted to float32 once (``wj``), then every
    row of A adds x * q over them (``aq``); per group the zero and the scale are applied once:
    y += s * (sum x*q - z * sum x)."""
    m_dim = a.shape[0]
    groups = (k_dim + g_size - 1) // g_size
    sx = np.zeros((m_dim, groups), np.float32)
    for m in range(m_dim):
        for g in range(groups):
            t = np.float32(0.0)
            for k in range(g * g_size, min(k_dim, (g + 1) * g_size)):
                t += a[m, k]
            sx[m, g] = t
    wj = np.zeros((4, 8, CW), np.float32)
    st = np.zeros((8, CW), np.float32)
    zt = np.zeros((8, CW), np.float32)
    aq = np.zeros((m_dim, 8, CW), np.float32)
    acc = np.zeros((m_dim, 8, CW), np.float32)
    cw = CW if m_dim == 1 else CW // 4     # several rows of A: 4 converted rows of W stay in L1 (32 KB)
    for t0 in range(c0, c1, cw):
        nc = min(cw, c1 - t0)
        acc[:, :, :] = 0.0
        for g in range(groups):
            for j in range(8):
                sh = 4 * j
                oj = order[j]
                zrow = qz[g, t0:t0 + nc]
                srow = sc[g]
                stj = st[j]
                ztj = zt[j]
                for c in range(nc):
                    stj[c] = srow[(t0 + c) * 8 + oj]
                    ztj[c] = np.float32((zrow[c] >> sh) & 15)
            aq[:, :, :] = 0.0
            k0 = g * g_size
            k1 = min(k_dim, k0 + g_size)
            if m_dim == 1:                     # one row of A: convert and accumulate in one pass, 4 rows of W
                k = k0                         # per load / store of the accumulators
                while k + 4 <= k1:
                    r0, r1 = qw[k, t0:t0 + nc], qw[k + 1, t0:t0 + nc]
                    r2, r3 = qw[k + 2, t0:t0 + nc], qw[k + 3, t0:t0 + nc]
                    x0, x1, x2, x3 = a[0, k], a[0, k + 1], a[0, k + 2], a[0, k + 3]
                    _plane4(aq[0, 0], r0, r1, r2, r3, x0, x1, x2, x3, 0, nc)
                    _plane4(aq[0, 1], r0, r1, r2, r3, x0, x1, x2, x3, 4, nc)
                    _plane4(aq[0, 2], r0, r1, r2, r3, x0, x1, x2, x3, 8, nc)
                    _plane4(aq[0, 3], r0, r1, r2, r3, x0, x1, x2, x3, 12, nc)
                    _plane4(aq[0, 4], r0, r1, r2, r3, x0, x1, x2, x3, 16, nc)
                    _plane4(aq[0, 5], r0, r1, r2, r3, x0, x1, x2, x3, 20, nc)
                    _plane4(aq[0, 6], r0, r1, r2, r3, x0, x1, x2, x3, 24, nc)
                    _plane4(aq[0, 7], r0, r1, r2, r3, x0, x1, x2, x3, 28, nc)
                    k += 4
                while k < k1:
                    row = qw[k, t0:t0 + nc]
                    xv = a[0, k]
                    for j in range(8):
                        sh = 4 * j
                        aqj = aq[0, j]
                        for c in range(nc):
                            aqj[c] += xv * np.float32((row[c] >> sh) & 15)
                    k += 1
            if m_dim > 1:                      # several rows of A: 4 rows of W converted once, then every row
                k = k0                         # of A accumulates them per load / store of its accumulators
                while k < k1:
                    kr = min(4, k1 - k)
                    for r in range(4):
                        if r < kr:
                            row = qw[k + r, t0:t0 + nc]
                            _conv(wj[r, 0], row, 0, nc)
                            _conv(wj[r, 1], row, 4, nc)
                            _conv(wj[r, 2], row, 8, nc)
                            _conv(wj[r, 3], row, 12, nc)
                            _conv(wj[r, 4], row, 16, nc)
                            _conv(wj[r, 5], row, 20, nc)
                            _conv(wj[r, 6], row, 24, nc)
                            _conv(wj[r, 7], row, 28, nc)
                        else:
                            wj[r, :, :] = 0.0
                    m = 0
                    while m + 1 < m_dim:       # two rows of A share the loads of the converted rows
                        x0, x1, x2, x3 = _xs(a, m, k, kr)
                        y0, y1, y2, y3 = _xs(a, m + 1, k, kr)
                        am, bm = aq[m], aq[m + 1]
                        for j in range(8):
                            _acc4x2(am[j], bm[j], wj[0, j], wj[1, j], wj[2, j], wj[3, j], x0, x1, x2, x3, y0, y1, y2,
                                    y3, nc)
                        m += 2
                    if m < m_dim:
                        x0, x1, x2, x3 = _xs(a, m, k, kr)
                        am = aq[m]
                        for j in range(8):
                            _acc4(am[j], wj[0, j], wj[1, j], wj[2, j], wj[3, j], x0, x1, x2, x3, nc)
                    k += kr
            for m in range(m_dim):
                sxm = sx[m, g]
                for j in range(8):
                    accj = acc[m, j]
                    aqj = aq[m, j]
                    stj = st[j]
                    ztj = zt[j]
                    for c in range(nc):
                        accj[c] += stj[c] * (aqj[c] - ztj[c] * sxm)
        for m in range(m_dim):
            orow = out[m]
            for j in range(8):
                oj = order[j]
                accj = acc[m, j]
                for c in range(nc):
                    orow[(t0 + c) * 8 + oj] = accj[c]


@njit(cache=True, nogil=True, boundscheck=False)
def gemv(a, qw, qz, sc, order, g_size, k_dim, out):
    """out[m, n] = sum_k a[m, k] * W[k, n] over all columns (one thread); a float32 [M, K], sc float32 [Kp/G, N],
    out float32 [M, N]."""
    gemv_cols(a, qw, qz, sc, order, g_size, k_dim, 0, qw.shape[1], out)


def matmul(a, qweight, qzeros, scales, group_size, K, N, bias=None):  # noqa: N803 - the format's names
    """Host-array entry (tests and the kernel): a [..., K] float32/float16 -> [..., N] of a's dtype."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_weights(qweight, qzeros, scales, sh, first=1)
    m = check_a_bias(a, bias, sh)
    return _matmul(a, qweight, qzeros, scales, sh, m, bias)


def product(a2, qweight, qzeros, scales, sh):
    """a2 float32 [M, K] @ W -> float32 [M, N] with exact (q - z) * s weights (also used by FusedFFNAWQ's CPU
    face): ``gemv_cols`` over rows in blocks of MB, columns split over threads (device/threads.py) from
    PARALLEL_MIN_MACS multiply-adds. No BLAS (its pool kept spinning after the call and slowed what ran next)."""
    m, k, n = a2.shape[0], sh.K, sh.N
    qw, qz = np.ascontiguousarray(qweight), np.ascontiguousarray(qzeros)
    sc = np.empty(np.shape(scales), np.float32)
    s16 = np.ascontiguousarray(scales, dtype=np.float16).view(np.uint16)
    widen_f16(s16.reshape(-1), sc.view(np.uint32).reshape(-1))     # 15x numpy's cast
    out = np.empty((m, n), np.float32)
    if m == 0:
        return out
    a2 = np.ascontiguousarray(a2, dtype=np.float32)
    rs = [(0, sh.NG)] if m * k * n < PARALLEL_MIN_MACS else threads.split(sh.NG, TW)
    for m0 in range(0, m, MB):
        ab, ob = a2[m0:m0 + MB], out[m0:m0 + MB]
        threads.run_ranges(gemv_cols, lambda lo, hi, ab=ab, ob=ob: (ab, qw, qz, sc, ORDER_NP, sh.group_size, k, lo,
                                                                  hi, ob), rs)
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


class ScalesCache:
    """The float32 scales a kernel widened when it recorded a native plan, by the address of the fp16 scales they
    came from (the scales are constant initializers in the models the weights4 pass writes, so one address per
    weight). Entries check per call, on their columns, that the fp16 scales there still widen to the cached values
    (``scales_f32``), so a scales input that changes at the same address is still served right (widened per call).
    At most CACHED addresses per kernel; others are widened per call."""
    CACHED = 4

    def __init__(self):
        self._by_ptr = {}

    def get(self, sc) -> int:
        """The address of the widened copy of the bridge tensor ``sc`` (fp16 scales), made on the first request
        for its address; 0 past CACHED addresses."""
        f32 = self._by_ptr.get(sc.ptr)
        if f32 is None:
            if len(self._by_ptr) >= self.CACHED:
                return 0
            h = np.ascontiguousarray(sc.numpy()).view(np.uint16).reshape(-1)
            f32 = np.empty(h.size, np.float32)
            widen_f16(h, f32.view(np.uint32))
            self._by_ptr[sc.ptr] = f32
        return f32.ctypes.data if f32.size else 0


class MatMulAWQKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.sh = parse_attrs(self.attrs)
        self.scales = ScalesCache()

    native_plans = True  # M <= SMALL_M: the native entry (below); larger M: the Python path every call

    def compute(self, ctx, inputs):
        a, (qw, qz, sc), bias, m = operands(inputs, self.sh)
        if ctx.native and m <= SMALL_M:
            sh = self.sh
            y = ctx.output(0, tuple(a.shape[:-1]) + (sh.N,))
            values = [a.ptr, qw.ptr, qz.ptr, sc.ptr, bias.ptr if bias is not None else 0, y, m, sh.K, sh.N,
                      sh.group_size, int(a.elem_type == 10), int(bias is not None), self.scales.get(sc)]
            items, grain = task_items(sh)
            if ctx.run_native(native.compile_entry(_native_matmul), items, grain, values, (0, 1, 2, 3, 4, 5)):
                return
        elif ctx.native:
            plans.not_replayable()
        av = a.numpy()
        out = ctx.output_numpy(0, tuple(a.shape[:-1]) + (self.sh.N,), av.dtype)
        if m:
            out[...] = _matmul(av, qw.numpy(), qz.numpy(), sc.numpy(), self.sh, m,
                               None if bias is None else bias.numpy())


KERNEL = MatMulAWQKernel


# ---- native entries (runtime/plans.py, "CPU kernels"; MatMulAWQ's below, FusedFFNAWQ's in ffn/): M <= SMALL_M;
# items are parts of ITEM_WORDS qweight words, tasks at least MIN_TASK_WORDS (gemv_cols' inner loops run over a
# part's words: parts of 16 words, the former items, left LLVM's vector loops of 64 lanes unused and took 2x the
# kernel's time at 2048 x 2048, M = 1); a task runs gemv_cols on its words' columns over the rows in blocks of MB,
# as ``product`` does (the M = 1 and M > 1 paths round differently), with the full-width arrays ``product`` passes:
# the same bytes as the Python path. The scales come widened from the kernel's ScalesCache (checked per call).
SMALL_M = 16        # larger M: the Python path every call (as before the merge)
ITEM_WORDS = 64     # qweight words (512 columns) per item
MIN_TASK_WORDS = 128


def task_items(sh):
    """(items, grain) of a native AWQ call: parts of ITEM_WORDS words, tasks of at least MIN_TASK_WORDS."""
    return -(-sh.NG // ITEM_WORDS), max(1, MIN_TASK_WORDS // ITEM_WORDS)


@njit(cache=True, nogil=True, boundscheck=False)
def scales_f32(sc_addr, cached_addr, groups, n, c0, c1):
    """The scales of qweight words [c0, c1) as float32 [groups, N]: the cached widened scales at ``cached_addr``
    when every fp16 scale of those columns at ``sc_addr`` widens to the cached bits (one vectorised pass, no
    stores), else a new array with just those columns widened (other columns unset)."""
    sc16 = native.array(sc_addr, (groups, n), np.uint16)
    if cached_addr:
        bits = native.array(cached_addr, (groups, n), np.uint32)
        diff = np.uint32(0)
        for r in range(groups):
            hr, br = sc16[r], bits[r]
            for j in range(8 * c0, 8 * c1):
                diff |= br[j] ^ f32_bits(hr[j])
        if diff == 0:
            return native.array(cached_addr, (groups, n), np.float32)
    sc = np.empty((groups, n), np.float32)
    sb = sc.view(np.uint32)
    for r in range(groups):
        hr, br = sc16[r], sb[r]
        for j in range(8 * c0, 8 * c1):
            br[j] = f32_bits(hr[j])
    return sc


@njit(cache=True, nogil=True, boundscheck=False)
def cols_product(a, qw, qz, sc, g_size, k_dim, c0, c1, out):
    """out[:, 8 c0:8 c1] = a @ W for qweight words [c0, c1) (full-width out), rows of a in blocks of MB as
    ``product`` runs them."""
    for m0 in range(0, a.shape[0], MB):
        gemv_cols(a[m0:m0 + MB], qw, qz, sc, ORDER_NP, g_size, k_dim, c0, c1, out[m0:m0 + MB])


# MatMulAWQ's params: A, qweight, qzeros, scales, bias (0: none), Y, M, K, N, group size, A is fp16, has bias,
# the cached float32 scales (0: none)
def _native_matmul(p, begin, end):
    m, k, n, g = native.arg(p, 6), native.arg(p, 7), native.arg(p, 8), native.arg(p, 9)
    f16 = native.arg(p, 10)
    ng = n // 8
    c0, c1 = begin * ITEM_WORDS, min(end * ITEM_WORDS, ng)
    if c1 <= c0 or m == 0:
        return 0
    groups = (k + g - 1) // g
    a = native.load_f32(p[0], m, k, f16)
    qw = native.array(p[1], (groups * g, ng), np.int32)
    qz = native.array(p[2], (groups, ng), np.int32)
    sc = scales_f32(p[3], p[12], groups, n, c0, c1)
    out = np.empty((m, n), np.float32) if f16 else native.array(p[5], (m, n), np.float32)  # fp32 Y: in place
    cols_product(a, qw, qz, sc, g, k, c0, c1, out)
    res = out[:, 8 * c0:8 * c1]
    if native.arg(p, 11):
        native.add_bias(res, p[4], 8 * c0, f16)
    if f16:
        native.store_cols(res, p[5], n, 8 * c0, f16)
    return 0

"""FusedFFN's prefill kernels, both weight layouts: the cuBLAS path (``gemm``: per chunk of rows of X, two
cublasGemmEx with fp32 accumulation write gate and up side by side into a scratch G [rows, 2N]; one elementwise
kernel adds the biases, applies SiLU * mul in fp32 and writes S) and the tiled kernel that serves every call when
there is no cuBLAS or no scratch memory (``make_tiled``). Routed by fusedffn_cuda.ROUTES (rows ``gemm*``,
``tiled``).

The GEMMs: [N, K] weights with op T, [K, N] weights (weights_kn = 1) with op N (the unfused graph's own GEMMs).
Types cuBLAS has no GemmEx for are brought to one it has without losing accuracy: fp16 X with fp32 W -> X widened
to fp32 (exact, SGEMM); fp32 X with fp16 W (mixed) -> X split into fp16 hi + lo parts (X = hi + lo to ~2^-22
relative), both multiplied in one fp16 GEMM with 2x the rows and summed in the elementwise kernel (reads the fp16
weight once, never widens it). G is fp32, except for fp16 X and W with [K, N] weights (route ``gemm_f16out``) and
the 4-bit FFN ops' prefill route (fusedffn4_prefill_cuda, either layout): fp16, the unfused graph's MatMul
outputs (H100 sessions, M = 24..256: 1.00-1.04x the unfused graph, max rel. error 4.7e-4 .. 7.4e-4; fp32 G
0.96-1.00x, docs/ffn.md). fp32-input GEMMs (fp32 W) run in TF32 unless strict fp32 is
asked for (fusedffn_cuda.TF32, route ``gemm_tf32``).

Scratch (``prefill_plan`` gives the bytes, a function of M, K, N and the types): G, the converted x, the row scales,
taken once per call from the caller's provider (onnxruntime's ``Context.scratch``).

The tiled kernel: a 64 x 64 output tile for both W1 and W3, 16-deep K tiles in shared memory, 4 x 4 x 2
accumulators per thread, SiLU * mul in the epilogue: correct, not tuned (a 4 x 4 thread block of 8 x 8 tiles under
the simulator).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device import cublas
from ..device.activations import silu
from ..device.fp16 import as_f32, f2h, h2f
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16 as _ld16, ld32 as _ld32, st16 as _st16, st32 as _st32
from ..device.target import SIM

SCRATCH_MAX = 96 << 20          # bytes of scratch per chunk of rows (more rows: several chunks)
TILE = dict(tx=4, ty=4, rm=2, rn=2, bk=4) if SIM else dict(tx=16, ty=16, rm=4, rn=4, bk=16)   # tiled kernel
ACT_BLOCK = 256

U0 = np.uint64(0)
F0, F1 = np.float32(0.0), np.float32(1.0)


def make_tiled(x16, w16, tx=16, ty=16, rm=4, rn=4, bk=16, kn=False):
    """Fused tiled kernel, any M/K/N: block (ty x tx threads) computes a (ty*rm) x (tx*rn) tile of S; ``kn``:
    W1, W3 [K, N] (else [N, K])."""
    ldx = _ld16 if x16 else _ld32
    ldw = _ld16 if w16 else _ld32
    st = _st16 if x16 else _st32
    bm, bn, nt = ty * rm, tx * rn, tx * ty
    xs_size, ws_size, na = bk * bm, bk * bn, rm * rn

    @cuda.jit
    def tiled(x, w1, w3, b1, b3, y, m_dim, k_dim, n_dim, has_b1, has_b3):
        """x [M*K] (T), w1/w3 [N*K] (TW; fp16 as uint16 bits), b1/b3 [N], y [M*N]."""
        xs = cuda.shared.array(xs_size, float32)
        as1 = cuda.shared.array(ws_size, float32)
        as3 = cuda.shared.array(ws_size, float32)
        tid = uint64(cuda.threadIdx.x)
        tc = tid % uint64(tx)
        tr = tid // uint64(tx)
        k64 = uint64(k_dim)
        m64 = uint64(m_dim)
        n64 = uint64(n_dim)
        tiles_n = (n64 + uint64(bn - 1)) // uint64(bn)
        bid = uint64(cuda.blockIdx.x)
        m0 = (bid // tiles_n) * uint64(bm)
        n0 = (bid % tiles_n) * uint64(bn)
        acc1 = cuda.local.array(na, float32)
        acc3 = cuda.local.array(na, float32)
        xr = cuda.local.array(rm, float32)
        for v in range(na):
            acc1[v] = F0
            acc3[v] = F0
        k0 = U0
        while k0 < k64:
            i = tid
            while i < uint64(bm * bk):
                mm = i // uint64(bk)
                kk = i - mm * uint64(bk)
                gm = m0 + mm
                gk = k0 + kk
                xs[kk * uint64(bm) + mm] = ldx(x, gm * k64 + gk) if gm < m64 and gk < k64 else F0
                i += uint64(nt)
            i = tid
            while i < uint64(bn * bk):
                nn = i // uint64(bk)
                kk = i - nn * uint64(bk)
                gn = n0 + nn
                gk = k0 + kk
                ok = gn < n64 and gk < k64
                wi = gk * n64 + gn if kn else gn * k64 + gk
                as1[kk * uint64(bn) + nn] = ldw(w1, wi) if ok else F0
                as3[kk * uint64(bn) + nn] = ldw(w3, wi) if ok else F0
                i += uint64(nt)
            cuda.syncthreads()
            for kk in range(bk):
                for a in range(rm):
                    xr[a] = xs[uint64(kk * bm + a * ty) + tr]
                for b in range(rn):
                    o = uint64(kk * bn + b * tx) + tc
                    v1 = as1[o]
                    v3 = as3[o]
                    for a in range(rm):
                        acc1[a * rn + b] += xr[a] * v1
                        acc3[a * rn + b] += xr[a] * v3
            cuda.syncthreads()
            k0 += uint64(bk)
        for a in range(rm):
            m = m0 + tr + uint64(a * ty)
            for b in range(rn):
                n = n0 + tc + uint64(b * tx)
                if m < m64 and n < n64:
                    gs = acc1[a * rn + b]
                    us = acc3[a * rn + b]
                    if has_b1:
                        gs += ldx(b1, n)
                    if has_b3:
                        us += ldx(b3, n)
                    st(y, m * n64 + n, silu(gs) * us)

    return tiled


ACT_EPT = 4                     # outputs per thread of the elementwise kernel


def act_grid(rows, n, block=ACT_BLOCK):
    """Blocks of the elementwise kernel: each block covers block * ACT_EPT columns of one row."""
    return rows * -(-n // (block * ACT_EPT))


def make_act(x16, g16):
    """S[m, n] = SiLU(sum_s G[s*rows + m, n] + b1[n]) * (sum_s G[s*rows + m, N + n] + b3[n]), G the GEMMs'
    scratch [splits*rows, 2N], fp32 (or fp16 bits with ``g16``) (splits = 2: the hi/lo halves of a split fp32 X,
    scaled by 1/inv[m]). Grid: ``act_grid``."""
    ldx = _ld16 if x16 else _ld32
    ldg = _ld16 if g16 else _ld32
    st = _st16 if x16 else _st32

    @cuda.jit
    def act(gbuf, inv, b1, b3, y, rows, n_dim, splits, has_b1, has_b3):
        per = uint32(cuda.blockDim.x) * uint32(ACT_EPT)
        nb = (uint32(n_dim) + per - uint32(1)) // per
        bid = uint32(cuda.blockIdx.x)
        mrow = bid // nb
        m = uint64(mrow)
        n64 = uint64(n_dim)
        r64 = uint64(rows)
        n0 = uint64((bid - mrow * nb) * per + uint32(cuda.threadIdx.x))
        for q in range(ACT_EPT):
            n = n0 + uint64(q) * uint64(cuda.blockDim.x)
            if n < n64:
                o = m * uint64(2) * n64 + n
                gs = ldg(gbuf, o)
                us = ldg(gbuf, o + n64)
                if splits == 2:
                    o += r64 * uint64(2) * n64
                    gs = (gs + ldg(gbuf, o)) * inv[m]
                    us = (us + ldg(gbuf, o + n64)) * inv[m]
                if has_b1:
                    gs += ldx(b1, n)
                if has_b3:
                    us += ldx(b3, n)
                st(y, m * n64 + n, silu(gs) * us)

    return act


def make_widen():
    @cuda.jit
    def widen(x, xo, count):
        """fp16 bits x -> fp32 xo (exact)."""
        i = uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x) + uint64(cuda.threadIdx.x)
        if i < uint64(count):
            xo[i] = h2f(x[i])

    return widen


def make_split(block=ACT_BLOCK):
    nh = block // 2

    @cuda.jit
    def split(x, xo, inv, rows, k_dim):
        """fp32 X (bits) -> fp16 hi/lo parts for the fp16 GEMM, row r in block r. With e the exponent of
        max_k |x[r, k]| (e >= 16; else f = 1) and f = 2^(141 - e) (exact: the row's largest value lands in
        [2^14, 2^15), inside fp16's range whatever X's range): hi = fp16(x f) -> xo[r K + k],
        lo = fp16(x f - hi) -> xo[(rows + r) K + k] (0 where hi is inf/NaN, which then propagates), inv[r] = 1/f.
        hi + lo = x f to ~2^-22 relative; the elementwise kernel multiplies the GEMM sums by inv[r]."""
        red = cuda.shared.array(block, uint32)
        tid = cuda.threadIdx.x
        r = uint64(cuda.blockIdx.x)
        k64 = uint64(k_dim)
        base = r * k64
        mx = uint32(0)
        k = uint64(tid)
        while k < k64:
            mx = max(mx, uint32(x[base + k]) & uint32(0x7FFFFFFF))
            k += uint64(block)
        red[tid] = mx
        cuda.syncthreads()
        h = nh
        while h > 0:
            if tid < h:
                red[tid] = max(red[tid], red[tid + h])
            cuda.syncthreads()
            h //= 2
        e = uint32(red[0]) >> uint32(23)
        f = as_f32(uint32(268) - e << uint32(23)) if e >= uint32(16) else F1
        if tid == 0:
            inv[r] = as_f32(e - uint32(14) << uint32(23)) if e >= uint32(16) else F1
        k = uint64(tid)
        while k < k64:
            v = as_f32(x[base + k]) * f
            hi = f2h(v)
            hv = h2f(hi)
            xo[base + k] = hi
            xo[uint64(rows) * k64 + base + k] = f2h(v - hv) if hv - hv == F0 else U0
            k += uint64(block)

    return split


def tiled_grid(m, n, t=None):
    t = t or TILE
    return -(-m // (t["ty"] * t["rm"])) * -(-n // (t["tx"] * t["rn"]))


def sig(kind, x16, w16):
    """Launch signature of kernel ``kind`` ('tiled', 'act': ``w16`` meaning an fp16 G, 'widen', 'split')."""
    t = Array(np.uint16) if x16 else Array(np.float32)
    if kind == "tiled":
        tw = Array(np.uint16) if w16 else Array(np.float32)
        return [t, tw, tw, t, t, t] + ["int64"] * 5
    if kind == "act":
        return [Array(np.uint16) if w16 else Array(np.float32), Array(np.float32), t, t, t] + ["int64"] * 5
    if kind == "widen":
        return [Array(np.uint16), Array(np.float32), "int64"]
    return [Array(np.uint32), Array(np.uint16), Array(np.float32), "int64", "int64"]     # split


_launchers = {}


def launcher(kind, x16=False, w16=False, kn=False):
    """Direct-launch wrapper of one kernel, compiled once per process (SimLauncher under the simulator)."""
    key = (kind, x16, w16, kn)
    if key not in _launchers:
        if kind == "tiled":
            fn = make_tiled(x16, w16, **TILE, kn=kn)
        elif kind == "act":
            fn = make_act(x16, w16)
        elif kind == "widen":
            fn = make_widen()
        else:
            fn = make_split()
        _launchers[key] = (SimLauncher if SIM else Launcher)(fn, sig(kind, x16, w16))
    return _launchers[key]


def launch_tiled(lau, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp):
    """The tiled kernel ``lau`` (``launcher('tiled', ...)``) on device pointers (b1p / b3p 0 when absent)."""
    bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
    lau.launch(tiled_grid(m, n), TILE["tx"] * TILE["ty"], stream, (xp, (m * k,)), (w1p, (n * k,)), (w3p, (n * k,)),
               *bias, (yp, (m * n,)), m, k, n, int(b1p != 0), int(b3p != 0))


# ------------------------------------------------------------------------------------------ the cuBLAS path
def _r256(b):
    return -(-b // 256) * 256


def prefill_plan(m, k, n, x16, w16, g16=False, scratch_max=None):
    """(rows per chunk, x conversion: None | 'widen' | 'split', GEMM x type, GEMM w type, scratch layout
    (offset of the converted x, offset of the row scales, total bytes)). Scratch: G [splits*rows, 2N] (fp32, or
    fp16 with ``g16``), then the converted x (fp32 [rows, K] or fp16 hi/lo [2*rows, K]), then fp32 [rows] row
    scales (split). Rows: all M in one chunk if the scratch stays within ``scratch_max`` (default SCRATCH_MAX, read
    at the call), else M split evenly."""
    scratch_max = SCRATCH_MAX if scratch_max is None else scratch_max
    if w16 and not x16:
        conv, xt, wt = "split", cublas.R_16F, cublas.R_16F
    elif x16 and not w16:
        conv, xt, wt = "widen", cublas.R_32F, cublas.R_32F
    else:
        t = cublas.R_16F if x16 else cublas.R_32F
        conv, xt, wt = None, t, t
    splits = 2 if conv == "split" else 1
    row_bytes = splits * 2 * n * (2 if g16 else 4) + (0 if conv is None else k * 4 + 4)
    chunks = -(-m // max(1, scratch_max // row_bytes))
    rows = max(1, -(-m // max(chunks, 1)))
    xoff = _r256(splits * rows * 2 * n * (2 if g16 else 4))
    soff = xoff + (0 if conv is None else _r256(rows * k * 4))
    return rows, conv, xt, wt, (xoff, soff, soff + (rows * 4 if conv == "split" else 0))


def launch_gemm(stream, m, k, n, x16, w16, kn, g16, tf32, xp, w1p, w3p, b1p, b3p, yp, scratch, weight=None):
    """The cuBLAS path on device pointers: ``kn``: W1, W3 [K, N] (op N), else [N, K] (op T); ``g16``: fp16 G;
    ``tf32``: fp32-input GEMMs in TF32; ``scratch``: nbytes -> device pointer of this call's scratch; ``weight``
    (optional; then w1p / w3p are unused): i -> device pointer of W1 (i = 0) / W3 (1), called right before each
    chunk's GEMM with that weight (the 4-bit route dequantises there)."""
    rows, conv, xt, wt, (xoff, soff, nbytes) = prefill_plan(m, k, n, x16, w16, g16)
    xsize = 2 if x16 else 4
    splits = 2 if conv == "split" else 1
    gsize, gt = (2, cublas.R_16F) if g16 else (4, cublas.R_32F)
    compute = cublas.COMPUTE_32F_FAST_TF32 if tf32 and xt == cublas.R_32F else cublas.COMPUTE_32F
    bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
    hb1, hb3 = int(b1p != 0), int(b3p != 0)
    act = launcher("act", x16, g16)
    blas = cublas.handle_for(stream)
    gp = scratch(nbytes)
    xc, sc = gp + xoff, gp + soff
    for r0 in range(0, m, rows):
        r = min(rows, m - r0)
        xr = xp + r0 * k * xsize
        if conv == "widen":
            cnt = r * k
            launcher(conv).launch(-(-cnt // ACT_BLOCK), ACT_BLOCK, stream, (xr, (cnt,)), (xc, (cnt,)), cnt)
            xr = xc
        elif conv == "split":
            launcher(conv).launch(r, ACT_BLOCK, stream, (xr, (r * k,)), (xc, (2 * r * k,)), (sc, (r,)), r, k)
            xr = xc
        for i, off in ((0, 0), (1, n)):
            w = weight(i) if weight is not None else (w1p, w3p)[i]
            blas.gemm_rows(xr, xt, w, wt, gp + off * gsize, splits * r, n, k, 2 * n, gt, w_kn=kn, compute=compute)
        cnt = r * n
        act.launch(act_grid(r, n), ACT_BLOCK, stream, (gp, (splits * r * 2 * n,)),
                   (sc if conv == "split" else gp, (r,)), *bias, (yp + r0 * n * xsize, (cnt,)), r, n, splits, hb1, hb3)

"""QuantGRU, CUDA face: the ``xproj`` kernel -- qWx for all steps and directions at once (quantgru_cuda.py runs it).

An integer GEMM of the quantised X (quantised while it is staged: rint(x 2^e_x) clamped, minus zp_x, so no
row-sum correction is needed) by W, computed exactly on the float pipes (int8: float32 FFMA in chunks of K_F32
products, int16: float64 DFMA; bounds below), 4 x 4 to 8 x 8 outputs per thread read from shared memory with
16-byte vector loads, the tile picked per call by quantgru_cuda.ROUTES from XTILES, then sat(rshift(acc, shW[c]) +
zp_Wx) stored as int16 [D, T, N, 3H]. docs/gru-cuda.md has the derivation and the figures.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint64

from ..device.launch import Array
from ..device.target import SIM
from .common_cuda import NP, PC, P_ZPWX, P_ZPX, rintf, rsh, sat

@cuda.jit(device=True, inline=True)
def _quantf(x, scale, lo, hi):
    """quantgru_rec_cuda's _quant in float32, for X (float32) and a power-of-two scale 2^e, |e| <= 62 (exact in
    float32): x 2^e is exact unless it overflows (inf: clamped to hi as the float64 product would be) or leaves the
    normal range (|x 2^e| < 2^-126 rounds to 0 either way), so the result equals _quant's, as a float."""
    v = x * scale
    if v != v:
        v = float32(0.0)
    return min(max(rintf(v), lo), hi)


# Exact integer products on the float pipes. A staged operand is an integer: a = qx - zp_x with |a| <= 2^bits - 1
# (qx and zp_x both in [qmin, qmax]) and w in [qmin, qmax], so |a w| <= (2^bits - 1) 2^(bits-1).
#   bits=8, float32 (FFMA, twice the IMAD rate on Hopper): |a w| <= 255 * 128 = 32640, so a sum of at most
#     K_F32 = 512 products stays below 512 * 32640 = 16,711,680 < 2^24: every partial sum is an integer that
#     float32 represents exactly, so every FFMA is exact. The K loop runs in chunks of K_F32; each chunk's float
#     sum is converted (exactly) and added to an integer accumulator (int32: |acc| <= C * 32640 < 2^31 for
#     C < 65793; int64 beyond).
#   bits=16, float64 (DFMA: one instruction per product, where int64 multiply-adds take several): |a w| <=
#     65535 * 32768 < 2^31, so a sum of at most K_F64 = 2^22 products stays below 2^53: exact in float64. Larger
#     C are chunked into an int64 accumulator likewise.
K_F32 = 512
K_F64 = 1 << 22
ALIGN = None if SIM else 32     # the shared tiles' alignment (vector loads; the simulator takes no alignment=)
assert K_F32 * 255 * 128 < 1 << 24 and K_F64 * 65535 * 32768 < 1 << 53

if SIM:
    def _lds4(a, i):
        i = int(i)
        return a[i], a[i + 1], a[i + 2], a[i + 3]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _lds4(typingctx, arr, idx):
        """a[i : i + 4] as one vector load (i a multiple of 4, the array 4-element aligned): LDS.128 for
        float32, two LDS.128 for float64."""
        dt = arr.dtype
        rt = types.UniTuple(dt, 4)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            i = context.cast(builder, args[1], sig.args[1], types.uint64)
            p = builder.gep(ary.data, [i], inbounds=True)
            vt = ir.VectorType(context.get_data_type(dt), 4)
            v = builder.load(builder.bitcast(p, vt.as_pointer()), align=4 * dt.bitwidth // 8)
            return context.make_tuple(builder, rt, [builder.extract_element(v, ir.Constant(ir.IntType(32), k))
                                                    for k in range(4)])
        return rt(arr, types.uint64), codegen


@cuda.jit(device=True, inline=True)
def _lds4_into(dst, j, sm, i):
    """dst[j : j + 4] = sm[i : i + 4], one vector load (``_lds4``)."""
    v0, v1, v2, v3 = _lds4(sm, i)
    dst[j] = v0
    dst[j + 1] = v1
    dst[j + 2] = v2
    dst[j + 3] = v3


class XTile:
    """xproj block geometry: ty x tx threads, each rm x rn outputs (rm, rn in {4, 8}: groups of 4 consecutive
    rows / columns, 4 ty (4 tx) apart), so a tile of bm = 4 ty (rm/4) rows by bn = 4 tx (rn/4) columns; bk is the
    K depth staged per round."""

    def __init__(self, bits, name, ty, tx, rm, rn, bk):
        self.name, self.ty, self.tx, self.rm, self.rn, self.bk = name, ty, tx, rm, rn, bk
        self.bm, self.bn, self.nt = ty * rm, tx * rn, ty * tx
        self.smem = 2 * bk * (self.bm + self.bn + 8) * (4 if bits == 8 else 8)   # two rounds of A and B

    def blocks(self, m, g3, dirs):
        return dirs * (-(-m // self.bm)) * (-(-g3 // self.bn))


# tiles per bit width in order of preference, the smallest last (quantgru_cuda.ROUTES picks one per call). 128x64:
# 128 registers (float32) / 168 (float64), 2 / 1 blocks per SM (benchmarks/sass.py)
XTILES = {8: [XTile(8, "128x64", 16, 16, 8, 4, 16),
              XTile(8, "64x64", 16, 16, 4, 4, 32), XTile(8, "32x32", 8, 8, 4, 4, 32)],
          16: [XTile(16, "128x64", 16, 16, 8, 4, 16), XTile(16, "64x64", 16, 16, 4, 4, 16),
               XTile(16, "32x32", 8, 8, 4, 4, 16)]}
if SIM:   # few threads (the simulator runs a Python thread per CUDA thread); still two row and column groups
    XTILES = {b: [XTile(b, "16x16", 2, 2, 8, 8, 4), XTile(b, "8x8", 2, 2, 4, 4, 2)] for b in (8, 16)}


def xtile(bits, name):
    """The tile of XTILES[bits] called ``name``."""
    return next(t for t in XTILES[bits] if t.name == name)


def _make_xproj(bits, tile, chunked, wide, kc=None):
    """xproj for one bit width and tile. chunked: the float sums are moved into an integer accumulator (int64
    when ``wide``, else int32) every kc (default K_F32 / K_F64) products; without it the caller guarantees
    C <= kc (one float sum, converted once)."""
    ft = float32 if bits == 8 else float64
    acc_t = int64 if wide else int32
    kc = kc or (K_F32 if bits == 8 else K_F64)
    ty_n, tx_n, rm, rn, bk = tile.ty, tile.tx, tile.rm, tile.rn, tile.bk
    bm, bn, nt = tile.bm, tile.bn, tile.nt
    assert kc % bk == 0 and rm % 4 == 0 and rn % 4 == 0
    lda, ldb = bm + 4, bn + 4                   # shared rows (one per k) padded: fewer bank conflicts when staging
    assert nt % bk == 0 and bm * bk % nt == 0 and bn * bk % nt == 0
    pa, pb = bm * bk // nt, bn * bk // nt
    rstep = nt // bk
    sa, sb = bk * lda, bk * ldb
    u_lda, u_ldb = np.uint64(lda), np.uint64(ldb)
    nacc = rm * rn

    @cuda.jit
    def xproj(x, w, out, prm, pch, qsc, t_dim, n_dim, c_dim, hd, layout, lo, hi):
        """x float32 [T*N*C] (layout 0) or [N*T*C], w [D*3H*C], out int16 [D*T*N*3H]: row m = t*N + n.
        Block: direction, row tile, column tile. Two shared buffers per operand: round r + 1's values are loaded
        into registers while round r is multiplied, then stored into the other buffer (one barrier per round)."""
        if ALIGN is None:   # the simulator's shared arrays take no alignment= (a constant: compiled out on the GPU)
            sm = cuda.shared.array(0, ft)
        else:
            sm = cuda.shared.array(0, ft, alignment=ALIGN)    # A tiles at 0 and sa, B tiles at 2 sa and 2 sa + sb
        tid = cuda.threadIdx.x
        tx = tid % tx_n
        ty = tid // tx_n
        g3 = 3 * hd
        m_dim = t_dim * n_dim
        ct = (g3 + bn - 1) // bn
        mt = (m_dim + bm - 1) // bm
        bid = cuda.blockIdx.x
        d = bid // (ct * mt)
        rest = bid - d * (ct * mt)
        m0 = (rest // ct) * bm
        c0 = (rest % ct) * bn
        pb_ = d * NP
        zpx = prm[pb_ + P_ZPX]
        scale = float32(qsc[2 * d])
        qlo = float32(lo - zpx)
        qhi = float32(hi - zpx)
        facc = cuda.local.array(nacc, ft)
        iacc = cuda.local.array(nacc if chunked else 1, acc_t)
        for i in range(nacc):
            facc[i] = ft(0)
        if chunked:
            for i in range(nacc):
                iacc[i] = acc_t(0)
        wbase = d * g3 * c_dim
        ra = cuda.local.array(pa, ft)
        rb = cuda.local.array(pb, ft)
        # element r of this thread's share of a round: k = tid % bk, row (tid // bk) + r nt / bk of the tile;
        # offsets of the rows in x / W (unsigned: no negative-index wraparound code; rows past the end read the
        # last row, their outputs are not stored) and the shared index of element 0
        kth = uint64(tid % bk)
        xoff = cuda.local.array(pa, uint64)
        woff = cuda.local.array(pb, uint64)
        for r in range(pa):
            m = min(m0 + tid // bk + r * rstep, m_dim - 1)
            t = m // n_dim
            n = m - t * n_dim
            xoff[r] = uint64((m if layout == 0 else n * t_dim + t) * c_dim) + kth
        for r in range(pb):
            woff[r] = uint64(wbase + min(c0 + tid // bk + r * rstep, g3 - 1) * c_dim) + kth
        xs0 = kth * u_lda + uint64(tid // bk)
        ws0 = np.uint64(2 * sa) + kth * u_ldb + uint64(tid // bk)
        uc = uint64(c_dim)
        for r in range(pa):                     # round 0
            sm[xs0 + np.uint64(r * rstep)] = ft(_quantf(x[xoff[r]], scale, qlo, qhi)) if kth < uc else ft(0)
        for r in range(pb):
            sm[ws0 + np.uint64(r * rstep)] = ft(w[woff[r]]) if kth < uc else ft(0)
        cuda.syncthreads()
        cur = uint64(0)
        k0 = 0
        while k0 < c_dim:
            kn = k0 + bk
            if kn < c_dim:                      # next round's values in flight during this round's products
                ukn = uint64(kn)
                inb = ukn + kth < uc
                for r in range(pa):
                    ra[r] = ft(_quantf(x[xoff[r] + ukn], scale, qlo, qhi)) if inb else ft(0)
                for r in range(pb):
                    rb[r] = ft(w[woff[r] + ukn]) if inb else ft(0)
            ua = cur * np.uint64(sa) + uint64(4 * ty)
            ub = np.uint64(2 * sa) + cur * np.uint64(sb) + uint64(4 * tx)
            for kk in range(bk):
                av = cuda.local.array(rm, ft)
                bv = cuda.local.array(rn, ft)
                for g in range(rm // 4):
                    _lds4_into(av, 4 * g, sm, ua + np.uint64(4 * ty_n * g))
                for g in range(rn // 4):
                    _lds4_into(bv, 4 * g, sm, ub + np.uint64(4 * tx_n * g))
                for i in range(rm):
                    for j in range(rn):
                        facc[i * rn + j] += av[i] * bv[j]
                ua += u_lda
                ub += u_ldb
            if chunked and (kn % kc == 0 or kn >= c_dim):   # a chunk of kc products done: exact, move it
                for i in range(nacc):
                    iacc[i] += acc_t(facc[i])
                    facc[i] = ft(0)
            if kn < c_dim:
                nxt = uint64(1) - cur
                xs = xs0 + nxt * np.uint64(sa)
                ws = ws0 + nxt * np.uint64(sb)
                for r in range(pa):
                    sm[xs + np.uint64(r * rstep)] = ra[r]
                for r in range(pb):
                    sm[ws + np.uint64(r * rstep)] = rb[r]
                cur = nxt
            cuda.syncthreads()
            k0 = kn
        zpwx = prm[pb_ + P_ZPWX]
        for j in range(rn):
            c = c0 + 4 * tx_n * (j // 4) + 4 * tx + j % 4
            if c < g3:
                sh = pch[d * PC * hd + c]
                for i in range(rm):
                    m = m0 + 4 * ty_n * (i // 4) + 4 * ty + i % 4
                    if m < m_dim:
                        v = int64(iacc[i * rn + j]) if chunked else int64(facc[i * rn + j])
                        out[(d * m_dim + m) * g3 + c] = sat(rsh(v, sh) + zpwx, lo, hi)

    return xproj


def sig_xproj(wdt):
    return [Array(np.float32), Array(wdt), Array(np.int16), Array(np.int64), Array(np.int64), Array(np.float64)] + \
        ["int64"] * 7


_xproj_fns = {}


def xproj_fn(bits, tile, c_dim, kc=None):
    """The xproj kernel for one bit width, tile and C (chunked when C exceeds the exact float sum's length)."""
    kc = kc or (K_F32 if bits == 8 else K_F64)
    key = (bits, tile.name, c_dim > kc, bits == 16 or c_dim >= 65536, kc)
    if key not in _xproj_fns:
        _xproj_fns[key] = _make_xproj(bits, tile, *key[2:])
    return _xproj_fns[key]


def compiled():
    """The xproj kernels made so far in this process (tests replay native plans with them)."""
    return list(_xproj_fns.values())

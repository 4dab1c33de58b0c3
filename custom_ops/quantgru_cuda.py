"""QuantGRU, CUDA face: the pure fixed-point GRU of onnx_lowbit.gru_int, bit-exact (spec: docs/gru.md).

Two kernels per call:

* ``xproj`` -- qWx for all steps and directions at once: an integer GEMM of the quantised X (quantised while it
  is staged: rint(x 2^e_x) clamped, minus zp_x, so no row-sum correction is needed) by W, 4 x 4 outputs per
  thread from shared-memory tiles, then sat(rshift(acc, shW[c]) + zp_Wx) stored as int16 [D, T, N, 3H].
* ``rec`` -- the recurrence, one launch for all T steps. Block (group, b) owns the hidden units
  [b*units, +units) of one direction and batch chunk (a group); its 3*units rows of R (as int32) and the three
  lookup tables stay in shared memory for the whole launch. Per step it stages h_{t-1} (minus zp_h) of its
  batch rows from the exchange buffer, computes the R h dot products (each thread: 3 gates x TN batch rows over
  one K slice, then the K slices are summed per output), runs the integer cell for its (n, unit) pairs, writes
  h_t (int16) to the exchange buffer and the dequantised Y / Y_h, and meets the other blocks of its group at a
  barrier: a monotonically growing uint64 counter per group (threadfence + atomic add, spin on an atomic read,
  threadfence), which needs all blocks resident at once -- the launch is cooperative
  (cuLaunchCooperativeKernel). When the grid exceeds what can be resident (occupancy x SMs), or under the CUDA
  simulator (which runs blocks one after the other) where a group has more than one block, the same kernel is
  launched once per step instead (the kernel boundary is the barrier). docs/gru-cuda.md has the figures.

Accumulators: int32 for bits=8 (|R (h - zp)| <= 255 * 128 * H < 2^31 for H <= 32768; likewise W (x - zp) for
C < 65793), int64 for bits=16 (and for bits=8 with C >= 65536). Every quantity after a GEMM is computed in int64
exactly as gru_int.step does.
"""
from __future__ import annotations

import ctypes

import numpy as np
from numba import config, cuda, float32, float64, int32, int64, uint64

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import CH_BR, CH_BX, CH_R, CH_W, Q

from .kernels import Kernel

SIM = bool(config.ENABLE_CUDASIM)

XS = 4 if SIM else 16        # xproj: threads per tile side (each thread 4 x 4 outputs)
XK = 16                      # xproj: K slice staged per round
REC_TPB = 32 if SIM else 256
PAD = 8                      # recurrent weight rows are H + PAD int32 apart (spreads the rows over the banks)
MAX_SMEM = 227 * 1024        # dynamic shared memory per block (H100/H200), opted in once per device
SIM_SMEM = 48 * 1024

# scalar parameters per direction (int64 array prm[D, NP])
(P_ZPX, P_ZPH, P_ZPWX, P_ZPRH, P_SWXZ, P_SRHZ, P_ZPZ, P_SWXR, P_SRHR, P_ZPR, P_SRHAB, P_ZPAB, P_ZPROUT, P_SRRH,
 P_ZPRRH, P_SWXG, P_SRRHG, P_ZPG, P_ZPZOUT, P_ONE, P_ZPGOUT, P_SOLD, P_ZPOLD, P_SNEW, P_ZPNEW, P_SOH, P_SNH,
 NP) = range(28)
# per-channel parameters per direction (int64 array pch[D, 10H]): shifts of W x and R h (3H each), then the
# folded bias terms cz, cr (both biases of z_pre / r_pre), cbg (bx_g for g_pre), cbr (br_g for Rh_add_br)
PC = 10

if SIM:
    def _rint(v):
        return np.rint(v)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _rint(v):
        return libdevice.rint(v)


@cuda.jit(device=True, inline=True)
def _rsh(v, s):
    """gru_int.rshift: v 2^-s rounded half up (s > 0), exact left shift (s <= 0), 0 for s >= 63."""
    if s <= 0:
        return v << (-s)
    if s >= 63:
        return int64(0)
    return (v + (int64(1) << (s - 1))) >> s


@cuda.jit(device=True, inline=True)
def _sat(v, lo, hi):
    return min(max(v, lo), hi)


@cuda.jit(device=True, inline=True)
def _quant(x, scale, lo, hi):
    """gru_int.quantize minus the zero point: rint(x 2^e) (NaN -> 0) clamped to [lo, hi] = [qmin-zp, qmax-zp]."""
    v = float64(x) * scale
    if v != v:
        v = 0.0
    v = _rint(v)
    return int64(min(max(v, float64(lo)), float64(hi)))


@cuda.jit(device=True, inline=True)
def _lut(sm, base, q, lo, sh):
    """gru_int.lut on a table staged as int32 at sm[base:]."""
    u = q - lo
    if sh == 0:
        return int64(sm[base + u])
    i = u >> sh
    t0 = int64(sm[base + i])
    return t0 + _rsh((int64(sm[base + i + 1]) - t0) * (u & ((int64(1) << sh) - 1)), sh)


# ---------------------------------------------------------------------------------------------------- xproj
def _make_xproj(wide, xs=XS):
    acc_t = int64 if wide else int32
    xt = 4 * xs
    t_size = XK * xt
    per = t_size // (xs * xs)        # tile elements each thread stages per K round (of X and of W)
    u_xs, u_xt = np.uint64(xs), np.uint64(xt)

    @cuda.jit
    def xproj(x, w, out, prm, pch, qsc, t_dim, n_dim, c_dim, hd, layout, lo, hi):
        """x float32 [T*N*C] (layout 0) or [N*T*C], w [D*3H*C], out int16 [D*T*N*3H]: row m = t*N + n.
        Block: direction, row tile, column tile; xs x xs threads, 4 x 4 outputs each (rows ty + xs i,
        columns tx + xs j). The next K round's X and W values are loaded into registers while the current
        round's tiles are multiplied."""
        a_s = cuda.shared.array(t_size, int32)
        b_s = cuda.shared.array(t_size, int32)
        tid = cuda.threadIdx.x
        tx = tid % xs
        ty = tid // xs
        g3 = 3 * hd
        m_dim = t_dim * n_dim
        ct = (g3 + xt - 1) // xt
        mt = (m_dim + xt - 1) // xt
        bid = cuda.blockIdx.x
        d = bid // (ct * mt)
        rest = bid - d * (ct * mt)
        m0 = (rest // ct) * xt
        c0 = (rest % ct) * xt
        pb = d * NP
        zpx = prm[pb + P_ZPX]
        scale = qsc[2 * d]
        acc = cuda.local.array(16, acc_t)
        for i in range(16):
            acc[i] = acc_t(0)
        wbase = d * g3 * c_dim
        ra = cuda.local.array(per, int32)
        rb = cuda.local.array(per, int32)
        xoff = cuda.local.array(per, int64)     # this thread's staged elements: row offsets in x and W (-1: none)
        woff = cuda.local.array(per, int64)
        sidx = cuda.local.array(per, uint64)
        for r in range(per):
            e = tid + r * xs * xs
            sidx[r] = uint64((e % XK) * xt + e // XK)
            rr = e // XK
            m = m0 + rr
            xoff[r] = -1
            if m < m_dim:
                t = m // n_dim
                n = m - t * n_dim
                xoff[r] = (m if layout == 0 else n * t_dim + t) * c_dim
            c = c0 + rr
            woff[r] = wbase + c * c_dim if c < g3 else -1
        k0 = 0
        for r in range(per):                    # round 0 into registers
            k = (tid + r * xs * xs) % XK
            ra[r] = int32(_quant(x[xoff[r] + k], scale, lo - zpx, hi - zpx)) if k < c_dim and xoff[r] >= 0 \
                else int32(0)
            rb[r] = int32(w[woff[r] + k]) if k < c_dim and woff[r] >= 0 else int32(0)
        while k0 < c_dim:
            for r in range(per):
                a_s[sidx[r]] = ra[r]
                b_s[sidx[r]] = rb[r]
            cuda.syncthreads()
            kn = k0 + XK
            if kn < c_dim:                      # next round in flight during this round's products
                for r in range(per):
                    k = kn + (tid + r * xs * xs) % XK
                    ra[r] = int32(_quant(x[xoff[r] + k], scale, lo - zpx, hi - zpx)) \
                        if k < c_dim and xoff[r] >= 0 else int32(0)
                    rb[r] = int32(w[woff[r] + k]) if k < c_dim and woff[r] >= 0 else int32(0)
            ua = uint64(ty)                     # unsigned indices: no negative-index wraparound code
            ub = uint64(tx)
            for kk in range(XK):
                av = cuda.local.array(4, acc_t)
                for i in range(4):
                    av[i] = acc_t(a_s[ua + u_xs * uint64(i)])
                for j in range(4):
                    bv = acc_t(b_s[ub + u_xs * uint64(j)])
                    for i in range(4):
                        acc[i * 4 + j] += av[i] * bv
                ua += u_xt
                ub += u_xt
            cuda.syncthreads()
            k0 = kn
        zpwx = prm[pb + P_ZPWX]
        for i in range(4):
            m = m0 + ty + xs * i
            if m < m_dim:
                for j in range(4):
                    c = c0 + tx + xs * j
                    if c < g3:
                        q = _sat(_rsh(int64(acc[i * 4 + j]), pch[d * PC * hd + c]) + zpwx, lo, hi)
                        out[(d * m_dim + m) * g3 + c] = q

    return xproj


# ---------------------------------------------------------------------------------------------------- rec
@cuda.jit(device=True, inline=True)
def _barrier(cnt, grp, nblk, target):
    """Thread 0 of each block: arrives at the group's barrier and waits until all nblk blocks arrived; returns
    the counter value that ends the next round. cnt[grp] only grows, so it needs no reset: a launch leaves it at
    a multiple of nblk. The first barrier of a launch (target 0) learns its round from its ticket; later ones
    know their target and arrive with a reduction (no returned value to wait for)."""
    cuda.threadfence()                                   # release: this block's h stores before the arrival
    if target == uint64(0):
        ticket = cuda.atomic.add(cnt, grp, uint64(1))
        target = (ticket // uint64(nblk) + uint64(1)) * uint64(nblk)
    else:
        cuda.atomic.add(cnt, grp, uint64(1))
    while cuda.atomic.add(cnt, grp, uint64(0)) < target:   # an L2-coherent read
        pass
    cuda.threadfence()                                   # acquire: the other blocks' h stores are visible
    return target + uint64(nblk)


if SIM:
    def _ksum(v, ks):
        return v
else:
    @cuda.jit(device=True, inline=True)
    def _ksum(v, ks):
        """Sum over the ks consecutive lanes (ks a power of two <= 32) that hold one output's K slices."""
        off = 16
        while off >= 1:
            if off < ks:
                v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off >>= 1
        return v


@cuda.jit(device=True, inline=True)
def _h16(w, i):
    """Signed 16-bit lane i of a uint64 word."""
    v = int64((w >> uint64(16 * i)) & uint64(0xFFFF))
    return (v ^ 0x8000) - 0x8000


def _make_rec(wide, tn, tpb=REC_TPB):
    acc_t = int64 if wide else int32
    na = 3 * tn
    shfl = not SIM          # K slices summed with warp shuffles (the simulator has none: shared memory there)

    @cuda.jit
    def rec(qwx, rq, lut, h0, seql, hb, hw, y, yh, cnt, prm, pch, qsc, dq,
            t_dim, n_dim, hd, dirs, nch, nbc, units, ks, s0, s1, nblk, revmask, layout, lo, hi, lsh, llen,
            flags, pc_off, rs_off, hs_off, lt_off):
        """qwx int16 [D*T*N*3H] (xproj), rq [D*3H*H], lut [D*3*llen], h0 float32 [D*N*H] or [N*D*H] (layout 1),
        seql int32 [N], hb int16 [2*D*N*H] (h of the last two steps: the blocks' exchange; hw: the same buffer as
        uint64 words, used when H % 4 == 0), y float32 [T*D*N*H] or [N*T*D*H], yh float32 [D*N*H] or [N*D*H],
        cnt uint64 [D*nch] (barrier counters), prm int64 [D*NP], pch int64 [D*10H], qsc float64 [D*2]
        (2^e_x, 2^e_h), dq float32 [D] (2^-e_h). flags: 1 has h0, 2 has sequence_lens, 4 write Y, 8 write Y_h,
        16 H % 4 == 0. Grid: D*nch groups x nblk blocks. Dynamic shared memory: int64 sums at 0, int64
        per-unit parameters at pc_off, then int32 (word offsets): R rows at rs_off, h at hs_off, tables at
        lt_off."""
        sm64 = cuda.shared.array(0, int64)
        sm32 = cuda.shared.array(0, int32)
        tid = cuda.threadIdx.x
        bid = cuda.blockIdx.x
        grp_id = bid // nblk
        d = grp_id // nch
        n0 = (grp_id - d * nch) * nbc
        nb = min(nbc, n_dim - n0)
        u0 = (bid - grp_id * nblk) * units
        nu = min(units, hd - u0)
        g3 = 3 * hd
        rs = hd + PAD
        pb = d * NP
        cb = d * PC * hd
        zph = prm[pb + P_ZPH]
        zprh = prm[pb + P_ZPRH]
        zpwx = prm[pb + P_ZPWX]
        s_wxz = prm[pb + P_SWXZ]
        s_rhz = prm[pb + P_SRHZ]
        zpz = prm[pb + P_ZPZ]
        s_wxr = prm[pb + P_SWXR]
        s_rhr = prm[pb + P_SRHR]
        zpr = prm[pb + P_ZPR]
        s_rhab = prm[pb + P_SRHAB]
        zpab = prm[pb + P_ZPAB]
        zprout = prm[pb + P_ZPROUT]
        s_rrh = prm[pb + P_SRRH]
        zprrh = prm[pb + P_ZPRRH]
        s_wxg = prm[pb + P_SWXG]
        s_rrhg = prm[pb + P_SRRHG]
        zpg = prm[pb + P_ZPG]
        zpzout = prm[pb + P_ZPZOUT]
        one = prm[pb + P_ONE]
        zpgout = prm[pb + P_ZPGOUT]
        s_old = prm[pb + P_SOLD]
        zpold = prm[pb + P_ZPOLD]
        s_new = prm[pb + P_SNEW]
        zpnew = prm[pb + P_ZPNEW]
        s_oh = prm[pb + P_SOH]
        s_nh = prm[pb + P_SNH]
        rev = (revmask >> d) & 1
        ngr = (nb + tn - 1) // tn
        nitems = ngr * nu * ks
        nitems_w = (nitems + 31) // 32 * 32 if shfl else nitems   # whole warps take part in the shuffles
        scale_h = qsc[2 * d + 1]
        dqh = dq[d]
        e = tid
        while e < 3 * nu * hd:                  # weight row j*3+g of the slice = R[d, g*H + u0 + j, :]
            k = e % hd
            row = e // hd
            j = row // 3
            sm32[rs_off + row * rs + k] = int32(rq[(d * g3 + (row - 3 * j) * hd + u0 + j) * hd + k])
            e += tpb
        e = tid
        while e < 3 * llen:
            sm32[lt_off + e] = int32(lut[d * 3 * llen + e])
            e += tpb
        e = tid
        while e < 7 * nu:                       # per unit: R h shifts (z, r, g), cz, cr, cbg, cbr
            j = e // 7
            i = e - 7 * j
            col = (3 + i) * hd + u0 + j if i < 3 else (6 + i - 3) * hd + u0 + j
            sm64[pc_off + e] = pch[cb + col]
            e += tpb
        e = nb * hd + tid                       # padding rows of the last batch group: zero
        while e < ngr * tn * hd:
            sm32[hs_off + e] = int32(0)
            e += tpb
        # the x parts of the first cell item of this thread, loaded a step ahead (before the barrier)
        pe = tid < nb * nu
        pnl = tid // nu
        pln = int64(t_dim)
        if pe and flags & 2:
            pln = int64(seql[n0 + pnl])
        pxb = ((d * t_dim + (pln - 1 - s0 if rev else s0)) * n_dim + n0 + pnl) * g3 + u0 + tid - pnl * nu
        pz = int64(0)
        pr = int64(0)
        pg = int64(0)
        if pe and s0 < pln:
            pz = int64(qwx[pxb])
            pr = int64(qwx[pxb + hd])
            pg = int64(qwx[pxb + 2 * hd])
        target = uint64(0)                      # barrier: the counter value that ends the next round
        s = s0
        while s < s1:
            cur = s & 1
            if s == 0:                          # h_{-1}: the quantised initial state (or zp_h), minus zp_h
                e = tid
                while e < nb * hd:
                    v = int64(0)
                    if flags & 1:
                        n = n0 + e // hd
                        k = e % hd
                        v = _quant(h0[(d * n_dim + n) * hd + k if layout == 0 else (n * dirs + d) * hd + k],
                                   scale_h, lo - zph, hi - zph)
                    sm32[hs_off + e] = int32(v)
                    e += tpb
            elif flags & 16:                    # h_{s-1} as 8-byte words, 4 loads in flight per thread
                nw = nb * hd // 4
                wb0 = ((cur * dirs + d) * n_dim + n0) * hd // 4
                e = tid
                while e < nw:
                    w0 = hw[wb0 + e]
                    w1 = hw[wb0 + e + tpb] if e + tpb < nw else uint64(0)
                    w2 = hw[wb0 + e + 2 * tpb] if e + 2 * tpb < nw else uint64(0)
                    w3 = hw[wb0 + e + 3 * tpb] if e + 3 * tpb < nw else uint64(0)
                    for i in range(4):
                        sm32[hs_off + 4 * e + i] = int32(_h16(w0, i) - zph)
                    if e + tpb < nw:
                        for i in range(4):
                            sm32[hs_off + 4 * (e + tpb) + i] = int32(_h16(w1, i) - zph)
                    if e + 2 * tpb < nw:
                        for i in range(4):
                            sm32[hs_off + 4 * (e + 2 * tpb) + i] = int32(_h16(w2, i) - zph)
                    if e + 3 * tpb < nw:
                        for i in range(4):
                            sm32[hs_off + 4 * (e + 3 * tpb) + i] = int32(_h16(w3, i) - zph)
                    e += 4 * tpb
            else:
                hb0 = ((cur * dirs + d) * n_dim + n0) * hd
                e = tid
                while e < nb * hd:
                    v0 = hb[hb0 + e]
                    v1 = hb[hb0 + e + tpb] if e + tpb < nb * hd else v0
                    sm32[hs_off + e] = int32(v0) - int32(zph)
                    if e + tpb < nb * hd:
                        sm32[hs_off + e + tpb] = int32(v1) - int32(zph)
                    e += 2 * tpb
            cuda.syncthreads()
            it = tid                            # item ((batch group * nu) + j) * ks + K slice
            while it < nitems_w:
                a = cuda.local.array(na, acc_t)
                for i in range(na):
                    a[i] = acc_t(0)
                if it < nitems:
                    sl = it % ks
                    rest = it // ks
                    j = rest % nu
                    bg = rest // nu
                    w_0 = uint64(rs_off + j * 3 * rs)    # unsigned indices: no negative-index wraparound
                    w_1 = uint64(rs_off + j * 3 * rs + rs)
                    w_2 = uint64(rs_off + j * 3 * rs + 2 * rs)
                    h_0 = uint64(hs_off + bg * tn * hd)
                    hdu = uint64(hd)
                    ksu = uint64(ks)
                    k = uint64(sl)
                    while k < hdu:
                        w0 = acc_t(sm32[w_0 + k])
                        w1 = acc_t(sm32[w_1 + k])
                        w2 = acc_t(sm32[w_2 + k])
                        for m in range(tn):
                            hv = acc_t(sm32[h_0 + uint64(m) * hdu + k])
                            a[3 * m] += w0 * hv
                            a[3 * m + 1] += w1 * hv
                            a[3 * m + 2] += w2 * hv
                        k += ksu
                if shfl:
                    for i in range(na):
                        a[i] = _ksum(a[i], ks)
                    if it < nitems and it % ks == 0:
                        for i in range(na):
                            sm64[(it // ks) * na + i] = int64(a[i])
                else:
                    for i in range(na):
                        sm64[it * na + i] = int64(a[i])
                it += tpb
            cuda.syncthreads()
            nxt = 1 - cur
            e = tid
            while e < nb * nu:                  # the cell of (batch row n, unit u)
                nl = e // nu
                j = e - nl * nu
                u = u0 + j
                n = n0 + nl
                bg = nl // tn
                hold = int64(sm32[hs_off + nl * hd + u]) + zph
                ln = pln
                if e != tid:
                    ln = int64(seql[n]) if flags & 2 else int64(t_dim)
                hn = hold
                if s < ln:
                    t = ln - 1 - s if rev else s
                    if e == tid:
                        dwz = pz - zpwx
                        dwr = pr - zpwx
                        dwg = pg - zpwx
                    else:
                        xb = ((d * t_dim + t) * n_dim + n) * g3 + u
                        dwz = int64(qwx[xb]) - zpwx
                        dwr = int64(qwx[xb + hd]) - zpwx
                        dwg = int64(qwx[xb + 2 * hd]) - zpwx
                    if shfl:
                        ib = (bg * nu + j) * na + 3 * (nl - bg * tn)
                        az = sm64[ib]
                        ar = sm64[ib + 1]
                        ag = sm64[ib + 2]
                    else:
                        ib = ((bg * nu + j) * ks) * na + 3 * (nl - bg * tn)
                        az = int64(0)
                        ar = int64(0)
                        ag = int64(0)
                        for sl in range(ks):
                            az += sm64[ib + sl * na]
                            ar += sm64[ib + sl * na + 1]
                            ag += sm64[ib + sl * na + 2]
                    pc = pc_off + 7 * j
                    drz = _sat(_rsh(az, sm64[pc]) + zprh, lo, hi) - zprh
                    drr = _sat(_rsh(ar, sm64[pc + 1]) + zprh, lo, hi) - zprh
                    drg = _sat(_rsh(ag, sm64[pc + 2]) + zprh, lo, hi) - zprh
                    zpre = _sat(_rsh(dwz, s_wxz) + _rsh(drz, s_rhz) + sm64[pc + 3] + zpz, lo, hi)
                    rpre = _sat(_rsh(dwr, s_wxr) + _rsh(drr, s_rhr) + sm64[pc + 4] + zpr, lo, hi)
                    qz = _lut(sm32, lt_off, zpre, lo, lsh)
                    qr = _lut(sm32, lt_off + llen, rpre, lo, lsh)
                    qrb = _sat(_rsh(drg, s_rhab) + sm64[pc + 6] + zpab, lo, hi)
                    qrrh = _sat(_rsh((qr - zprout) * (qrb - zpab), s_rrh) + zprrh, lo, hi)
                    gpre = _sat(_rsh(dwg, s_wxg) + _rsh(qrrh - zprrh, s_rrhg) + sm64[pc + 5] + zpg, lo, hi)
                    qg = _lut(sm32, lt_off + 2 * llen, gpre, lo, lsh)
                    dz = qz - zpzout
                    qold = _sat(_rsh(dz * (hold - zph), s_old) + zpold, lo, hi)
                    qnew = _sat(_rsh((one - dz) * (qg - zpgout), s_new) + zpnew, lo, hi)
                    hn = _sat(_rsh(qold - zpold, s_oh) + _rsh(qnew - zpnew, s_nh) + zph, lo, hi)
                    if flags & 4:
                        yi = ((t * dirs + d) * n_dim + n) * hd + u if layout == 0 else \
                            ((n * t_dim + t) * dirs + d) * hd + u
                        y[yi] = float32(hn - zph) * dqh
                elif flags & 4:
                    yi = ((s * dirs + d) * n_dim + n) * hd + u if layout == 0 else ((n * t_dim + s) * dirs + d) * hd + u
                    y[yi] = float32(0.0)
                hb[((nxt * dirs + d) * n_dim + n) * hd + u] = hn
                if s == t_dim - 1 and flags & 8:        # 0 for length-0 entries (as onnxruntime's GRU)
                    yh[(d * n_dim + n) * hd + u if layout == 0 else (n * dirs + d) * hd + u] = \
                        float32(hn - zph) * dqh if ln > 0 else float32(0.0)
                e += tpb
            cuda.syncthreads()
            if pe and s + 1 < pln and s + 1 < s1:       # next step's x parts, in flight during the barrier
                pxb = ((d * t_dim + (pln - 2 - s if rev else s + 1)) * n_dim + n0 + pnl) * g3 + u0 + tid - pnl * nu
                pz = int64(qwx[pxb])
                pr = int64(qwx[pxb + hd])
                pg = int64(qwx[pxb + 2 * hd])
            if s + 1 < s1 and nblk > 1:
                if tid == 0:
                    target = _barrier(cnt, grp_id, nblk, target)
                cuda.syncthreads()
            s += 1
        if t_dim == 0 and flags & 8:            # no steps: every entry has length 0, Y_h = 0
            e = tid
            while e < nb * nu:
                nl = e // nu
                u = u0 + e - nl * nu
                n = n0 + nl
                yh[(d * n_dim + n) * hd + u if layout == 0 else (n * dirs + d) * hd + u] = float32(0.0)
                e += tpb

    return rec


# ---------------------------------------------------------------------------------------------------- host side
def prepare(a: gru_int.GRUAttrs, B, channel_exp):
    """Kernel parameters from validated attributes and the host values of B [D, 6H] and channel_exp [D, 4, 3H]:
    prm int64 [D, NP], pch int64 [D, 10H], qsc float64 [D, 2] (2^e_x, 2^e_h), dq float32 [D] (2^-e_h)."""
    d, h = a.num_directions, a.hidden_size
    prm = np.zeros((d, NP), np.int64)
    pch = np.zeros((d, PC * h), np.int64)
    qsc = np.zeros((d, 2), np.float64)
    dq = np.zeros(d, np.float32)
    B = np.asarray(B, np.int64)
    ce = np.asarray(channel_exp, np.int64)
    for k in range(d):
        E = {n: int(a.exponents[k, Q[n]]) for n in gru_int.QUANTITIES}
        Z = {n: int(a.zero_points[k, Q[n]]) for n in gru_int.QUANTITIES}
        p = prm[k]
        p[P_ZPX], p[P_ZPH], p[P_ZPWX], p[P_ZPRH] = Z["x"], Z["h"], Z["Wx"], Z["Rh"]
        p[P_SWXZ], p[P_SRHZ], p[P_ZPZ] = E["Wx"] - E["z_pre"], E["Rh"] - E["z_pre"], Z["z_pre"]
        p[P_SWXR], p[P_SRHR], p[P_ZPR] = E["Wx"] - E["r_pre"], E["Rh"] - E["r_pre"], Z["r_pre"]
        p[P_SRHAB], p[P_ZPAB], p[P_ZPROUT] = E["Rh"] - E["Rh_add_br"], Z["Rh_add_br"], Z["r_out"]
        p[P_SRRH], p[P_ZPRRH] = E["r_out"] + E["Rh_add_br"] - E["rRh"], Z["rRh"]
        p[P_SWXG], p[P_SRRHG], p[P_ZPG] = E["Wx"] - E["g_pre"], E["rRh"] - E["g_pre"], Z["g_pre"]
        p[P_ZPZOUT], p[P_ONE], p[P_ZPGOUT] = Z["z_out"], 1 << E["z_out"], Z["g_out"]
        p[P_SOLD], p[P_ZPOLD] = E["z_out"] + E["h"] - E["old"], Z["old"]
        p[P_SNEW], p[P_ZPNEW] = E["z_out"] + E["g_out"] - E["new"], Z["new"]
        p[P_SOH], p[P_SNH] = E["old"] - E["h"], E["new"] - E["h"]
        c = pch[k]
        c[:3 * h] = ce[k, CH_W] + E["x"] - E["Wx"]
        c[3 * h:6 * h] = ce[k, CH_R] + E["h"] - E["Rh"]
        bx, br, cbx, cbr = B[k, :3 * h], B[k, 3 * h:], ce[k, CH_BX], ce[k, CH_BR]
        zs, rs_, gs = slice(0, h), slice(h, 2 * h), slice(2 * h, 3 * h)
        c[6 * h:7 * h] = (gru_int.rshift(bx[zs], cbx[zs] - E["z_pre"]) + gru_int.rshift(br[zs], cbr[zs] - E["z_pre"]))
        c[7 * h:8 * h] = (gru_int.rshift(bx[rs_], cbx[rs_] - E["r_pre"])
                          + gru_int.rshift(br[rs_], cbr[rs_] - E["r_pre"]))
        c[8 * h:9 * h] = gru_int.rshift(bx[gs], cbx[gs] - E["g_pre"])
        c[9 * h:] = gru_int.rshift(br[gs], cbr[gs] - E["Rh_add_br"])
        qsc[k] = np.ldexp(1.0, E["x"]), np.ldexp(1.0, E["h"])
        dq[k] = np.float32(np.ldexp(1.0, -E["h"]))
    return prm, pch, qsc, dq


class Plan:
    """Geometry of the recurrent kernel for one (N, H, D) and bit width."""

    def __init__(self, n, h, dirs, bits, sms, *, units=None, tpb=REC_TPB, smem_cap=None):
        smem_cap = smem_cap or (SIM_SMEM if SIM else MAX_SMEM)
        self.tn = 1 if n < 2 else (2 if n < 4 else 4)
        self.llen = gru_int.lut_len(bits)
        self.tpb = tpb
        per_group = max(1, sms // dirs)
        units = units or max(-(-h // per_group), 4)
        units = min(units, h)
        nbc = max(n, 1)
        while True:
            self._layout(n, h, nbc, units)
            if self.smem <= smem_cap:
                break
            if nbc > 1:
                nbc = -(-nbc // 2)
            elif units > 1:
                units = -(-units // 2)
            else:
                raise ValueError(f"hidden_size {h} is too large for the CUDA kernel (one block needs "
                                 f"{self.smem} bytes of shared memory, at most {smem_cap})")
        self.nch = -(-max(n, 1) // nbc)
        self.nblk = -(-h // self.units)
        self.groups = dirs * self.nch
        self.grid = self.groups * self.nblk

    def _layout(self, n, h, nbc, units):
        tn = self.tn
        ngr = -(-nbc // tn)
        ks = max(1, min(32, self.tpb // (ngr * units), h))
        ks = 1 << (ks.bit_length() - 1)             # a power of two (the warp-shuffle sums)
        nitems = ngr * units * ks
        self.nbc, self.units, self.ks = nbc, units, ks
        sums = (ngr * units if not SIM else nitems) * 3 * tn
        self.pc_off = sums
        self.rs_off = 2 * (sums + 7 * units)
        self.hs_off = self.rs_off + 3 * units * (h + PAD)
        self.lt_off = self.hs_off + ngr * tn * h
        self.smem = 4 * (self.lt_off + 3 * self.llen)


_launchers = {}


def _sig_xproj(wdt):
    from .cuda_launch import Array
    return [Array(np.float32), Array(wdt), Array(np.int16), Array(np.int64), Array(np.int64), Array(np.float64)] + \
        ["int64"] * 7


def _sig_rec(wdt):
    from .cuda_launch import Array
    return [Array(np.int16), Array(wdt), Array(wdt), Array(np.float32), Array(np.int32), Array(np.int16),
            Array(np.uint64), Array(np.float32), Array(np.float32), Array(np.uint64), Array(np.int64),
            Array(np.int64), Array(np.float64), Array(np.float32)] + ["int64"] * 22


_xproj_fns, _rec_fns = {}, {}


def xproj_fn(wide):
    if wide not in _xproj_fns:
        _xproj_fns[wide] = _make_xproj(wide)
    return _xproj_fns[wide]


def rec_fn(wide, tn):
    if (wide, tn) not in _rec_fns:
        _rec_fns[(wide, tn)] = _make_rec(wide, tn)
    return _rec_fns[(wide, tn)]


def function_handle(launcher):
    """The CUfunction of a Launcher's kernel in the current context (Numba may hold a CUkernel, which not every
    driver call takes: cuKernelGetFunction; an error means the handle already is a CUfunction)."""
    from .cuda_launch import libcuda
    fn = libcuda().cuKernelGetFunction
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    f = ctypes.c_void_p()
    return f if fn(ctypes.byref(f), launcher.handle) == 0 and f.value else launcher.handle


class _CoopLauncher:
    """Makes a Launcher's launches cooperative (cuLaunchCooperativeKernel: all blocks resident, or an error)."""

    def __init__(self, launcher):
        from .cuda_launch import libcuda
        fn = libcuda().cuLaunchCooperativeKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2
        self.func = None

        def launch(f, gx, gy, gz, bx, by, bz, sh, st, p, extra):
            if self.func is None:
                self.func = function_handle(launcher)
            return fn(self.func, gx, gy, gz, bx, by, bz, sh, st, p)
        launcher._launch = launch
        self.launcher = launcher


def launchers(bits, tn, c_dim):
    """(xproj, rec, rec cooperative) direct-launch wrappers, compiled once per process."""
    from .cuda_launch import Launcher
    wdt = np.int8 if bits == 8 else np.int16
    wide_x = bits == 16 or c_dim >= 65536
    key = (bits, tn, wide_x)
    if key not in _launchers:
        xp = Launcher(xproj_fn(wide_x), _sig_xproj(wdt))
        rc = Launcher(rec_fn(bits == 16, tn), _sig_rec(wdt), dynamic_shared=MAX_SMEM)
        rcc = Launcher(rec_fn(bits == 16, tn), _sig_rec(wdt), dynamic_shared=MAX_SMEM)
        _CoopLauncher(rcc)
        _launchers[key] = (xp, rc, rcc)
    return _launchers[key]


def occupancy(launcher, tpb, smem):
    """Resident blocks per SM of a Launcher's kernel with ``smem`` bytes of dynamic shared memory (after the
    kernel was opted in to MAX_SMEM)."""
    from .cuda_launch import check, current_device, libcuda
    dev = current_device()
    if dev not in launcher._configured:      # the Launcher opts in on its first launch; occupancy needs it now
        launcher._configure(dev)
    fn = libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    v = ctypes.c_int(0)
    check(fn(ctypes.byref(v), function_handle(launcher), tpb, smem), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return v.value


def _xgrid(t, n, h, dirs):
    xt = 4 * XS
    return dirs * (-(-(t * n) // xt)) * (-(-(3 * h) // xt))


class Prepared:
    """One QuantGRU call on device arrays: validated shapes, the plan, parameters and scratch; ``launch(stream)``
    issues its kernels (tests and benchmarks; the onnxruntime kernel below does the same on onnxruntime's
    buffers)."""

    def __init__(self, X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
                 exponents, zero_points, direction="forward", layout=0, units=None, per_step=False, sms=None):
        a = self.a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
        X = np.ascontiguousarray(X, np.float32)
        t, n, c = gru_int.check_inputs(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
        self.t, self.n, self.c, self.h, self.d = t, n, c, a.hidden_size, a.num_directions
        if not SIM:
            from .cuda_launch import current_device, sm_count
            sms = sms or sm_count(current_device())
        self.plan = Plan(n, self.h, self.d, bits, sms or 4, units=units)
        # the simulator runs blocks one after the other: a launch of several steps only without barriers there
        self.per_step = per_step or (SIM and self.plan.nblk > 1)
        prm, pch, qsc, dq = prepare(a, B, channel_exp)
        dev = lambda v, dt: cuda.to_device(np.ascontiguousarray(v, dt).reshape(-1))  # noqa: E731
        qt = np.int8 if bits == 8 else np.int16
        self.x, self.w, self.r, self.lut = dev(X, np.float32), dev(W, qt), dev(R, qt), dev(luts, qt)
        self.prm, self.pch, self.qsc, self.dq = dev(prm, np.int64), dev(pch, np.int64), dev(qsc, np.float64), \
            dev(dq, np.float32)
        self.flags = 12 | (1 if initial_h is not None else 0) | (2 if sequence_lens is not None else 0) | \
            (16 if hidden_size % 4 == 0 else 0)
        self.h0 = dev(initial_h if initial_h is not None else np.zeros(1), np.float32)
        self.seql = dev(sequence_lens if sequence_lens is not None else np.zeros(1), np.int32)
        d, h = self.d, self.h
        self.qwx = cuda.device_array(max(d * t * n * 3 * h, 1), np.int16)
        self.hb = cuda.device_array(-(-max(2 * d * n * h, 4) // 4) * 4, np.int16)
        self.hw = self.hb.view(np.uint64)
        self.y = cuda.device_array(max(t * d * n * h, 1), np.float32)
        self.yh = cuda.device_array(max(d * n * h, 1), np.float32)
        self.cnt = cuda.to_device(np.zeros(self.plan.groups, np.uint64))
        self.revmask = 1 if direction == "reverse" else (2 if direction == "bidirectional" else 0)
        self.lo, self.hi = gru_int.qrange(bits)
        self.wide_x = bits == 16 or c >= 65536

    def _args(self, p):
        return ((self.qwx, self.r, self.lut, self.h0, self.seql, self.hb, self.hw, self.y, self.yh, self.cnt,
                 self.prm,
                 self.pch, self.qsc, self.dq),
                (self.t, self.n, self.h, self.d, p.nch, p.nbc, p.units, p.ks),
                (p.nblk, self.revmask, self.a.layout, self.lo, self.hi, gru_int.LUT_SHIFT[self.a.bits], p.llen,
                 self.flags, p.pc_off, p.rs_off, p.hs_off, p.lt_off))

    def launch(self, stream=0, what="all"):
        """Issues the call's kernels on ``stream`` (``what``: "all", or "xproj" / "rec" alone, for timing)."""
        p, bits = self.plan, self.a.bits
        xargs = (self.x, self.w, self.qwx, self.prm, self.pch, self.qsc)
        xsc = (self.t, self.n, self.c, self.h, self.a.layout, self.lo, self.hi)
        arrays, head, tail = self._args(p)
        steps = [(s, s + 1) for s in range(self.t)] if self.per_step else [(0, self.t)]
        if self.t == 0:
            steps = [(0, 0)]
        if SIM:
            if self.t * self.n:
                xproj_fn(self.wide_x)[_xgrid(self.t, self.n, self.h, self.d), XS * XS](*xargs, *xsc)
            k = rec_fn(bits == 16, p.tn)
            for s0, s1 in steps:
                k[p.grid, p.tpb, 0, p.smem](*arrays, *head, s0, s1, *tail)
            return
        ptr = lambda v: (v.device_ctypes_pointer.value, (v.size,))  # noqa: E731
        self.per_step = issue(bits, p, self.c, self.t, self.n, [ptr(v) for v in xargs], xsc,
                              [ptr(v) for v in arrays], head, tail, stream, self.per_step, what)

    def result(self):
        """(Y, Y_h) as numpy arrays with the reference's shapes."""
        cuda.synchronize()
        t, n, h, d = self.t, self.n, self.h, self.d
        y = self.y.copy_to_host()[: t * d * n * h]
        yh = self.yh.copy_to_host()[: d * n * h]
        if self.a.layout == 0:
            return y.reshape(t, d, n, h), yh.reshape(d, n, h)
        return y.reshape(n, t, d, h), yh.reshape(n, d, h)


def issue(bits, p, c, t, n, xarrays, xsc, arrays, head, tail, stream, per_step, what="all"):
    """GPU: launches xproj and the recurrent kernel (cooperative, all steps; or one launch per step when
    ``per_step`` or when the grid cannot be resident at once). Returns per_step as used."""
    xp, rc, rcc = launchers(bits, p.tn, c)
    if t * n and what != "rec":
        xp.launch(_xgrid(t, n, head[2], head[3]), XS * XS, stream, *xarrays, *xsc)
    if what == "xproj":
        return per_step
    if not per_step:
        key = (id(rcc), p.tpb, p.smem)
        if key not in _resident:
            _resident[key] = occupancy(rcc, p.tpb, p.smem) * sm_count_now()
        per_step = p.grid > _resident[key]
    steps = [(0, t)] if not per_step or t == 0 else [(s, s + 1) for s in range(t)]
    for s0, s1 in steps:
        (rc if per_step else rcc).launch(p.grid, p.tpb, stream, *arrays, *head, s0, s1, *tail, shmem=p.smem)
    return per_step


_resident = {}


def sm_count_now():
    from .cuda_launch import current_device, sm_count
    return sm_count(current_device())


def run_arrays(*args, repeat=1, **kw):
    """QuantGRU on host arrays (the arguments of gru_int.quant_gru, plus ``units``/``per_step`` overrides):
    returns (Y, Y_h). Under the CUDA simulator through the Numba dispatcher (one launch per step), on a GPU
    through the direct (cooperative) launch path."""
    p = Prepared(*args, **kw)
    for _ in range(repeat):
        p.launch()
    return p.result()


# ---------------------------------------------------------------------------------------------------- onnxruntime
def _to_host(ptr, shape, dtype, stream):
    """A small device tensor copied to the host (stream-ordered, then waited for)."""
    from .cuda_launch import check, libcuda
    out = np.empty(shape, dtype)
    if out.nbytes:
        lib = libcuda()
        lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        check(lib.cuMemcpyDtoHAsync_v2(out.ctypes.data, ptr, out.nbytes, stream), "cuMemcpyDtoHAsync")
        check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
    return out


def _to_device(dst, arr, stream):
    from .cuda_launch import check, libcuda
    lib = libcuda()
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    arr = np.ascontiguousarray(arr)
    check(lib.cuMemcpyHtoDAsync_v2(dst.device_ctypes_pointer.value, arr.ctypes.data, arr.nbytes, stream),
          "cuMemcpyHtoDAsync")


class _Scratch:
    """Per CUDA stream: parameter buffers, qWx and the h exchange buffer (grown on demand), barrier counters."""

    def __init__(self, d, h):
        self.prm = cuda.device_array(d * NP, np.int64)
        self.pch = cuda.device_array(d * PC * h, np.int64)
        self.qsc = cuda.device_array(d * 2, np.float64)
        self.dq = cuda.device_array(d, np.float32)
        self.bufs = {}
        self.cnt = {}

    def buf(self, name, size, dtype):
        b = self.bufs.get(name)
        if b is None or b.size < size:
            b = self.bufs[name] = cuda.device_array(max(size, 1), dtype)
        return b

    def counters(self, groups, nblk):
        """Zeroed counters for one plan (a counter must start each launch at a multiple of its nblk)."""
        key = (groups, nblk)
        if key not in self.cnt:
            self.cnt[key] = cuda.to_device(np.zeros(groups, np.uint64))
        return self.cnt[key]


class QuantGRUCudaKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        from .bridge import KernelError
        at = self.attrs
        try:
            self.a = gru_int.GRUAttrs(at["hidden_size"], at["bits"], at["exponents"], at["zero_points"],
                                      at.get("direction", "forward"), at.get("layout", 0))
        except ValueError as e:
            raise KernelError(str(e)) from None
        if self.in_types[1] != (3 if self.a.bits == 8 else 5):
            raise KernelError(f"bits={self.a.bits} needs int{self.a.bits} W, R and luts")
        self.sms = sm_count_now()
        self.plans = {}
        self.scratch = {}
        self.revmask = {"forward": 0, "reverse": 1, "bidirectional": 2}[self.a.direction]

    def compute(self, ctx, inputs):
        from .bridge import NP_DTYPES, KernelError
        a = self.a
        ins = [inputs[i] if i < len(inputs) else None for i in range(8)]
        for i in range(6):
            self.check_input(ins, i)
        x, w, r, b, ce, lt, sl, h0 = ins
        stand = lambda v: None if v is None else np.broadcast_to(  # noqa: E731 - shape and dtype only
            np.zeros((), NP_DTYPES[v.elem_type]), v.shape)
        ce_h = _to_host(ce.ptr, ce.shape, np.int32, ctx.stream) if len(ce.shape) == 3 and ce.elem_type == 6 \
            else stand(ce)
        sl_h = None if sl is None else (_to_host(sl.ptr, sl.shape, np.int32, ctx.stream) if len(sl.shape) == 1
                                        else stand(sl))
        try:
            t, n, c = gru_int.check_inputs(a, stand(x), stand(w), stand(r), stand(b), ce_h, stand(lt), sl_h,
                                           stand(h0))
        except ValueError as e:
            raise KernelError(str(e)) from None
        d, h = a.num_directions, a.hidden_size
        b_h = _to_host(b.ptr, b.shape, np.int32, ctx.stream)
        shapes = ((t, d, n, h), (d, n, h)) if a.layout == 0 else ((n, t, d, h), (n, d, h))
        y, yh = (ctx.output(i, s) for i, s in enumerate(shapes))
        if n == 0:
            return
        s = self.scratch.get(ctx.stream)
        if s is None:
            s = self.scratch[ctx.stream] = _Scratch(d, h)
        p = self.plans.get(n)
        if p is None:
            p = self.plans[n] = Plan(n, h, d, a.bits, self.sms)
        for dst, v in zip((s.prm, s.pch, s.qsc, s.dq), prepare(a, b_h, ce_h)):
            _to_device(dst, v, ctx.stream)
        qwx = s.buf("qwx", d * t * n * 3 * h, np.int16)
        hb = s.buf("hb", -(-2 * d * n * h // 4) * 4, np.int16)
        cnt = s.counters(p.groups, p.nblk)
        dev = lambda v: (v.device_ctypes_pointer.value, (v.size,))  # noqa: E731
        flags = 12 | (1 if h0 is not None else 0) | (2 if sl is not None else 0) | (16 if h % 4 == 0 else 0)
        xarr = [(x.ptr, (max(x.size, 1),)), (w.ptr, (w.size,)), dev(qwx), dev(s.prm), dev(s.pch), dev(s.qsc)]
        lo, hi = gru_int.qrange(a.bits)
        xsc = (t, n, c, h, a.layout, lo, hi)
        arrays = [dev(qwx), (r.ptr, (r.size,)), (lt.ptr, (lt.size,)),
                  (h0.ptr, (h0.size,)) if h0 is not None else (x.ptr, (1,)),
                  (sl.ptr, (n,)) if sl is not None else dev(s.dq), dev(hb),
                  (hb.device_ctypes_pointer.value, (hb.size // 4,)),
                  (y, (max(t * d * n * h, 1),)), (yh, (d * n * h,)), dev(cnt), dev(s.prm), dev(s.pch), dev(s.qsc),
                  dev(s.dq)]
        head = (t, n, h, d, p.nch, p.nbc, p.units, p.ks)
        tail = (p.nblk, self.revmask, a.layout, lo, hi, gru_int.LUT_SHIFT[a.bits], p.llen, flags, p.pc_off, p.rs_off,
                p.hs_off, p.lt_off)
        issue(a.bits, p, c, t, n, xarr, xsc, arrays, head, tail, ctx.stream, False)


KERNEL = QuantGRUCudaKernel

"""QuantGRU, CUDA face: the ``rec`` kernel -- the recurrence, one launch for all T steps -- and its geometry
(``Plan``); quantgru_cuda.py launches it (cooperatively, once per step, or once: quantgru_cuda.ROUTES).

Block (group, b) owns the hidden units [b*units, +units) of one direction and batch chunk (a group); its 3*units
rows of R (as int32) and the three lookup tables stay in shared memory for the whole launch. Per step it stages
h_{t-1} (minus zp_h) of its batch rows from the exchange buffer, computes the R h dot products (each thread: 3
gates x TN batch rows over one K slice, then the K slices are summed per output), runs the integer cell for its (n,
unit) pairs, writes h_t (int16) to the exchange buffer and the dequantised Y / Y_h, and meets the other blocks of
its group at a barrier: a monotonically growing uint64 counter per group (threadfence + atomic add, spin on an
atomic read, threadfence), which needs all blocks resident at once. docs/gru-cuda.md has the figures.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint64

from onnx_lowbit import gru_int

from ..device.launch import Array
from ..device.target import SIM
from .common_cuda import (NP, PC, P_ONE, P_SNEW, P_SNH, P_SOH, P_SOLD, P_SRHAB, P_SRHR, P_SRHZ, P_SRRH, P_SRRHG, P_SWXG,
                          P_SWXR, P_SWXZ, P_ZPAB, P_ZPG, P_ZPGOUT, P_ZPH, P_ZPNEW, P_ZPOLD, P_ZPR, P_ZPRH, P_ZPROUT,
                          P_ZPRRH, P_ZPWX, P_ZPZ, P_ZPZOUT, rint, rsh, sat)

REC_TPB = 32 if SIM else 256
PAD = 8                      # recurrent weight rows are H + PAD int32 apart (spreads the rows over the banks)
MAX_SMEM = 227 * 1024        # dynamic shared memory per block (H100/H200), opted in once per device
SIM_SMEM = 48 * 1024

@cuda.jit(device=True, inline=True)
def _quant(x, scale, lo, hi):
    """gru_int.quantize minus the zero point: rint(x 2^e) (NaN -> 0) clamped to [lo, hi] = [qmin-zp, qmax-zp]."""
    v = float64(x) * scale
    if v != v:
        v = 0.0
    v = rint(v)
    return int64(min(max(v, float64(lo)), float64(hi)))


@cuda.jit(device=True, inline=True)
def _lut(sm, base, q, lo, sh):
    """gru_int.lut on a table staged as int32 at sm[base:]."""
    u = q - lo
    if sh == 0:
        return int64(sm[base + u])
    i = u >> sh
    t0 = int64(sm[base + i])
    return t0 + rsh((int64(sm[base + i + 1]) - t0) * (u & ((int64(1) << sh) - 1)), sh)


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


def _make_rec(wide, tn):
    tpb = REC_TPB
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
                    drz = sat(rsh(az, sm64[pc]) + zprh, lo, hi) - zprh
                    drr = sat(rsh(ar, sm64[pc + 1]) + zprh, lo, hi) - zprh
                    drg = sat(rsh(ag, sm64[pc + 2]) + zprh, lo, hi) - zprh
                    zpre = sat(rsh(dwz, s_wxz) + rsh(drz, s_rhz) + sm64[pc + 3] + zpz, lo, hi)
                    rpre = sat(rsh(dwr, s_wxr) + rsh(drr, s_rhr) + sm64[pc + 4] + zpr, lo, hi)
                    qz = _lut(sm32, lt_off, zpre, lo, lsh)
                    qr = _lut(sm32, lt_off + llen, rpre, lo, lsh)
                    qrb = sat(rsh(drg, s_rhab) + sm64[pc + 6] + zpab, lo, hi)
                    qrrh = sat(rsh((qr - zprout) * (qrb - zpab), s_rrh) + zprrh, lo, hi)
                    gpre = sat(rsh(dwg, s_wxg) + rsh(qrrh - zprrh, s_rrhg) + sm64[pc + 5] + zpg, lo, hi)
                    qg = _lut(sm32, lt_off + 2 * llen, gpre, lo, lsh)
                    dz = qz - zpzout
                    qold = sat(rsh(dz * (hold - zph), s_old) + zpold, lo, hi)
                    qnew = sat(rsh((one - dz) * (qg - zpgout), s_new) + zpnew, lo, hi)
                    hn = sat(rsh(qold - zpold, s_oh) + rsh(qnew - zpnew, s_nh) + zph, lo, hi)
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


class Plan:
    """Geometry of the recurrent kernel for one (N, H, D) and bit width."""

    def __init__(self, n, h, dirs, bits, sms, *, units=None):
        smem_cap = SIM_SMEM if SIM else MAX_SMEM
        self.tn = 1 if n < 2 else (2 if n < 4 else 4)
        self.llen = gru_int.lut_len(bits)
        self.tpb = REC_TPB
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


def sig_rec(wdt):
    return [Array(np.int16), Array(wdt), Array(wdt), Array(np.float32), Array(np.int32), Array(np.int16),
            Array(np.uint64), Array(np.float32), Array(np.float32), Array(np.uint64), Array(np.int64),
            Array(np.int64), Array(np.float64), Array(np.float32)] + ["int64"] * 22


_rec_fns = {}


def rec_fn(wide, tn):
    if (wide, tn) not in _rec_fns:
        _rec_fns[(wide, tn)] = _make_rec(wide, tn)
    return _rec_fns[(wide, tn)]


def compiled():
    """The recurrent kernels made so far in this process (tests replay native plans with them)."""
    return list(_rec_fns.values())

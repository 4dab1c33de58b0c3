"""QuantGRU, CUDA face: the pure fixed-point GRU of onnx_lowbit.gru_int, bit-exact (spec: docs/gru.md).

Three kernels per call, all on the caller's stream, with no host round trip:

* ``prep`` (quantgru_prep_cuda.py) -- the per-channel parameters from the call's B and channel_exp in device
  memory, sequence_lens clamped to 0..T, the barrier counters zeroed; all in the call's scratch.
* ``xproj`` -- qWx for all steps and directions at once: an integer GEMM of the quantised X (quantised while it
  is staged: rint(x 2^e_x) clamped, minus zp_x, so no row-sum correction is needed) by W, computed exactly on
  the float pipes (int8: float32 FFMA in chunks of K_F32 products, int16: float64 DFMA; bounds below), 4 x 4 to
  8 x 8 outputs per thread read from shared memory with 16-byte vector loads, tiles picked per shape (XTILES),
  then sat(rshift(acc, shW[c]) + zp_Wx) stored as int16 [D, T, N, 3H].
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
  launched once per step instead (the kernel boundary is the barrier); a plain launch when no barrier is
  reached (groups of one block, or one step). docs/gru-cuda.md has the figures.

Memory: per call, one scratch block (``CallPlan``: pch, lengths, counters, qWx, the h exchange) from
onnxruntime's allocator (``Context.scratch``; a per-stream buffer of the kernel's without onnxruntime's scratch
API, and for direct calls: ``Prepared``); the parameters that depend on the attributes alone (``Params``) are
uploaded once per node. The launches are a function of the shapes only, so the kernel opts in to native plans
and can be captured in a CUDA graph. (The recurrence does not leave its counters at 0 but at a multiple of the
group's block count, all its next launch needs; zeroing them in the call's scratch is free -- the parameter
launch does it -- and leaves no state between calls.)

Accumulators: int32 for bits=8 (|R (h - zp)| <= 255 * 128 * H < 2^31 for H <= 32768; likewise W (x - zp) for
C < 65793), int64 for bits=16 (and for bits=8 with C >= 65536). Every quantity after a GEMM is computed in int64
exactly as gru_int.step does.
"""
from __future__ import annotations

import ctypes

import numpy as np
from numba import config, cuda, float32, float64, int32, int64, uint64

from onnx_lowbit import gru_int

from ..device import launch as cuda_launch
from ..device.launch import Array, Launcher, SimLauncher
from ..runtime import plans
from ..runtime.abi import NP_DTYPES
from ..runtime.kernels import Kernel, KernelError
from . import quantgru_prep_cuda as qp
from .common_cuda import (NP, PC, P_ONE, P_SNEW, P_SNH, P_SOH, P_SOLD, P_SRHAB, P_SRHR, P_SRHZ, P_SRRH, P_SRRHG, P_SWXG,
                          P_SWXR, P_SWXZ, P_ZPAB, P_ZPG, P_ZPGOUT, P_ZPH, P_ZPNEW, P_ZPOLD, P_ZPR, P_ZPRH, P_ZPROUT,
                          P_ZPRRH, P_ZPWX, P_ZPX, P_ZPZ, P_ZPZOUT, rsh, scalar_params)
from .quantgru_prep_cuda import standin_channel_exp

SIM = bool(config.ENABLE_CUDASIM)

REC_TPB = 32 if SIM else 256
PAD = 8                      # recurrent weight rows are H + PAD int32 apart (spreads the rows over the banks)
MAX_SMEM = 227 * 1024        # dynamic shared memory per block (H100/H200), opted in once per device
SIM_SMEM = 48 * 1024

if SIM:
    def _rint(v):
        return np.rint(v)

    _rintf = _rint
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _rint(v):
        return libdevice.rint(v)

    @cuda.jit(device=True, inline=True)
    def _rintf(v):
        return libdevice.rintf(v)


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
def _quantf(x, scale, lo, hi):
    """_quant in float32, for X (float32) and a power-of-two scale 2^e, |e| <= 62 (exact in float32): x 2^e is
    exact unless it overflows (inf: clamped to hi as the float64 product would be) or leaves the normal range
    (|x 2^e| < 2^-126 rounds to 0 either way), so the result equals _quant's, as a float."""
    v = x * scale
    if v != v:
        v = float32(0.0)
    return min(max(_rintf(v), lo), hi)


@cuda.jit(device=True, inline=True)
def _lut(sm, base, q, lo, sh):
    """gru_int.lut on a table staged as int32 at sm[base:]."""
    u = q - lo
    if sh == 0:
        return int64(sm[base + u])
    i = u >> sh
    t0 = int64(sm[base + i])
    return t0 + rsh((int64(sm[base + i + 1]) - t0) * (u & ((int64(1) << sh) - 1)), sh)


# ---------------------------------------------------------------------------------------------------- xproj
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
ALIGN = None if SIM else 32     # the shared tiles' alignment (vector loads; the simulator takes none)
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


# tiles per bit width in order of preference, the smallest last. 128x64: 128 registers (float32) / 168
# (float64), 2 / 1 blocks per SM; 128x128 (float32): 181 registers, 1 block per SM (benchmarks/sass.py)
XTILES = {8: [XTile(8, "128x64", 16, 16, 8, 4, 16), XTile(8, "128x128", 16, 16, 8, 8, 16),
              XTile(8, "64x64", 16, 16, 4, 4, 32), XTile(8, "32x32", 8, 8, 4, 4, 32)],
          16: [XTile(16, "128x64", 16, 16, 8, 4, 16), XTile(16, "64x64", 16, 16, 4, 4, 16),
               XTile(16, "32x32", 8, 8, 4, 4, 16)]}
if SIM:   # few threads (the simulator runs a Python thread per CUDA thread); still two row and column groups
    XTILES = {b: [XTile(b, "16x16", 2, 2, 8, 8, 4), XTile(b, "8x8", 2, 2, 4, 4, 2)] for b in (8, 16)}


def pick_xtile(bits, m, g3, dirs, sms, name=None):
    """The first tile of XTILES[bits] whose grid gives every SM a block (else the smallest), or the tile called
    ``name``."""
    tiles = XTILES[bits]
    if name is not None:
        return next(t for t in tiles if t.name == name)
    return next((t for t in tiles if t.blocks(m, g3, dirs) >= sms), tiles[-1])


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
                        out[(d * m_dim + m) * g3 + c] = _sat(rsh(v, sh) + zpwx, lo, hi)

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
                    drz = _sat(rsh(az, sm64[pc]) + zprh, lo, hi) - zprh
                    drr = _sat(rsh(ar, sm64[pc + 1]) + zprh, lo, hi) - zprh
                    drg = _sat(rsh(ag, sm64[pc + 2]) + zprh, lo, hi) - zprh
                    zpre = _sat(rsh(dwz, s_wxz) + rsh(drz, s_rhz) + sm64[pc + 3] + zpz, lo, hi)
                    rpre = _sat(rsh(dwr, s_wxr) + rsh(drr, s_rhr) + sm64[pc + 4] + zpr, lo, hi)
                    qz = _lut(sm32, lt_off, zpre, lo, lsh)
                    qr = _lut(sm32, lt_off + llen, rpre, lo, lsh)
                    qrb = _sat(rsh(drg, s_rhab) + sm64[pc + 6] + zpab, lo, hi)
                    qrrh = _sat(rsh((qr - zprout) * (qrb - zpab), s_rrh) + zprrh, lo, hi)
                    gpre = _sat(rsh(dwg, s_wxg) + rsh(qrrh - zprrh, s_rrhg) + sm64[pc + 5] + zpg, lo, hi)
                    qg = _lut(sm32, lt_off + 2 * llen, gpre, lo, lsh)
                    dz = qz - zpzout
                    qold = _sat(rsh(dz * (hold - zph), s_old) + zpold, lo, hi)
                    qnew = _sat(rsh((one - dz) * (qg - zpgout), s_new) + zpnew, lo, hi)
                    hn = _sat(rsh(qold - zpold, s_oh) + rsh(qnew - zpnew, s_nh) + zph, lo, hi)
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
    return [Array(np.float32), Array(wdt), Array(np.int16), Array(np.int64), Array(np.int64), Array(np.float64)] + \
        ["int64"] * 7


def _sig_rec(wdt):
    return [Array(np.int16), Array(wdt), Array(wdt), Array(np.float32), Array(np.int32), Array(np.int16),
            Array(np.uint64), Array(np.float32), Array(np.float32), Array(np.uint64), Array(np.int64),
            Array(np.int64), Array(np.float64), Array(np.float32)] + ["int64"] * 22


_xproj_fns, _rec_fns = {}, {}


def xproj_fn(bits, tile, c_dim, kc=None):
    """The xproj kernel for one bit width, tile and C (chunked when C exceeds the exact float sum's length)."""
    kc = kc or (K_F32 if bits == 8 else K_F64)
    key = (bits, tile.name, c_dim > kc, bits == 16 or c_dim >= 65536, kc)
    if key not in _xproj_fns:
        _xproj_fns[key] = _make_xproj(bits, tile, *key[2:])
    return _xproj_fns[key]


def rec_fn(wide, tn):
    if (wide, tn) not in _rec_fns:
        _rec_fns[(wide, tn)] = _make_rec(wide, tn)
    return _rec_fns[(wide, tn)]


class _CoopLauncher:
    """A Launcher whose launches are cooperative (cuLaunchCooperativeKernel: all blocks resident, or an error)."""

    def __init__(self, launcher):
        fn = cuda_launch.libcuda().cuLaunchCooperativeKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2
        self.func = None

        def launch(f, gx, gy, gz, bx, by, bz, sh, st, p, extra):
            if self.func is None:
                self.func = launcher.function()
            return fn(self.func, gx, gy, gz, bx, by, bz, sh, st, p)
        launcher._launch = launch
        self.launcher = launcher

    def blocks_per_sm(self, block, shmem=None):
        return self.launcher.blocks_per_sm(block, shmem)

    def launch(self, *args, **kw):
        """Launcher.launch, then: a native plan being recorded must replay this launch cooperatively too (a plain
        cuLaunchKernel would drop the co-residency the barrier needs: with other work on the GPU a group's blocks
        could wait for each other forever). With a bridge that has cooperative steps (Recorder.mark_cooperative)
        the step is marked so; otherwise the call is not replayable and calls with its key keep going through
        Python (with no host synchronisation either way, so CUDA-graph capture is unaffected)."""
        self.launcher.launch(*args, **kw)
        rec = plans.active()
        if rec is not None:
            mark = getattr(rec, "mark_cooperative", None)
            if mark is None:
                plans.not_replayable()
            else:
                mark(self.func.value)


def _dptr(v):
    """The device address of a Numba device array (under the simulator: its host buffer's)."""
    return int(v._ary.ctypes.data if SIM else (v.device_ctypes_pointer.value or 0))


def launchers(bits, tn, c_dim, tile, kc=None):
    """(prep, xproj, rec, rec cooperative) direct-launch wrappers, compiled once per process; under the simulator
    launch.SimLauncher stand-ins and no cooperative one."""
    wdt = np.int8 if bits == 8 else np.int16
    if SIM:
        return (SimLauncher(qp.prep, qp.signature()), SimLauncher(xproj_fn(bits, tile, c_dim, kc), _sig_xproj(wdt)),
                SimLauncher(rec_fn(bits == 16, tn), _sig_rec(wdt)), None)
    if "prep" not in _launchers:
        _launchers["prep"] = Launcher(qp.prep, qp.signature())
    key = (bits, tn)
    if key not in _launchers:
        rc = Launcher(rec_fn(bits == 16, tn), _sig_rec(wdt), dynamic_shared=MAX_SMEM)
        rcc = _CoopLauncher(Launcher(rec_fn(bits == 16, tn), _sig_rec(wdt), dynamic_shared=MAX_SMEM))
        _launchers[key] = (rc, rcc)
    fn = xproj_fn(bits, tile, c_dim, kc)
    if fn not in _launchers:
        _launchers[fn] = Launcher(fn, _sig_xproj(wdt), dynamic_shared=MAX_SMEM)
    return (_launchers["prep"], _launchers[fn]) + _launchers[key]


def occupancy(launcher, tpb, smem):
    """Resident blocks per SM of a Launcher's kernel with ``smem`` bytes of dynamic shared memory."""
    return launcher.blocks_per_sm(tpb, smem)


class CallPlan:
    """What one call's launches depend on: the attributes, the shapes (T, N, C) and whether initial_h and
    sequence_lens are given -- nothing else. The recurrent kernel's geometry (Plan), the xproj tile, the flags and
    the layout of the call's scratch (byte offsets, each 256-aligned): pch int64 [D*10H] and lens int32 [N]
    (written by the parameter kernel), cnt uint64 [groups] (barrier counters, zeroed by it), qwx int16
    [D*T*N*3H], hb int16 (the h exchange, 2 D N H values in whole uint64 words)."""

    def __init__(self, a, t, n, c, sms, has_h0, has_lens, *, units=None, xtile=None, kc=None, per_step=False):
        d, h = a.num_directions, a.hidden_size
        self.a, self.t, self.n, self.c, self.d, self.h = a, t, n, c, d, h
        self.plan = p = Plan(n, h, d, a.bits, sms, units=units)
        self.xt = pick_xtile(a.bits, t * n, 3 * h, d, sms, xtile)
        self.kc = kc                            # tests: a shorter exact float sum (chunk boundaries on small C)
        # the simulator runs blocks one after the other: a launch of several steps only without barriers there
        self.per_step = per_step or (SIM and p.nblk > 1)
        self.has_h0, self.has_lens = has_h0, has_lens
        self.flags = 12 | (1 if has_h0 else 0) | (2 if has_lens else 0) | (16 if h % 4 == 0 else 0)
        self.nq = max(d * t * n * 3 * h, 1)
        self.nhw = max(-(-2 * d * n * h // 4), 1)
        self.off, o = {}, 0
        for name, nbytes in (("pch", d * PC * h * 8), ("lens", max(n, 1) * 4), ("cnt", p.groups * 8),
                             ("qwx", self.nq * 2), ("hb", self.nhw * 8)):
            self.off[name] = o
            o += -(-nbytes // 256) * 256
        self.nbytes = o


class Params:
    """A node's kernel-lifetime device arrays, from its attributes alone: prm, qsc, dq (scalar_params) and the
    exponents ex int64 [D*NQ] the parameter kernel reads. Allocated on the current device, read-only afterwards
    (what native plans allow a kernel to own)."""

    def __init__(self, a):
        prm, qsc, dq = scalar_params(a)
        self.arrays = [cuda.to_device(np.ascontiguousarray(v).reshape(-1))
                       for v in (prm, qsc, dq, a.exponents.astype(np.int64))]
        self.prm, self.qsc, self.dq, self.ex = ((_dptr(v), (v.size,)) for v in self.arrays)


REVMASK = {"forward": 0, "reverse": 1, "bidirectional": 2}


def issue(cp, params, ptrs, stream, what="all", prep=True):
    """Issues one call's launches on ``stream``: the parameter kernel (quantgru_prep_cuda.prep), xproj, then the
    recurrence -- one cooperative launch for all steps; a plain one when no group has two blocks or there is at
    most one step (no barrier is reached); one launch per step when ``cp.per_step`` or when the grid cannot be
    resident at once. ``ptrs``: device pointers x, w, r, luts, b, ce, seql, h0 (0 when absent), y, yh (outputs)
    and scratch (cp.nbytes bytes); ``params``: the node's Params. ``what``: "all", or "prep" / "xproj" / "rec"
    alone (tests, timing); ``prep``: False when an earlier launch on the same scratch left the parameters
    (timing). Every launch depends on ``cp`` alone; everything written is in the outputs or the scratch. Returns
    per_step as used."""
    a, p, t, n, c, d, h = cp.a, cp.plan, cp.t, cp.n, cp.c, cp.d, cp.h
    pk, xp, rc, rcc = launchers(a.bits, p.tn, c, cp.xt, cp.kc)
    sb = ptrs["scratch"]
    at = lambda name, size: (sb + cp.off[name], (size,))  # noqa: E731
    pch, lens, cnt, qwx = at("pch", d * PC * h), at("lens", max(n, 1)), at("cnt", p.groups), at("qwx", cp.nq)
    if prep:
        seql = (ptrs["seql"], (n,)) if cp.has_lens else lens
        pk.launch(qp.grid(d, h, n, p.groups), qp.TPB, stream, (ptrs["b"], (d * 6 * h,)), (ptrs["ce"], (d * 12 * h,)),
                  seql, params.ex, pch, lens, cnt, d, h, n, t, p.groups, int(cp.has_lens))
    if what == "prep":
        return cp.per_step
    lo, hi = gru_int.qrange(a.bits)
    if t * n and what != "rec":
        xp.launch(cp.xt.blocks(t * n, 3 * h, d), cp.xt.nt, stream, (ptrs["x"], (max(t * n * c, 1),)),
                  (ptrs["w"], (max(d * 3 * h * c, 1),)), qwx, params.prm, pch, params.qsc, t, n, c, h, a.layout,
                  lo, hi, shmem=cp.xt.smem)
    if what == "xproj":
        return cp.per_step
    arrays = (qwx, (ptrs["r"], (d * 3 * h * h,)), (ptrs["luts"], (d * 3 * p.llen,)),
              (ptrs["h0"], (d * n * h,)) if cp.has_h0 else (sb, (1,)), lens, at("hb", 4 * cp.nhw), at("hb", cp.nhw),
              (ptrs["y"], (max(t * d * n * h, 1),)), (ptrs["yh"], (d * n * h,)), cnt, params.prm, pch, params.qsc,
              params.dq)
    head = (t, n, h, d, p.nch, p.nbc, p.units, p.ks)
    tail = (p.nblk, REVMASK[a.direction], a.layout, lo, hi, gru_int.LUT_SHIFT[a.bits], p.llen, cp.flags, p.pc_off,
            p.rs_off, p.hs_off, p.lt_off)
    barrier = p.nblk > 1 and t > 1
    per_step = cp.per_step
    if barrier and not per_step:
        key = (id(rcc), p.tpb, p.smem)
        if key not in _resident:
            _resident[key] = occupancy(rcc, p.tpb, p.smem) * sm_count_now()
        per_step = p.grid > _resident[key]
    coop = barrier and not per_step
    steps = [(s, s + 1) for s in range(t)] if per_step and t > 0 else [(0, t)]
    for s0, s1 in steps:
        (rcc if coop else rc).launch(p.grid, p.tpb, stream, *arrays, *head, s0, s1, *tail, shmem=p.smem)
    return per_step


_resident = {}


def sm_count_now():
    return cuda_launch.sm_count(cuda_launch.current_device())


class Prepared:
    """One QuantGRU call on host arrays copied to the device (tests, benchmarks): validated (values too), its
    CallPlan, the node's Params, device copies of the inputs, the outputs and a scratch buffer of its own;
    ``launch(stream)`` issues the call exactly as the onnxruntime kernel does on onnxruntime's buffers."""

    def __init__(self, X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
                 exponents, zero_points, direction="forward", layout=0, units=None, per_step=False, sms=None,
                 xtile=None, kc=None):
        a = self.a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
        X = np.ascontiguousarray(X, np.float32)
        t, n, c = gru_int.check_inputs(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
        self.t, self.n, self.c, self.h, self.d = t, n, c, a.hidden_size, a.num_directions
        if not SIM:
            sms = sms or sm_count_now()
        self.cp = CallPlan(a, t, n, c, sms or 4, initial_h is not None, sequence_lens is not None, units=units,
                           xtile=xtile, kc=kc, per_step=per_step)
        self.plan, self.xt, self.per_step = self.cp.plan, self.cp.xt, self.cp.per_step
        self.params = Params(a)
        qt = np.int8 if bits == 8 else np.int16
        i32, f32 = np.int32, np.float32
        host = {"x": (X, f32), "w": (W, qt), "r": (R, qt), "luts": (luts, qt), "b": (B, i32), "ce": (channel_exp, i32),
                "seql": (sequence_lens, i32), "h0": (initial_h, f32)}
        self.bufs = {k: cuda.to_device(np.ascontiguousarray(v, dt).reshape(-1) if v is not None and np.size(v)
                                       else np.zeros(1, dt)) for k, (v, dt) in host.items()}
        d, h = self.d, self.h
        self.y = cuda.device_array(max(t * d * n * h, 1), np.float32)
        self.yh = cuda.device_array(max(d * n * h, 1), np.float32)
        self.scratch = cuda.device_array(self.cp.nbytes, np.uint8)
        self.ptrs = {k: _dptr(v) for k, v in self.bufs.items()}
        self.ptrs.update(y=_dptr(self.y), yh=_dptr(self.yh), scratch=_dptr(self.scratch))
        self._prepped = False

    def _view(self, name, count, dtype):
        o = self.cp.off[name]
        return self.scratch[o:o + count * np.dtype(dtype).itemsize].view(dtype)

    @property
    def qwx(self):
        """xproj's output (int16 [D*T*N*3H], a view of the scratch)."""
        return self._view("qwx", self.cp.nq, np.int16)

    @property
    def pch(self):
        """The parameter kernel's per-channel parameters (int64 [D*10H], a view of the scratch)."""
        return self._view("pch", self.d * PC * self.h, np.int64)

    @property
    def lens(self):
        """The sequence lengths the recurrence reads (int32 [N]: sequence_lens clamped to 0..T, or T)."""
        return self._view("lens", max(self.n, 1), np.int32)

    @property
    def counters(self):
        """The barrier counters (uint64 [groups])."""
        return self._view("cnt", self.plan.groups, np.uint64)

    def launch(self, stream=0, what="all"):
        """Issues the call's kernels on ``stream`` (``what``: "all", or "prep" / "xproj" / "rec" alone, for tests
        and timing: xproj and rec alone run the parameter kernel only on the first launch)."""
        self.per_step = issue(self.cp, self.params, self.ptrs, stream, what, prep=what == "all" or not self._prepped)
        self._prepped = True

    def result(self):
        """(Y, Y_h) as numpy arrays with the reference's shapes."""
        cuda.synchronize()
        t, n, h, d = self.t, self.n, self.h, self.d
        y = self.y.copy_to_host()[: t * d * n * h]
        yh = self.yh.copy_to_host()[: d * n * h]
        if self.a.layout == 0:
            return y.reshape(t, d, n, h), yh.reshape(d, n, h)
        return y.reshape(n, t, d, h), yh.reshape(n, d, h)


def run_arrays(*args, repeat=1, **kw):
    """QuantGRU on host arrays (the arguments of gru_int.quant_gru, plus ``units``/``per_step`` overrides):
    returns (Y, Y_h). Under the CUDA simulator through launch.SimLauncher (one launch per step when a group has
    several blocks), on a GPU through the direct (cooperative) launch path."""
    p = Prepared(*args, **kw)
    for _ in range(repeat):
        p.launch()
    return p.result()


# ---------------------------------------------------------------------------------------------------- onnxruntime
class QuantGRUCudaKernel(Kernel):
    """Per call: the parameter kernel, xproj and the recurrence on onnxruntime's stream; every buffer is an input,
    an output, the call's scratch from onnxruntime's allocator, or the node's read-only Params. Nothing is read
    back to the host and nothing carries over between calls (the barrier counters are zeroed in the call's
    scratch by the parameter kernel), so the launches depend only on the shapes: native plans (the cooperative
    launch needs a bridge that replays it cooperatively, see _CoopLauncher.launch) and CUDA-graph capture."""
    native_plans = True

    def __init__(self, **kw):
        super().__init__(**kw)
        at = self.attrs
        try:
            self.a = gru_int.GRUAttrs(at["hidden_size"], at["bits"], at["exponents"], at["zero_points"],
                                      at.get("direction", "forward"), at.get("layout", 0))
        except ValueError as e:
            raise KernelError(str(e)) from None
        if self.in_types[1] != (3 if self.a.bits == 8 else 5):
            raise KernelError(f"bits={self.a.bits} needs int{self.a.bits} W, R and luts")
        self.sms = 4 if SIM else sm_count_now()
        self.params = Params(self.a)
        self.ce_standin = standin_channel_exp(self.a)
        self.calls = {}                         # (T, N, C, has initial_h, has sequence_lens) -> CallPlan
        self._own = {}                          # stream -> scratch of calls without onnxruntime's (onnxruntime < 1.18)

    def compute(self, ctx, inputs):
        a = self.a
        ins = [inputs[i] if i < len(inputs) else None for i in range(8)]
        for i in range(6):
            self.check_input(ins, i)
        x, w, r, b, ce, lt, sl, h0 = ins
        stand = lambda v: None if v is None else np.broadcast_to(  # noqa: E731 - shape and dtype only
            np.zeros((), NP_DTYPES[v.elem_type]), v.shape)
        ce_s = self.ce_standin if tuple(ce.shape) == self.ce_standin.shape and ce.elem_type == 6 else stand(ce)
        try:
            t, n, c = gru_int.check_inputs(a, stand(x), stand(w), stand(r), stand(b), ce_s, stand(lt), stand(sl),
                                           stand(h0))
        except ValueError as e:
            raise KernelError(str(e)) from None
        d, h = a.num_directions, a.hidden_size
        shapes = ((t, d, n, h), (d, n, h)) if a.layout == 0 else ((n, t, d, h), (n, d, h))
        y, yh = (ctx.output(i, s) for i, s in enumerate(shapes))
        if n == 0:
            return
        key = (t, n, c, h0 is not None, sl is not None)
        cp = self.calls.get(key)
        if cp is None:
            cp = self.calls[key] = CallPlan(a, t, n, c, self.sms, key[3], key[4])
        if ctx.has_scratch:
            sb = ctx.scratch(cp.nbytes)
        else:
            sb = self._own_scratch(ctx.stream, cp.nbytes)
            plans.not_replayable()              # a buffer of ours that may be replaced: no plan may keep it
        ptrs = {"x": x.ptr, "w": w.ptr, "r": r.ptr, "luts": lt.ptr, "b": b.ptr, "ce": ce.ptr,
                "seql": sl.ptr if sl is not None else 0, "h0": h0.ptr if h0 is not None else 0, "y": y, "yh": yh,
                "scratch": sb}
        issue(cp, self.params, ptrs, ctx.stream)

    def _own_scratch(self, stream, nbytes):
        """Scratch kept per stream for onnxruntime without a scratch API (grown, never shrunk)."""
        buf = self._own.get(stream)
        if buf is None or buf.size < nbytes:
            buf = self._own[stream] = cuda.device_array(max(nbytes, 1), np.uint8)
        return _dptr(buf)


KERNEL = QuantGRUCudaKernel

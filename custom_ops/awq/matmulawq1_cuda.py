"""MatMulAWQ and FusedFFNAWQ at M = 1 .. 8 on the tensor cores: y = x W1 (+ b1), or SiLU(x W1 + b1) * (x W3 + b3),
W in AutoAWQ's K-major layout (qweight int32 [Kp, N/8], nibble j of word c = column 8c + ORDER[j]; qzeros, fp16
scales per group of G rows).

Why a kernel of its own (H100, 4096 x 11008, ncu): the fp32 decode kernel (matmulawq_cuda.make_gemv) executes
8.1 M warp instructions for 45 M nibbles and issues on 56% of its cycles; the M >= 2 tensor-core kernel
(matmulawq_cuda._make_tc) executes 4.9 M, most of them per-warp set-up and reductions (every warp streams only 8
16-row steps), and waits on memory (16 bytes in flight per thread). Reading the weights alone takes 9.2-10.6 us
with any of these block shapes (benchmarks/awq_read_probe.py), against 18.3 us for the whole fp32 kernel.

This kernel keeps the tensor-core arithmetic (mma.sync m16n8k16, the nibbles as exact fp16 subnormals, see
matmulawq_cuda) and changes what each warp streams:
- lane (g, t) reads ``wpl`` words per row: words wpl g .. wpl g + wpl - 1 of the warp's 8 wpl-word column tile, so
  one warp instruction reads 32 wpl contiguous bytes from each of 4 rows;
- a register ring of ``unroll`` 16-row steps: each step's slots are reloaded with the step ``unroll`` ahead as soon
  as the step has used them; it runs on across group boundaries, the next group's zero points and scales loaded
  a group ahead; each warp streams ``gpw`` whole groups;
- B holds x in all 8 columns, so every lane of a quad holds the real row in its first D column and scales a
  quarter of the group's columns at each group end;
- the block's warps (``warps``, all on the same column tile, consecutive K ranges) add their sums in shared memory
  in warp order, and the K splits through fp32 partials that the last block of a tile adds in split order
  (splitk.sum_splits): the result does not depend on timing;
- with two weights (``nw`` = 2, FusedFFNAWQ) two rings and two sets of accumulators share x and S = sum x, and the
  last block applies the biases and SiLU * mul.

Up to 8 rows (``mr`` = 8): B column g holds row g of X instead of x in every column, and each lane scales all
columns of its words for its two rows (sessions: M = 2 .. MAX_M). M = 9 .. 16: two chunks of 8 rows in the
same launch, each block streaming its weights once per chunk (the second time from L2: the block's slice was read
just before).

Needs fp16 x, K % 4 == 0 (x is read 8 bytes at a time), N % (8 wpl) == 0 and G % (16 * unroll) == 0 (``takes``;
the ops' ROUTES send other products to the fp32 decode kernels, gemv_cuda). Measured: docs/ffn4.md, BENCHMARKS.md
(sessions 23, 24).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.fp16 import as_f32, h2f
from ..device.inputs import check_x_biases
from ..device.host import sm_count
from ..device.launch import Array, arg
from ..device.mma import mma as _mma, tc_store
from ..device.ptx import add32, mad32, prmt
from ..device.splitk import arrive_last, partial_floats, sum_splits
from ..device.target import SIM, device
from .common_cuda import F2P20, F2P24, HI16, LO16, ONES16, SIM_BLOCKS_PER_SM, TC_SEL, launcher_for
from .dequantawq_cpu import check_a_bias, check_both, check_weights, parse_attrs

WPL = 2                   # int32 words per lane and row: 2 (8-byte loads, 64 contiguous bytes per row and warp
                          # instruction) or 1 (4-byte loads, 32 bytes; half the accumulators)
WARPS = 4                 # warps per block (consecutive K ranges of one column tile)
UNROLL = 2                # 16-row steps per pipelined batch (a ring: unroll x 4 rows x 4 WPL bytes in flight per lane)
GPW = 4                   # groups per warp at most: the plan takes the fewest that fit one wave (FusedFFNAWQ at
                          # 4096 -> 2 x 11008 on the H100: 3, 27.3 us; 2 (1.3 waves) 29.7)
MAX_REGISTERS = 128
U0, M32, F0 = np.uint64(0), np.uint64(0xFFFFFFFF), np.float32(0.0)   # (matmulawq_cuda's values)
MAGIC = np.uint32(0x4B000000)   # as_f32(v | MAGIC) - 2^23 = v for v < 2^23 (no integer-to-float conversion)
F2P23 = np.float32(2.0 ** 23)


# What sessions launch (config): per words per lane, (warps, unroll, register cap); H100, weights cycled past L2
# (benchmarks/awq1_gpu.py --tc1, 2026-11-26), us against the fp32 decode kernel in the same run:
# wpl 2 (unroll 4: 120 registers, 4 blocks per SM): 4096 x 11008 15.18 / 18.29 (wpl 1 there: 15.21);
# wpl 1 (unroll 4: 80 registers, 6 blocks per SM): 2048 x 2048 6.03 / 8.44, 8192 x 2048 8.62 / 10.83,
# 2048 x 6144 8.32 / 9.95. Wpl 1 doubles the blocks; it is taken where its grid with one group per warp fits one
# wave.
CONFIGS = {2: (WARPS, 4, None), 1: (WARPS, 4, None)}
WPL1_BLOCKS_PER_SM = 6      # the wpl 1 configuration's occupancy (H100) (for the choice, before compiling anything)


MAX_M = 16                  # rows of X one launch takes: chunks of 8 (B's columns), the second chunk's weights
                            # re-read by the same block right after the first (from L2)


def takes(k, g_size):
    """Whether the kernel takes a product with fp16 X of K columns in groups of ``g_size`` rows (N is a multiple of
    8: wpl 1 always fits): x is read 8 bytes at a time, a group is whole 16-row steps. The ops' ROUTES ask."""
    return k % 4 == 0 and g_size % 16 == 0


def ok(m, k, n, g_size, unroll=UNROLL, wpl=WPL):
    """Whether this kernel can take the product (fp16 X) at ``unroll`` steps per batch and ``wpl`` words per lane."""
    return 1 <= m <= MAX_M and k % 4 == 0 and n % (8 * wpl) == 0 and g_size % (16 * unroll) == 0


def config(k, n, g_size, sms, nw=1, mr=1):
    """(warps, unroll, register cap, wpl) that a session launches for a product the kernel ``takes`` (``nw``
    weights): two weights always with wpl 1 (their accumulators and rings together are what wpl 2 holds for
    one); one weight: wpl 1 where its grid with one group per warp fits one wave of the SMs, else wpl 2; unroll 4,
    or the largest of 2, 1 that divides G / 16. Up to 8 rows (``mr`` = 8): wpl 1 (the lane's column sums are 8
    times M = 1's)."""
    unroll = next(u for u in (4, 2, 1) if g_size % (16 * u) == 0)
    if nw == 2 or mr == 8:
        return WARPS, unroll, None, 1
    fits = plan(k, n, g_size, sms, WPL1_BLOCKS_PER_SM, WARPS, 1, 1)[0] <= sms * WPL1_BLOCKS_PER_SM
    wpl = 1 if fits or not ok(1, k, n, g_size, unroll, 2) else 2
    warps, _, cap = CONFIGS[wpl]
    return warps, unroll, cap, wpl


def make(warps=WARPS, unroll=UNROLL, max_registers=MAX_REGISTERS, wpl=WPL, nw=1, mr=1):
    """The kernel for ``nw`` weights: 1 = MatMulAWQ (out = x W1 + b1), 2 = FusedFFNAWQ (out = SiLU(x W1 + b1) *
    (x W3 + b3)). Signature: (x uint64 [K/4] (fp16 bits), qw1 [Kp * N/8/wpl], qz1 [groups * N/8/wpl] (uint64 for
    wpl = 2, uint32 for 1), sc1 uint64 [groups * N/4] (fp16 bits), qw3, qz3, sc3, b1, b3 uint16 [N], out uint16 [N],
    part float32 [splits * nw * M * N], cnt uint32 [tiles], k_dim, n_dim, g_size, groups, tiles, gpw, splits, has_b1,
    has_b3, m_dim); nw = 1 ignores the second weight and b3 (pass the first one's buffers).
    Block b: column tile (8 wpl words) b % tiles, K split b // tiles; warp w of split s takes groups
    (s * warps + w) * gpw .. + gpw - 1 (past the last group: re-reads of the last batch with x = 0, whose sums are
    dropped, so that every warp runs the same steps, as the simulator's mma needs); the lane loads word(s)
    wpl (tile * 8 + g) .. of each row (clamped past N: not stored).

    B holds x in all 8 columns (M = 1), so every lane's first D column is the real row: lane (g, t) scales the
    nibbles of byte t of its words at each group end (a quarter of the epilogue each, instead of all of it in the
    lanes t = 0).

    ``mr`` = 8: up to 8 rows of X (M = m_dim), B column g = row g (zeros past M). Lane (g, t) then holds rows 2 t and
    2 t + 1 of every column of its words, and scales all 8 columns of each word at group ends (its S values are the
    two rows' sums). M = 9 .. MAX_M: the block runs its whole pipeline once per chunk of 8 rows (rows 8 c + g), the
    chunk's sums stored (or written as partials) before the next; the last block of a tile then sums every row."""
    assert mr in (1, 8)
    scr_size = warps * 32 * 6 if SIM else 1
    nbuf = unroll * 4
    ncol_c = 64 * wpl                        # columns per tile (8 lanes g x wpl words x 8)
    red_size = warps * ncol_c * nw * mr
    nacc = 16 * wpl
    no = 2 * wpl * (8 if mr == 8 else 1)     # the lane's column sums: [word h][half] (mr 8: [h][byte][half][row])
    nsv = 2 * wpl                            # (array sizes: closure constants, not expressions)
    wdt = uint64 if wpl == 2 else uint32
    opts = {} if SIM or max_registers is None else {"max_registers": max_registers}

    @device
    def word(v, h):
        return uint32((v >> uint64(32 * h)) & M32) if wpl == 2 else uint32(v)

    @device
    def step(buf, u, xb0, xb1, acc, scr, tid):
        """One weight's 16-row step u of the ring: the A fragments of the lane's words, one mma per byte and word."""
        for h in range(wpl):                         # the lane's words of each row
            w0 = word(buf[u * 4], h)
            w1 = word(buf[u * 4 + 1], h)
            w2 = word(buf[u * 4 + 2], h)
            w3 = word(buf[u * 4 + 3], h)
            for by in range(4):
                p1 = prmt(w0, w1, TC_SEL[by])
                p2 = prmt(w2, w3, TC_SEL[by])
                ai = (h * 4 + by) * 4
                r4 = _mma(uint32(p1 & LO16), uint32(p1 & HI16), uint32(p2 & LO16), uint32(p2 & HI16),
                          xb0, xb1, acc[ai], acc[ai + 1], acc[ai + 2], acc[ai + 3], scr, tid)
                for i in range(4):
                    acc[ai + i] = r4[i]

    @device
    def batch(buf, buf3, xbuf, more, nbase, qw1, qw3, nq32, x, nkx, k32, sacc, acc, acc3, scr, tid, xoff, xok):
        """``unroll`` 16-row steps on the words in ``buf`` (and ``buf3``) and x fragments in ``xbuf`` (a ring: with
        ``more``, each step's slots are reloaded with the next batch's step, from word index ``nbase`` and row
        ``nkx``, as soon as the step has used them, so that ``unroll`` steps stay in flight)."""
        for u in range(unroll):
            xq = xbuf[u]
            xb0 = uint32(xq & M32)
            xb1 = uint32(xq >> uint64(32))
            r4 = _mma(ONES16, ONES16, ONES16, ONES16, xb0, xb1, sacc[0], sacc[1], sacc[2], sacc[3], scr, tid)
            for i in range(4):
                sacc[i] = r4[i]
            step(buf, u, xb0, xb1, acc, scr, tid)
            if nw == 2:
                step(buf3, u, xb0, xb1, acc3, scr, tid)
            if more:
                for r in range(4):
                    o = mad32(uint32(16 * u + r), nq32, nbase)
                    buf[u * 4 + r] = qw1[o]
                    if nw == 2:
                        buf3[u * 4 + r] = qw3[o]
            if more:
                kk = add32(nkx, uint32(16 * u))
                xbuf[u] = x[(xoff + kk) >> uint32(2)] if kk < k32 and xok else U0

    @device
    def group_end(acc, sacc, o, zq, sv, t, use):
        """This group's sums into the lane's column sums: o[2 h + half] += s (2^24 D - z S) (2^20 for half 1), D =
        the accumulator of nibble j = 2 t + half of word h (every D column is the real row); then the accumulators
        (not S) are cleared."""
        # nibble j = 2 t + half is column col_of(j) = 4 (t & 1) + 2 half + (t >> 1): scale word sv[2 h + (t & 1)]
        # (columns 0-3 / 4-7 of word h), half-word 2 half + (t >> 1)
        j0 = t * uint32(2)
        sh = (t >> uint32(1)) * uint32(16)
        odd = (t & uint32(1)) != uint32(0)
        for h in range(wpl):
            z = word(zq, h)
            for half in range(2):
                d = F0
                for by in range(4):                  # acc[(h * 4 + t) * 4 + 2 half] without a dynamic index
                    if t == uint32(by):
                        d = acc[(h * 4 + by) * 4 + 2 * half]
                j = j0 + uint32(half)
                sw = sv[2 * h + 1] if odd else sv[2 * h]
                s = h2f(uint32(sw >> uint64(sh + uint32(32 * half))) & uint32(0xFFFF))
                zf = as_f32(((z >> (uint32(4) * j)) & uint32(15)) | MAGIC) - F2P23
                if use:
                    if half:
                        o[2 * h + half] += s * (F2P20 * d - zf * sacc[0])
                    else:
                        o[2 * h + half] += s * (F2P24 * d - zf * sacc[0])
        for i in range(nacc):
            acc[i] = F0

    @device
    def group_end8(acc, sacc, o, zq, sv, use):
        """mr = 8: o[((h 4 + by) 2 + half) 2 + e] += s (2^24 D - z S_e) (2^20 for half 1) for every nibble of the
        lane's words (column col = 4 (by & 1) + 2 half + (by >> 1) of word h) and its rows 2 t + e; then the
        accumulators (not S) are cleared."""
        for h in range(wpl):
            z = word(zq, h)
            for by in range(4):
                for half in range(2):
                    col = 4 * (by & 1) + 2 * half + (by >> 1)
                    sw = sv[2 * h + (col >> 2)]
                    s = h2f(uint32(sw >> uint64(16 * (col & 3))) & uint32(0xFFFF))
                    zf = as_f32(((z >> uint32(4 * (2 * by + half))) & uint32(15)) | MAGIC) - F2P23
                    for e in range(2):
                        d = acc[(h * 4 + by) * 4 + 2 * half + e]
                        if use:
                            if half:
                                o[((h * 4 + by) * 2 + half) * 2 + e] += s * (F2P20 * d - zf * sacc[e])
                            else:
                                o[((h * 4 + by) * 2 + half) * 2 + e] += s * (F2P24 * d - zf * sacc[e])
        for i in range(nacc):
            acc[i] = F0

    @device
    def load_sz(qz, sc, sv, gq, nq, n32, wi):
        """Group gq's zero word(s) and the 8 wpl scales of the lane's words (2 wpl x 8 bytes)."""
        so = (gq * n32 + wi * uint32(8 * wpl)) >> uint32(2)
        for i in range(2 * wpl):
            sv[i] = sc[so + uint32(i)]
        return qz[gq * nq + wi]

    @cuda.jit(**opts)
    def gemv1(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, out, part, cnt, k_dim, n_dim, g_size, groups_, tiles_, gpw,
              splits, has_b1, has_b3, m_dim):
        scr = cuda.shared.array(scr_size, uint32)
        red = cuda.shared.array(red_size, float32)
        flag = cuda.shared.array(1, uint32)
        tid = uint32(cuda.threadIdx.x)
        lane = tid & uint32(31)
        warp = tid >> uint32(5)
        g = lane >> uint32(2)
        t = lane & uint32(3)
        k32 = uint32(k_dim)
        n32 = uint32(n_dim)
        m32 = uint32(m_dim) if mr == 8 else uint32(1)
        g32 = uint32(g_size)
        groups = uint32(groups_)
        tiles = uint32(tiles_)
        nq = n32 >> uint32(2 + wpl)                   # loads (wpl words) per row
        bid = uint32(cuda.blockIdx.x)
        split = bid // tiles
        tile = bid - split * tiles
        wi = min(tile * uint32(8) + g, nq - uint32(1))   # the lane's load of each row (clamped: not stored)
        kp = groups * g32
        gp = uint32(gpw)
        gw0 = (split * uint32(warps) + warp) * gp     # the warp's first group
        bpg = (g32 >> uint32(4)) // uint32(unroll)    # batches per group
        nb = gp * bpg
        bstep = uint32(16 * unroll)                   # rows per batch
        rstep = bstep * nq                            # words between batches
        buf = cuda.local.array(nbuf, wdt)
        buf3 = cuda.local.array(nbuf, wdt)
        xbuf = cuda.local.array(unroll, uint64)
        o = cuda.local.array(no, float32)
        o3 = cuda.local.array(no, float32)
        acc = cuda.local.array(nacc, float32)         # [word h][byte][4]
        acc3 = cuda.local.array(nacc, float32)
        sacc = cuda.local.array(4, float32)
        sv = cuda.local.array(nsv, uint64)
        sv3 = cuda.local.array(nsv, uint64)
        nchunk = (m32 + uint32(7)) >> uint32(3) if mr == 8 else uint32(1)   # chunks of 8 rows (B's columns)
        ncol = uint32(ncol_c)
        # batch b reads rows kb + 16 unroll b + 16 u + 4 t + r; from the last batch in Kp on it re-reads that one
        kb = gw0 * g32
        last = (kp - bstep + t * uint32(4)) * nq + wi
        ch = uint32(0)
        while ch < nchunk:            # M = 9 .. 16: the second chunk re-reads the block's weights from L2
            r0 = ch * uint32(8)
            xoff = (r0 + g) * k32 if mr == 8 else uint32(0)      # the lane's row of X (B column g)
            xok = r0 + g < m32 if mr == 8 else True
            for i in range(nacc):
                acc[i] = F0
                acc3[i] = F0
            for i in range(4):
                sacc[i] = F0
            for i in range(no):
                o[i] = F0
                o3[i] = F0
            base = min((min(kb, kp - bstep) + t * uint32(4)) * nq + wi, last)
            kx = kb + t * uint32(4)
            for u in range(unroll):
                for r in range(4):
                    i0 = mad32(uint32(16 * u + r), nq, base)
                    buf[u * 4 + r] = qw1[i0]
                    if nw == 2:
                        buf3[u * 4 + r] = qw3[i0]
                kk = add32(kx, uint32(16 * u))
                xbuf[u] = x[(xoff + kk) >> uint32(2)] if kk < k32 and xok else U0
            gl = uint32(0)
            gq = min(gw0, groups - uint32(1))
            zq = load_sz(qz1, sc1, sv, gq, nq, n32, wi)
            zq3 = load_sz(qz3, sc3, sv3, gq, nq, n32, wi) if nw == 2 else zq
            b = uint32(0)
            cg = uint32(0)                                # batches done in the current group
            while b < nb:
                base = min(add32(base, rstep), last)
                kx = add32(kx, bstep)
                batch(buf, buf3, xbuf, b + uint32(1) < nb, base, qw1, qw3, nq, x, kx, k32, sacc, acc, acc3, scr, tid,
                      xoff, xok)
                b += uint32(1)
                cg += uint32(1)
                if cg == bpg:                             # group end
                    cg = uint32(0)
                    use = gw0 + gl < groups
                    if mr == 8:
                        group_end8(acc, sacc, o, zq, sv, use)
                        if nw == 2:
                            group_end8(acc3, sacc, o3, zq3, sv3, use)
                    else:
                        group_end(acc, sacc, o, zq, sv, t, use)
                        if nw == 2:
                            group_end(acc3, sacc, o3, zq3, sv3, t, use)
                    for i in range(4):
                        sacc[i] = F0
                    gl += uint32(1)
                    if gl < gp:
                        gq = min(gw0 + gl, groups - uint32(1))
                        zq = load_sz(qz1, sc1, sv, gq, nq, n32, wi)
                        if nw == 2:
                            zq3 = load_sz(qz3, sc3, sv3, gq, nq, n32, wi)
            if mr == 8:
                # red[((warp nw + w) 8 + row) ncol + column]: row 2 t + e, column (g wpl + h) 8 + col
                for h in range(wpl):
                    for by in range(4):
                        for half in range(2):
                            col = 4 * (by & 1) + 2 * half + (by >> 1)
                            for e in range(2):
                                ri = ((warp * uint32(nw) * uint32(8) + uint32(2) * t + uint32(e)) * ncol +
                                      (g * uint32(wpl) + uint32(h)) * uint32(8) + uint32(col))
                                oi_ = ((h * 4 + by) * 2 + half) * 2 + e
                                red[ri] = o[oi_]
                                if nw == 2:
                                    red[ri + uint32(8) * ncol] = o3[oi_]
            else:
                for h in range(wpl):
                    for half in range(2):
                        j = t * uint32(2) + uint32(half)
                        col = ((j & uint32(3)) << uint32(1)) | (j >> uint32(2))
                        ri = (warp * uint32(nw) * ncol) + (g * uint32(wpl) + uint32(h)) * uint32(8) + col
                        red[ri] = o[2 * h + half]
                        if nw == 2:
                            red[ri + ncol] = o3[2 * h + half]
            # the block's warps in warp order, then the output (one split) or this split's partials [split, nw, M, N]
            cuda.syncthreads()
            ntot = ncol * uint32(mr)
            i = tid
            while i < ntot:
                row = i // ncol
                ci = i - row * ncol
                col = tile * ncol + ci
                if col < n32 and r0 + row < m32:
                    gv = F0
                    uv = F0
                    for w_ in range(warps):
                        gv += red[(uint32(w_ * nw * mr) + row) * ncol + ci]
                        if nw == 2:
                            uv += red[(uint32(w_ * nw * mr + mr) + row) * ncol + ci]
                    if splits == 1:
                        tc_store(nw, out, b1, b3, has_b1, has_b3, (r0 + row) * n32 + col, col, gv, uv)
                    else:
                        pi = (((uint64(split) * uint64(nw)) * uint64(m32) + uint64(r0 + row)) * uint64(n32) +
                              uint64(col))
                        part[pi] = gv
                        if nw == 2:
                            part[pi + uint64(m32) * uint64(n32)] = uv
                i += uint32(warps * 32)
            cuda.syncthreads()        # red is written again by the next chunk
            ch += uint32(1)
        ntot = ncol * uint32(mr) * nchunk
        if splits == 1:
            return
        if arrive_last(cnt, tile, uint64(splits), flag, tid == uint32(0)):
            i = tid
            while i < ntot:
                row = i // ncol
                ci = i - row * ncol
                col = tile * ncol + ci
                if col < n32 and row < m32:
                    mn = uint64(m32) * uint64(n32)
                    stride = uint64(nw) * mn             # split sp, weight w, row r: ((sp nw + w) M + r) N + col
                    b0 = uint64(row) * uint64(n32) + uint64(col)
                    gv = sum_splits(part, b0, stride, splits)     # split order: deterministic
                    uv = F0
                    if nw == 2:
                        uv = sum_splits(part, b0 + mn, stride, splits)
                    tc_store(nw, out, b1, b3, has_b1, has_b3, row * n32 + col, col, gv, uv)
                i += uint32(warps * 32)
            if tid == uint32(0):
                cnt[tile] = uint32(0)

    return gemv1


def tiles(n, wpl=WPL):
    """Column tiles (8 wpl words each) of N."""
    return -(-(n // (8 * wpl)) // 8)


def plan(k, n, g_size, sms, blocks_per_sm=SIM_BLOCKS_PER_SM, warps=WARPS, gpw=None, wpl=WPL):
    """(grid, gpw, splits): the fewest groups per warp (at most GPW, or ``gpw``) whose grid fits one wave of
    ``sms`` x ``blocks_per_sm`` blocks (else GPW)."""
    groups = -(-k // g_size)
    t = tiles(n, wpl)
    if gpw is None:
        gpw = GPW
        for c in range(1, GPW + 1):
            if t * -(-groups // (warps * c)) <= sms * blocks_per_sm:
                gpw = c
                break
    gpw = max(1, min(gpw, groups))
    splits = -(-groups // (warps * gpw))
    return t * splits, gpw, splits


def sig(wpl=WPL):
    u64 = Array(np.uint64)
    w = Array(np.uint64 if wpl == 2 else np.uint32)
    h = Array(np.uint16)
    return [u64, w, w, u64, w, w, u64, h, h, h, Array(np.float32), Array(np.uint32)] + ["int64"] * 10


_launchers = {}


def launcher(warps=WARPS, unroll=UNROLL, max_registers=MAX_REGISTERS, wpl=WPL, nw=1, mr=1):
    key = (warps, unroll, max_registers, wpl, nw, mr)
    if key not in _launchers:
        _launchers[key] = launcher_for(make(warps, unroll, max_registers, wpl, nw, mr), sig(wpl))
    return _launchers[key]


def scalars(k, n, g_size, gpw, splits, has_b1, has_b3=False, wpl=WPL, m=1):
    """The kernel's scalar arguments after the arrays."""
    return (k, n, g_size, -(-k // g_size), tiles(n, wpl), gpw, splits, int(has_b1), int(has_b3), m)


class SessionPlan(NamedTuple):
    """What a MatMulAWQ (nw = 1) / FusedFFNAWQ (nw = 2) kernel object keeps of this kernel (``session_setup``)."""
    launcher: object
    grid: int
    block: int
    gpw: int
    splits: int
    wpl: int
    nw: int
    scalars: tuple          # the scalar arguments without the two bias flags and M
    mr: int                 # 1 (M = 1) or 8 (M = 2 .. 16: chunks of 8 rows)

    def scratch(self, n):
        """(partial floats, tile counters) the plan's largest call needs."""
        return partial_floats(self.splits, self.nw, 1 if self.mr == 1 else MAX_M, n), tiles(n, self.wpl)


def session_setup(sh, sms, nw, mr):
    """This kernel for a kernel object of ``nw`` weights and shape ``sh`` (dequantawq_cpu.AWQShape) that its
    ROUTES send here, for M = 1 (``mr`` 1) or M = 2 .. 16 (``mr`` 8): the SessionPlan (compiled now)."""
    warps, unroll, cap, wpl = config(sh.K, sh.N, sh.group_size, sms, nw, mr)
    lau = launcher(warps, unroll, cap, wpl, nw, mr)
    grid, gpw, splits = plan(sh.K, sh.N, sh.group_size, sms, max(1, lau.blocks_per_sm(32 * warps)), warps, None,
                             wpl)
    return SessionPlan(lau, grid, 32 * warps, gpw, splits, wpl, nw,
                       scalars(sh.K, sh.N, sh.group_size, gpw, splits, False, False, wpl)[:-3], mr)


def session_launch(sp, ctx, scratch, x, w1, w3, b1, b3, out, n, m=1):
    """One session call at M = m (1 for a plan of ``mr`` 1, up to MAX_M for ``mr`` 8; bridge Tensors; w3 = (qweight,
    qzeros, scales) and b3 None for MatMulAWQ; ``out`` the output's device pointer; ``scratch`` the kernel object's
    splitk.ScratchPool). The caller's route checked the alignment (X and scales to 8 bytes, qweight and qzeros to
    4 wpl bytes, biases to 2)."""
    ws = (w1,) if w3 is None else (w1, w3)
    part = scratch.partials(ctx, partial_floats(sp.splits, sp.nw, m, n))
    ob = (out, (m * n,))
    wa = [(t.ptr, (t.size // (4 if i == 2 else sp.wpl),)) for w in (w1, ws[-1]) for i, t in enumerate(w)]
    bias = [(b.ptr, (n,)) if b is not None else ob for b in (b1, b3)]
    sp.launcher.launch(sp.grid, sp.block, ctx.stream, (x.ptr, (x.size // 4,)), *wa, *bias, ob, part,
                       scratch.counters(ctx.stream), *sp.scalars, int(b1 is not None), int(b3 is not None), m)


def run(x, w1, w3, b1, b3, group_size, K, N, *, warps=None, unroll=UNROLL, gpw=None,  # noqa: N803
        max_registers=MAX_REGISTERS, wpl=WPL, repeat=1, mr=None):
    """Runs the kernel on host arrays and returns the fp16 output [M, N] (tests, benchmarks/kernel_once.py): x fp16
    [M, K] (``mr`` default 1 for M = 1, else 8), w1 / w3 = (qweight, qzeros, scales), w3 None for MatMulAWQ. It
    exposes what a session (and so runtime/direct.py) fixes by shape and SM count: ``wpl``, ``unroll``, ``gpw``,
    ``mr``, and ``warps`` per block (default 2 under the simulator, whose threads are Python threads); the Numba
    dispatcher under the simulator, the direct launch path on a GPU. The inputs are checked as a session checks
    them (the kernel reads all Kp rows of qweight), and the product must suit the kernel (``ok``). ``repeat``
    launches that many times on the same scratch."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    if w3 is None:
        check_weights(*w1, sh, first=1)
        check_a_bias(x, b1, sh)
    else:
        check_both(w1, w3, sh)
        check_x_biases(x, b1, b3, K, N, 7, 8)
    m = x.size // K if K else 0
    mr = mr or (1 if m == 1 else 8)
    most = 1 if mr == 1 else MAX_M
    if x.dtype != np.float16 or not ok(m, K, N, group_size, unroll, wpl) or m > most:
        raise ValueError(f"the small-M tensor-core GEMV cannot take this product (fp16 X [M, K], M <= {most}, "
                         f"K % 4 == 0, N % {8 * wpl} == 0, group_size % {16 * unroll} == 0)")
    nw = 1 if w3 is None else 2
    warps = warps or (2 if SIM else WARPS)
    wdt = np.uint64 if wpl == 2 else np.uint32
    dev = lambda v, dt: cuda.to_device(np.ascontiguousarray(v).reshape(-1).view(dt))  # noqa: E731
    ws = [dev(v, dt) for w in (w1, w3 if nw == 2 else w1) for v, dt in zip(w, (wdt, wdt, np.uint64))]
    dout = cuda.device_array(m * N, np.uint16)
    db1 = dev(b1, np.uint16) if b1 is not None else dout
    db3 = dev(b3, np.uint16) if b3 is not None else dout
    lau = launcher(warps, unroll, max_registers, wpl, nw, mr)
    grid, gp, splits = plan(K, N, group_size, sm_count(), lau.blocks_per_sm(32 * warps), warps, gpw, wpl)
    dpart = cuda.to_device(np.zeros(max(1, splits * nw * m * N), np.float32))
    dcnt = cuda.to_device(np.zeros(tiles(N, wpl), np.uint32))
    args = (dev(x, np.uint64), *ws, db1, db3, dout, dpart, dcnt,
            *scalars(K, N, group_size, gp, splits, b1 is not None, b3 is not None, wpl, m))
    for _ in range(repeat):
        if SIM:
            lau.dispatcher[grid, 32 * warps](*args)
        else:
            lau.launch(grid, 32 * warps, 0, *[arg(v) for v in args])
    if not SIM:
        cuda.synchronize()
    return dout.copy_to_host().view(np.float16).reshape(m, N)

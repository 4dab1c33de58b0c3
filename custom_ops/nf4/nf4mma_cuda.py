"""NF4/FP4 balanced tensor-core GEMV (fp16 X, M <= 4, K % 128 == 0, block_size >= 64): FusedFFNNF4's
S = SiLU(X W1^T + B1) * (X W3^T + B3) on the bitsandbytes layout
(onnx_lowbit.nf4: W^T [N, K] row-major, element i in byte i >> 1, high nibble first, one fp32 absmax per block).

Why another kernel: the decode kernels before it (fusedffnnf4_cuda's fp32 decode, nf4tc_cuda) read 8 bytes per lane
and load instruction and give each block whole 16-row tiles; at LLaMA-7B's 688 tiles on 132 SMs a block gets 2 or 3
tiles (87% balance at best) and the M=1 pair stayed at 27-31 us against a 16-17 us read floor. Here:

* Work unit = one 128-element chunk of K of one 16-row tile (of both weights). The U = tiles * K/128
  units are cut into ``nblk`` equal contiguous ranges, one per block (one wave); the W warps of a block take its
  units in turn (warp w: units lo + w, lo + w + W, ...), so no warp does more than one unit above the mean.
* A lane (fragment row g = lane >> 2, t = lane & 3) reads 16 bytes (one 128-bit ``ld.global.nc`` that does not
  allocate in L1) of rows g and g + 8 of the tile at bytes 16t .. 16t+15 of the chunk: a warp load instruction
  covers 64 contiguous bytes of each of 8 rows. The next unit's words and absmax are in flight while the current
  one is decoded.
* Decoding: each weight byte is one PRMT (byte into bits 8..15, 4 * lane into bits 0..7) and one 4-byte shared load
  of a half2 table (the fp16 code values of the byte's high and low nibble; 32 copies at a stride of 256 bytes per
  entry, lane l's copy in bank l: no bank conflicts), which is the A fragment's register as is; mma.sync m16n8k16
  (fp16 in, fp32 accumulation) takes 16 rows x 16 k per step, 8 steps per chunk. The sum over k does not care
  which k sits in which fragment slot as long as B (= x) uses the same: step j takes byte 2j of the lane's 16
  (elements 32t + 4j, +1: slots 2t, 2t+1) and byte 2j+1 (elements 32t + 4j + 2, +3: slots 2t+8, 2t+9).
* A 128-element chunk spans two 64-element absmax halves (lanes t = 0, 1 the first, t = 2, 3 the second). B column
  2m is X row m on the first half's slots (zero on the others), column 2m + 1 X row m on the second's: after a
  chunk's 8 steps the lane (g, t) holds, for X row m = t, the partial dot products of rows g and g + 8 over each
  half apart, and scales each by its absmax into fp32 accumulators (4 FFMAs per weight and chunk). So M <= 4.
* When a warp leaves a tile its partials go to shared memory (one slot per warp and tile of the block's range);
  after one barrier the block sums them in warp order. Tiles entirely inside the block's range are finished there
  (bias, SiLU * mul in fp32, fp16 store); a tile shared with the neighbouring blocks (at most the first and last
  of a range) goes through fp32 partials in global scratch (two slots per block) and a per-tile counter: the block
  whose increment comes last sums the slots in block order (deterministic), finishes the tile and resets the
  counter to zero, so the counters stay zero between launches (splitk.ScratchPool keeps them per stream).

Accuracy: as nf4tc_cuda (code values rounded to fp16: at most 2^-12 relative per weight; products and sums fp32).
NaN/Inf in a row of X make that row's outputs non-finite.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.launch import Array, arg
from ..device.memory import LOAD, make_ld4
from ..device.mma import mma as _mma, tc_store
from ..device.ptx import add32, lds32, mad32, min32, prmt
from ..device.target import SIM
from ..device import host
from .nf4tc_cuda import SEL, build_table, device_args

WARPS = 8
MAX_M = 4                  # rows of X (the kernel's slots are sized for MAX_M rows whatever M is)
NW = 2                     # weights (W1, W3: FusedFFNNF4; the one-weight form, for MatMulNF4, was never routed)
TLMAX = 6                  # tiles one block's range may touch (the plan raises the block count to keep to it)
TAB_WORDS = 16384          # half2 table: 256 entries x 256 bytes (32 lanes x 4 bytes used)
F0 = np.float32(0.0)
U0 = np.uint32(0)

_ldw = make_ld4(LOAD)                       # weights: streamed, no L1 allocation
_ldx = make_ld4("ld.global.nc.v4.u32")      # x: staged once per block
XSEGS = 512                # 32-element segments of X a block stages (M * K <= 16384): in the table's holes

if SIM:
    def sub32(a, b):
        return np.uint32((int(a) - int(b)) & 0xFFFFFFFF)

    def lds128(tab, off):
        i = int(off) >> 2
        return tab[i], tab[i + 1], tab[i + 2], tab[i + 3]
else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def sub32(typingctx, a, b):
        """uint32 a - b, kept in 32 bits (Numba widens uint32 arithmetic to 64)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            return builder.call(ir.InlineAsm(ir.FunctionType(i32, [i32, i32]), "sub.u32 $0, $1, $2;", "=r,r,r"), args)
        return types.uint32(types.uint32, types.uint32), codegen

    @intrinsic
    def lds128(typingctx, tab, off):
        """4 words of the (shared) uint32 array ``tab`` at byte offset ``off`` (16-byte aligned), one load."""
        rt = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            p = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()),
                            [builder.zext(args[1], ir.IntType(64))], inbounds=True)
            vt = ir.VectorType(ir.IntType(32), 4)
            v = builder.load(builder.bitcast(p, vt.as_pointer()), align=16)
            return context.make_tuple(builder, rt, [builder.extract_element(v, ir.Constant(ir.IntType(32), k))
                                                    for k in range(4)])
        return rt(tab, types.uint32), codegen


def ok(a16, m, k, n, bs):
    """Whether this kernel can take the product (element offsets of W^T are 32-bit; ``bs`` a BlockSize's size, a
    power of two)."""
    return bool(a16) and 0 < m <= MAX_M and k % 128 == 0 and bs >= 64 and k * n < 2 ** 32 and m * k <= 32 * XSEGS


def red_floats(warps=WARPS):
    return TLMAX * warps * NW * MAX_M * 16


def shared_bytes(warps=WARPS):
    """Dynamic shared memory of a launch: the table (whose holes hold the staged x), then the warps' partials."""
    return 4 * (TAB_WORDS + red_floats(warps))


def units(k, n):
    return -(-n // 16) * (k // 128)


def plan_blocks(k, n, sms, occupancy):
    """Blocks of one launch: one wave (SMs x resident blocks), fewer if there are fewer units, more if a range
    would touch more than TLMAX tiles."""
    u = units(k, n)
    cpt = k // 128
    b = max(1, min(u, sms * occupancy))
    span = (TLMAX - 1) * cpt + 1             # units per block that touch at most TLMAX tiles
    return max(b, -(-u // span))


def scratch(blocks, k, n):
    """(partial floats, counters) one launch needs."""
    return 2 * blocks * NW * MAX_M * 16, -(-n // 16)


@cuda.jit(device=True, inline=True)
def advance(c, tile, step, cpt):
    """(chunk, tile) of the unit ``step`` units after (c, tile): chunks of K per tile ``cpt``."""
    c = add32(c, step)
    while c >= cpt:
        c = sub32(c, cpt)
        tile = add32(tile, uint32(1))
    return c, tile


@cuda.jit(device=True, inline=True)
def first_unit(b, utot, nb):
    """The first unit of block ``b`` of ``nb`` (equal ranges of the ``utot`` units)."""
    return uint32(b * utot // nb)


@cuda.jit(device=True, inline=True)
def blocks_of(tau, cpt, utot, nb):
    """(first, last) block whose range holds units of tile ``tau``: block(u) = ((u + 1) nb - 1) // utot."""
    lo_u = uint64(tau * cpt)
    return ((lo_u + uint64(1)) * nb - uint64(1)) // utot, ((lo_u + uint64(cpt)) * nb - uint64(1)) // utot


def make(warps=WARPS):
    """The kernel for the two weights and at most MAX_M rows of X, the next unit's words in flight while one is
    decoded. Signature: x uint32 [M*K/2] (fp16 pairs), q1 uint32 [N*K/8], am1 float32, q3, am3, lut uint32 [256]
    (nf4tc_cuda.lut), b1, b3 uint16, out uint16 [M*N], part float32 (``scratch``), cnt uint32 [tiles] (zero), m_dim,
    k_dim, n_dim, bs_shift (BlockSize.log2), nblk (the grid), has_b1, has_b3. Dynamic shared memory:
    ``shared_bytes(warps)``."""
    nw, mm = NW, MAX_M
    slot = nw * mm * 16
    nwv = 8 * nw
    nav = 4 * nw
    nacc = 2 * nw
    red_words = TLMAX * warps * slot
    scr_size = warps * 32 * 6 if SIM else 1

    @cuda.jit(device=True, inline=True)
    def fetch(wv, av, q1, am1, q3, am3, tile, c, g, t, kdim, ndim, sh, amok):
        last = ndim - uint32(1)
        r0 = min32(mad32(tile, uint32(16), g), last)
        r1 = min32(mad32(tile, uint32(16), g + uint32(8)), last)
        kw = kdim >> uint32(5)                       # 16-byte units per row
        o = mad32(c, uint32(4), t)
        i0 = mad32(r0, kw, o)
        i1 = mad32(r1, kw, o)
        w0, w1, w2, w3 = _ldw(q1, i0)
        v0, v1, v2, v3 = _ldw(q1, i1)
        wv[0] = w0
        wv[1] = w1
        wv[2] = w2
        wv[3] = w3
        wv[4] = v0
        wv[5] = v1
        wv[6] = v2
        wv[7] = v3
        # W3's words as W1's above, written out (not a loop over the weights): constant register indices
        w0, w1, w2, w3 = _ldw(q3, i0)
        v0, v1, v2, v3 = _ldw(q3, i1)
        wv[8] = w0
        wv[9] = w1
        wv[10] = w2
        wv[11] = w3
        wv[12] = v0
        wv[13] = v1
        wv[14] = v2
        wv[15] = v3
        if amok:
            e0 = mad32(r0, kdim, c << uint32(7))
            e1 = mad32(r1, kdim, c << uint32(7))
            h0 = add32(e0, uint32(64))
            h1 = add32(e1, uint32(64))
            av[0] = am1[e0 >> sh]
            av[1] = am1[h0 >> sh]
            av[2] = am1[e1 >> sh]
            av[3] = am1[h1 >> sh]
            av[4] = am3[e0 >> sh]
            av[5] = am3[h0 >> sh]
            av[6] = am3[e1 >> sh]
            av[7] = am3[h1 >> sh]

    @cuda.jit(device=True, inline=True)
    def chunk(wv, av, xw, acc, tab, lane4, valid, scr, tid):
        for w in range(nw):
            d0 = F0
            d1 = F0
            d2 = F0
            d3 = F0
            e0 = F0
            e1 = F0
            e2 = F0
            e3 = F0
            for j in range(8):               # two independent mma chains (even / odd steps)
                wg = wv[8 * w + (j >> 1)]
                wg8 = wv[8 * w + 4 + (j >> 1)]
                lo = SEL[2 * (j & 1)]
                hi = SEL[2 * (j & 1) + 1]
                a0 = lds32(tab, prmt(wg, lane4, lo))
                a1 = lds32(tab, prmt(wg8, lane4, lo))
                a2 = lds32(tab, prmt(wg, lane4, hi))
                a3 = lds32(tab, prmt(wg8, lane4, hi))
                if j & 1 == 0:
                    r = _mma(a0, a1, a2, a3, xw[2 * j], xw[2 * j + 1], d0, d1, d2, d3, scr, tid)
                    d0 = r[0]
                    d1 = r[1]
                    d2 = r[2]
                    d3 = r[3]
                else:
                    r = _mma(a0, a1, a2, a3, xw[2 * j], xw[2 * j + 1], e0, e1, e2, e3, scr, tid)
                    e0 = r[0]
                    e1 = r[1]
                    e2 = r[2]
                    e3 = r[3]
            if valid:
                acc[2 * w] += (d0 + e0) * av[4 * w] + (d1 + e1) * av[4 * w + 1]
                acc[2 * w + 1] += (d2 + e2) * av[4 * w + 2] + (d3 + e3) * av[4 * w + 3]

    @cuda.jit
    def nf4mma(x, q1, am1, q3, am3, lt, b1, b3, out, part, cnt, m_dim, k_dim, n_dim, bs_shift, nblk, has_b1, has_b3):
        tab = cuda.shared.array(0, uint32)           # table (x in its holes), then the warps' partials
        red = cuda.shared.array(0, float32)          # (the same memory as float)
        scr = cuda.shared.array(scr_size, uint32)
        flag = cuda.shared.array(2, uint32)
        tid = uint32(cuda.threadIdx.x)
        nthr = uint32(cuda.blockDim.x)
        lane = tid & uint32(31)
        warp = tid >> uint32(5)
        g = lane >> uint32(2)
        t = lane & uint32(3)
        lane4 = lane << uint32(2)
        mdim = uint32(m_dim)
        kdim = uint32(k_dim)
        ndim = uint32(n_dim)
        sh = uint32(bs_shift)
        cpt = kdim >> uint32(7)
        tiles = (ndim + uint32(15)) >> uint32(4)
        utot = uint64(tiles) * uint64(cpt)
        bid = uint64(cuda.blockIdx.x)
        nb = uint64(nblk)
        u_lo = first_unit(bid, utot, nb)
        u_hi = first_unit(bid + uint64(1), utot, nb)
        tau0 = u_lo // cpt
        n_iter = (sub32(u_hi, u_lo) + uint32(warps - 1)) // uint32(warps)
        amok = t < mdim
        m = g >> uint32(1)
        xok = m < mdim and (t >> uint32(1)) == (g & uint32(1))
        segs = kdim >> uint32(5)                     # 32-element segments per row of x
        xrow = mad32(m, segs, t)                     # segment of (row m, chunk 0, lane t)
        rot = (t & uint32(2)) << uint32(4)           # its quarters' rotation (byte offset XOR)
        wv = cuda.local.array(nwv, uint32)
        av = cuda.local.array(nav, float32)
        wn = cuda.local.array(nwv, uint32)
        an = cuda.local.array(nav, float32)
        xw = cuda.local.array(16, uint32)
        acc = cuda.local.array(nacc, float32)
        for q in range(nacc):
            acc[q] = F0
        for q in range(nav):
            av[q] = F0
            an[q] = F0
        u = add32(u_lo, warp)
        tile = u // cpt
        c = sub32(u, tile * cpt)
        if u < u_hi:           # the first units' words fly while the table and x are staged
            fetch(wv, av, q1, am1, q3, am3, tile, c, g, t, kdim, ndim, sh, amok)
        ua = add32(u, uint32(warps))                 # the next unit (its tile and chunk)
        ca, ta = advance(c, tile, uint32(warps), cpt)
        build_table(tab, lt, tid, nthr, lane)
        i = tid
        while i < uint32(red_words):
            red[TAB_WORDS + i] = F0
            i = add32(i, nthr)
        i = tid
        xunits = mdim * (kdim >> uint32(3))          # 16-byte units of X; unit i: segment i >> 2, quarter i & 3
        while i < xunits:
            p0, p1, p2, p3 = _ldx(x, i)
            sg = i >> uint32(2)                      # segment sg: hole sg >> 1, half sg & 1, quarters rotated
            o = (((sg >> uint32(1)) << uint32(6)) | uint32(32) | ((sg & uint32(1)) << uint32(4))
                 | (((i & uint32(3)) ^ (sg & uint32(2))) << uint32(2)))
            tab[o] = p0
            tab[o + uint32(1)] = p1
            tab[o + uint32(2)] = p2
            tab[o + uint32(3)] = p3
            i = add32(i, nthr)
        cuda.syncthreads()
        it = uint32(0)
        while it < n_iter:
            valid = u < u_hi
            ub = add32(ua, uint32(warps))            # the unit after the next
            cb, tb = advance(ca, ta, uint32(warps), cpt)
            if ua < u_hi:
                fetch(wn, an, q1, am1, q3, am3, ta, ca, g, t, kdim, ndim, sh, amok)
            # every warp decodes n_iter units (at most one past its range, with x zero and no accumulation): the
            # decode stays in block-uniform control flow (fewer instructions: ptxas had branched around it)
            sg = mad32(c, uint32(4), xrow)
            xo = ((sg >> uint32(1)) << uint32(8)) | uint32(128) | ((sg & uint32(1)) << uint32(6))
            for q in range(4):
                if xok and valid:
                    p0, p1, p2, p3 = lds128(tab, xo | (uint32(q << 4) ^ rot))
                else:
                    p0, p1, p2, p3 = U0, U0, U0, U0
                xw[4 * q] = p0
                xw[4 * q + 1] = p1
                xw[4 * q + 2] = p2
                xw[4 * q + 3] = p3
            chunk(wv, av, xw, acc, tab, lane4, valid, scr, tid)
            if valid and (ua >= u_hi or ta != tile):
                if amok:
                    base = TAB_WORDS + mad32(mad32(sub32(tile, tau0), uint32(warps), warp), uint32(slot),
                                             mad32(t, uint32(16), g))
                    for w in range(nw):
                        red[base + uint32(w * mm * 16)] = acc[2 * w]
                        red[base + uint32(w * mm * 16 + 8)] = acc[2 * w + 1]
                for q in range(nacc):
                    acc[q] = F0
            for q in range(nwv):
                wv[q] = wn[q]
            for q in range(nav):
                av[q] = an[q]
            u = ua
            c = ca
            tile = ta
            ua = ub
            ca = cb
            ta = tb
            it = add32(it, uint32(1))
        cuda.syncthreads()
        # the block's tiles: sums over its warps in warp order; whole tiles finished here, shared ones to scratch
        tau_last = (u_hi - uint32(1)) // cpt
        nt = tau_last - tau0 + uint32(1)
        per = mdim << uint32(4)
        e = tid
        while e < nt * per:
            tl = e // per
            r = e - tl * per
            mr = r >> uint32(4)
            row = r & uint32(15)
            tau = tau0 + tl
            o = TAB_WORDS + tl * uint32(warps * slot) + (mr << uint32(4)) + row
            gv = F0
            uv = F0
            for wp in range(warps):
                gv += red[o + uint32(wp * slot)]
                uv += red[o + uint32(wp * slot + mm * 16)]
            if tau * cpt >= u_lo and (tau + uint32(1)) * cpt <= u_hi:
                n = (tau << uint32(4)) + row
                if n < ndim:
                    tc_store(nw, out, b1, b3, has_b1, has_b3, uint64(mr) * uint64(ndim) + uint64(n), n, gv, uv)
            else:
                s = uint64(0) if tl == uint32(0) else uint64(1)
                pb = (bid * uint64(2) + s) * uint64(slot) + uint64((mr << uint32(4)) + row)
                part[pb] = gv
                part[pb + uint64(mm * 16)] = uv
            e += nthr
        full0 = tau0 * cpt >= u_lo and (tau0 + uint32(1)) * cpt <= u_hi
        full1 = nt == uint32(1) or (tau_last + uint32(1)) * cpt <= u_hi
        if full0 and full1:
            return
        cuda.threadfence()
        cuda.syncthreads()
        if tid == U0:
            for k in range(2):
                flag[k] = U0
                tau = tau0 if k == 0 else tau_last
                if (k == 0 and not full0) or (k == 1 and not full1):
                    b_lo, b_hi = blocks_of(tau, cpt, utot, nb)
                    old = cuda.atomic.add(cnt, tau, uint32(1))
                    if uint64(old) == b_hi - b_lo:
                        flag[k] = uint32(1)
        cuda.syncthreads()
        for k in range(2):
            if flag[k] != U0:
                cuda.threadfence()
                tau = tau0 if k == 0 else tau_last
                b_lo, b_hi = blocks_of(tau, cpt, utot, nb)
                e = tid
                while e < per:
                    mr = e >> uint32(4)
                    row = e & uint32(15)
                    n = (tau << uint32(4)) + row
                    gv = F0
                    uv = F0
                    bb = b_lo
                    while bb <= b_hi:
                        first = first_unit(bb, utot, nb) // cpt
                        s = uint64(0) if first == tau else uint64(1)
                        pb = (bb * uint64(2) + s) * uint64(slot) + uint64(e)
                        gv += part[pb]
                        uv += part[pb + uint64(mm * 16)]
                        bb += uint64(1)
                    if n < ndim:
                        tc_store(nw, out, b1, b3, has_b1, has_b3, uint64(mr) * uint64(ndim) + uint64(n), n, gv, uv)
                    e += nthr
                if tid == U0:
                    cnt[tau] = U0

    return nf4mma


def sig():
    u32, f32, u16 = Array(np.uint32), Array(np.float32), Array(np.uint16)
    return [u32, u32, f32, u32, f32, u32, u16, u16, u16, f32, u32] + ["int64"] * 7


_launchers = {}


def launcher(warps=WARPS):
    """Direct-launch wrapper, compiled once per process (device/host.launcher; ``.dispatcher``: the Numba kernel)."""
    if warps not in _launchers:
        _launchers[warps] = host.launcher(make(warps), sig(), dynamic_shared=shared_bytes(warps))
    return _launchers[warps]


def run(x, q1, am1, q3, am3, code, block_size, K, N, b1=None, b3=None, *, warps=None, sms=None,  # noqa: N803
        blocks=None, repeat=1):
    """Host arrays in, host array out. x fp16 [..., K]. Kept beside runtime/direct.py (which runs what FusedFFNNF4
    routes to, with its geometry) for what tests choose that sessions do not: ``warps`` per block (2 under the
    simulator), a grid of ``blocks`` (default: the plan's) so that tiles are shared by several blocks, M = 1, 2 and
    ``repeat`` launches (the tile counters left at zero: asserted)."""
    x = np.ascontiguousarray(x, np.float16)
    lead = x.shape[:-1]
    m = int(np.prod(lead)) if lead else 1
    assert ok(True, m, K, N, block_size), "shape not served by the balanced tensor-core kernel"
    assert q3 is not None, "two weights"
    warps = warps or (2 if SIM else WARPS)
    _, (dx, dq1, dam1, dq3, dam3, dlut, db1, db3, dout) = device_args(x, q1, am1, q3, am3, code, b1, b3, m * N,
                                                                       np.uint32)
    if SIM:
        occ, sms = 1, sms or 2
    else:
        lau = launcher(warps)
        occ = max(1, lau.blocks_per_sm(32 * warps, shared_bytes(warps)))
        sms = sms or host.sm_count()
    nblk = blocks or plan_blocks(K, N, sms, occ)
    pf, nc = scratch(nblk, K, N)
    dpart = cuda.device_array(max(pf, 1), np.float32)
    dcnt = cuda.to_device(np.zeros(nc, np.uint32))
    args = (dx, dq1, dam1, dq3, dam3, dlut, db1, db3, dout, dpart, dcnt, m, K, N, block_size.bit_length() - 1, nblk,
            int(b1 is not None), int(b3 is not None))
    if SIM:
        kern = make(warps)
        for _ in range(repeat):
            kern[nblk, 32 * warps, 0, shared_bytes(warps)](*args)
    else:
        for _ in range(repeat):
            lau.launch(nblk, 32 * warps, 0, *[arg(a) for a in args], shmem=shared_bytes(warps))
        cuda.synchronize()
    assert not dcnt.copy_to_host().any(), "tile counters not left at zero"
    return dout.copy_to_host().view(np.float16).reshape(tuple(lead) + (N,))

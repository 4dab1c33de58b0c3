"""FusedFFN decode kernel for K-major weights (attribute ``weights_kn`` = 1: W1, W3 [K, N], the MatMul weights as
they are): S[m, n] = SiLU(sum_k X[m, k] W1[k, n] + B1[n]) * (sum_k X[m, k] W3[k, n] + B3[n]), M <= MAX_M rows.

Why a second layout: onnxruntime's MatMul multiplies [K, N] weights, and cuBLAS picks faster kernels for that
("NN") than for [N, K] ("TN", 2-8 us per gate/up pair at M = 17..256 on the H100, docs/ffn.md); with K-major
weights the prefill path runs the same GEMMs as the unfused graph. The [N, K] decode kernel streams each weight
row along K; this one streams the weight rows k, each a contiguous run of N values, with split-K:

* grid = column tiles x K splits; a block of 256 threads = ``CW`` = 1 column warp x ``kw`` = 8 K warps; a column tile
  is 32 lanes x 16 bytes (256 fp16 columns), each lane owns the 8 (fp16) or 4 (fp32) columns of one 16-byte
  chunk; a block takes ``ks`` consecutive rows of K, its K warps every kw-th step of ``u`` rows;
* the block stages its ks values of x (each row of X) as fp32 in shared memory; per step a lane issues its 2 x u
  16-byte loads (``ld.global.nc.L1::no_allocate.v4.u32``: rows k .. k+u-1 of W1 and W3), then multiplies them
  with the broadcast x values into 2 x epc x M fp32 accumulators;
* the K warps' sums meet in shared memory (in warp order); with one split the block applies bias + SiLU * mul and
  stores S; with several it writes fp32 partials [splits, 2, M, N] (onnxruntime's per-call scratch) and the last
  block of a column tile (threadfence + a tile counter, reset by that block) adds the splits in split order
  (deterministic) and finishes. The counters are the kernel object's, per stream (splitk.ScratchPool).
Needs N % epc == 0 and 16-byte aligned weights (every row then starts on a chunk); other shapes take the tiled
kernel or cuBLAS.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.activations import silu
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import LOAD, ld16 as _ld16, ld32 as _ld32, make_ld4, st16 as _st16, st32 as _st32, w16 as _w16, w32
from ..device.splitk import arrive_last
from ..device.target import SIM, device

MAX_M = 2                       # rows of X the kernel takes (accumulators: 2 x epc x M per lane)
BLOCK = 64 if SIM else 256      # threads (the simulator: 2 K warps, a Python thread per CUDA thread)
CW = 1                          # column warps per block (a tile of 256 fp16 columns: 512 bytes of each weight row)
# per row bucket: rows per step, double-buffered loads (H100, 4096 x 14336 fp16, benchmarks/ffn_kn_gpu.py
# --variants, 2026-11-27: M = 1 u=2 db 83.6 us, u=4 84.3; M = 2 u=4 88.8, u=4 db 89.4, u=2 90.9)
TUNED = {1: dict(u=2, db=True), 2: dict(u=4, db=False)}
BLOCKS_PER_SM = 3               # resident blocks the split count aims at (one wave; 4096 x 14336, M = 1: 83.6 us
                                # with u = 2 db; u = 4: 85.0 at 3 per SM, 84.4 at 2, 90.8 at 1)
TILES_MAX = 4096                # tile counters the kernel object keeps per stream
KS_MAX = 4096                   # rows of K one block may stage (x: MAX_M x KS_MAX x 4 bytes of shared memory)
U0, F0 = np.uint64(0), np.float32(0.0)   # (fusedffn_cuda's values)


def epc_of(w16):
    return 8 if w16 else 4


def ok(m, k, n, w16, aligned=True):
    """Whether the kernel takes this product (``aligned``: W1, W3 16-byte aligned)."""
    return 1 <= m <= MAX_M and k >= 1 and n % epc_of(w16) == 0 and aligned and \
        -(-n // (CW * 32 * epc_of(w16))) <= TILES_MAX


def geometry(k, n, w16, sms, occupancy, u, ks=None):
    """(tiles, splits, rows per split): one wave of ``sms * occupancy`` blocks, rows per split a multiple of kw x u
    so every K warp does the same number of steps; ``ks``: rows per split given (one split when >= K)."""
    kw = BLOCK // 32 // CW
    tiles = -(-n // (CW * 32 * epc_of(w16)))
    if ks is None:
        splits = max(1, (sms * occupancy) // tiles)
        ks = -(-k // splits)
        ks = min(KS_MAX, -(-ks // (kw * u)) * (kw * u))
    splits = -(-k // ks)
    return tiles, splits, ks


def partial_floats(splits, m, n):
    return splits * 2 * m * n if splits > 1 else 0


def make(mt, x16, w16, u, db):
    """The kernel for M <= mt rows of X: ``u`` weight rows per step, ``db``: double-buffered loads (TUNED[mt])."""
    block, cw = BLOCK, CW
    ldx = _ld16 if x16 else _ld32
    st = _st16 if x16 else _st32
    wget = _w16 if w16 else w32
    epc = epc_of(w16)
    warps = block // 32
    kw = warps // cw
    tw = cw * 32 * epc                    # columns per tile
    nacc = mt * 2 * epc
    nw = 8 * u                            # loaded words per step (W1, W3)
    sh_size = max(mt * KS_MAX, kw * mt * 2 * tw)   # x while the block streams, then the K warps' sums
    ld4 = make_ld4(LOAD)

    @device
    def load_step(w1, w3, wa, r, ke, nch, ch):
        """The 16-byte chunks of rows r .. r+u-1 (those before ke) of W1 and W3 at chunk column ch; returns how many
        rows were loaded."""
        nu = min(uint64(u), ke - r)
        for q in range(u):
            if uint64(q) < nu:
                w = ld4(w1, (r + uint64(q)) * nch + ch)
                wa[8 * q] = w[0]
                wa[8 * q + 1] = w[1]
                wa[8 * q + 2] = w[2]
                wa[8 * q + 3] = w[3]
                w = ld4(w3, (r + uint64(q)) * nch + ch)
                wa[8 * q + 4] = w[0]
                wa[8 * q + 5] = w[1]
                wa[8 * q + 6] = w[2]
                wa[8 * q + 7] = w[3]
        return nu

    @device
    def compute_step(wa, acc, xs, r0, nu, ks64):
        """Both products of the loaded rows (x values at xs[m ks + r0 + q], broadcast to the warp)."""
        for q in range(u):
            if uint64(q) < nu:
                for m in range(mt):
                    xv = xs[uint64(m) * ks64 + r0 + uint64(q)]
                    for e in range(epc):
                        acc[(m * 2) * epc + e] += wget(wa, 8 * q, e) * xv
                        acc[(m * 2 + 1) * epc + e] += wget(wa, 8 * q + 4, e) * xv

    @device
    def sum_splits(part, i0, stride, splits):
        tot = F0
        for sp in range(splits):
            tot += part[i0 + uint64(sp) * stride]
        return tot

    @device
    def finish(y, b1, b3, has_b1, has_b3, oi, col, gv, uv):
        if has_b1:
            gv += ldx(b1, col)
        if has_b3:
            uv += ldx(b3, col)
        st(y, oi, silu(gv) * uv)

    @cuda.jit
    def kn(x, w1, w3, b1, b3, y, part, cnt, m_dim, k_dim, n_dim, ks, splits, has_b1, has_b3):
        """x [M*K] (T; fp16 as uint16 bits), w1/w3 [K*N*size/4] uint32 words, b1/b3 [N] (T), y [M*N] (T),
        part fp32 [splits*2*M*N] (unused with one split), cnt uint32 [tiles] (zero, left zero)."""
        xs = cuda.shared.array(sh_size, float32)
        red = xs
        flag = cuda.shared.array(1, uint32)
        tid = uint64(cuda.threadIdx.x)
        k64 = uint64(k_dim)
        m64 = uint64(m_dim)
        n64 = uint64(n_dim)
        ks64 = uint64(ks)
        ntiles = (n64 + uint64(tw - 1)) // uint64(tw)
        bid = uint64(cuda.blockIdx.x)
        tile = bid % ntiles
        split = bid // ntiles
        warp = tid >> uint64(5)
        lane = tid & uint64(31)
        wc = warp % uint64(cw)
        wk = warp // uint64(cw)
        cl = (wc * uint64(32) + lane) * uint64(epc)          # first column of this lane in the tile
        col = tile * uint64(tw) + cl
        nch = n64 // uint64(epc)                             # 16-byte chunks per weight row
        ch = col // uint64(epc)
        kb = split * ks64
        ke = min(k64, kb + ks64)
        acc = cuda.local.array(nacc, float32)
        wa = cuda.local.array(nw, uint32)
        wb = cuda.local.array(nw if db else 1, uint32)
        for v in range(nacc):
            acc[v] = F0
        # x[m, kb:ke] -> fp32 shared memory (rows past M are never read)
        i = tid
        while i < uint64(mt) * ks64:
            m = i // ks64
            kk = i - m * ks64
            if m < m64 and kb + kk < ke:
                xs[m * ks64 + kk] = ldx(x, m * k64 + kb + kk)
            i += uint64(block)
        cuda.syncthreads()
        if col < n64:
            r = kb + wk * uint64(u)
            if db:
                # double-buffered: the next step's loads are issued before this step's arithmetic
                nu = U0
                if r < ke:
                    nu = load_step(w1, w3, wa, r, ke, nch, ch)
                while r < ke:
                    rn = r + uint64(kw * u)
                    nn = U0
                    if rn < ke:
                        nn = load_step(w1, w3, wb, rn, ke, nch, ch)
                    compute_step(wa, acc, xs, r - kb, nu, ks64)
                    for i_ in range(nw):
                        wa[i_] = wb[i_]
                    nu = nn
                    r = rn
            else:
                while r < ke:
                    nu = load_step(w1, w3, wa, r, ke, nch, ch)
                    compute_step(wa, acc, xs, r - kb, nu, ks64)
                    r += uint64(kw * u)
        # the K warps' sums in shared memory (over x: every warp is done with it), added in warp order
        cuda.syncthreads()
        for m in range(mt):
            for g in range(2):
                base = ((wk * uint64(mt) + uint64(m)) * uint64(2) + uint64(g)) * uint64(tw) + cl
                for e in range(epc):
                    red[base + uint64(e)] = acc[(m * 2 + g) * epc + e]
        cuda.syncthreads()
        mn = m64 * n64
        i = tid
        while i < uint64(mt * tw):
            m = i // uint64(tw)
            c = i - m * uint64(tw)
            cg = tile * uint64(tw) + c
            if m < m64 and cg < n64:
                gv = F0
                uv = F0
                for w_ in range(kw):
                    b = (uint64(w_ * mt) + m) * uint64(2 * tw) + c
                    gv += red[b]
                    uv += red[b + uint64(tw)]
                if splits == 1:
                    finish(y, b1, b3, has_b1, has_b3, m * n64 + cg, cg, gv, uv)
                else:
                    pi = uint64(split) * uint64(2) * mn + m * n64 + cg     # split s, weight w: (2 s + w) M N
                    part[pi] = gv
                    part[pi + mn] = uv
            i += uint64(block)
        if splits == 1:
            return
        if arrive_last(cnt, tile, uint64(splits), flag, tid == U0):
            i = tid
            while i < uint64(mt * tw):
                m = i // uint64(tw)
                c = i - m * uint64(tw)
                cg = tile * uint64(tw) + c
                if m < m64 and cg < n64:
                    b0 = m * n64 + cg
                    gv = sum_splits(part, b0, uint64(2) * mn, splits)
                    uv = sum_splits(part, b0 + mn, uint64(2) * mn, splits)
                    finish(y, b1, b3, has_b1, has_b3, b0, cg, gv, uv)
                i += uint64(block)
            if tid == U0:
                cnt[tile] = uint32(0)

    return kn


_launchers = {}


def launcher(mt, x16, w16):
    """Direct-launch wrapper of the bucket-``mt`` kernel (TUNED[mt]), compiled once per process (SimLauncher under
    the simulator)."""
    key = (mt, x16, w16)
    if key not in _launchers:
        t = Array(np.uint16) if x16 else Array(np.float32)
        sig = [t, Array(np.uint32), Array(np.uint32), t, t, t, Array(np.float32), Array(np.uint32)] + ["int64"] * 7
        fn = make(mt, x16, w16, TUNED[mt]["u"], TUNED[mt]["db"])
        _launchers[key] = SimLauncher(fn, sig) if SIM else Launcher(fn, sig)
    return _launchers[key]


def bucket(m):
    return 1 if m <= 1 else MAX_M


def launch(lau, stream, m, k, n, w16, xp, w1p, w3p, b1p, b3p, yp, part, cnt, geo):
    """One launch on device pointers; ``geo`` = geometry(...); ``part`` = (pointer, floats) of the partials,
    ``cnt`` = (pointer, shape) of the tile counters."""
    tiles, splits, ks = geo
    words = k * n * (2 if w16 else 4) // 4
    bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
    lau.launch(tiles * splits, BLOCK, stream, (xp, (m * k,)), (w1p, (words,)), (w3p, (words,)), *bias,
               (yp, (m * n,)), (part[0] or yp, (max(part[1], 1),)), cnt, m, k, n, ks, splits,
               int(b1p != 0), int(b3p != 0))

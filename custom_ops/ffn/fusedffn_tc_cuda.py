"""FusedFFN with fp16 X and fp16 W at small M (prefill, M >= 3) on the tensor cores, SiLU * mul in the epilogue:
S[m, n] = SiLU(sum_k X[m, k] W1[n, k] + b1[n]) * (sum_k X[m, k] W3[n, k] + b3[n]), W1/W3 [N, K] as the op stores them.

Why (docs/ffn.md, "where the prefill gap comes from"): at M = 3..256 the cuBLAS path multiplies the [N, K] weights
with op T ("TN"), for which cuBLAS picks slower kernels than for onnxruntime's [K, N] MatMul, then writes the two
fp32 products and reads them back for SiLU * mul. At these M the product is bound by reading the weights once.

mma.sync m16n8k16 (fp16 x fp16 -> fp32) with the weights as the A operand (16 output features) and X as B (8 rows
of X): D[n, m]. The sum over k does not care about the order of k, so the lane's fragments are whole 16-byte
chunks: lane (g, t) loads bytes [16 t, 16 t + 16) of a 64-byte (32-column) chunk of weight rows n0 + g and
n0 + g + 8 and of X row m0 + g, and feeds words (0, 1) to one mma and words (2, 3) to a second (the same
permutation of k on both operands). A warp reads 8 rows x 64 contiguous bytes per load instruction.

Block b: feature tile (16 rows of W1 and of W3) b % tiles, X row chunk (8 ``mt`` rows) b // tiles (``mfast``:
row chunk b % chunks, feature tile b // chunks, so a tile's weights are re-read from L2); its ``kw``
warps take consecutive ranges of the K chunks (the same number each, chunks past K read as zeros) and add their
sums in shared memory in warp order (deterministic); warp 0 applies biases and SiLU * mul. Each warp keeps a
register ring of ``ring`` chunks in flight (weights and X), each slot reloaded right after its mmas.

Needs fp16 X and W, K % 8 == 0 and 16-byte aligned X, W1, W3 (rows of 16-byte chunks); any M, N. Sessions route
M in [fusedffn_cuda.TC_MIN_M, TC_MAX_M] here (fusedffn_cuda.ROUTES, row ``tc``). Measured: docs/ffn.md, BENCHMARKS.md.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32

from ..device.activations import silu
from ..device.fp16 import h2f
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import make_ld4, st16
from ..device.mma import make_to_warp0, mma as _mma
from ..device.target import SIM, device

KW = 4                           # warps per block (K ranges of one feature tile)
RING = 2                         # 32-column chunks in flight per warp
# What sessions launch, by M (H100, x[M, 4096], W1/W3 [11008, 4096], benchmarks/ffn_tc_gpu.py, 2026-11-26, us
# against torch's unfused block on [K, N] weights in the same run): (mt, kw, ring, mfast) for M <= rows.
# M = 3: 68.4 / 76.3, M = 8: 68.6 / 76.1, M = 16: 72.0 / 79.0, M = 24: 77.3 / 77.3, M = 32: 77.7 / 77.1; M = 48,
# 64: 94.8, 102.7 against 79.8, 77.8 (not routed: past 16 rows the weights are re-read per row chunk, from L2 with
# mfast; 4 and 8 row tiles per block hold too many registers for a ring).
CONFIGS = ((8, (1, 4, 4, False)), (16, (2, 2, 2, False)), (32, (2, 4, 2, True)))
LOAD_W = "ld.global.nc.L1::no_allocate.v4.u32"   # weights: read once
LOAD_X = "ld.global.nc.v4.u32"                    # X: read by every feature tile (L1 / L2)
U0 = np.uint32(0)
F0 = np.float32(0.0)

_ldw = make_ld4(LOAD_W)
_ldx = make_ld4(LOAD_X)


def config(m):
    """(mt, kw, ring, mfast) a session launches at M = m (the last entry past its rows)."""
    for rows, c in CONFIGS:
        if m <= rows:
            return c
    return CONFIGS[-1][1]


def ok(x16, w16, m, k, aligned=True):
    """Whether the kernel can take the product (``aligned``: X, W1, W3 16-byte aligned)."""
    return x16 and w16 and m > 0 and k > 0 and k % 8 == 0 and aligned


def grid(m, n, mt):
    return -(-n // 16) * -(-m // (8 * mt))


def chunks_per_warp(k, kw=KW, ring=RING):
    """32-column chunks each warp streams (the same for all warps, a multiple of ``ring``)."""
    per = -(-(-(-k // 32)) // kw)
    return -(-per // ring) * ring


def make(mt, kw=KW, ring=RING, mfast=False):
    """Signature: (x uint32 [M*K/2] (fp16 pairs), w1, w3 uint32 [N*K/2], b1, b3 uint16 [N], out uint16 [M*N],
    m_dim, k_dim, n_dim, cpw, has_b1, has_b3); ``cpw`` = chunks_per_warp(K, kw, ring). ``mfast``: consecutive blocks take the
    X row chunks of one feature tile (past 8 mt rows, its weights are read again while still in L2), else the
    feature tiles of one row chunk."""
    if not 1 <= ring <= 4:
        raise ValueError(f"ring must be 1..4 chunks (the loop spells out 4 slots), got {ring}")
    scr_size = kw * 32 * 6 if SIM else 1
    nacc = 8 * mt                     # [weight][tile][c0..c3]
    red_size = max(1, (kw - 1) * nacc * 32)
    nwb = ring * 16                   # per slot: W1 row g, W1 row g + 8, W3 row g, W3 row g + 8 (4 words each)
    nxb = ring * mt * 4               # per slot and tile: X row 8 j + g (4 words)
    to_warp0 = make_to_warp0(kw, nacc)

    @device
    def load(wb, xb, u, c, cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m_dim):
        """Slot ``u`` <- chunk ``c`` (zeros past the warp's range, past K, past N / M)."""
        q = uint32(c * 4 + t)                            # the lane's 16-byte chunk within a row
        kin = c < cend and q < k8
        for wsel in range(2):
            w = w1 if wsel == 0 else w3
            o = u * 16 + wsel * 8
            if kin and va:
                r = _ldw(w, ra * k8 + q)
                for i in range(4):
                    wb[o + i] = r[i]
            else:
                for i in range(4):
                    wb[o + i] = U0
            if kin and vb:
                r = _ldw(w, rb * k8 + q)
                for i in range(4):
                    wb[o + 4 + i] = r[i]
            else:
                for i in range(4):
                    wb[o + 4 + i] = U0
        for j in range(mt):
            o = (u * mt + j) * 4
            row = xr + uint32(8 * j)
            if kin and row < m_dim:
                r = _ldx(x, row * k8 + q)
                for i in range(4):
                    xb[o + i] = r[i]
            else:
                for i in range(4):
                    xb[o + i] = U0

    @device
    def compute(wb, xb, u, acc, scr, tid):
        for j in range(mt):
            xo = (u * mt + j) * 4
            for wsel in range(2):
                o = u * 16 + wsel * 8
                ai = (wsel * mt + j) * 4
                for h in range(2):                       # words (0, 1), then (2, 3)
                    r4 = _mma(wb[o + 2 * h], wb[o + 4 + 2 * h], wb[o + 2 * h + 1], wb[o + 4 + 2 * h + 1],
                              xb[xo + 2 * h], xb[xo + 2 * h + 1], acc[ai], acc[ai + 1], acc[ai + 2], acc[ai + 3],
                              scr, tid)
                    for i in range(4):
                        acc[ai + i] = r4[i]

    @device
    def slot(wb, xb, u, acc, scr, tid, c0, cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m_dim):
        """Slot u: its chunk's mmas, then the slot reloaded with the chunk ``ring`` ahead."""
        compute(wb, xb, u, acc, scr, tid)
        load(wb, xb, u, c0 + uint32(ring + u), cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m_dim)

    @cuda.jit
    def kern(x, w1, w3, b1, b3, out, m_dim, k_dim, n_dim, cpw, has_b1, has_b3):
        scr = cuda.shared.array(scr_size, uint32)
        red = cuda.shared.array(red_size, float32)
        tid = cuda.threadIdx.x
        lane = uint32(tid & 31)
        warp = uint32(tid >> 5)
        g = lane >> uint32(2)
        t = lane & uint32(3)
        n32 = uint32(n_dim)
        tiles = (n32 + uint32(15)) >> uint32(4)
        b = uint32(cuda.blockIdx.x)
        if mfast:
            mcs = (uint32(m_dim) + uint32(8 * mt - 1)) // uint32(8 * mt)
            bt = b // mcs
            mc = b - bt * mcs
        else:
            mc = b // tiles
            bt = b - mc * tiles
        n0 = bt * uint32(16)
        m0 = mc * uint32(8 * mt)
        k8 = uint32(k_dim >> 3)
        kc = (uint32(k_dim) + uint32(31)) >> uint32(5)
        cpw32 = uint32(cpw)
        cbase = warp * cpw32
        cend = min(cbase + cpw32, kc)
        ra = n0 + g
        rb = ra + uint32(8)
        va = ra < n32
        vb = rb < n32
        xr = m0 + g
        m32 = uint32(m_dim)

        wb = cuda.local.array(nwb, uint32)
        xb = cuda.local.array(nxb, uint32)
        acc = cuda.local.array(nacc, float32)
        for i in range(nacc):
            acc[i] = F0
        for u in range(ring):
            load(wb, xb, u, cbase + uint32(u), cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m32)
        s = uint32(0)
        while s < cpw32:                                  # warp- and block-uniform trip count
            # the slots spelled out (constant slot indices: the ring stays in registers at any mt)
            slot(wb, xb, 0, acc, scr, tid, cbase + s, cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m32)
            if ring > 1:
                slot(wb, xb, 1, acc, scr, tid, cbase + s, cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m32)
            if ring > 2:
                slot(wb, xb, 2, acc, scr, tid, cbase + s, cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m32)
            if ring > 3:
                slot(wb, xb, 3, acc, scr, tid, cbase + s, cend, t, k8, ra, rb, va, vb, xr, x, w1, w3, m32)
            s += uint32(ring)

        to_warp0(acc, red, warp, lane)        # warp 0's acc: the block's sums, added in warp order
        if warp == 0:
            # D[n, m]: c0 = (n0 + g, m 2t), c1 = (n0 + g, 2t + 1), c2 = (n0 + g + 8, 2t), c3 = (n0 + g + 8, 2t + 1)
            for half in range(2):
                n = ra if half == 0 else rb
                if n < n32:
                    bg = h2f(b1[n]) if has_b1 else F0
                    bu = h2f(b3[n]) if has_b3 else F0
                    for j in range(mt):
                        for e in range(2):
                            m = m0 + uint32(8 * j) + uint32(2) * t + uint32(e)
                            if m < m32:
                                i = j * 4 + 2 * half + e
                                gv = acc[i] + bg
                                uv = acc[mt * 4 + i] + bu
                                st16(out, m * n32 + n, silu(gv) * uv)

    return kern


_launchers = {}


def sig():
    u32, u16 = Array(np.uint32), Array(np.uint16)
    return [u32, u32, u32, u16, u16, u16] + ["int64"] * 6


def launcher(mt, kw=KW, ring=RING, mfast=False):
    """Direct-launch wrapper, compiled once per process and configuration (SimLauncher under the simulator)."""
    key = (mt, kw, ring, mfast)
    if key not in _launchers:
        fn = make(mt, kw, ring, mfast)
        _launchers[key] = SimLauncher(fn, sig()) if SIM else Launcher(fn, sig())
    return _launchers[key]


def launch(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, mt, kw=KW, ring=RING, mfast=False):
    """One launch on device pointers (b1p / b3p 0 when absent)."""
    wwords = n * k // 2
    bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
    launcher(mt, kw, ring, mfast).launch(
        grid(m, n, mt), 32 * kw, stream, (xp, (m * k // 2,)), (w1p, (wwords,)), (w3p, (wwords,)), *bias,
        (yp, (m * n,)), m, k, n, chunks_per_warp(k, kw, ring), int(b1p != 0), int(b3p != 0))

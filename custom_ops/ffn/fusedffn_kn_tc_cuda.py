"""FusedFFN with fp16 X and fp16 K-major weights (attribute weights_kn = 1: W1, W3 [K, N]) at small M on the tensor
cores, SiLU * mul in the epilogue: S[m, n] = SiLU(sum_k X[m, k] W1[k, n] + b1[n]) * (sum_k X[m, k] W3[k, n] + b3[n]).

The [K, N] twin of fusedffn_tc_cuda (the [N, K] kernel): mma.sync m16n8k16 (fp16 x fp16 -> fp32) with the weights as
the A operand (16 output features) and X as B (8 rows of X), D[n, m]. A K-major weight row holds consecutive
features, so a lane's 16-byte load gives 8 features at one k, while an A fragment pairs two k of one feature. So:
* a warp's step is 16 rows of K x 64 features; lane (g, t) loads 16 bytes at features [8 g, 8 g + 8) of the tile from
  each of the rows k0 + 4 t + i (i = 0..3) of W1 and of W3 (8 rows x 128 contiguous bytes per load instruction),
  and X[m, k0 + 4 t .. + 4] (8 bytes) for its row of each 8-row X tile;
* the sum over k ignores the order of k, so the mma's k positions (2t, 2t+1, 2t+8, 2t+9) are taken to be the rows
  k0 + 4t + (0, 1, 2, 3) on both operands; the features likewise: mma tile T (0..3) has row g = feature 8 g + 2 T
  and row g + 8 = feature 8 g + 2 T + 1 of the 64, i.e. the halves of word T of the lane's chunks. A fragments are
  two 16-bit halves of two rows' words (a byte permute), B fragments the X words as loaded;
* block = one 64-feature tile x one chunk of 8 mt rows of X; its ``kw`` warps take consecutive ranges of the 16-row
  steps (the same count each), each with a register ring of ``ring`` steps in flight; the warps' sums meet in shared
  memory in warp order (deterministic) and warp 0 applies biases and SiLU * mul.
Needs fp16 X and W, K % 8 == 0, N % 8 == 0, 16-byte aligned X, W1, W3; any M (row chunks of 8 mt). Routed by
FusedFFNCudaKernel for weights_kn = 1 at M in [KN_TC_MIN_M, KN_TC_MAX_M]; measured in docs/ffn.md, BENCHMARKS.md.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.activations import silu
from ..device.fp16 import h2f
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import make_ld4, st16
from ..device.mma import make_to_warp0, mma as _mma
from ..device.target import SIM, device

KW = 4                           # warps per block (ranges of K steps of one feature tile)
RING = 2                         # 16-row steps in flight per warp
# What sessions launch, by M: (mt, kw, ring) for M <= rows (the last entry past its rows; sessions route M <=
# fusedffn_cuda.KN_TC_MAX_M = 16 here)
CONFIGS = ((8, (1, 4, 2)), (16, (2, 4, 2)))
LOAD_W = "ld.global.nc.L1::no_allocate.v4.u32"   # weights: read once
U0 = np.uint32(0)
F0 = np.float32(0.0)
LO = np.uint32(0xFFFF)
HI = np.uint32(0xFFFF0000)

_ldw = make_ld4(LOAD_W)


def ok(x16, w16, m, k, n, aligned=True):
    """Whether the kernel can take the product (``aligned``: X, W1, W3 16-byte aligned)."""
    return x16 and w16 and m > 0 and k > 0 and k % 8 == 0 and n % 8 == 0 and aligned


def config(m):
    for rows, c in CONFIGS:
        if m <= rows:
            return c
    return CONFIGS[-1][1]


def grid(m, n, mt):
    return -(-n // 64) * -(-m // (8 * mt))


def steps_per_warp(k, kw=KW, ring=RING):
    """16-row steps each warp streams (the same for all warps, a multiple of ``ring``)."""
    per = -(-(-(-k // 16)) // kw)
    return -(-per // ring) * ring


SMEM_MAX = 48 << 10              # static shared memory of one block


def red_bytes(mt, kw, smem_out):
    """Shared memory for the warps' sums: every warp's with ``smem_out``, else warps 1.. (fp32, 32 mt per lane)."""
    return 4 * 32 * 32 * mt * (kw if smem_out else kw - 1)


def make(mt, kw=KW, ring=RING):
    """Signature: (x uint64 [M*K/4] (fp16 quads), w1, w3 uint32 [K*N/2], b1, b3 uint16 [N], out uint16 [M*N],
    m_dim, k_dim, n_dim, spw, has_b1, has_b3); ``spw`` = steps_per_warp(K, kw, ring). From mt = 2 (where the sums
    fit SMEM_MAX) every warp's sums go to shared memory and the whole block finishes the outputs from there,
    instead of warp 0 from its registers: from mt = 2 the register epilogue's loops are too long for LLVM to
    unroll, which put the accumulators in local memory (ptxas: a 256-byte stack frame at mt = 2)."""
    smem_out = mt > 1 and red_bytes(mt, kw, True) <= SMEM_MAX
    if red_bytes(mt, kw, smem_out) > SMEM_MAX:
        raise ValueError(f"mt={mt}, kw={kw}: {red_bytes(mt, kw, smem_out)} bytes of shared memory for the warps' sums "
                         f"(at most {SMEM_MAX})")
    if not 1 <= ring <= 3:
        raise ValueError(f"ring must be 1..3 steps (the loop spells out 3 slots), got {ring}")
    scr_size = kw * 32 * 6 if SIM else 1
    nacc = 32 * mt                    # [weight][tile j][mma tile T][c0..c3]
    red_size = kw * nacc * 32 if smem_out else max(1, (kw - 1) * nacc * 32)
    nwb = ring * 32                   # per slot: rows i = 0..3 of W1, then of W3 (4 words each)
    nxb = ring * mt * 2               # per slot and X tile: 2 words (4 fp16 of one row)
    to_warp0 = make_to_warp0(kw, nacc)

    @device
    def load(wb, xb, u, s, send, k32, n32, col, colok, t, xr, x, w1, w3, m_dim):
        """Slot ``u`` <- step ``s`` (zeros past the warp's range, past K, past N / M)."""
        k0 = s * uint32(16) + uint32(4) * t
        live = s < send
        nch = n32 >> uint32(3)                            # 16-byte chunks per weight row
        for wsel in range(2):
            w = w1 if wsel == 0 else w3
            for i in range(4):
                o = u * 32 + wsel * 16 + i * 4
                r = k0 + uint32(i)
                if live and colok and r < k32:
                    q = _ldw(w, uint64(r) * uint64(nch) + uint64(col >> uint32(3)))
                    for e in range(4):
                        wb[o + e] = q[e]
                else:
                    for e in range(4):
                        wb[o + e] = U0
        for j in range(mt):
            o = (u * mt + j) * 2
            row = xr + uint32(8 * j)
            if live and row < m_dim and k0 < k32:
                v = x[(uint64(row) * uint64(k32) + uint64(k0)) >> uint64(2)]
                xb[o] = uint32(v & uint64(0xFFFFFFFF))
                xb[o + 1] = uint32(v >> uint64(32))
            else:
                xb[o] = U0
                xb[o + 1] = U0

    @device
    def compute(wb, xb, u, acc, scr, tid):
        for wsel in range(2):
            o = u * 32 + wsel * 16
            for tt in range(4):                          # mma tile T: word T of each row's chunk
                c0 = wb[o + tt]
                c1 = wb[o + 4 + tt]
                c2 = wb[o + 8 + tt]
                c3 = wb[o + 12 + tt]
                a0 = (c0 & LO) | (c1 << uint32(16))
                a1 = (c0 >> uint32(16)) | (c1 & HI)
                a2 = (c2 & LO) | (c3 << uint32(16))
                a3 = (c2 >> uint32(16)) | (c3 & HI)
                for j in range(mt):
                    xo = (u * mt + j) * 2
                    ai = ((wsel * mt + j) * 4 + tt) * 4
                    r4 = _mma(a0, a1, a2, a3, xb[xo], xb[xo + 1], acc[ai], acc[ai + 1], acc[ai + 2], acc[ai + 3],
                              scr, tid)
                    for i in range(4):
                        acc[ai + i] = r4[i]

    @device
    def slot(wb, xb, u, acc, scr, tid, s0, send, k32, n32, col, colok, t, xr, x, w1, w3, m_dim):
        """Slot u: its step's mmas, then the slot reloaded with the step ``ring`` ahead."""
        compute(wb, xb, u, acc, scr, tid)
        load(wb, xb, u, s0 + uint32(ring + u), send, k32, n32, col, colok, t, xr, x, w1, w3, m_dim)

    @cuda.jit
    def kern(x, w1, w3, b1, b3, out, m_dim, k_dim, n_dim, spw, has_b1, has_b3):
        scr = cuda.shared.array(scr_size, uint32)
        red = cuda.shared.array(red_size, float32)
        tid = cuda.threadIdx.x
        lane = uint32(tid & 31)
        warp = uint32(tid >> 5)
        g = lane >> uint32(2)
        t = lane & uint32(3)
        n32 = uint32(n_dim)
        k32 = uint32(k_dim)
        m32 = uint32(m_dim)
        tiles = (n32 + uint32(63)) >> uint32(6)
        b = uint32(cuda.blockIdx.x)
        mc = b // tiles
        bt = b - mc * tiles
        col = bt * uint32(64) + uint32(8) * g              # the lane's 8 features
        colok = col < n32
        m0 = mc * uint32(8 * mt)
        xr = m0 + g
        ks = (k32 + uint32(15)) >> uint32(4)
        spw32 = uint32(spw)
        sbase = warp * spw32
        send = min(sbase + spw32, ks)

        wb = cuda.local.array(nwb, uint32)
        xb = cuda.local.array(nxb, uint32)
        acc = cuda.local.array(nacc, float32)
        if smem_out:
            for a in range(nacc // 16):             # nested: LLVM unrolls 16 x (nacc / 16), not a flat 64
                for c in range(16):
                    acc[a * 16 + c] = F0
        else:
            for i in range(nacc):
                acc[i] = F0
        for u in range(ring):
            load(wb, xb, u, sbase + uint32(u), send, k32, n32, col, colok, t, xr, x, w1, w3, m32)
        s = uint32(0)
        while s < spw32:                                  # warp- and block-uniform trip count
            slot(wb, xb, 0, acc, scr, tid, sbase + s, send, k32, n32, col, colok, t, xr, x, w1, w3, m32)
            if ring > 1:
                slot(wb, xb, 1, acc, scr, tid, sbase + s, send, k32, n32, col, colok, t, xr, x, w1, w3, m32)
            if ring > 2:
                slot(wb, xb, 2, acc, scr, tid, sbase + s, send, k32, n32, col, colok, t, xr, x, w1, w3, m32)
            s += uint32(ring)

        if smem_out:
            # every warp's sums to shared memory; the block's threads finish the outputs, adding in warp order
            for a in range(nacc // 16):
                for c in range(16):
                    red[(warp * uint32(nacc) + uint32(a * 16 + c)) * uint32(32) + lane] = acc[a * 16 + c]
            cuda.syncthreads()
            i = uint32(tid)
            while i < uint32(16 * mt * 32):         # (gate accumulator gi, lane L); up is gi + 16 mt
                gi = i >> uint32(5)
                ln = i & uint32(31)
                n = bt * uint32(64) + uint32(8) * (ln >> uint32(2)) + uint32(2) * ((gi >> uint32(2)) & uint32(3)) + \
                    ((gi >> uint32(1)) & uint32(1))
                m = m0 + uint32(8) * (gi >> uint32(4)) + uint32(2) * (ln & uint32(3)) + (gi & uint32(1))
                if n < n32 and m < m32:
                    gv = F0
                    uv = F0
                    for w in range(kw):
                        gv += red[(uint32(w * nacc) + gi) * uint32(32) + ln]
                        uv += red[(uint32(w * nacc + 16 * mt) + gi) * uint32(32) + ln]
                    if has_b1:
                        gv += h2f(b1[n])
                    if has_b3:
                        uv += h2f(b3[n])
                    st16(out, m * n32 + n, silu(gv) * uv)
                i += uint32(32 * kw)
            return
        to_warp0(acc, red, warp, lane)        # warp 0's acc: the block's sums, added in warp order
        if warp == 0:
            # tile T: D row g = feature col + 2T, row g + 8 = col + 2T + 1; D column 2t + e = X row m0 + 8j + 2t + e
            for tt in range(4):
                for half in range(2):
                    n = col + uint32(2 * tt + half)
                    if n < n32:
                        bg = h2f(b1[n]) if has_b1 else F0
                        bu = h2f(b3[n]) if has_b3 else F0
                        for j in range(mt):
                            for e in range(2):
                                m = m0 + uint32(8 * j) + uint32(2) * t + uint32(e)
                                if m < m32:
                                    i = (j * 4 + tt) * 4 + 2 * half + e
                                    gv = acc[i] + bg
                                    uv = acc[mt * 16 + i] + bu
                                    st16(out, m * n32 + n, silu(gv) * uv)

    return kern


_launchers = {}


def sig():
    u32, u16 = Array(np.uint32), Array(np.uint16)
    return [Array(np.uint64), u32, u32, u16, u16, u16] + ["int64"] * 6


def launcher(mt, kw=KW, ring=RING):
    """Direct-launch wrapper, compiled once per process and configuration (SimLauncher under the simulator)."""
    key = (mt, kw, ring)
    if key not in _launchers:
        fn = make(mt, kw, ring)
        _launchers[key] = SimLauncher(fn, sig()) if SIM else Launcher(fn, sig())
    return _launchers[key]


def launch(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, mt, kw=KW, ring=RING):
    """One launch on device pointers (b1p / b3p 0 when absent)."""
    wwords = n * k // 2
    bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
    launcher(mt, kw, ring).launch(
        grid(m, n, mt), 32 * kw, stream, (xp, (m * k // 4,)), (w1p, (wwords,)), (w3p, (wwords,)), *bias,
        (yp, (m * n,)), m, k, n, steps_per_warp(k, kw, ring), int(b1p != 0), int(b3p != 0))

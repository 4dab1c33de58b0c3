"""FusedFFN decode kernel for W1, W3 [N, K] (the op's default layout): S = SiLU(X W1^T + B1) * (X W3^T + B3) at M <= 2
rows of X, one launch, after the fused gate/up kernel of the seed (shared/seeds/fused-ffn-swiglu.md). Routed by
fusedffn_cuda.ROUTES (row ``decode``); ``fits`` is its condition.

* persistent blocks of 256 threads; a block stages all M rows of x ONCE as fp32 in shared memory (dynamic,
  MT x K x 4 bytes for the row bucket MT; element e of chunk j at e * K/8 + j, so a warp's 32 lanes read 32
  consecutive words, conflict-free), then walks groups of COLS = 2 weight rows (grid-stride, the grid sized so
  every block does the same number of groups: no tail wave);
* for a group, thread t owns the 16-byte chunks t, t + 256, ... of the rows; it issues all its weight loads of
  UJ = 2 chunks x COLS rows x {W1, W3} first (128-bit ``ld.global.nc.L1::no_allocate.v4.u32`` through a Numba
  intrinsic with inline PTX: 8 independent 16-byte loads in flight), then reads each chunk's x once from shared
  memory and feeds both dot products (W1 and W3) of every row of the group and every row of X; the
  2 x 2 x COLS x MT accumulators are independent (ILP), fp16 weights widen with cvt.f32.f16;
* reduction: warp shuffles (5 steps per value), then the 8 warps' partials in shared memory; one thread per
  (row of W, row of X) adds the biases, applies SiLU(g) * u in fp32 and stores S in T. Gate and up never touch
  global memory.
Rows past N in the last group are clamped onto row N-1 (valid reads, results discarded), so any N >= 1 works.
Under the simulator the block has 32 threads (a Python thread per CUDA thread), so tests still see several
chunk steps and grid-stride groups at small K and N.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.activations import silu
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import (LOAD, ld16 as _ld16, ld32 as _ld32, make_ld4, st16 as _st16, st32 as _st32,
                             w16 as _w16, w32 as _w32)
from ..device.ptx import warp_sum
from ..device.target import SIM, device

BLOCK = 32 if SIM else 256      # threads (8 warps on the GPU)
MT_BUCKETS = (1, 2)             # row buckets (M <= 2: H100, 4096 x 11008 fp16, M = 1, 2 beat the cuBLAS path, a
                                # bucket-4 kernel did not: 99 us vs 80 us; docs/lab-log.md, removed variants)
XS_MAX = 100 * 1024             # bytes of fp32 x a block may stage (MT * K * 4): >= 2 blocks per SM
COLS = 2                        # weight rows per group (accumulators: 4 * COLS * MT)
UJ = 2                          # chunks per thread per step (loads in flight: 2 * COLS * UJ)

U0, U1 = np.uint64(0), np.uint64(1)
F0 = np.float32(0.0)


def bucket(m):
    """The row bucket of M rows (None past the last)."""
    for mt in MT_BUCKETS:
        if m <= mt:
            return mt
    return None


def fits(m, k, w16, aligned=True):
    """Whether the kernel takes the call: M <= 2, K a multiple of the 16-byte chunk (8 fp16 / 4 fp32 weights),
    16-byte aligned weights (``aligned``), the bucket's x within XS_MAX of shared memory."""
    mt = bucket(m)
    return mt is not None and aligned and k % (8 if w16 else 4) == 0 and mt * k * 4 <= XS_MAX


def grid(n, mt, sms, occupancy):
    """Blocks so that each does the same number of row groups (ceil), at most one wave of resident blocks."""
    groups = -(-n // COLS)
    cap = max(1, sms * occupancy)
    steps = -(-groups // cap)
    return max(1, -(-groups // steps))


# ------------------------------------------------------------------------------------------ device helpers
if SIM:
    def _partial(red, v, s, tid, nred):
        """Simulator (no warp shuffles): every thread's partial goes to shared memory."""
        red[v * nred + int(tid)] = s
else:
    @device
    def _partial(red, v, s, tid, nred):
        """Warp-reduce value v's partial; lane 0 puts the warp's sum into red[v * nred + warp]."""
        s = warp_sum(s, red, tid)
        if (tid & uint64(31)) == U0:
            red[uint64(v * nred) + (tid >> uint64(5))] = s


# ------------------------------------------------------------------------------------------------ kernels
def make(mt, x16, w16):
    """Decode kernel for row bucket ``mt`` (M <= mt rows; x rows >= M are staged as zeros, never stored)."""
    cols, uj, block = COLS, UJ, BLOCK
    ldx = _ld16 if x16 else _ld32
    st = _st16 if x16 else _st32
    wget = _w16 if w16 else _w32
    epc = 8 if w16 else 4                 # weight elements per 16-byte chunk
    sh = epc.bit_length() - 1
    nacc = 2 * cols * mt * uj             # (chunk u, row c, x row m, gate/up)
    nv = 2 * cols * mt                    # values reduced per group
    nw = 8 * cols * uj                    # loaded words (W1, W3)
    warps = block // 32
    nred = block if SIM else warps        # partials per value in shared memory
    red_size = nv * nred
    ld4 = make_ld4(LOAD)

    @device
    def set_rows(rows, g, n64, nch):
        """First chunk index of each weight row of group g (rows past N clamped onto N-1)."""
        for c in range(cols):
            rows[c] = min(g * uint64(cols) + uint64(c), n64 - U1) * nch

    @device
    def load_step(w1, w3, wa, rows, j, nch, blk):
        """Issue the 16-byte loads of chunks j, j + blk, ... (uj of them if all exist, else 1) of every row of
        the group, W1 and W3; returns how many chunks were loaded."""
        nu = uj if j + uint64(uj - 1) * blk < nch else 1
        for u in range(uj):
            if u < nu:
                jj = j + uint64(u) * blk
                for c in range(cols):
                    o = (u * cols + c) * 8
                    q = ld4(w1, rows[c] + jj)
                    wa[o] = q[0]
                    wa[o + 1] = q[1]
                    wa[o + 2] = q[2]
                    wa[o + 3] = q[3]
                    q = ld4(w3, rows[c] + jj)
                    wa[o + 4] = q[0]
                    wa[o + 5] = q[1]
                    wa[o + 6] = q[2]
                    wa[o + 7] = q[3]
        return nu

    @device
    def compute_step(wa, acc, xs, xv, j, nu, k64, nch, blk):
        """Both dot products of the loaded chunks with every staged row of x (each x chunk read once)."""
        for u in range(uj):
            if u < nu:
                jj = j + uint64(u) * blk
                for m in range(mt):
                    xb = uint64(m) * k64 + jj
                    for e in range(epc):
                        xv[e] = xs[xb + uint64(e) * nch]
                    for c in range(cols):
                        o = (u * cols + c) * 8
                        a = ((u * cols + c) * mt + m) * 2
                        sg = acc[a]
                        su = acc[a + 1]
                        for e in range(epc):
                            sg += wget(wa, o, e) * xv[e]
                            su += wget(wa, o + 4, e) * xv[e]
                        acc[a] = sg
                        acc[a + 1] = su

    @device
    def stage_x(x, xs, tid, blk, m64, k64, nch):
        """x rows -> fp32 shared memory, element e of chunk j of row m at xs[m K + e nch + j] (a warp's lanes
        then read consecutive words: no bank conflicts); rows past M are zeros. Four loads in flight."""
        for m in range(mt):
            base = uint64(m) * k64
            k = tid
            if uint64(m) < m64:
                while k + uint64(3) * blk < k64:
                    v0 = ldx(x, base + k)
                    v1 = ldx(x, base + k + blk)
                    v2 = ldx(x, base + k + uint64(2) * blk)
                    v3 = ldx(x, base + k + uint64(3) * blk)
                    xs[base + (k & uint64(epc - 1)) * nch + (k >> uint64(sh))] = v0
                    kk = k + blk
                    xs[base + (kk & uint64(epc - 1)) * nch + (kk >> uint64(sh))] = v1
                    kk += blk
                    xs[base + (kk & uint64(epc - 1)) * nch + (kk >> uint64(sh))] = v2
                    kk += blk
                    xs[base + (kk & uint64(epc - 1)) * nch + (kk >> uint64(sh))] = v3
                    k += uint64(4) * blk
                while k < k64:
                    xs[base + (k & uint64(epc - 1)) * nch + (k >> uint64(sh))] = ldx(x, base + k)
                    k += blk
            else:
                while k < k64:
                    xs[base + k] = F0
                    k += blk

    @cuda.jit
    def decode(x, w1, w3, b1, b3, y, m_dim, k_dim, n_dim, has_b1, has_b3):
        """x [M*K] (T; fp16 as uint16 bits), w1/w3 [N*K*size/4] uint32 words, b1/b3 [N] (T), y [M*N] (T)."""
        xs = cuda.shared.array(0, float32)
        red = cuda.shared.array(red_size, float32)
        tid = uint64(cuda.threadIdx.x)
        blk = uint64(block)
        k64 = uint64(k_dim)
        m64 = uint64(m_dim)
        n64 = uint64(n_dim)
        nch = k64 >> uint64(sh)                           # 16-byte chunks per weight row
        acc = cuda.local.array(nacc, float32)
        wa = cuda.local.array(nw, uint32)
        xv = cuda.local.array(epc, float32)
        rows = cuda.local.array(cols, uint64)
        ngroups = (n64 + uint64(cols - 1)) // uint64(cols)
        g = uint64(cuda.blockIdx.x)
        gstep = uint64(cuda.gridDim.x)
        nu = 0
        if tid < nch and g < ngroups:                     # first weight loads in flight while x is staged
            set_rows(rows, g, n64, nch)
            nu = load_step(w1, w3, wa, rows, tid, nch, blk)
        stage_x(x, xs, tid, blk, m64, k64, nch)
        cuda.syncthreads()
        while g < ngroups:                                # block-uniform: every thread reaches the syncs
            for v in range(nacc):
                acc[v] = F0
            gn = g + gstep
            j = tid
            while j < nch:
                compute_step(wa, acc, xs, xv, j, nu, k64, nch, blk)
                j += uint64(nu) * blk
                if j < nch:
                    nu = load_step(w1, w3, wa, rows, j, nch, blk)
            if tid < nch and gn < ngroups:            # the next group's first loads fly during the reduction
                set_rows(rows, gn, n64, nch)
                nu = load_step(w1, w3, wa, rows, tid, nch, blk)
            # fold the chunk slots, reduce over the block, one thread per (row, x row) finishes
            for v in range(nv):
                s = acc[v]
                for u in range(1, uj):
                    s += acc[u * nv + v]
                _partial(red, v, s, tid, nred)
            cuda.syncthreads()
            if tid < uint64(cols * mt):
                c = tid // uint64(mt)
                m = tid - c * uint64(mt)
                r = g * uint64(cols) + c
                if r < n64 and m < m64:
                    gs = F0
                    us = F0
                    for t in range(nred):
                        gs += red[tid * uint64(2 * nred) + uint64(t)]
                        us += red[(tid * uint64(2) + U1) * uint64(nred) + uint64(t)]
                    # the bias + SiLU * mul epilogue is spelled out in each float FusedFFN kernel (decode, tiled,
                    # act; fusedffn_kn_cuda's finish): one shared device helper changed their PTX (2026-11-28)
                    if has_b1:
                        gs += ldx(b1, r)
                    if has_b3:
                        us += ldx(b3, r)
                    st(y, m * n64 + r, silu(gs) * us)
            cuda.syncthreads()
            g = gn

    return decode


_launchers = {}


def launcher(mt, x16, w16):
    """Direct-launch wrapper of the bucket-``mt`` kernel, compiled once per process (SimLauncher under the
    simulator)."""
    key = (mt, x16, w16)
    if key not in _launchers:
        t = Array(np.uint16) if x16 else Array(np.float32)
        sig = [t, Array(np.uint32), Array(np.uint32), t, t, t] + ["int64"] * 5
        _launchers[key] = SimLauncher(make(mt, x16, w16), sig) if SIM else \
            Launcher(make(mt, x16, w16), sig, dynamic_shared=XS_MAX)
    return _launchers[key]


def launch(lau, stream, m, k, n, w16, xp, w1p, w3p, b1p, b3p, yp, sms, occupancy):
    """One launch on device pointers (b1p / b3p 0 when absent); ``occupancy``: resident blocks per SM."""
    mt = bucket(m)
    wwords = n * k * (2 if w16 else 4) // 4
    bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
    lau.launch(grid(n, mt, sms, occupancy), BLOCK, stream, (xp, (m * k,)), (w1p, (wwords,)), (w3p, (wwords,)),
               *bias, (yp, (m * n,)), m, k, n, int(b1p != 0), int(b3p != 0), shmem=mt * k * 4)

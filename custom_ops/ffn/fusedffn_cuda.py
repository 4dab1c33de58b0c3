"""FusedFFN, CUDA face: S[..., N] = SiLU(X W1^T + B1) * (X W3^T + B3), W1/W3 [N, K] (reference: onnx_lowbit.ffn).

Types: X, B1, B3, S of T, W1, W3 of TW, T and TW each float or float16 (four variants). Products are
accumulated in fp32 and SiLU is computed in fp32 (z / (1 + exp(-z)), libdevice expf), one rounding to T.

Decode path (M <= DECODE_MAX_M rows of X, K a multiple of the 16-byte chunk, 16-byte aligned weights, the x
block fits in shared memory), one launch, after the fused gate/up kernel of the seed
(shared/seeds/fused-ffn-swiglu.md):
* persistent blocks of 256 threads; a block stages all M rows of x ONCE as fp32 in shared memory (dynamic,
  MT x K x 4 bytes for the row bucket MT; element e of chunk j at e * K/8 + j, so a warp's 32 lanes read 32
  consecutive words, conflict-free), then walks groups of COLS weight rows (grid-stride, the grid sized
  so every block does the same number of groups: no tail wave);
* for a group, thread t owns the 16-byte chunks t, t + 256, ... of the rows; it issues all its weight loads of
  two chunks x COLS rows x {W1, W3} first (128-bit ``ld.global.nc.L1::no_allocate.v4.u32`` through a Numba
  intrinsic with inline PTX: 16 independent 16-byte loads in flight for COLS=2), then reads each chunk's x once
  from shared memory and feeds both dot products (W1 and W3) of every row of the group and every row of X; the
  2 x 2 x COLS x MT accumulators are independent (ILP), fp16 weights widen with cvt.f32.f16;
* reduction: warp shuffles (5 steps per value), then the 8 warps' partials in shared memory; one thread per
  (row of W, row of X) adds the biases, applies SiLU(g) * u in fp32 and stores S in T. Gate and up never touch
  global memory.
Rows past N in the last group are clamped onto row N-1 (valid reads, results discarded), so any N >= 1 works.

Prefill path (any other M, K, alignment): with cuBLAS (found by custom_ops.device.cublas): per chunk of rows of X (one
chunk unless the scratch would pass SCRATCH_MAX), two cublasGemmEx (fp32 accumulation, COMPUTE_32F: no TF32) write
gate and up side by side into an fp32 scratch [rows, 2N]; one elementwise kernel adds the biases, applies SiLU * mul
in fp32 and writes S. Option
FP16_SCRATCH (off): for fp16 X and W, GEMM outputs in fp16 as the unfused graph's MatMuls have them (2 bytes less
per value written and read; on the H100 at K=4096, N=11008, M=512 it was 173 us against 184 us with fp32 scratch,
torch's unfused path 173 us), but g and u rounded to fp16 before SiLU cost accuracy: up to 8.1e-4 max relative
error measured (fp32 scratch: 2.5e-4), with a worst case past the issue's 1e-3 bar, so it is off. Types cuBLAS has
no GemmEx for are brought to one it has without losing accuracy: fp16 X with fp32 W -> X widened to fp32 (exact,
SGEMM); fp32 X with fp16 W (mixed) -> X split into fp16 hi + lo parts (X = hi + lo to ~2^-22 relative), both
multiplied in one fp16 GEMM with 2x the rows and summed in the elementwise kernel (reads the fp16 weight once,
never widens it). Without cuBLAS (and under the CUDA simulator): a fused Numba tiled kernel (64 x 64 output
tile for both W1 and W3, 16-deep K tiles in shared memory, 4 x 4 x 2 accumulators per thread, SiLU * mul in the
epilogue): correct, not tuned.

K-major weights (attribute weights_kn = 1: W1, W3 [K, N], the MatMul weights as they are; ``_run_kn``):
M = 1 (and M = 2 unless fp16 X and W) on the split-K decode kernel of fusedffn_kn_cuda; fp16 X and W at M =
KN_TC_MIN_M..KN_TC_MAX_M (2..16) on the tensor-core kernel of fusedffn_kn_tc_cuda; else cuBLAS with op N on the
weights (the unfused graph's own GEMMs), with fp16 GEMM outputs for fp16 X and W (KN_FP16_SCRATCH), else the tiled
kernel. The ffn pass picks the layout (option ffn_weights, default "auto": for fp16 models [N, K] below 17 static
rows, [K, N] from there and for dynamic rows; [N, K] for fp32 / mixed); measured trade-off in docs/ffn.md.

Native plans (plans.py), every path: the GEMMs are recorded like kernel launches (cublas.Handle.gemm_rows; one
cuBLAS handle per stream with a fixed workspace), so after the first call per input signature the C shim replays
the whole prefill path (converts, GEMMs, activation) without Python, also under CUDA-graph capture.

Scratch (prefill with cuBLAS only: G, the converted x, the row scales; ``prefill_plan`` gives the bytes, a function
of M, K, N and the types): taken per call from onnxruntime's allocator (``Context.scratch``: the CUDA arena, on the
call's stream) and given back by the shim once the call's launches are issued; a native replay takes one of the
recorded size the same way. Nothing is shared between calls, so concurrent calls need no lock. With onnxruntime
older than 1.18 (no scratch API) the prefill shapes run the tiled kernel instead. Direct calls outside onnxruntime
(``run`` without a scratch provider: tests, benchmarks) use a buffer the kernel object keeps and grows.
"""
from __future__ import annotations

import os as _os

import numpy as np
from numba import config, cuda, float32, uint32, uint64

from onnx_lowbit import ffn

from ..device import cublas, launch as cuda_launch
from ..device.activations import silu
from ..device.fp16 import as_f32, f2h, h2f
from ..device.launch import Array, Launcher
from ..device.memory import (ld16 as _ld16, ld32 as _ld32, make_ld4, st16 as _st16, st32 as _st32, w16 as _w16,
                             w32 as _w32)
from ..device.splitk import ScratchPool
from ..device.target import device, tc_device
from ..runtime.kernels import Kernel, KernelError
from . import fusedffn_kn_cuda as knm, fusedffn_kn_tc_cuda as kntc, fusedffn_tc_cuda as tcm
from .common import check_arrays, check_shapes

SIM = bool(config.ENABLE_CUDASIM)

BLOCK = 256                     # decode kernel threads (8 warps)
DECODE_MAX_M = 2                # rows of X routed to the decode kernel (H100, 4096 x 11008 fp16: M = 1, 2 beat the
                                # cuBLAS path, the bucket-4 kernel did not: 99 us vs 80 us); any bucket when forced;
                                # read at kernel creation (benchmarks/session_gpu.py varies it)
MT_BUCKETS = (1, 2, 4, 8, 16)
TC_MIN_M, TC_MAX_M = 3, 32      # fp16 X and W: M in this range on the tensor-core kernel (fusedffn_tc_cuda; read at
                                # kernel creation; past 32 rows it re-reads the weights per 16-row chunk and cuBLAS
                                # is faster)
KN_TC_MIN_M, KN_TC_MAX_M = 2, 16    # weights_kn = 1, fp16 X and W: M on fusedffn_kn_tc_cuda (read at kernel creation;
                                    # M = 9..16, H100 sessions: 81.4-82.6 us with CUDA graphs, 87-93 without, against
                                    # cuBLAS's 82.2-82.9 and 89-100; the kernels alone: 73.4 against 69.1-70.6 us)
XS_MAX = 100 * 1024             # bytes of fp32 x a decode block may stage (MT * K * 4): >= 2 blocks per SM
COLS = {1: 2, 2: 2, 4: 1, 8: 1, 16: 1}   # weight rows per group, by bucket (accumulators: 4 * COLS * MT)
UJ = {1: 2, 2: 2, 4: 2, 8: 1, 16: 1}     # chunks per thread per step, by bucket (loads in flight: 2 * COLS * UJ)
DB = {1: False, 2: False, 4: True, 8: True, 16: True}   # double-buffered weight registers, by bucket
LOAD = "ld.global.nc.L1::no_allocate.v4.u32"
DEFAULT_BLOCKS_PER_SM = 4
FP16_SCRATCH = False            # prefill, fp16 X and W: GEMM outputs in fp16 (faster, less accurate; see above);
                                # read at kernel creation
KN_FP16_SCRATCH = True          # the same for [K, N] weights (weights_kn = 1, chosen for prefill): its GEMMs are then
                                # the unfused graph's own (fp16 outputs), with SiLU * mul in fp32 (one rounding
                                # instead of the unfused graph's three); H100 sessions, M = 24..256: 1.00-1.04x the
                                # unfused graph, max rel. error 4.7e-4 .. 7.4e-4 (fp32 outputs: 0.96-1.00x), docs/ffn.md
TF32 = _os.environ.get("ONNX_LOWBIT_TF32", "1") != "0"
                                # prefill GEMMs with fp32 inputs (fp32 X and W; fp16 X widened for fp32 W) on the
                                # tensor cores in TF32 (cuBLAS COMPUTE_32F_FAST_TF32), as onnxruntime's CUDA MatMul
                                # runs the unfused graph's by default (provider option use_tf32 = 1). H100 sessions,
                                # fp32 4096 x 11008: strict fp32 GEMMs made FusedFFN 0.24-0.79x the unfused graph at
                                # M = 3..256, TF32 0.98-1.14x (max rel. error 4.7e-4). ONNX_LOWBIT_TF32=0 (for
                                # sessions with use_tf32 = 0): strict fp32. Read at kernel creation.
SCRATCH_MAX = 96 << 20          # prefill: bytes of scratch per chunk of rows (more rows: several chunks)
TILE = dict(tx=16, ty=16, rm=4, rn=4, bk=16)   # fallback tiled kernel (GPU geometry)
ACT_BLOCK = 256

U0, U1 = np.uint64(0), np.uint64(1)
F0, F1 = np.float32(0.0), np.float32(1.0)
FULL = np.uint32(0xFFFFFFFF)
M16 = np.uint64(0xFFFF)


# ------------------------------------------------------------------------------------------ device helpers
if SIM:
    def _partial(red, v, s, tid, nred):
        """Simulator (no warp shuffles): every thread's partial goes to shared memory."""
        red[v * nred + int(tid)] = s
else:
    @device
    def _warp_sum(v):
        v += cuda.shfl_down_sync(FULL, v, 16)
        v += cuda.shfl_down_sync(FULL, v, 8)
        v += cuda.shfl_down_sync(FULL, v, 4)
        v += cuda.shfl_down_sync(FULL, v, 2)
        v += cuda.shfl_down_sync(FULL, v, 1)
        return v

    @device
    def _partial(red, v, s, tid, nred):
        """Warp-reduce value v's partial; lane 0 puts the warp's sum into red[v * nred + warp]."""
        s = _warp_sum(s)
        if (tid & uint64(31)) == U0:
            red[uint64(v * nred) + (tid >> uint64(5))] = s


# ------------------------------------------------------------------------------------------------ kernels
def _make_decode(mt, x16, w16, cols=None, block=BLOCK, uj=None, load=LOAD, db=None):
    """Decode kernel for row bucket ``mt`` (M <= mt rows; x rows >= M are staged as zeros, never stored);
    ``db``: double-buffered weight registers."""
    cols = COLS[mt] if cols is None else cols
    uj = UJ[mt] if uj is None else uj
    db = DB[mt] if db is None else db
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
    ld4 = make_ld4(load)

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
        wb = cuda.local.array(nw, uint32)
        xv = cuda.local.array(epc, float32)
        rows = cuda.local.array(cols, uint64)
        rown = cuda.local.array(cols, uint64)
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
            if db:
                # double-buffered: the loads of the next step (or of the next group's first step) are issued
                # before this step's arithmetic, so the memory pipe never waits for it
                while j < nch:
                    jn = j + uint64(nu) * blk
                    nn = 0
                    if jn < nch:
                        nn = load_step(w1, w3, wb, rows, jn, nch, blk)
                    elif gn < ngroups:
                        set_rows(rown, gn, n64, nch)
                        nn = load_step(w1, w3, wb, rown, tid, nch, blk)
                    compute_step(wa, acc, xs, xv, j, nu, k64, nch, blk)
                    for i in range(nw):
                        wa[i] = wb[i]
                    nu = nn
                    j = jn
                for c in range(cols):
                    rows[c] = rown[c]
            else:
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
                    if has_b1:
                        gs += ldx(b1, r)
                    if has_b3:
                        us += ldx(b3, r)
                    st(y, m * n64 + r, silu(gs) * us)
            cuda.syncthreads()
            g = gn

    return decode


def _make_tiled(x16, w16, tx=16, ty=16, rm=4, rn=4, bk=16, kn=False):
    """Fused tiled kernel, any M/K/N: block (ty x tx threads) computes a (ty*rm) x (tx*rn) tile of S; ``kn``:
    W1, W3 [K, N] (else [N, K])."""
    ldx = _ld16 if x16 else _ld32
    ldw = _ld16 if w16 else _ld32
    st = _st16 if x16 else _st32
    bm, bn, nt = ty * rm, tx * rn, tx * ty
    xs_size, ws_size, na = bk * bm, bk * bn, rm * rn

    @cuda.jit
    def tiled(x, w1, w3, b1, b3, y, m_dim, k_dim, n_dim, has_b1, has_b3):
        """x [M*K] (T), w1/w3 [N*K] (TW; fp16 as uint16 bits), b1/b3 [N], y [M*N]."""
        xs = cuda.shared.array(xs_size, float32)
        as1 = cuda.shared.array(ws_size, float32)
        as3 = cuda.shared.array(ws_size, float32)
        tid = uint64(cuda.threadIdx.x)
        tc = tid % uint64(tx)
        tr = tid // uint64(tx)
        k64 = uint64(k_dim)
        m64 = uint64(m_dim)
        n64 = uint64(n_dim)
        tiles_n = (n64 + uint64(bn - 1)) // uint64(bn)
        bid = uint64(cuda.blockIdx.x)
        m0 = (bid // tiles_n) * uint64(bm)
        n0 = (bid % tiles_n) * uint64(bn)
        acc1 = cuda.local.array(na, float32)
        acc3 = cuda.local.array(na, float32)
        xr = cuda.local.array(rm, float32)
        for v in range(na):
            acc1[v] = F0
            acc3[v] = F0
        k0 = U0
        while k0 < k64:
            i = tid
            while i < uint64(bm * bk):
                mm = i // uint64(bk)
                kk = i - mm * uint64(bk)
                gm = m0 + mm
                gk = k0 + kk
                xs[kk * uint64(bm) + mm] = ldx(x, gm * k64 + gk) if gm < m64 and gk < k64 else F0
                i += uint64(nt)
            i = tid
            while i < uint64(bn * bk):
                nn = i // uint64(bk)
                kk = i - nn * uint64(bk)
                gn = n0 + nn
                gk = k0 + kk
                ok = gn < n64 and gk < k64
                wi = gk * n64 + gn if kn else gn * k64 + gk
                as1[kk * uint64(bn) + nn] = ldw(w1, wi) if ok else F0
                as3[kk * uint64(bn) + nn] = ldw(w3, wi) if ok else F0
                i += uint64(nt)
            cuda.syncthreads()
            for kk in range(bk):
                for a in range(rm):
                    xr[a] = xs[uint64(kk * bm + a * ty) + tr]
                for b in range(rn):
                    o = uint64(kk * bn + b * tx) + tc
                    v1 = as1[o]
                    v3 = as3[o]
                    for a in range(rm):
                        acc1[a * rn + b] += xr[a] * v1
                        acc3[a * rn + b] += xr[a] * v3
            cuda.syncthreads()
            k0 += uint64(bk)
        for a in range(rm):
            m = m0 + tr + uint64(a * ty)
            for b in range(rn):
                n = n0 + tc + uint64(b * tx)
                if m < m64 and n < n64:
                    gs = acc1[a * rn + b]
                    us = acc3[a * rn + b]
                    if has_b1:
                        gs += ldx(b1, n)
                    if has_b3:
                        us += ldx(b3, n)
                    st(y, m * n64 + n, silu(gs) * us)

    return tiled


ACT_EPT = 4                     # outputs per thread of the elementwise kernel


def act_grid(rows, n, block=ACT_BLOCK):
    """Blocks of the elementwise kernel: each block covers block * ACT_EPT columns of one row."""
    return rows * -(-n // (block * ACT_EPT))


def _make_act(x16, g16):
    """S[m, n] = SiLU(sum_s G[s*rows + m, n] + b1[n]) * (sum_s G[s*rows + m, N + n] + b3[n]), G the GEMMs'
    scratch [splits*rows, 2N], fp32 (or fp16 bits with ``g16``) (splits = 2: the hi/lo halves of a split fp32 X,
    scaled by 1/inv[m]). Grid: ``act_grid``."""
    ldx = _ld16 if x16 else _ld32
    ldg = _ld16 if g16 else _ld32
    st = _st16 if x16 else _st32

    @cuda.jit
    def act(gbuf, inv, b1, b3, y, rows, n_dim, splits, has_b1, has_b3):
        per = uint32(cuda.blockDim.x) * uint32(ACT_EPT)
        nb = (uint32(n_dim) + per - uint32(1)) // per
        bid = uint32(cuda.blockIdx.x)
        mrow = bid // nb
        m = uint64(mrow)
        n64 = uint64(n_dim)
        r64 = uint64(rows)
        n0 = uint64((bid - mrow * nb) * per + uint32(cuda.threadIdx.x))
        for q in range(ACT_EPT):
            n = n0 + uint64(q) * uint64(cuda.blockDim.x)
            if n < n64:
                o = m * uint64(2) * n64 + n
                gs = ldg(gbuf, o)
                us = ldg(gbuf, o + n64)
                if splits == 2:
                    o += r64 * uint64(2) * n64
                    gs = (gs + ldg(gbuf, o)) * inv[m]
                    us = (us + ldg(gbuf, o + n64)) * inv[m]
                if has_b1:
                    gs += ldx(b1, n)
                if has_b3:
                    us += ldx(b3, n)
                st(y, m * n64 + n, silu(gs) * us)

    return act


def _make_widen():
    @cuda.jit
    def widen(x, xo, count):
        """fp16 bits x -> fp32 xo (exact)."""
        i = uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x) + uint64(cuda.threadIdx.x)
        if i < uint64(count):
            xo[i] = h2f(x[i])

    return widen


def _make_split(block=ACT_BLOCK):
    nh = block // 2

    @cuda.jit
    def split(x, xo, inv, rows, k_dim):
        """fp32 X (bits) -> fp16 hi/lo parts for the fp16 GEMM, row r in block r. With e the exponent of
        max_k |x[r, k]| (e >= 16; else f = 1) and f = 2^(141 - e) (exact: the row's largest value lands in
        [2^14, 2^15), inside fp16's range whatever X's range): hi = fp16(x f) -> xo[r K + k],
        lo = fp16(x f - hi) -> xo[(rows + r) K + k] (0 where hi is inf/NaN, which then propagates), inv[r] = 1/f.
        hi + lo = x f to ~2^-22 relative; the elementwise kernel multiplies the GEMM sums by inv[r]."""
        red = cuda.shared.array(block, uint32)
        tid = cuda.threadIdx.x
        r = uint64(cuda.blockIdx.x)
        k64 = uint64(k_dim)
        base = r * k64
        mx = uint32(0)
        k = uint64(tid)
        while k < k64:
            mx = max(mx, uint32(x[base + k]) & uint32(0x7FFFFFFF))
            k += uint64(block)
        red[tid] = mx
        cuda.syncthreads()
        h = nh
        while h > 0:
            if tid < h:
                red[tid] = max(red[tid], red[tid + h])
            cuda.syncthreads()
            h //= 2
        e = uint32(red[0]) >> uint32(23)
        f = as_f32(uint32(268) - e << uint32(23)) if e >= uint32(16) else F1
        if tid == 0:
            inv[r] = as_f32(e - uint32(14) << uint32(23)) if e >= uint32(16) else F1
        k = uint64(tid)
        while k < k64:
            v = as_f32(x[base + k]) * f
            hi = f2h(v)
            hv = h2f(hi)
            xo[base + k] = hi
            xo[uint64(rows) * k64 + base + k] = f2h(v - hv) if hv - hv == F0 else U0
            k += uint64(block)

    return split


# ------------------------------------------------------------------------------------------ shapes, plans
def bucket(m):
    for mt in MT_BUCKETS:
        if m <= mt:
            return mt
    return None


def decode_ok(m, k, w16, aligned=True, max_m=DECODE_MAX_M, xs_max=XS_MAX):
    mt = bucket(m) if m <= max_m else None
    return mt is not None and aligned and k % (8 if w16 else 4) == 0 and mt * k * 4 <= xs_max


def decode_grid(n, mt, sms, occupancy, cols=None):
    """Blocks so that each does the same number of row groups (ceil), at most one wave of resident blocks."""
    groups = -(-n // (COLS[mt] if cols is None else cols))
    cap = max(1, sms * occupancy)
    steps = -(-groups // cap)
    return max(1, -(-groups // steps))


def tiled_grid(m, n, t=None):
    t = t or TILE
    return -(-m // (t["ty"] * t["rm"])) * -(-n // (t["tx"] * t["rn"]))


_launchers = {}


def _sig(kind, x16, w16):
    t = Array(np.uint16) if x16 else Array(np.float32)
    if kind == "decode":
        return [t, Array(np.uint32), Array(np.uint32), t, t, t] + ["int64"] * 5
    if kind == "tiled":
        tw = Array(np.uint16) if w16 else Array(np.float32)
        return [t, tw, tw, t, t, t] + ["int64"] * 5
    if kind == "act":
        return [Array(np.uint16) if w16 else Array(np.float32), Array(np.float32), t, t, t] + ["int64"] * 5
    if kind == "widen":
        return [Array(np.uint16), Array(np.float32), "int64"]
    return [Array(np.uint32), Array(np.uint16), Array(np.float32), "int64", "int64"]     # split


def launcher(kind, x16=False, w16=False, mt=None, **variant):
    """Direct-launch wrapper of one kernel, compiled once per process (``variant``: decode kernel options; for
    kind 'act', ``w16`` means an fp16 GEMM scratch)."""
    key = (kind, x16, w16, mt, tuple(sorted(variant.items())))
    if key not in _launchers:
        if kind == "decode":
            fn, dyn = _make_decode(mt, x16, w16, **variant), XS_MAX
        elif kind == "tiled":
            fn, dyn = _make_tiled(x16, w16, **TILE, **variant), 0
        elif kind == "act":
            fn, dyn = _make_act(x16, w16), 0
        elif kind == "widen":
            fn, dyn = _make_widen(), 0
        else:
            fn, dyn = _make_split(), 0
        _launchers[key] = Launcher(fn, _sig(kind, x16, w16), dynamic_shared=dyn)
    return _launchers[key]


def occupancy(launcher_, block, shmem):
    return max(1, launcher_.blocks_per_sm(block, shmem))


# ------------------------------------------------------------------------------------------ prefill layout
def _r256(b):
    return -(-b // 256) * 256


def prefill_plan(m, k, n, x16, w16, g16=False, scratch_max=SCRATCH_MAX):
    """(rows per chunk, x conversion: None | 'widen' | 'split', GEMM x type, GEMM w type, scratch layout
    (offset of the converted x, offset of the row scales, total bytes)). Scratch: G [splits*rows, 2N] (fp32, or
    fp16 with ``g16``), then the converted x (fp32 [rows, K] or fp16 hi/lo [2*rows, K]), then fp32 [rows] row
    scales (split). Rows: all M in one chunk if the scratch stays within ``scratch_max``, else M split evenly."""
    if w16 and not x16:
        conv, xt, wt = "split", cublas.R_16F, cublas.R_16F
    elif x16 and not w16:
        conv, xt, wt = "widen", cublas.R_32F, cublas.R_32F
    else:
        t = cublas.R_16F if x16 else cublas.R_32F
        conv, xt, wt = None, t, t
    splits = 2 if conv == "split" else 1
    row_bytes = splits * 2 * n * (2 if g16 else 4) + (0 if conv is None else k * 4 + 4)
    chunks = -(-m // max(1, scratch_max // row_bytes))
    rows = max(1, -(-m // max(chunks, 1)))
    xoff = _r256(splits * rows * 2 * n * (2 if g16 else 4))
    soff = xoff + (0 if conv is None else _r256(rows * k * 4))
    return rows, conv, xt, wt, (xoff, soff, soff + (rows * 4 if conv == "split" else 0))


# ------------------------------------------------------------------------------------------ the kernel
class FusedFFNCudaKernel(Kernel):
    # every path's steps (launches, cuBLAS GEMMs on per-stream handles) and scratch size depend only on shapes and
    # weight alignment; scratch is per call, handles live for the process (see plans.py)
    native_plans = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.x16 = self.in_types[0] == 10
        self.w16 = self.in_types[1] == 10
        try:
            self.kn = ffn.parse_kn(self.attrs or {})    # W1, W3 [K, N] (attribute weights_kn = 1), else [N, K]
        except ValueError as e:
            raise KernelError(str(e)) from None
        self.sms = cuda_launch.sm_count(cuda_launch.current_device())
        self.decode_max_m = DECODE_MAX_M
        # compile everything now (once per process and type variant), never on the hot path
        top = bucket(min(max(self.decode_max_m, 1), MT_BUCKETS[-1]))
        self.decode = {mt: launcher("decode", self.x16, self.w16, mt) for mt in MT_BUCKETS if mt <= top} \
            if not self.kn else {}
        self.use_fp16_scratch(KN_FP16_SCRATCH if self.kn else FP16_SCRATCH)
        self.conv = {"widen": launcher("widen"), "split": launcher("split")}
        self.tiled = launcher("tiled", self.x16, self.w16, kn=self.kn)
        if self.kn:     # K-major weights: their decode kernel (split-K; tile counters per stream), their tc kernel
            self.decode = {mt: knm.launcher(mt, self.x16, self.w16) for mt in (1, knm.MAX_M)}
            self.pool = ScratchPool(0, knm.TILES_MAX)
            self.kn_tc = (KN_TC_MIN_M, KN_TC_MAX_M) if self.x16 and self.w16 and tc_device() else (1, 0)
            lo = 1
            for rows, c in kntc.CONFIGS:  # the configurations routed M can take: compiled now, launched by kntc.launch
                if lo <= self.kn_tc[1] and rows >= self.kn_tc[0]:
                    kntc.launcher(*c)
                lo = rows + 1
        self.tc_max_m = TC_MAX_M if self.x16 and self.w16 and tc_device() and not self.kn else 0
        self.tc = [tcm.launcher(mt, kw, ring, None, mf) for _, (mt, kw, ring, mf) in tcm.CONFIGS] if \
            self.tc_max_m else []                 # compiled now, launched through tcm.launch
        self._occ = {}
        self.blas = cublas.load() is not None     # else the tiled kernel serves every shape
        self.compute32 = cublas.COMPUTE_32F_FAST_TF32 if TF32 else cublas.COMPUTE_32F   # fp32-input GEMMs
        self._direct = None                       # scratch of direct calls (run without a provider)

    def use_fp16_scratch(self, on):
        """Prefill with fp16 X and W: keep the GEMM outputs in fp16 (``on``) or fp32."""
        self.g16 = bool(on) and self.x16 and self.w16
        self.act = launcher("act", self.x16, self.g16)

    def compute(self, ctx, inputs):
        x, w1, w3 = (inputs[i] if i < len(inputs) else None for i in range(3))
        b1 = inputs[3] if len(inputs) > 3 else None
        b3 = inputs[4] if len(inputs) > 4 else None
        for i, name, t in ((0, "X", x), (1, "W1", w1), (2, "W3", w3)):
            if t is None:
                raise KernelError(f"input {i} '{name}' is missing")
        m, k, n = check_shapes(x.shape, w1.shape, w3.shape, b1.shape if b1 is not None else None,
                               b3.shape if b3 is not None else None, self.kn)
        y = ctx.output(0, tuple(x.shape[:-1]) + (n,))
        if m == 0 or n == 0:
            return
        self.run(ctx.stream, m, k, n, x.ptr, w1.ptr, w3.ptr, b1.ptr if b1 is not None else 0,
                 b3.ptr if b3 is not None else 0, y, scratch=ctx.scratch if ctx.has_scratch else False)

    def run(self, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, path=None, variant=None, scratch=None):
        """Launches on device pointers (b1p/b3p 0 when absent). ``path``: force 'decode', 'gemm' or 'tiled';
        ``path`` 'tc': the tensor-core kernel (fp16 X and W, fusedffn_tc_cuda; auto for M in [TC_MIN_M, TC_MAX_M]);
        ``variant``: decode kernel options (block, cols, uj, db, load), compiled on first use (tests, benchmark);
        ``scratch``: nbytes -> device pointer of the cuBLAS path's scratch for this call (onnxruntime's:
        ``Context.scratch``), False when there is none (then no cuBLAS path), None for the kernel object's own
        buffer (direct calls outside onnxruntime, one thread)."""
        hb1, hb3 = int(b1p != 0), int(b3p != 0)
        bias = ((b1p or yp, (n,)), (b3p or yp, (n,)))
        aligned = ((w1p | w3p) & 15) == 0
        if self.kn:     # K-major weights: their own kernels; the tiled kernel and cuBLAS launch below as for [N, K]
            path = self._run_kn(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, aligned, path, scratch)
            if path is None:
                return
        tc_ok = bool(self.tc) and tcm.ok(self.x16, self.w16, m, k, aligned and (xp & 15) == 0)
        if path is None:
            if decode_ok(m, k, self.w16, aligned, self.decode_max_m):
                path = "decode"
            elif tc_ok and TC_MIN_M <= m <= self.tc_max_m:
                path = "tc"
            else:
                path = "gemm" if self.blas and k > 0 and scratch is not False else "tiled"
        elif path == "tc" and not tc_ok:
            raise KernelError(f"the tensor-core kernel does not take this product (fp16 X and W, K % 8 == 0, "
                              f"16-byte aligned X and weights; got K={k})")
        elif path == "gemm" and (not self.blas or k == 0 or scratch is False):
            raise KernelError("the cuBLAS path needs cuBLAS, scratch memory and K > 0")
        elif path == "decode" and not decode_ok(m, k, self.w16, aligned, max_m=MT_BUCKETS[-1]):
            raise KernelError(f"the decode kernel does not take M={m}, K={k} (or unaligned weights)")
        if path == "decode":
            mt = bucket(m)
            shmem = mt * k * 4
            if variant:
                dk, blk = launcher("decode", self.x16, self.w16, mt, **variant), variant.get("block", BLOCK)
            else:
                if mt not in self.decode:           # past decode_max_m: only when forced (tests, benchmark)
                    self.decode[mt] = launcher("decode", self.x16, self.w16, mt)
                dk, blk = self.decode[mt], BLOCK
            okey = (mt, shmem, tuple(sorted((variant or {}).items())))
            occ = self._occ.get(okey)
            if occ is None:
                occ = self._occ[okey] = occupancy(dk, blk, shmem)
            wwords = n * k * (2 if self.w16 else 4) // 4
            cols = (variant or {}).get("cols")
            dk.launch(decode_grid(n, mt, self.sms, occ, cols), blk, stream, (xp, (m * k,)),
                                   (w1p, (wwords,)), (w3p, (wwords,)), *bias, (yp, (m * n,)), m, k, n, hb1, hb3,
                                   shmem=shmem)
        elif path == "tc":
            mt, kw, ring, mfast = tcm.config(m)
            tcm.launch(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, mt, kw, ring, None, mfast)
        elif path == "tiled":
            self.tiled.launch(tiled_grid(m, n), TILE["tx"] * TILE["ty"], stream, (xp, (m * k,)), (w1p, (n * k,)),
                              (w3p, (n * k,)), *bias, (yp, (m * n,)), m, k, n, hb1, hb3)
        else:
            self._gemm(stream, m, k, n, xp, w1p, w3p, bias, yp, hb1, hb3, scratch or self._own_scratch)

    def _run_kn(self, stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, aligned, path, scratch):
        """``run``'s routing for W1, W3 [K, N]: the K-major tensor-core kernel (fp16, M in self.kn_tc), the K-major
        decode kernel (M <= fusedffn_kn_cuda.MAX_M), else cuBLAS with op N on the weights (the unfused graph's
        GEMMs), else the tiled kernel. Launches the first two and returns None; returns 'gemm' or 'tiled' for ``run``
        to check and launch as it does for [N, K]."""
        dec_ok = knm.ok(m, k, n, self.w16, aligned) and (scratch is not False or k <= knm.KS_MAX)
        tc_ok = self.x16 and self.w16 and kntc.ok(True, True, m, k, n, aligned and (xp & 15) == 0)
        if path is None:
            if self.kn_tc[0] <= m <= self.kn_tc[1] and tc_ok:
                path = "tc"
            else:
                path = "decode" if dec_ok else "gemm" if self.blas and k > 0 and scratch is not False else "tiled"
        elif path == "tc" and not tc_ok:
            raise KernelError(f"the K-major tensor-core kernel does not take this product (fp16 X and W, K % 8 == 0, "
                              f"N % 8 == 0, 16-byte aligned X and weights; got K={k}, N={n})")
        elif path == "decode" and not dec_ok:
            raise KernelError(f"the K-major decode kernel does not take M={m}, N={n} (M <= {knm.MAX_M}, "
                              f"N % {knm.epc_of(self.w16)} == 0, 16-byte aligned weights)")
        elif path not in ("decode", "gemm", "tiled", "tc"):
            raise KernelError(f"path {path!r} does not take [K, N] weights")
        if path == "tc":
            kntc.launch(stream, m, k, n, xp, w1p, w3p, b1p, b3p, yp, *kntc.config(m))
        elif path == "decode":
            mt = knm.bucket(m)
            lau = self.decode[mt]
            occ = self._occ.get(("kn", mt))
            if occ is None:
                occ = self._occ[("kn", mt)] = occupancy(lau, knm.BLOCK, 0)
            # without onnxruntime's scratch (onnxruntime < 1.18) one split: no partials
            geo = knm.geometry(k, n, self.w16, self.sms, min(occ, knm.BLOCKS_PER_SM), u=knm.TUNED[mt]["u"],
                               ks=None if scratch is not False else min(k, knm.KS_MAX))
            floats = knm.partial_floats(geo[1], m, n)
            part = ((scratch or self._own_scratch)(4 * floats) if floats else 0, floats)
            knm.launch(lau, stream, m, k, n, self.w16, xp, w1p, w3p, b1p, b3p, yp, part,
                       self.pool.counters(stream), geo)
        else:
            return path
        return None

    def _own_scratch(self, nbytes):
        """The kernel object's scratch for direct calls outside onnxruntime (grown, never shrunk)."""
        if self._direct is None or self._direct.size < nbytes:
            self._direct = cuda.device_array(max(nbytes, 1), np.uint8)
        return self._direct.device_ctypes_pointer.value

    def _gemm(self, stream, m, k, n, xp, w1p, w3p, bias, yp, hb1, hb3, scratch):
        rows, conv, xt, wt, (xoff, soff, nbytes) = prefill_plan(m, k, n, self.x16, self.w16, self.g16)
        xsize = 2 if self.x16 else 4
        splits = 2 if conv == "split" else 1
        gsize, gt = (2, cublas.R_16F) if self.g16 else (4, cublas.R_32F)
        blas = cublas.handle_for(stream)
        gp = scratch(nbytes)
        xc, sc = gp + xoff, gp + soff
        for r0 in range(0, m, rows):
            r = min(rows, m - r0)
            xr = xp + r0 * k * xsize
            if conv == "widen":
                cnt = r * k
                self.conv[conv].launch(-(-cnt // ACT_BLOCK), ACT_BLOCK, stream, (xr, (cnt,)), (xc, (cnt,)), cnt)
                xr = xc
            elif conv == "split":
                self.conv[conv].launch(r, ACT_BLOCK, stream, (xr, (r * k,)), (xc, (2 * r * k,)), (sc, (r,)), r, k)
                xr = xc
            for w, off in ((w1p, 0), (w3p, n)):
                blas.gemm_rows(xr, xt, w, wt, gp + off * gsize, splits * r, n, k, 2 * n, gt, w_kn=self.kn,
                               compute=self.compute32 if xt == cublas.R_32F else cublas.COMPUTE_32F)
            cnt = r * n
            self.act.launch(act_grid(r, n), ACT_BLOCK, stream, (gp, (splits * r * 2 * n,)),
                            (sc if conv == "split" else gp, (r,)), *bias, (yp + r0 * n * xsize, (cnt,)), r, n,
                            splits, hb1, hb3)


KERNEL = FusedFFNCudaKernel


# ------------------------------------------------------------------------------------------ host entry (tests)
def run_arrays(x, w1, w3, b1=None, b3=None, *, path=None, sim_block=32, sim_tile=None, decode_variant=None,
               fp16_scratch=None, kn=False):
    """S for host arrays (tests, benchmark): the dispatcher under the CUDA simulator (shrunk blocks), the direct
    launch path (as the bridge runs it) on a GPU. ``path``: force 'decode', 'tc', 'gemm' (GPU) or 'tiled';
    ``kn``: W1, W3 [K, N] (attribute weights_kn = 1)."""
    m, k, n = check_arrays(x, w1, w3, b1, b3, kn)
    x16, w16 = x.dtype == np.float16, w1.dtype == np.float16
    lead = tuple(x.shape[:-1])
    if m == 0 or n == 0:
        return np.zeros(lead + (n,), x.dtype)
    xb = np.uint16 if x16 else np.float32

    def dev(a, dt):
        return cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))

    dx = dev(x, xb)
    dy = cuda.device_array(m * n, xb)
    db1 = dev(b1, xb) if b1 is not None else dy
    db3 = dev(b3, xb) if b3 is not None else dy
    hb = (int(b1 is not None), int(b3 is not None))
    if SIM and kn:
        if path is None:
            path = "tc" if KN_TC_MIN_M <= m <= KN_TC_MAX_M and kntc.ok(x16, w16, m, k, n) else \
                "decode" if knm.ok(m, k, n, w16) else "tiled"
        if path == "decode":
            return knm.run_arrays(x, w1, w3, b1, b3, block=64, **(decode_variant or {}))
        if path == "tc":
            mt = kntc.config(m)[0]
            return kntc.run_arrays(x, w1, w3, b1, b3, mt=mt, kw=2, ring=2)
        t = sim_tile or dict(tx=4, ty=4, rm=2, rn=2, bk=4)
        wb = np.uint16 if w16 else np.float32
        kern = _make_tiled(x16, w16, **t, kn=True)
        kern[tiled_grid(m, n, t), t["tx"] * t["ty"]](dx, dev(w1, wb), dev(w3, wb), db1, db3, dy, m, k, n, *hb)
    elif SIM:
        if path is None:
            path = "decode" if decode_ok(m, k, w16) else (
                "tc" if tcm.ok(x16, w16, m, k) and TC_MIN_M <= m <= TC_MAX_M else "tiled")
        if path == "tc":
            mt, kw, ring, mfast = tcm.config(m)
            return tcm.run_arrays(x, w1, w3, b1, b3, mt, kw, ring, None, mfast)
        if path == "decode":
            mt = bucket(m)
            dw1, dw3 = dev(w1, np.uint32), dev(w3, np.uint32)
            kern = _make_decode(mt, x16, w16, block=sim_block, **(decode_variant or {}))
            grid = decode_grid(n, mt, 2, 1, (decode_variant or {}).get("cols"))
            kern[grid, sim_block, 0, mt * k * 4](dx, dw1, dw3, db1, db3, dy, m, k, n, *hb)
        else:
            t = sim_tile or dict(tx=4, ty=4, rm=2, rn=2, bk=4)
            wb = np.uint16 if w16 else np.float32
            kern = _make_tiled(x16, w16, **t)
            kern[tiled_grid(m, n, t), t["tx"] * t["ty"]](dx, dev(w1, wb), dev(w3, wb), db1, db3, dy, m, k, n, *hb)
    else:
        dw1, dw3 = dev(w1, w1.dtype), dev(w3, w3.dtype)
        kern = FusedFFNCudaKernel(spec=None, attrs={"weights_kn": int(kn)}, node_name="run_arrays",
                                  in_types=(10 if x16 else 1, 10 if w16 else 1), out_types=(10 if x16 else 1,))
        if fp16_scratch is not None:
            kern.use_fp16_scratch(fp16_scratch)
        p = lambda a: a.device_ctypes_pointer.value  # noqa: E731
        kern.run(0, m, k, n, p(dx), p(dw1), p(dw3), p(db1) if b1 is not None else 0,
                 p(db3) if b3 is not None else 0, p(dy), path=path, variant=decode_variant)
        cuda.synchronize()
    return dy.copy_to_host().view(x.dtype).reshape(lead + (n,))


def gbps(m, k, n, w16, x16, t_us):
    """Effective bandwidth of one call in GB/s: the weights read once, x read, S written."""
    wb = 2 * n * k * (2 if w16 else 4)
    xb = m * k * (2 if x16 else 4) + m * n * (2 if x16 else 4)
    return (wb + xb) / t_us / 1e3


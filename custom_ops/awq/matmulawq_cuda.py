"""MatMulAWQ, CUDA face: Y[..., N] = A[..., K] x W (+ bias), W in AutoAWQ GEMM layout (see dequantawq_cpu).

Decode kernel (M <= 16), fused: the fp16 weight is never written; every nibble is dequantised in registers.
qweight is K-major (one int32 = 8 columns of one row k), so

* a block is 32 lanes x 8 warps; lane = column group c (a warp reads 128 contiguous bytes of a qweight row),
  warp = a slice of R consecutive rows of K (split-K). R divides group_size, so a thread's slice lies in one
  group and needs one zero word and 8 scales. R <= 64; a block covers 8R rows and 32 (or 64, below) column
  groups.
* the block's slice of x (M rows x 8R columns) is staged in shared memory as fp32 (from fp32 or fp16 A);
* UNROLL independent qweight loads per thread, software-pipelined (the next batch is loaded while the current
  one is decoded; the first batch, the zero word and the scales are loaded before x is staged); full slices take
  a path without bounds checks (one add per load). Decoding is 32-bit (see _pair_word): one shift serves two
  nibbles, each nibble becomes v = 1 + q/256 or 1 + q/16 (q in mantissa bits 15..18 or 19..22) in one LOP3,
  no int->float conversion, and the thread accumulates P[m][j] = sum_k x*v (one FFMA per weight and row) and
  S[m] = sum_k x: 3.6 SASS instructions per nibble in the hot loop (5.1 with the earlier 64-bit decode). With
  sum x*q = C_j (P - S), its partial output is  s_j * (C_j P[m][j] - (C_j + z_j) S[m]) = s_j (sum x*q - z_j sum x);
* split-K reduction, two levels, deterministic. (1) in the block: the 8 warps' partials meet in shared memory and
  one thread per column sums them in warp order; (2) across the blocks that share a column tile (`splits` of
  them): each block stores its sums into its own slot of a scratch partials[splits, M, N] (plain stores, no
  float atomics); the block whose increment of the tile's counter comes last (threadfence pattern) sums the
  `splits` partials in split order (8 loads in flight at a time, ``sum_splits``: 8.5 against 9.3 us at 2048 x 2048
  with 32 splits), adds bias, converts to A's type, writes Y, and resets the tile's counter.
  One launch per call, and the same result on every run (the summation order is fixed).
  Why not a second kernel over the partials: it would cost ~2-3 us per call at M=1 (the weight read itself is
  ~8 us for 4096x11008).
* split-K memory. The partials (splits x M x N fp32: 5.6 MB for 4096x11008 at M=16, 0.35 MB at M=1; none with a
  single split) are per call from onnxruntime's allocator (``Context.scratch``: the CUDA arena, on the call's
  stream, given back once the launch is issued; a native replay takes one of the recorded size), so the nodes
  of a model share arena memory instead of each keeping its own per stream (a LLaMA-7B has 224 such nodes, each
  kept up to 5.6 MB per stream before). No zeroing: every slot the last block reads was stored by a block of
  the same launch. The tile counters (uint32, one per column tile and row chunk: at most 344, 1.4 KB, for
  N = 11008) must be zero when a launch starts and each launch leaves them zero, so they carry from call to
  call and stay the kernel's: ``ScratchPool``, one set per CUDA stream the node runs on (the first made at
  kernel creation, others on a new stream's first call, synchronously, before its launch), touched only by this
  node's launches, which are ordered on that stream (zeroing them in a launch of its own would add a launch to
  every call). With onnxruntime < 1.18 (no scratch API) the pool also keeps partials per stream, sized for the
  largest M <= 16 and made on the stream's first such call. Direct calls (``run_arrays``, ``tc_run``: tests,
  benchmarks) allocate both for the call.
* grid: row chunks x column tiles x splits; R (<= 64, dividing group_size) from a small cost model of the
  kernel's occupancy and the SM count (``plan``).
* option (GPT_SMALL_M = 2, off): for M <= 2 with N % 16 == 0 each thread takes two column groups through 8-byte
  loads (16 columns, a block tile of 512 columns). Measured on the H100 (4096 x 11008, M=1): 20.0 us against
  16.2 us for one group per thread (96 registers: 2 blocks per SM), so it is off.
* one kernel per row bucket MT in {1, 2, 4, 8} (M is rounded up; rows >= M are zero in shared memory and never
  written), so the MT x 8 accumulators stay in registers (16 x 8 would not: 255 registers and a stack frame);
  M in 9..16 runs the MT=8 kernel with two row chunks as neighbouring blocks that share the weight reads through
  L2. All four are compiled at kernel creation (once per process and A type).

Tensor-core decode kernel (fp16 A, M = TC_MIN_M..16, K % 4 == 0, group_size % 32 == 0; ``_make_tc``, also
FusedFFNAWQ's): the nibbles are fed to mma.sync m16n8k16 as fp16 subnormals (exact), fp32 accumulation, 8 rows
of A per pass; see the comment above ``_make_tc`` and docs/ffn4.md. H100, 4096 x 11008 x2 (2026-11-24): 50.3 us
at M=4 and 80.9 us at M=16 for two launches + silu*mul, against 80.1 / 211.4 us for the fp32 decode kernel.

Generic kernel (M > 16): correct, NOT tuned (prefill): a thread owns 8 columns of one row m and walks all of
K with the same decoding; weights are re-read per row through L1/L2. For long prompts DequantAWQ + a cuBLAS
MatMul is the faster graph.

FusedFFNAWQ (fusedffnawq_cuda) builds its decode and generic kernels here too, with two weights (``nw=2``): each
thread reads both weights' words for its rows and the output is SiLU(X W1 + B1) * (X W3 + B3).
"""
from __future__ import annotations


import numpy as np
from numba import config, cuda, float32, uint32, uint64

from ..device import launch as cuda_launch
from ..device.fp16 import as_f32, f2h, h2f
from ..device.launch import Array, Launcher, arg
from ..device.mma import mma as _mma, silu, tc_store
from ..device.ptx import add32, mad32, prmt
from ..device.splitk import ScratchPool, arrive_last, partial_floats, sum_splits
from ..device.target import SIM, device, tc_device
from ..runtime.kernels import Kernel, KernelError
from . import matmulawq1_cuda
from .common_cuda import F2M20, F2M24, F2P20, F2P24, HI16, LO16, ONES16, TC_SEL
from .dequantawq_cpu import check_a_bias, check_weights, parse_attrs
from .dequantawq_cuda import col_of

CT = 32                  # column groups per block (lanes of a warp)
WARPS = 8                # K slices per block
BLOCK = CT * WARPS
RMAX = 64                # rows per K slice, at most
UNROLL = 8               # qweight words in flight per thread
UNROLL_M1 = 16           # ... at M = 1 (MT=1: 80 registers, 3 blocks per SM). H100, fp16 A, weights cycled past L2
                         # (benchmarks/awq1_gpu.py), us against 8: 4096x11008 18.8 / 19.1, 2048x2048 9.3 / 11.5,
                         # 8192x2048 11.5 / 14.0 (the smaller occupancy also makes the plan take fewer K splits)
MT_BUCKETS = (1, 2, 4, 8)   # rows per block; M in 9..16 runs as 2 chunks of 8 (16 rows x 8 columns of fp32
MAX_M_FAST = 16             # accumulators would not stay in registers)
DEFAULT_BLOCKS_PER_SM = 4  # planning without an occupancy query (simulator)
OVERHEAD_ROWS = 24         # a block's fixed cost in row-steps per warp (plan)
GPT_SMALL_M = 1            # column groups per thread for M <= 2 (2 = 8-byte loads; measured slower, see above)

U0, U1, U2, U3, U4, U5, U6, U7, U8, U15 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 5, 6, 7, 8, 15))
M32 = np.uint64(0xFFFFFFFF)
ONE_BITS = np.uint64(0x3F800000)
NIB_MASK = np.uint64(0xF << 19)
F0, F16 = np.float32(0.0), np.float32(16.0)


@device
def _vnib(w, j):
    """1 + q_j/16 for nibble j of w (uint64 holding a 32-bit word): q_j moved to mantissa bits 19..22."""
    if j <= 4:
        t = w << uint64(19 - 4 * j)
    else:
        t = w >> uint64(4 * j - 19)
    return as_f32((t & NIB_MASK) | ONE_BITS)


@device
def _ld32(a, i):
    return a[i]


@device
def _ld16(a, i):
    return h2f(a[i])


@device
def _st32(y, i, v):
    y[i] = v


@device
def _st16(y, i, v):
    y[i] = f2h(v)


# Hot-loop decoding in 32-bit integer ops (Numba widens anything mixed with uint64 or Python ints to 64 bits, and
# every 64-bit shift/and costs two SASS instructions). One shift serves two nibbles: after it, nibble j sits in
# mantissa bits 15..18 (j even: v = 1 + q/256) or 19..22 (j odd: v = 1 + q/16), so v = as_float((t & mask) | one)
# is one LOP3 when `one` (0x3F800000) is in a register; the kernels read it from shared memory so that the
# compiler cannot fold it into two immediate-operand LOP3s. Per nibble: 1/2 shift, 1 LOP3, 1 FFMA per row.
# Sum x*q = C_j (P_j - S) with C_j = 256 (j even) or 16 (j odd).
MASK_LO = np.uint32(0xF << 15)
MASK_HI = np.uint32(0xF << 19)
ONE32 = np.uint32(0x3F800000)
F256 = np.float32(256.0)


@device
def _pair_word(w, h):
    """w (uint32) shifted so that nibbles 2h and 2h+1 sit in bits 15..18 and 19..22."""
    if h == 0:
        return w << uint32(15)
    if h == 1:
        return w << uint32(7)
    if h == 2:
        return w >> uint32(1)
    return w >> uint32(9)


@device
def _nib_value(t, odd, one):
    return as_f32((t & (MASK_HI if odd else MASK_LO)) | one)


@device
def _nib_scale(j):
    """C_j: sum x*q_j = C_j * (P_j - S)."""
    return F16 if j & 1 else F256


@device
def _decode(gpt, w, vj, one):
    """vj[g * 8 + j] = v_gj of the ``gpt`` int32 words (8 columns each) in w, a uint32 or uint64."""
    for gi in range(gpt):
        wg = uint32(w) if gpt == 1 else uint32((w >> uint64(32 * gi)) & M32)
        for h in range(4):
            t = _pair_word(wg, h)
            vj[gi * 8 + 2 * h] = _nib_value(t, False, one)
            vj[gi * 8 + 2 * h + 1] = _nib_value(t, True, one)


@device
def _accumulate(nw, mt, gpt, w1, w3, xs, xi, xstride, vj, p, sx, one):
    """One row of each of the ``nw`` weights, their qweight words w1 and w3 (``gpt`` int32 of 8 columns each, in a
    uint32 or uint64; w3 unused with one weight): P[w][m][g][j] += x[m] * v_wgj, S[m] += x[m];
    x[m] = xs[xi + m * xstride] (uint32 indices)."""
    _decode(gpt, w1, vj, one)
    for m in range(mt):
        xv = xs[xi + uint32(m) * xstride]
        sx[m] += xv
        for t in range(gpt * 8):
            p[m * gpt * 8 + t] += xv * vj[t]
    if nw == 2:
        _decode(gpt, w3, vj, one)
        for m in range(mt):
            xv = xs[xi + uint32(m) * xstride]
            for t in range(gpt * 8):
                p[(mt + m) * gpt * 8 + t] += xv * vj[t]


def _make_finish(nw, a16):
    """The output of the fp32 kernels for ``nw`` weights at row m, column col of y [M*N] from the sums gv (and
    uv, the second weight's): gv + b1, or SiLU(gv + b1) * (uv + b3), stored in A's type."""
    load = _ld16 if a16 else _ld32
    store = _st16 if a16 else _st32

    @device
    def finish(y, b1, b3, has_b1, has_b3, m, col, n64, gv, uv):
        if has_b1:
            gv += load(b1, col)
        if nw == 1:
            store(y, m * n64 + col, gv)
        else:
            if has_b3:
                uv += load(b3, col)
            store(y, m * n64 + col, silu(gv) * uv)

    return finish


def make_gemv(mt, a16, ct=CT, warps=WARPS, unroll=None, gpt=1, max_registers=None, nw=1):
    """The decode kernel for row bucket ``mt`` and ``nw`` weights: nw=1 is MatMulAWQ (Y = A W + bias), nw=2
    FusedFFNAWQ (S = SiLU(X W1 + B1) * (X W3 + B3), fusedffnawq_cuda). ``gpt`` column groups (int32 words) per
    thread: 1 (4-byte loads) or 2 (8-byte loads, qweight/qzeros passed as uint64 arrays; needs N % 16 == 0);
    ``unroll`` words in flight per weight (default UNROLL_M1 for mt = 1, else UNROLL). Both kernels run one body
    (``body``, inlined) with ``nw`` a closure constant, so the branches of the other one are compiled away; with
    one weight the body gets the weight's buffers and the bias twice."""
    if unroll is None:
        unroll = UNROLL_M1 if mt == 1 else UNROLL
    load = _ld16 if a16 else _ld32
    finish = _make_finish(nw, a16)
    block = ct * warps
    xs_size = mt * warps * RMAX      # array sizes must be compile-time constants (closure values, not expressions)
    red_size = nw * warps * ct * 8 * gpt
    p_size = nw * mt * 8 * gpt
    v_size = 8 * gpt
    s_size = nw * v_size
    w_size = nw * unroll
    u3 = w_size - unroll             # the second weight's words in a batch (the first's again with one weight)
    wdt = uint32 if gpt == 1 else uint64
    wzero = wdt(0)
    # one weight: the slice's zero word and scales are loaded with the first batch of weight words, before x is
    # staged; two weights: after the hot loop (18 fewer live registers in it)
    early_scales = nw == 1
    # where the next batch's first word index is computed: ahead of the prefetch branch with one weight, inside it
    # with two, as each kernel was tuned (the same arithmetic, but ptxas 12.9 compiles it differently: inside, the
    # one-weight kernel at MT=1 takes 80 registers instead of 72; ahead, the two-weight hot loop changes)
    addr_ahead = nw == 1
    opts = {} if SIM or max_registers is None else {"max_registers": max_registers}

    @device
    def group_scales(qz1, sc1, qz3, sc3, k0, g_size, wpr, n64, c, zw, sj):
        """Per weight w, the zero word zw[w] and the scales sj[w][:] of the group of row k0 for this thread's
        column groups."""
        g = k0 // uint64(g_size)
        zw[0] = uint64(qz1[g * wpr + c])
        for t in range(v_size):
            sj[t] = h2f(sc1[g * n64 + c * uint64(v_size) + uint64((t >> 3) * 8 + col_of(t & 7))])
        if nw == 2:
            zw[1] = uint64(qz3[g * wpr + c])
            for t in range(v_size):
                sj[v_size + t] = h2f(sc3[g * n64 + c * uint64(v_size) + uint64((t >> 3) * 8 + col_of(t & 7))])

    @device
    def body(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, y, acc, cnt, m_dim, k_dim, n_dim, g_size, rows, splits,
             has_b1, has_b3):
        xs = cuda.shared.array(xs_size, float32)
        red = cuda.shared.array(red_size, float32)     # [weight][warp][column of the tile]
        flag = cuda.shared.array(1, uint32)
        one_sm = cuda.shared.array(1, uint32)
        tid = uint64(cuda.threadIdx.x)
        if tid == U0:
            one_sm[0] = ONE32
        lane = tid % uint64(ct)
        warp = tid // uint64(ct)
        m64 = uint64(m_dim)
        k64 = uint64(k_dim)
        n64 = uint64(n_dim)
        r64 = uint64(rows)
        wpr = (n64 >> U3) // uint64(gpt)            # words per qweight row
        tiles = (wpr + uint64(ct - 1)) // uint64(ct)
        nch = (m64 + uint64(mt - 1)) // uint64(mt)
        bid = uint64(cuda.blockIdx.x)
        m0 = (bid % nch) * uint64(mt)
        rest = bid // nch
        tile = rest % tiles
        split = rest // tiles
        span = r64 * uint64(warps)
        kb = split * span
        c = tile * uint64(ct) + lane                # this thread's word of each row
        k0 = kb + warp * r64
        kend = min(k0 + r64, k64)
        active = c < wpr and k0 < kend
        # prefetch before staging x: the first batch of weight words (with early_scales the zero words and scales)
        wv = cuda.local.array(w_size, wdt)          # [weight][u]
        wn = cuda.local.array(w_size, wdt)
        zw = cuda.local.array(nw, uint64)
        sj = cuda.local.array(s_size, float32)
        if active:
            for u in range(unroll):
                kk = k0 + uint64(u)
                wv[u] = qw1[kk * wpr + c] if kk < kend else wzero
                if nw == 2:
                    wv[unroll + u] = qw3[kk * wpr + c] if kk < kend else wzero
            if early_scales:
                group_scales(qz1, sc1, qz3, sc3, k0, g_size, wpr, n64, c, zw, sj)
        # stage this block's slice of x as fp32 (zero past K and for rows past M)
        i = tid
        while i < uint64(mt) * span:
            m = i // span
            k = kb + (i - m * span)
            v = F0
            if m0 + m < m64 and k < k64:
                v = load(x, (m0 + m) * k64 + k)
            xs[i] = v
            i += uint64(block)
        cuda.syncthreads()
        one = one_sm[0]

        p = cuda.local.array(p_size, float32)       # [weight][m][column]
        sx = cuda.local.array(mt, float32)
        for t in range(p_size):
            p[t] = F0
        for m in range(mt):
            sx[m] = F0
        if active:
            vj = cuda.local.array(v_size, float32)
            xo = uint32(k0 - kb)                      # this slice's first row in the staged x
            xstr = uint32(span)
            if nw == 2 or (kend - k0 == r64 and r64 % uint64(unroll) == U0):
                # whole batches of unroll rows, no bounds checks (one add per load). One weight only for a slice
                # inside K with R a multiple of unroll (else the checked loop below); two weights always, then the
                # last rows (< unroll) of a slice at the end of K, checked
                step = uint64(unroll) * wpr
                base = k0 * wpr + c
                nb = (kend - k0) // uint64(unroll)
                b = U0
                while b < nb:
                    if addr_ahead:
                        nbase = base + step
                    if b + U1 < nb:                     # software pipeline: the next batch is in flight
                        if not addr_ahead:
                            nbase = base + step
                        for u in range(unroll):
                            wn[u] = qw1[nbase + uint64(u) * wpr]
                            if nw == 2:
                                wn[unroll + u] = qw3[nbase + uint64(u) * wpr]
                    for u in range(unroll):
                        _accumulate(nw, mt, gpt, wv[u], wv[u3 + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
                    for t in range(w_size):
                        wv[t] = wn[t]
                    base += step
                    xo += uint32(unroll)
                    b += U1
                rem = (kend - k0) - nb * uint64(unroll)
                if nw == 2 and rem > U0:
                    if nb > U0:
                        for u in range(unroll):
                            ok = uint64(u) < rem
                            wv[u] = qw1[base + uint64(u) * wpr] if ok else wzero
                            wv[unroll + u] = qw3[base + uint64(u) * wpr] if ok else wzero
                    for u in range(unroll):
                        if uint64(u) < rem:
                            _accumulate(nw, mt, gpt, wv[u], wv[u3 + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
            else:
                k = k0
                while k < kend:
                    kn = k + uint64(unroll)
                    for u in range(unroll):
                        kk = kn + uint64(u)
                        wn[u] = qw1[kk * wpr + c] if kk < kend else wzero
                    for u in range(unroll):
                        if k + uint64(u) < kend:
                            _accumulate(nw, mt, gpt, wv[u], wv[u3 + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
                    for u in range(unroll):
                        wv[u] = wn[u]
                    k = kn
                    xo += uint32(unroll)
            if not early_scales:
                group_scales(qz1, sc1, qz3, sc3, k0, g_size, wpr, n64, c, zw, sj)
            # partial = s * (C P - (C + z) S) with this slice's group's zero points and scales
            for wsel in range(nw):
                z = zw[wsel]
                for t in range(v_size):
                    cj = _nib_scale(t & 7)
                    zc = cj + float32((z >> uint64(4 * t)) & U15)      # word t >> 3 of z, nibble t & 7
                    for m in range(mt):
                        pi = (wsel * mt + m) * v_size + t
                        p[pi] = sj[wsel * v_size + t] * (cj * p[pi] - zc * sx[m])

        # (1) reduce the warps' partials in shared memory, (2) store the block's sums into its slot of acc (or,
        # with a single split, write the output directly)
        cols = uint64(ct * v_size)                  # columns of the tile
        for m in range(mt):
            mg = m0 + uint64(m)                     # the row of A and Y
            if mg < m64:
                for wsel in range(nw):
                    for t in range(v_size):
                        red[warp * cols + lane * uint64(v_size) +
                            uint64(wsel * warps * ct * v_size + (t >> 3) * 8 + col_of(t & 7))] = \
                            p[(wsel * mt + m) * v_size + t]
                cuda.syncthreads()
                cl = tid
                while cl < cols:
                    gv = F0
                    uv = F0
                    for w_ in range(warps):
                        gv += red[uint64(w_) * cols + cl]
                        if nw == 2:
                            uv += red[(uint64(warps) + uint64(w_)) * cols + cl]
                    col = tile * cols + cl
                    if col < n64:
                        if splits == 1:
                            finish(y, b1, b3, has_b1, has_b3, mg, col, n64, gv, uv)
                        else:
                            acc[(split * uint64(nw) * m64 + mg) * n64 + col] = gv
                            if nw == 2:
                                acc[((split * uint64(nw) + U1) * m64 + mg) * n64 + col] = uv
                    cl += uint64(block)
                cuda.syncthreads()
        if splits == 1:
            return
        if arrive_last(cnt, tile, uint64(splits) * nch, flag, tid == U0):
            cl = tid
            while cl < cols:
                col = tile * cols + cl
                if col < n64:
                    mg = U0
                    while mg < m64:                          # all rows: every chunk of the tile is done
                        ai = mg * n64 + col
                        # split sp, weight w: ((sp * nw + w) * M + m) * N + col; fixed order: deterministic
                        gv = sum_splits(acc, ai, uint64(nw) * m64 * n64, splits)
                        uv = F0
                        if nw == 2:
                            uv = sum_splits(acc, ai + m64 * n64, uint64(nw) * m64 * n64, splits)
                        finish(y, b1, b3, has_b1, has_b3, mg, col, n64, gv, uv)
                        mg += U1
                cl += uint64(block)
            if tid == U0:
                cnt[tile] = uint32(0)

    if nw == 1:
        @cuda.jit(**opts)
        def gemv(a, qw, qz, sc, bias, y, acc, cnt, m_dim, k_dim, n_dim, g_size, rows, splits, has_bias):
            """a [M*K], qw [Kp*NG/gpt], qz [groups*NG/gpt] (uint32 or uint64 words), sc uint16 [groups*N], bias
            [N], y [M*N] (A's type; fp16 as uint16 bits), acc float32 [splits*M*N] (partials), cnt uint32 [tiles]
            (zero between launches).
            Block b: row chunk b % chunks (rows [chunk*mt, +mt) of A), then column tile and K split
            (rows [split*warps*rows, +warps*rows) of W) from b // chunks; the chunks of one tile and split are
            neighbours in launch order, so they read the same weights at about the same time (L2 hits)."""
            body(a, qw, qz, sc, qw, qz, sc, bias, bias, y, acc, cnt, m_dim, k_dim, n_dim, g_size, rows, splits,
                 has_bias, has_bias)
    else:
        @cuda.jit(**opts)
        def gemv(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, s, acc, cnt, m_dim, k_dim, n_dim, g_size, rows, splits,
                 has_b1, has_b3):
            """x [M*K] (fp32 or fp16 bits), qw*/qz* uint32, sc* uint16 (fp16 bits), b1/b3 [N], s [M*N], acc
            float32 [splits*2*M*N] (partials: any contents) and cnt uint32 [tiles] (zero between launches). Blocks
            as with one weight."""
            body(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, s, acc, cnt, m_dim, k_dim, n_dim, g_size, rows, splits,
                 has_b1, has_b3)

    return gemv


def make_generic(a16, ct=CT, warps=WARPS, nw=1):
    """The generic kernel (any M) for ``nw`` weights, one body for both as in ``_make_gemv``."""
    load = _ld16 if a16 else _ld32
    finish = _make_finish(nw, a16)
    size = 8 * nw

    @device
    def body(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, y, m_dim, k_dim, n_dim, g_size, has_b1, has_b3):
        tid = uint64(cuda.threadIdx.x)
        lane = tid % uint64(ct)
        warp = tid // uint64(ct)
        k64 = uint64(k_dim)
        n64 = uint64(n_dim)
        g64 = uint64(g_size)
        ng = n64 >> U3
        tiles = (ng + uint64(ct - 1)) // uint64(ct)
        bid = uint64(cuda.blockIdx.x)
        c = (bid % tiles) * uint64(ct) + lane
        m = (bid // tiles) * uint64(warps) + warp
        if c >= ng or m >= uint64(m_dim):
            return
        out = cuda.local.array(size, float32)       # [weight][j]
        p = cuda.local.array(size, float32)
        for j in range(size):
            out[j] = F0
        k0 = U0
        g = U0
        while k0 < k64:
            k1 = min(k0 + g64, k64)
            for j in range(size):
                p[j] = F0
            sx = F0
            for k in range(k0, k1):
                xv = load(x, m * k64 + k)
                w1 = uint64(qw1[k * ng + c])
                w3 = uint64(qw3[k * ng + c]) if nw == 2 else w1
                sx += xv
                for j in range(8):
                    p[j] += xv * _vnib(w1, j)
                    if nw == 2:
                        p[8 + j] += xv * _vnib(w3, j)
            z1 = uint64(qz1[g * ng + c])
            z3 = uint64(qz3[g * ng + c]) if nw == 2 else z1
            for j in range(8):
                col = g * n64 + c * uint64(8) + uint64(col_of(j))
                out[j] += h2f(sc1[col]) * (F16 * p[j] - (F16 + float32((z1 >> uint64(4 * j)) & U15)) * sx)
                if nw == 2:
                    out[8 + j] += h2f(sc3[col]) * (F16 * p[8 + j] - (F16 + float32((z3 >> uint64(4 * j)) & U15)) * sx)
            k0 = k1
            g += U1
        for j in range(8):
            n = c * uint64(8) + uint64(col_of(j))
            finish(y, b1, b3, has_b1, has_b3, m, n, n64, out[j], out[8 + j] if nw == 2 else F0)

    if nw == 1:
        @cuda.jit
        def generic(a, qw, qz, sc, bias, y, m_dim, k_dim, n_dim, g_size, has_bias):
            """Any M: thread = (row m, column group c); block = ct column groups x warps rows."""
            body(a, qw, qz, sc, qw, qz, sc, bias, bias, y, m_dim, k_dim, n_dim, g_size, has_bias, has_bias)
    else:
        @cuda.jit
        def generic(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, s, m_dim, k_dim, n_dim, g_size, has_b1, has_b3):
            """Any M: thread = (row m, column group c), all of K, both weights."""
            body(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, s, m_dim, k_dim, n_dim, g_size, has_b1, has_b3)

    return generic


def plan(k_dim, n_dim, g_size, sms, ct=CT, warps=WARPS, blocks_per_sm=DEFAULT_BLOCKS_PER_SM, nch=1, gpt=1):
    """(tiles, rows per warp slice R, splits) for the decode kernel.

    R is a divisor of group_size (a slice never straddles two groups), at most RMAX. Cost model: the block
    scheduler spreads the grid over the SMs, b = ceil(blocks / sms) blocks per SM, running in
    waves = ceil(b / blocks_per_sm) (the kernel's occupancy). An SM's streaming time is proportional to its
    rows, b * R; the fixed part of a block (x staging, the block reduction, the atomics: OVERHEAD_ROWS row-steps)
    overlaps between the blocks of a wave. R minimises b * R + waves * OVERHEAD_ROWS: large enough to amortise
    the fixed part, small enough to spread the rows evenly over the SMs. A column tile is ct * gpt column groups.
    """
    tiles = -(-(n_dim // 8) // (ct * gpt))
    best = None
    for r in range(1, min(g_size, RMAX) + 1):
        if g_size % r:
            continue
        splits = -(-k_dim // (warps * r))
        b = -(-(tiles * splits * nch) // max(1, sms))
        waves = -(-b // max(1, blocks_per_sm))
        key = (b * r + waves * OVERHEAD_ROWS, r)       # ties: the smaller R (more warps in flight)
        if best is None or key < best[0]:
            best = (key, r, splits)
    return tiles, best[1], best[2]


def blocks_per_sm(launcher_):
    """Resident blocks per SM of a compiled kernel (at least 1)."""
    return max(1, launcher_.blocks_per_sm(BLOCK, 0))


def bucket(m, buckets=MT_BUCKETS):
    """Rows per block for M rows (None: the generic kernel); ``buckets``: the decode kernels' row buckets
    (FusedFFNAWQ has fewer)."""
    if m > MAX_M_FAST:
        return None
    for mt in buckets:
        if m <= mt:
            return mt
    return buckets[-1]


def chunks(m, mt):
    return -(-m // mt)


_launchers = {}


def gpt_for(mt, n_dim):
    """Column groups per thread for bucket ``mt``: GPT_SMALL_M (for M <= 2 where N % 16 == 0), else 1."""
    return GPT_SMALL_M if mt is not None and mt <= 2 and n_dim % 16 == 0 else 1


def _sig(a16, fused, gpt=1):
    t = Array(np.uint16) if a16 else Array(np.float32)
    wt = Array(np.uint32) if gpt == 1 else Array(np.uint64)
    arrays = [t, wt, wt, Array(np.uint16), t, t]
    if fused:
        return arrays + [Array(np.float32), Array(np.uint32)] + ["int64"] * 7
    return arrays + ["int64"] * 5


def launcher(a16, mt, gpt=1):
    """The direct-launch wrapper of the decode kernel for bucket ``mt`` with ``gpt`` column groups per thread
    (or the generic kernel for mt=None), compiled once per process."""
    key = (a16, mt, gpt if mt is not None else 1)
    if key not in _launchers:
        fn = make_generic(a16) if mt is None else make_gemv(mt, a16, gpt=gpt)
        _launchers[key] = Launcher(fn, _sig(a16, mt is not None, key[2]))
    return _launchers[key]


def decode_plan(m, K, N, group_size, sms, occupancy=DEFAULT_BLOCKS_PER_SM, ct=CT, warps=WARPS,  # noqa: N803
                gpt=None):
    """(grid, rows R, splits) of the decode kernel for M = m rows (1..16); ``occupancy``: resident blocks per SM
    of the kernel of m's bucket (``blocks_per_sm``); ``gpt`` defaults to ``gpt_for``."""
    mt = bucket(m)
    nch = chunks(m, mt)
    gpt = gpt_for(mt, N) if gpt is None else gpt
    tiles, r, splits = plan(K, N, group_size, sms, ct, warps, occupancy, nch, gpt)
    return tiles * splits * nch, r, splits


def run_arrays(a, qweight, qzeros, scales, group_size, K, N, bias=None, *, sms=None, ct=None,  # noqa: N803
               warps=WARPS, force_generic=False, rows=None, repeat=1, gpt=None, tc=None):
    """Runs the kernels on host arrays and returns Y (tests, benchmark): through the Numba dispatcher under the
    CUDA simulator (``ct``/``warps`` may be shrunk there to keep it fast), through the direct launch path on a
    real GPU. Inputs are checked exactly as in a session. ``rows`` overrides the decode kernel's K slice (it must
    divide group_size); ``repeat`` launches that many times on the same scratch (which each launch must leave
    zeroed) and returns the last result; ``gpt`` overrides the column groups per thread (1 or 2); ``tc``: the
    tensor-core kernel (default: where ``tc_ok`` and no option of the fp32 decode kernel is given)."""
    ct = CT if ct is None else ct
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_weights(qweight, qzeros, scales, sh, first=1)
    m = check_a_bias(a, bias, sh)
    lead = tuple(a.shape[:-1])
    if m == 0:
        return np.empty(lead + (N,), a.dtype)
    a16 = a.dtype == np.float16
    if tc is None:
        tc = not (force_generic or rows or gpt) and m >= TC_MIN_M and tc_ok(a16, m, K, group_size)
    if tc:
        return tc_run(a, (qweight, qzeros, scales), None, bias, None, group_size, K, N, repeat=repeat).reshape(
            lead + (N,))
    bits = np.uint16 if a16 else np.float32
    dev = lambda x, dt: cuda.to_device(np.ascontiguousarray(x).reshape(-1).view(dt))  # noqa: E731
    da = dev(a, bits)
    mt = None if force_generic else bucket(m)
    if gpt is None or mt is None:
        gpt = gpt_for(mt, N)
    elif gpt not in (1, 2) or (N // 8) % gpt:
        raise ValueError("gpt must be 1, or 2 with N % 16 == 0")
    wdt = np.uint64 if gpt == 2 else np.uint32
    dqw, dqz, dsc = dev(qweight, wdt), dev(qzeros, wdt), dev(scales, np.uint16)
    dy = cuda.device_array(m * N, bits)
    db = dev(bias, bits) if bias is not None else dy
    sim = config.ENABLE_CUDASIM
    if not sim:
        sms = sms or cuda_launch.sm_count(cuda_launch.current_device())
        ct, warps = CT, WARPS
    sms = sms or 2
    tiles = -(-(N // 8) // ct)
    hb = int(bias is not None)
    if mt is None:
        grid = tiles * -(-m // warps)
        args = (da, dqw, dqz, dsc, db, dy, m, K, N, group_size, hb)
        if sim:
            make_generic(a16, ct, warps)[grid, ct * warps](*args)
    else:
        occ = DEFAULT_BLOCKS_PER_SM if sim else blocks_per_sm(launcher(a16, mt, gpt))
        grid, r, splits = decode_plan(m, K, N, group_size, sms, occ, ct, warps, gpt)
        if rows is not None:
            if group_size % rows or rows > RMAX:
                raise ValueError(f"rows must divide group_size and be <= {RMAX}")
            r, splits = rows, -(-K // (warps * rows))
            grid = -(-(N // 8) // (ct * gpt)) * splits * chunks(m, mt)
        dacc = cuda.to_device(np.zeros(max(splits, 1) * m * N, np.float32))
        dcnt = cuda.to_device(np.zeros(tiles, np.uint32))
        args = (da, dqw, dqz, dsc, db, dy, dacc, dcnt, m, K, N, group_size, r, splits, hb)
        if sim:
            kern = make_gemv(mt, a16, ct, warps, gpt=gpt)
            for _ in range(repeat):
                kern[grid, ct * warps](*args)
    if not sim:
        for _ in range(repeat):
            launcher(a16, mt, gpt).launch(grid, BLOCK, 0, *[arg(x) for x in args])
        cuda.synchronize()
    return dy.copy_to_host().view(a.dtype).reshape(lead + (N,))


# --------------------------------------------------------------------- tensor-core decode kernel (fp16 A, M <= 16)
# mma.sync m16n8k16 (fp16 x fp16 -> fp32 accumulation) with the weights as the A operand: fragment row g (lane
# 4g + t) = column X of the lane's column group (nibble 2b of its words), row g + 8 = column Y (nibble 2b + 1);
# the lane's four k values are its rows 4t .. 4t+3 of a 16-row step (the sum over k does not care about the
# order), paired (4t, 4t+1) and (4t+2, 4t+3) by one PRMT of two words. B = x: column j = activation row m0 + j
# (rows m0 .. m0+7 in one pass), the lane's 4 x values one 8-byte load. The nibbles enter the tensor core as fp16
# subnormals: (pair & 0x000F000F) = q * 2^-24 and (pair & 0x00F000F0) = q * 2^-20 per half, exact, so the products
# x * q are exact and the fp32 accumulation has no offset to cancel. One more mma with A = 1.0 gives S = sum x;
# at the end of each group sum x*(q - z) = 2^24 D - z S (2^20 for Y), times the scale. Per 8 nibbles and thread:
# 2 PRMT, 4 LOP3, 1 mma.
TC_COLS = 64         # columns per block tile (8 column groups: the 8 fragment rows g)
TC_WARPS = 4         # warps per block on the GPU; warp w of split s takes groups (s * warps + w) * gpt + i
TC_MIN_M = 2         # sessions take the tensor-core kernel from this M on; at M=1 the fp32 decode kernel is faster
                     # (H100, gate+up 4096 x 11008, 2026-11-24: 28.5 us against 31.9 - 33.7 us)
TC_UNROLL = 1        # 16-row steps per pipelined batch (4 * nw * unroll words in flight per thread); M=1 on the
                     # H100: 33.7 us, 2: 31.9, 4: 33.6 (M = 4, 16 measured with 1 only)
TC_MAX_REGISTERS = {1: 96, 2: 128}   # ptxas cap per number of weights (M=1, nw=2: 128 no slower than 96, 168
                                     # slower)
TC_SPLITS = 8        # K splits per column tile at most (the last block sums them)
TC_RSTR = 65         # row stride of the per-warp partials in shared memory (64 columns + 1: fewer bank conflicts)

def _make_tc(nw, a16=True, unroll=TC_UNROLL, max_registers=None, maxw=TC_WARPS):
    """The tensor-core decode kernel (fp16 A only) for ``nw`` weights: nw=1 is MatMulAWQ (out = A W + bias),
    nw=2 FusedFFNAWQ (out = SiLU(A W1 + B1) * (A W3 + B3)). Needs K % 4 == 0 and group_size % (32 * unroll) == 0.
    Signature (x uint64 [M*K/4] fp16 bits, qw1, qz1 uint32, sc1 uint64 [groups*N/4] fp16 bits, qw3, qz3, sc3,
    b1, b3 uint16, out uint16 [M*N], part float32 [splits*nw*M*N], cnt uint32 [tiles*chunks], m_dim, k_dim, n_dim,
    g_size, gpt, splits, has_b1, has_b3); nw=1 ignores the third weight and b3 (pass the first one's buffers).
    Block b: row chunk (8 rows) b % chunks, then column tile (64 columns) and K split from b // chunks; at most
    ``maxw`` warps per block (the shared memory for the block's partials is sized for them)."""
    assert a16
    scr_size = maxw * 32 * 6 if SIM else 1
    red_size = maxw * nw * 8 * TC_RSTR
    wn = nw * unroll * 4
    acc_size = nw * 16
    cap = max_registers or TC_MAX_REGISTERS[nw]

    @cuda.jit(device=True, inline=True)
    def batch(src, dst, xsrc, xdst, more, base, qw1, qw3, ng32, x, xi, kx, k32, valid, sacc, acc, scr, tid):
        """One batch of ``unroll`` 16-row steps on the words in ``src`` and the x fragments in ``xsrc``; with
        ``more``, the next batch's words (rows from base + 16 * unroll) and x fragments are loaded into ``dst`` and
        ``xdst`` first."""
        if more:
            for u in range(unroll):
                for r in range(4):
                    o = mad32(uint32(16 * (unroll + u) + r), ng32, base)
                    dst[u * 4 + r] = qw1[o]
                    if nw == 2:
                        dst[(unroll + u) * 4 + r] = qw3[o]
                xdst[u] = x[add32(xi, uint32(4 * (unroll + u)))] if valid and \
                    add32(kx, uint32(16 * (unroll + u))) < k32 else U0
        for u in range(unroll):
            xq = xsrc[u]
            xb0 = uint32(xq & M32)
            xb1 = uint32(xq >> uint64(32))
            r4 = _mma(ONES16, ONES16, ONES16, ONES16, xb0, xb1, sacc[0], sacc[1], sacc[2], sacc[3], scr, tid)
            for i in range(4):
                sacc[i] = r4[i]
            for wsel in range(nw):
                o = (wsel * unroll + u) * 4
                for by in range(4):
                    p1 = prmt(src[o], src[o + 1], TC_SEL[by])
                    p2 = prmt(src[o + 2], src[o + 3], TC_SEL[by])
                    ai = (wsel * 4 + by) * 4
                    r4 = _mma(uint32(p1 & LO16), uint32(p1 & HI16), uint32(p2 & LO16), uint32(p2 & HI16),
                              xb0, xb1, acc[ai], acc[ai + 1], acc[ai + 2], acc[ai + 3], scr, tid)
                    for i in range(4):
                        acc[ai + i] = r4[i]

    @cuda.jit(**({} if SIM else {"max_registers": cap}))
    def tc(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, out, part, cnt, m_dim, k_dim, n_dim, g_size, gpt, splits,
           has_b1, has_b3):
        scr = cuda.shared.array(scr_size, uint32)
        red = cuda.shared.array(red_size, float32)
        flag = cuda.shared.array(1, uint32)
        tid = uint64(cuda.threadIdx.x)
        nthr = uint64(cuda.blockDim.x)
        lane = tid & uint64(31)
        warp = tid >> uint64(5)
        nwarps = nthr >> uint64(5)
        g = lane >> uint64(2)
        t = lane & U3
        m64 = uint64(m_dim)
        k64 = uint64(k_dim)
        n64 = uint64(n_dim)
        g64 = uint64(g_size)
        ng = n64 >> U3
        tiles = (ng + uint64(7)) >> U3
        nch = (m64 + uint64(7)) >> U3
        bid = uint64(cuda.blockIdx.x)
        chunk = bid % nch
        rest = bid // nch
        tile = rest % tiles
        split = rest // tiles
        m0 = chunk * uint64(8)
        cl = min(tile * uint64(8) + g, ng - U1)             # the lane's column group (clamped: never stored)
        groups = (k64 + g64 - U1) // g64
        xok = m0 + g < m64                                   # the lane's x row (B column g)
        xb = (m0 + g) * k64
        nb = uint32((g64 >> uint64(4)) // uint64(unroll))    # batches per group (even)
        cur = cuda.local.array(wn, uint32)                   # [weight][step][row]
        nxt = cuda.local.array(wn, uint32)
        xcur = cuda.local.array(unroll, uint64)              # x fragments of the batch's steps
        xnxt = cuda.local.array(unroll, uint64)
        acc = cuda.local.array(acc_size, float32)             # [weight][byte][4]
        sacc = cuda.local.array(4, float32)
        gp = uint64(gpt)
        ng32 = uint32(ng)
        rstep = uint32(16 * unroll) * ng32                   # words between batches
        k32 = uint32(k64)
        rb = ((warp * uint64(nw * 8) + t * uint64(2)) * uint64(TC_RSTR) + g * uint64(8))   # this lane's partials
        gl = U0
        while gl < gp:
            gi = (split * nwarps + warp) * gp + gl
            valid = gi < groups and xok
            gq = min(gi, groups - U1)
            for i in range(acc_size):
                acc[i] = F0
            for i in range(4):
                sacc[i] = F0
            kx = uint32(gq * g64 + t * uint64(4))            # the lane's first row of the batch
            base = mad32(kx, ng32, uint32(cl))
            xi = uint32((xb + uint64(kx)) >> uint64(2))
            for u in range(unroll):
                for r in range(4):
                    o = mad32(uint32(16 * u + r), ng32, base)
                    cur[u * 4 + r] = qw1[o]
                    if nw == 2:
                        cur[(unroll + u) * 4 + r] = qw3[o]
                xcur[u] = x[add32(xi, uint32(4 * u))] if valid and add32(kx, uint32(16 * u)) < k32 else U0
            b = uint32(0)
            while b < nb:                                    # two batches per trip, the buffers swapping roles
                batch(cur, nxt, xcur, xnxt, True, base, qw1, qw3, ng32, x, xi, kx, k32, valid, sacc, acc, scr, tid)
                base = add32(base, rstep)
                kx = add32(kx, uint32(16 * unroll))
                xi = add32(xi, uint32(4 * unroll))
                b = add32(b, uint32(2))
                batch(nxt, cur, xnxt, xcur, b < nb, base, qw1, qw3, ng32, x, xi, kx, k32, valid, sacc, acc, scr, tid)
                base = add32(base, rstep)
                kx = add32(kx, uint32(16 * unroll))
                xi = add32(xi, uint32(4 * unroll))
            # this group's zero points and scales: sum x (q - z) s = s 2^24 (D - z 2^-24 S) (2^20 for column Y)
            for wsel in range(nw):
                z = uint32(qz1[gq * ng + cl] if wsel == 0 else qz3[gq * ng + cl])
                so = (gq * n64 + cl * uint64(8)) >> uint64(2)
                s0 = sc1[so] if wsel == 0 else sc3[so]
                s1 = sc1[so + U1] if wsel == 0 else sc3[so + U1]
                for by in range(4):
                    for half in range(2):
                        j = 2 * by + half
                        col = col_of(j)
                        sw = s0 if col < 4 else s1
                        sv = h2f(uint32(sw >> uint64(16 * (col & 3))) & uint32(0xFFFF))
                        sf = sv * (F2P20 if half else F2P24)
                        zf = float32((z >> uint32(4 * j)) & uint32(15)) * (F2M20 if half else F2M24)
                        for rr in range(2):
                            v = sf * (acc[(wsel * 4 + by) * 4 + 2 * half + rr] - zf * sacc[rr])
                            ri = rb + uint64((wsel * 8 + rr) * TC_RSTR + col)
                            if gl == U0:
                                red[ri] = v
                            else:
                                red[ri] += v
            gl += U1
        cuda.syncthreads()
        # the block's warps, in warp order; then the output (one split) or this split's partials
        mrows = min(uint64(8), m64 - m0)
        i = tid
        while i < mrows * uint64(TC_COLS):
            row = i >> uint64(6)
            cloc = i & uint64(63)
            col = tile * uint64(TC_COLS) + cloc
            if col < n64:
                m = m0 + row
                gv = F0
                uv = F0
                for w_ in range(maxw):
                    if uint64(w_) < nwarps:
                        gv += red[((uint64(w_) * uint64(nw)) * uint64(8) + row) * uint64(TC_RSTR) + cloc]
                        if nw == 2:
                            uv += red[((uint64(w_) * uint64(nw) + U1) * uint64(8) + row) * uint64(TC_RSTR) + cloc]
                if splits == 1:
                    tc_store(nw, out, b1, b3, has_b1, has_b3, m * n64 + col, col, gv, uv)
                else:
                    part[((split * uint64(nw)) * m64 + m) * n64 + col] = gv
                    if nw == 2:
                        part[((split * uint64(nw) + U1) * m64 + m) * n64 + col] = uv
            i += nthr
        if splits == 1:
            return
        ci = tile * nch + chunk
        if arrive_last(cnt, ci, uint64(splits), flag, tid == U0):
            i = tid
            while i < mrows * uint64(TC_COLS):
                col = tile * uint64(TC_COLS) + (i & uint64(63))
                if col < n64:
                    m = m0 + (i >> uint64(6))
                    i0 = m * n64 + col                   # split sp, weight w: ((sp * nw + w) * M + m) * N + col
                    gv = sum_splits(part, i0, uint64(nw) * m64 * n64, splits)
                    uv = F0
                    if nw == 2:
                        uv = sum_splits(part, i0 + m64 * n64, uint64(nw) * m64 * n64, splits)
                    tc_store(nw, out, b1, b3, has_b1, has_b3, m * n64 + col, col, gv, uv)
                i += nthr
            if tid == U0:
                cnt[ci] = uint32(0)

    return tc


def tc_ok(a16, m, k, g_size, unroll=TC_UNROLL):
    """Whether the tensor-core kernel can take this product (sessions use it from M = TC_MIN_M on)."""
    return a16 and 0 < m <= MAX_M_FAST and k % 4 == 0 and g_size % (32 * unroll) == 0


def tc_plan(m, k, n, g_size, warps=TC_WARPS, max_splits=TC_SPLITS):
    """(grid, gpt groups per warp, splits): at most ``max_splits`` K splits per column tile."""
    groups = -(-k // g_size)
    gpt = max(1, -(-groups // (warps * max_splits)))
    splits = -(-groups // (warps * gpt))
    tiles = -(-(n // 8) // 8)
    return -(-m // 8) * tiles * splits, gpt, splits


def tc_scratch(m, k, n, g_size, nw, warps=TC_WARPS, max_splits=TC_SPLITS):
    """(partials floats, counters) the tensor-core kernel needs at M = m (at least 1 each)."""
    _, _, splits = tc_plan(m, k, n, g_size, warps, max_splits)
    tiles = -(-(n // 8) // 8)
    return max(1, splits * nw * m * n if splits > 1 else 1), tiles * -(-m // 8)


def tc_sig():
    w = [Array(np.uint32), Array(np.uint32), Array(np.uint64)]
    h = Array(np.uint16)
    return [Array(np.uint64)] + w + w + [h, h, h, Array(np.float32), Array(np.uint32)] + ["int64"] * 8


_tc_launchers = {}


def tc_launcher(nw, unroll=TC_UNROLL, max_registers=None, maxw=TC_WARPS):
    key = (nw, unroll, max_registers, maxw)
    if key not in _tc_launchers:
        fn = _make_tc(nw, True, unroll, max_registers, maxw)
        lau = Launcher(fn, tc_sig())
        lau.dispatcher = fn
        _tc_launchers[key] = lau
    return _tc_launchers[key]


def tc_run(x, w1, w3, b1, b3, group_size, K, N, *, warps=None, repeat=1, unroll=TC_UNROLL,  # noqa: N803
           max_splits=TC_SPLITS):
    """Runs the tensor-core kernel on host arrays (x fp16 [M, K]; w1/w3 = (qweight, qzeros, scales), w3 None for
    MatMulAWQ) and returns the fp16 output: Numba dispatcher under the simulator (``warps`` per block, default 2),
    direct launch on a GPU. Inputs must already be checked."""
    m = x.size // K
    nw = 1 if w3 is None else 2
    warps = warps or (2 if SIM else TC_WARPS)
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    ws = [dev(a, dt) for w in ((w1, w3) if nw == 2 else (w1, w1)) for a, dt in zip(w, (np.uint32, np.uint32,
                                                                                         np.uint64))]
    dx = dev(x, np.uint64)
    dout = cuda.device_array(m * N, np.uint16)
    db1 = dev(b1, np.uint16) if b1 is not None else dout
    db3 = dev(b3, np.uint16) if b3 is not None else dout
    grid, gpt, splits = tc_plan(m, K, N, group_size, warps, max_splits)
    psize, csize = tc_scratch(m, K, N, group_size, nw, warps, max_splits)
    dpart = cuda.to_device(np.zeros(psize, np.float32))
    dcnt = cuda.to_device(np.zeros(csize, np.uint32))
    args = (dx, *ws, db1, db3, dout, dpart, dcnt, m, K, N, group_size, gpt, splits, int(b1 is not None),
            int(b3 is not None))
    if SIM:
        kern = _make_tc(nw, True, unroll, maxw=warps)
        for _ in range(repeat):
            kern[grid, 32 * warps](*args)
    else:
        lau = tc_launcher(nw, unroll, maxw=warps)
        for _ in range(repeat):
            lau.launch(grid, 32 * warps, 0, *[arg(a) for a in args])
        cuda.synchronize()
    return dout.copy_to_host().view(np.float16)


def tc_setup(a16, sh, nw, acc_size, cnt_size):
    """The tensor-core kernel of a MatMulAWQ (nw=1) / FusedFFNAWQ (nw=2) kernel object: (launcher or None where
    the kernel cannot serve it, plans per M, acc_size and cnt_size grown to what its partials need)."""
    if not (tc_ok(a16, 1, sh.K, sh.group_size) and tc_device()):
        return None, {}, acc_size, cnt_size
    plans = {m: tc_plan(m, sh.K, sh.N, sh.group_size) for m in range(1, MAX_M_FAST + 1)}
    for m in plans:
        part, cnt = tc_scratch(m, sh.K, sh.N, sh.group_size, nw)
        acc_size, cnt_size = max(acc_size, part), max(cnt_size, cnt)
    return tc_launcher(nw), plans, acc_size, cnt_size


class MatMulAWQCudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        sh = self.sh = parse_attrs(self.attrs)
        self.a16 = self.in_types[0] == 10
        self.sms = cuda_launch.sm_count(cuda_launch.current_device())
        self.tiles = -(-sh.NG // CT)
        # compile everything now (once per process and A type), never on the hot path; plan each M bucket
        # (and the two-chunk case M = 9..16) from the kernel's occupancy
        self.gpt = {mt: gpt_for(mt, sh.N) for mt in MT_BUCKETS}
        self.fast = {mt: launcher(self.a16, mt, self.gpt[mt]) for mt in MT_BUCKETS}
        self.generic = launcher(self.a16, None)
        self.plans = {}
        for m in (1, 2, 4, 8, MAX_M_FAST):
            occ = blocks_per_sm(self.fast[bucket(m)])
            self.plans[(bucket(m), chunks(m, bucket(m)))] = decode_plan(m, sh.K, sh.N, sh.group_size, self.sms, occ,
                                                                        gpt=self.gpt[bucket(m)])
        # split-K partials (per call from onnxruntime's allocator; the pool's size, for the largest M of each plan,
        # serves only onnxruntime < 1.18) and the tile counters (the pool's, per stream)
        acc_size = max(partial_floats(splits, 1, mt * ch, sh.N) for (mt, ch), (_, _, splits) in self.plans.items())
        self.tc, self.tc_plans, acc_size, cnt_size = tc_setup(self.a16, sh, 1, acc_size, self.tiles)
        # M = 1 with fp16 A: the tensor-core GEMV (matmulawq1_cuda) where it can take the shape
        self.m1, acc_size, cnt_size = matmulawq1_cuda.session_setup(self.a16, sh, self.sms, 1, acc_size, cnt_size)
        self.m8, acc_size, cnt_size = matmulawq1_cuda.session_setup(self.a16, sh, self.sms, 1, acc_size, cnt_size, mr=8)
        self.scratch = ScratchPool(acc_size, cnt_size)

    def compute(self, ctx, inputs):
        a, qw, qz, sc = (inputs[i] if i < len(inputs) else None for i in range(4))
        bias = inputs[4] if len(inputs) > 4 else None
        sh = self.sh
        check_weights(qw, qz, sc, sh, first=1)
        m = check_a_bias(a, bias, sh)
        y = ctx.output(0, tuple(a.shape[:-1]) + (sh.N,))
        if m == 0:
            return
        sp = self.m1 if m == 1 else self.m8 if m <= matmulawq1_cuda.SESSION_MAX_M else None
        if sp is not None and matmulawq1_cuda.session_launch(sp, ctx, self.scratch, a, (qw, qz, sc), None, bias, None, y,
                                                             sh.N, m):
            return
        if self.tc and TC_MIN_M <= m <= MAX_M_FAST and not ((a.ptr | sc.ptr) & 7 or (qw.ptr | qz.ptr) & 3 or
                                                   (bias is not None and bias.ptr & 1)):
            grid, gpt, splits = self.tc_plans[m]
            part = self.scratch.partials(ctx, partial_floats(splits, 1, m, sh.N))
            w = [(qw.ptr, (qw.size,)), (qz.ptr, (qz.size,)), (sc.ptr, (sc.size // 4,))]
            yb = (y, (m * sh.N,))
            bb = (bias.ptr, (sh.N,)) if bias is not None else yb
            self.tc.launch(grid, 32 * TC_WARPS, ctx.stream, (a.ptr, (m * sh.K // 4,)), *w, *w, bb, yb, yb, part,
                           self.scratch.counters(ctx.stream), m, sh.K, sh.N, sh.group_size, gpt, splits,
                           int(bias is not None), 0)
            return
        mt = bucket(m)
        gpt = 1 if mt is None else self.gpt[mt]
        if (a.ptr | y | (bias.ptr if bias is not None else 0)) & (1 if self.a16 else 3) or \
                (qw.ptr | qz.ptr) & (4 * gpt - 1) or sc.ptr & 1:
            raise KernelError(f"inputs and the output must be aligned device buffers (qweight, qzeros: {4 * gpt} "
                              f"bytes)")
        hb = int(bias is not None)
        args = [(a.ptr, (m * sh.K,)), (qw.ptr, (qw.size // gpt,)), (qz.ptr, (qz.size // gpt,)), (sc.ptr, (sc.size,)),
                (bias.ptr, (sh.N,)) if hb else (y, (sh.N,)), (y, (m * sh.N,))]
        if mt is None:
            grid = self.tiles * -(-m // WARPS)
            self.generic.launch(grid, BLOCK, ctx.stream, *args, m, sh.K, sh.N, sh.group_size, hb)
            return
        grid, rows, splits = self.plans[(mt, chunks(m, mt))]
        part = self.scratch.partials(ctx, partial_floats(splits, 1, m, sh.N))
        self.fast[mt].launch(grid, BLOCK, ctx.stream, *args, part, self.scratch.counters(ctx.stream), m, sh.K, sh.N,
                             sh.group_size, rows, splits, hb)


KERNEL = MatMulAWQCudaKernel

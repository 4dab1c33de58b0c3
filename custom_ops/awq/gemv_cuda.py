"""The fp32-accumulating AWQ decode kernel (M <= 16) and the generic kernel (any M), for one weight (MatMulAWQ:
Y = A W + bias) or two (``nw`` = 2, FusedFFNAWQ: S = SiLU(X W1 + B1) * (X W3 + B3)); W in AutoAWQ GEMM layout (see
dequantawq_cpu). Which calls take them: the ops' ROUTES (matmulawq_cuda, ffn/fusedffnawq_cuda).

Decode kernel (M <= 16), fused: the fp16 weight is never written; every nibble is dequantised in registers.
qweight is K-major (one int32 = 8 columns of one row k), so

* a block is 32 lanes x 8 warps; lane = column group c (a warp reads 128 contiguous bytes of a qweight row),
  warp = a slice of R consecutive rows of K (split-K). R divides group_size, so a thread's slice lies in one
  group and needs one zero word and 8 scales. R <= 64; a block covers 8R rows and 32 column groups.
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
  largest M <= 16 and made on the stream's first such call. The runner (gemv_run_cuda.run: tests) allocates
  both for the call.
* grid: row chunks x column tiles x splits; R (<= 64, dividing group_size) from a small cost model of the
  kernel's occupancy and the SM count (``plan``).
* one kernel per row bucket MT in {1, 2, 4, 8} (M is rounded up; rows >= M are zero in shared memory and never
  written), so the MT x 8 accumulators stay in registers (16 x 8 would not: 255 registers and a stack frame);
  M in 9..16 runs the MT=8 kernel with two row chunks as neighbouring blocks that share the weight reads through
  L2. All four are compiled at kernel creation (once per process and A type).

With two weights each thread reads both weights' words for its rows; the x slice and S = sum x are shared, and
the last block applies the biases and SiLU * mul. Per number of weights, the row buckets, words in flight and
register caps sessions compile (``TUNED``).

Generic kernel (M > 16): correct, NOT tuned (prefill): a thread owns 8 columns of one row m and walks all of
K with the same decoding; weights are re-read per row through L1/L2. For long prompts DequantAWQ + a cuBLAS
MatMul is the faster graph.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.fp16 import as_f32, f2h, h2f
from ..device.launch import Array
from ..device.mma import silu
from ..device.splitk import arrive_last, sum_splits
from ..device.target import SIM, device
from .dequantawq_cuda import col_of
from .common_cuda import launcher_for

CT = 32                  # column groups per block (lanes of a warp)
WARPS = 8                # K slices per block
BLOCK = CT * WARPS
RMAX = 64                # rows per K slice, at most
UNROLL = 8               # qweight words in flight per thread
UNROLL_M1 = 16           # ... at M = 1 (MT=1: 80 registers, 3 blocks per SM). H100, fp16 A, weights cycled past L2
                         # (benchmarks/awq1_gpu.py), us against 8: 4096x11008 18.8 / 19.1, 2048x2048 9.3 / 11.5,
                         # 8192x2048 11.5 / 14.0 (the smaller occupancy also makes the plan take fewer K splits)
MAX_M_FAST = 16          # rows the decode kernels take (more: the generic kernel)
DEFAULT_BLOCKS_PER_SM = 4  # planning without an occupancy query (simulator)
OVERHEAD_ROWS = 24         # a block's fixed cost in row-steps per warp (plan)
# What sessions compile per number of weights: {row bucket MT: (words in flight per thread and weight, register
# cap)}. Rows per block MT: M is rounded up to a bucket; M in 9..16 (one weight) runs as 2 chunks of 8, M in
# 5..16 (two weights) as chunks of 4 (16 rows x 8 columns of fp32 accumulators would not stay in registers).
# Two weights (FusedFFNAWQ): 2 x words in flight, pipelined; MT=1 measured 28.7 us with 8 against 29.9 with 4
# (H100, LLaMA-7B); the caps leave no local-memory spills (ptxas); MT=1 (77 registers): 3 blocks of 256 per SM,
# so LLaMA-7B gate+up (344 blocks) is one wave.
TUNED = {1: {1: (UNROLL_M1, None), 2: (UNROLL, None), 4: (UNROLL, None), 8: (UNROLL, None)},
         2: {1: (8, 96), 2: (4, 80), 4: (4, 128)}}

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
def _decode(w, vj, one):
    """vj[j] = v_j of the int32 word w (8 columns), a uint32."""
    wg = uint32(w)
    for h in range(4):
        t = _pair_word(wg, h)
        vj[2 * h] = _nib_value(t, False, one)
        vj[2 * h + 1] = _nib_value(t, True, one)


@device
def _accumulate(nw, mt, w1, w3, xs, xi, xstride, vj, p, sx, one):
    """One row of each of the ``nw`` weights, their qweight words w1 and w3 (uint32, 8 columns each; w3 unused
    with one weight): P[w][m][j] += x[m] * v_wj, S[m] += x[m]; x[m] = xs[xi + m * xstride] (uint32 indices)."""
    _decode(w1, vj, one)
    for m in range(mt):
        xv = xs[xi + uint32(m) * xstride]
        sx[m] += xv
        for t in range(8):
            p[m * 8 + t] += xv * vj[t]
    if nw == 2:
        _decode(w3, vj, one)
        for m in range(mt):
            xv = xs[xi + uint32(m) * xstride]
            for t in range(8):
                p[(mt + m) * 8 + t] += xv * vj[t]


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


def make_gemv(mt, a16, nw=1, ct=CT, warps=WARPS):
    """The decode kernel for row bucket ``mt`` and ``nw`` weights: nw=1 is MatMulAWQ (Y = A W + bias), nw=2
    FusedFFNAWQ (S = SiLU(X W1 + B1) * (X W3 + B3), fusedffnawq_cuda); words in flight and register cap from
    ``TUNED``; ``ct`` x ``warps`` threads per block (the simulator's tests shrink them). One column group (int32
    word, 4-byte loads) per thread. Both kernels run one body (``body``, inlined) with ``nw`` a closure constant,
    so the branches of the other one are compiled away; with one weight the body gets the weight's buffers and the
    bias twice."""
    unroll, max_registers = TUNED[nw][mt]
    load = _ld16 if a16 else _ld32
    finish = _make_finish(nw, a16)
    block = ct * warps
    xs_size = mt * warps * RMAX      # array sizes must be compile-time constants (closure values, not expressions)
    red_size = nw * warps * ct * 8
    p_size = nw * mt * 8
    v_size = 8
    s_size = nw * v_size
    w_size = nw * unroll
    u3 = w_size - unroll             # the second weight's words in a batch (the first's again with one weight)
    wdt = uint32
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
        wpr = n64 >> U3                             # words per qweight row
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
                        _accumulate(nw, mt, wv[u], wv[u3 + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
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
                            _accumulate(nw, mt, wv[u], wv[u3 + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
            else:
                k = k0
                while k < kend:
                    kn = k + uint64(unroll)
                    for u in range(unroll):
                        kk = kn + uint64(u)
                        wn[u] = qw1[kk * wpr + c] if kk < kend else wzero
                    for u in range(unroll):
                        if k + uint64(u) < kend:
                            _accumulate(nw, mt, wv[u], wv[u3 + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
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
            """a [M*K], qw [Kp*NG], qz [groups*NG] (uint32 words), sc uint16 [groups*N], bias
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


def make_generic(a16, nw=1, ct=CT, warps=WARPS):
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


def plan(k_dim, n_dim, g_size, sms, ct=CT, warps=WARPS, blocks_per_sm=DEFAULT_BLOCKS_PER_SM, nch=1):
    """(tiles, rows per warp slice R, splits) for the decode kernel.

    R is a divisor of group_size (a slice never straddles two groups), at most RMAX. Cost model: the block
    scheduler spreads the grid over the SMs, b = ceil(blocks / sms) blocks per SM, running in
    waves = ceil(b / blocks_per_sm) (the kernel's occupancy). An SM's streaming time is proportional to its
    rows, b * R; the fixed part of a block (x staging, the block reduction, the atomics: OVERHEAD_ROWS row-steps)
    overlaps between the blocks of a wave. R minimises b * R + waves * OVERHEAD_ROWS: large enough to amortise
    the fixed part, small enough to spread the rows evenly over the SMs. A column tile is ct column groups.
    """
    tiles = -(-(n_dim // 8) // ct)
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


def bucket(m, nw=1):
    """Rows per block of the ``nw``-weight decode kernel for M = m rows (1 .. MAX_M_FAST): the smallest bucket of
    TUNED[nw] that holds them, else the largest (several row chunks)."""
    buckets = tuple(TUNED[nw])
    return next((mt for mt in buckets if m <= mt), buckets[-1])


def chunks(m, mt):
    return -(-m // mt)


def decode_plan(m, K, N, group_size, sms, occupancy=DEFAULT_BLOCKS_PER_SM, nw=1, ct=CT, warps=WARPS,  # noqa: N803
                rows=None):
    """(grid, rows R, splits) of the ``nw``-weight decode kernel for M = m rows (1..16); ``occupancy``: resident
    blocks per SM of the kernel of m's bucket (``blocks_per_sm``); ``rows``: a forced R instead of the plan's
    (tests: it must divide group_size)."""
    nch = chunks(m, bucket(m, nw))
    tiles, r, splits = plan(K, N, group_size, sms, ct, warps, occupancy, nch)
    if rows is not None:
        if group_size % rows or rows > RMAX:
            raise ValueError(f"rows must divide group_size and be <= {RMAX}")
        r, splits = rows, -(-K // (warps * rows))
    return tiles * splits * nch, r, splits


def sig(a16, nw, decode):
    """The launch signature of the ``nw``-weight decode kernel (``decode``) or generic kernel."""
    t = Array(np.uint16) if a16 else Array(np.float32)
    arrays = [t] + [Array(np.uint32), Array(np.uint32), Array(np.uint16)] * nw + [t] * (nw + 1)
    if decode:
        return arrays + [Array(np.float32), Array(np.uint32)] + ["int64"] * (6 + nw)
    return arrays + ["int64"] * (4 + nw)


_launchers = {}


def launcher(a16, mt, nw=1):
    """The launcher of the ``nw``-weight decode kernel for bucket ``mt`` (the generic kernel for mt None), compiled
    once per process."""
    key = (a16, mt, nw)
    if key not in _launchers:
        fn = make_generic(a16, nw) if mt is None else make_gemv(mt, a16, nw)
        _launchers[key] = launcher_for(fn, sig(a16, nw, mt is not None))
    return _launchers[key]

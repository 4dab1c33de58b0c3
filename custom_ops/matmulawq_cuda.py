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
  `splits` partials in split order, adds bias, converts to A's type, writes Y, and resets the tile's counter.
  One launch per call, and the same result on every run (the summation order is fixed).
  Why not a second kernel over the partials: it would cost ~2-3 us per call at M=1 (the weight read itself is
  ~8 us for 4096x11008). The scratch is splits x M x N fp32 (5.6 MB for 4096x11008 at M=16, 0.35 MB at M=1).
  Stream-ordering: the scratch and counters are only touched by this node's kernel, whose launches are ordered
  on onnxruntime's compute stream; each launch leaves the counters zeroed. One scratch per CUDA stream the node
  is run on (concurrent runs on different streams never share one); the first is allocated at kernel creation
  for the largest M <= 16, others on the first run on a new stream (synchronously, before that run's launch).
* grid: row chunks x column tiles x splits; R (<= 64, dividing group_size) from a small cost model of the
  kernel's occupancy and the SM count (``plan``).
* option (GPT_SMALL_M = 2, off): for M <= 2 with N % 16 == 0 each thread takes two column groups through 8-byte
  loads (16 columns, a block tile of 512 columns). Measured on the H100 (4096 x 11008, M=1): 20.0 us against
  16.2 us for one group per thread (96 registers: 2 blocks per SM), so it is off.
* one kernel per row bucket MT in {1, 2, 4, 8} (M is rounded up; rows >= M are zero in shared memory and never
  written), so the MT x 8 accumulators stay in registers (16 x 8 would not: 255 registers and a stack frame);
  M in 9..16 runs the MT=8 kernel with two row chunks as neighbouring blocks that share the weight reads through
  L2. All four are compiled at kernel creation (once per process and A type).

Generic kernel (M > 16): correct, NOT tuned (prefill): a thread owns 8 columns of one row m and walks all of
K with the same decoding; weights are re-read per row through L1/L2. For long prompts DequantAWQ + a cuBLAS
MatMul is the faster graph.
"""
from __future__ import annotations

import numpy as np
from numba import config, cuda, float32, uint32, uint64

from .dequantawq_cpu import check_a_bias, check_weights, parse_attrs
from .dequantawq_cuda import as_f32, col_of, device, f2h, h2f
from .kernels import Kernel

CT = 32                  # column groups per block (lanes of a warp)
WARPS = 8                # K slices per block
BLOCK = CT * WARPS
RMAX = 64                # rows per K slice, at most
UNROLL = 8               # qweight words in flight per thread
MT_BUCKETS = (1, 2, 4, 8)   # rows per block; M in 9..16 runs as 2 chunks of 8 (16 rows x 8 columns of fp32
MAX_M_FAST = 16             # accumulators would not stay in registers)
DEFAULT_BLOCKS_PER_SM = 4  # planning without an occupancy query (simulator)
OVERHEAD_ROWS = 24         # a block's fixed cost in row-steps per warp (plan)
GPT_SMALL_M = 1            # column groups per thread for M <= 2 (2 = 8-byte loads; measured slower, see above)

U0, U1, U3, U15 = (np.uint64(v) for v in (0, 1, 3, 15))
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
def _accumulate(mt, gpt, w, xs, xi, xstride, vj, p, sx, one):
    """One qweight word (``gpt`` int32 of 8 columns each, in a uint32 or uint64) of one row:
    P[m][g][j] += x[m] * v_gj, S[m] += x[m]; x[m] = xs[xi + m * xstride] (uint32 indices)."""
    for gi in range(gpt):
        wg = uint32(w) if gpt == 1 else uint32((w >> uint64(32 * gi)) & M32)
        for h in range(4):
            t = _pair_word(wg, h)
            vj[gi * 8 + 2 * h] = _nib_value(t, False, one)
            vj[gi * 8 + 2 * h + 1] = _nib_value(t, True, one)
    for m in range(mt):
        xv = xs[xi + uint32(m) * xstride]
        sx[m] += xv
        for t in range(gpt * 8):
            p[m * gpt * 8 + t] += xv * vj[t]


def _make_gemv(mt, a16, ct=CT, warps=WARPS, unroll=UNROLL, gpt=1, max_registers=None):
    """The decode kernel for row bucket ``mt``; ``gpt`` column groups (int32 words) per thread: 1 (4-byte loads)
    or 2 (8-byte loads, qweight/qzeros passed as uint64 arrays; needs N % 16 == 0)."""
    load = _ld16 if a16 else _ld32
    store = _st16 if a16 else _st32
    block = ct * warps
    xs_size = mt * warps * RMAX      # array sizes must be compile-time constants (closure values, not expressions)
    red_size = warps * ct * 8 * gpt
    p_size = mt * 8 * gpt
    v_size = 8 * gpt
    wdt = uint32 if gpt == 1 else uint64
    wzero = wdt(0)
    opts = {} if max_registers is None else {"max_registers": max_registers}

    @cuda.jit(**opts)
    def gemv(a, qw, qz, sc, bias, y, acc, cnt, m_dim, k_dim, n_dim, g_size, rows, splits, has_bias):
        """a [M*K], qw [Kp*NG/gpt], qz [groups*NG/gpt] (uint32 or uint64 words), sc uint16 [groups*N], bias [N],
        y [M*N] (A's type; fp16 as uint16 bits), acc float32 [splits*M*N] (partials), cnt uint32 [tiles] (zero
        between launches).
        Block b: row chunk b % chunks (rows [chunk*mt, +mt) of A), then column tile and K split
        (rows [split*warps*rows, +warps*rows) of W) from b // chunks; the chunks of one tile and split are
        neighbours in launch order, so they read the same weights at about the same time (L2 hits)."""
        xs = cuda.shared.array(xs_size, float32)
        red = cuda.shared.array(red_size, float32)
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
        nw = (n64 >> U3) // uint64(gpt)             # words per qweight row
        tiles = (nw + uint64(ct - 1)) // uint64(ct)
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
        active = c < nw and k0 < kend
        # prefetch before staging x: the first batch of weight words, the group's zero words and scales
        wv = cuda.local.array(unroll, wdt)
        wn = cuda.local.array(unroll, wdt)
        sj = cuda.local.array(v_size, float32)
        z = U0
        if active:
            for u in range(unroll):
                kk = k0 + uint64(u)
                wv[u] = qw[kk * nw + c] if kk < kend else wzero
            g = k0 // uint64(g_size)
            z = uint64(qz[g * nw + c])
            for t in range(v_size):
                sj[t] = h2f(sc[g * n64 + c * uint64(v_size) + uint64((t >> 3) * 8 + col_of(t & 7))])
        # stage this block's slice of x as fp32 (zero past K and for rows past M)
        i = tid
        while i < uint64(mt) * span:
            m = i // span
            k = kb + (i - m * span)
            v = F0
            if m0 + m < m64 and k < k64:
                v = load(a, (m0 + m) * k64 + k)
            xs[i] = v
            i += uint64(block)
        cuda.syncthreads()
        one = one_sm[0]

        p = cuda.local.array(p_size, float32)
        sx = cuda.local.array(mt, float32)
        for t in range(p_size):
            p[t] = F0
        for m in range(mt):
            sx[m] = F0
        if active:
            vj = cuda.local.array(v_size, float32)
            xo = uint32(k0 - kb)                      # this slice's first row in the staged x
            xstr = uint32(span)
            if kend - k0 == r64 and r64 % uint64(unroll) == U0:
                # fast path (every slice inside K, R a multiple of UNROLL): no bounds checks, one add per load
                step = uint64(unroll) * nw
                base = k0 * nw + c
                nb = r64 // uint64(unroll)
                b = U0
                while b < nb:
                    nbase = base + step
                    if b + U1 < nb:
                        for u in range(unroll):       # software pipeline: the next batch is in flight
                            wn[u] = qw[nbase + uint64(u) * nw]
                    for u in range(unroll):
                        _accumulate(mt, gpt, wv[u], xs, xo + uint32(u), xstr, vj, p, sx, one)
                    for u in range(unroll):
                        wv[u] = wn[u]
                    base = nbase
                    xo += uint32(unroll)
                    b += U1
            else:
                k = k0
                while k < kend:
                    kn = k + uint64(unroll)
                    for u in range(unroll):
                        kk = kn + uint64(u)
                        wn[u] = qw[kk * nw + c] if kk < kend else wzero
                    for u in range(unroll):
                        if k + uint64(u) < kend:
                            _accumulate(mt, gpt, wv[u], xs, xo + uint32(u), xstr, vj, p, sx, one)
                    for u in range(unroll):
                        wv[u] = wn[u]
                    k = kn
                    xo += uint32(unroll)
            # partial = s * (C P - (C + z) S) with this slice's group's zero points and scales
            for t in range(v_size):
                cj = _nib_scale(t & 7)
                zc = cj + float32((z >> uint64(4 * t)) & U15)      # word t >> 3 of z, nibble t & 7
                for m in range(mt):
                    p[m * v_size + t] = sj[t] * (cj * p[m * v_size + t] - zc * sx[m])

        # (1) reduce the warps' partials in shared memory, (2) store the block's sums into its slot of acc (or,
        # with a single split, write Y directly)
        cols = uint64(ct * v_size)                  # columns of the tile
        for m in range(mt):
            mg = m0 + uint64(m)                     # the row of A and Y
            if mg < m64:
                for t in range(v_size):
                    red[warp * cols + lane * uint64(v_size) + uint64((t >> 3) * 8 + col_of(t & 7))] = \
                        p[m * v_size + t]
                cuda.syncthreads()
                cl = tid
                while cl < cols:
                    tot = F0
                    for w_ in range(warps):
                        tot += red[uint64(w_) * cols + cl]
                    col = tile * cols + cl
                    if col < n64:
                        if splits == 1:
                            if has_bias:
                                tot += load(bias, col)
                            store(y, mg * n64 + col, tot)
                        else:
                            acc[(split * m64 + mg) * n64 + col] = tot
                    cl += uint64(block)
                cuda.syncthreads()
        if splits == 1:
            return
        cuda.threadfence()
        cuda.syncthreads()
        if tid == U0:
            old = cuda.atomic.add(cnt, tile, uint32(1))
            flag[0] = uint32(1) if uint64(old) == uint64(splits) * nch - U1 else uint32(0)
        cuda.syncthreads()
        if flag[0] != uint32(0):
            cuda.threadfence()
            cl = tid
            while cl < cols:
                col = tile * cols + cl
                if col < n64:
                    mg = U0
                    while mg < m64:                          # all rows: every chunk of the tile is done
                        ai = mg * n64 + col
                        v = F0
                        sp = U0
                        while sp < uint64(splits):           # fixed order: deterministic
                            v += acc[sp * m64 * n64 + ai]
                            sp += U1
                        if has_bias:
                            v += load(bias, col)
                        store(y, ai, v)
                        mg += U1
                cl += uint64(block)
            if tid == U0:
                cnt[tile] = uint32(0)

    return gemv


def _make_generic(a16, ct=CT, warps=WARPS):
    load = _ld16 if a16 else _ld32
    store = _st16 if a16 else _st32

    @cuda.jit
    def generic(a, qw, qz, sc, bias, y, m_dim, k_dim, n_dim, g_size, has_bias):
        """Any M: thread = (row m, column group c); block = ct column groups x warps rows."""
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
        out = cuda.local.array(8, float32)
        p = cuda.local.array(8, float32)
        for j in range(8):
            out[j] = F0
        k0 = U0
        g = U0
        while k0 < k64:
            k1 = min(k0 + g64, k64)
            for j in range(8):
                p[j] = F0
            sx = F0
            for k in range(k0, k1):
                xv = load(a, m * k64 + k)
                w = uint64(qw[k * ng + c])
                sx += xv
                for j in range(8):
                    p[j] += xv * _vnib(w, j)
            z = uint64(qz[g * ng + c])
            for j in range(8):
                s = h2f(sc[g * n64 + c * uint64(8) + uint64(col_of(j))])
                out[j] += s * (F16 * p[j] - (F16 + float32((z >> uint64(4 * j)) & U15)) * sx)
            k0 = k1
            g += U1
        for j in range(8):
            n = c * uint64(8) + uint64(col_of(j))
            v = out[j]
            if has_bias:
                v += load(bias, n)
            store(y, m * n64 + n, v)

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
    """Resident blocks per SM of a compiled kernel (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
    import ctypes

    from .cuda_launch import check, libcuda
    fn = libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    n = ctypes.c_int(0)
    check(fn(ctypes.byref(n), launcher_.handle, BLOCK, 0), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return max(1, n.value)


def bucket(m):
    """Rows per block for M rows (None: the generic kernel)."""
    if m > MAX_M_FAST:
        return None
    for mt in MT_BUCKETS:
        if m <= mt:
            return mt
    return MT_BUCKETS[-1]


def chunks(m, mt):
    return -(-m // mt)


_launchers = {}


def gpt_for(mt, n_dim):
    """Column groups per thread for bucket ``mt``: GPT_SMALL_M (for M <= 2 where N % 16 == 0), else 1."""
    return GPT_SMALL_M if mt is not None and mt <= 2 and n_dim % 16 == 0 else 1


def _sig(a16, fused, gpt=1):
    from .cuda_launch import Array
    t = Array(np.uint16) if a16 else Array(np.float32)
    wt = Array(np.uint32) if gpt == 1 else Array(np.uint64)
    arrays = [t, wt, wt, Array(np.uint16), t, t]
    if fused:
        return arrays + [Array(np.float32), Array(np.uint32)] + ["int64"] * 7
    return arrays + ["int64"] * 5


def launcher(a16, mt, gpt=1):
    """The direct-launch wrapper of the decode kernel for bucket ``mt`` with ``gpt`` column groups per thread
    (or the generic kernel for mt=None), compiled once per process."""
    from .cuda_launch import Launcher
    key = (a16, mt, gpt if mt is not None else 1)
    if key not in _launchers:
        fn = _make_generic(a16) if mt is None else _make_gemv(mt, a16, gpt=gpt)
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


def run_arrays(a, qweight, qzeros, scales, group_size, K, N, bias=None, *, sms=None, ct=CT,  # noqa: N803
               warps=WARPS, force_generic=False, rows=None, repeat=1, gpt=None):
    """Runs the kernels on host arrays and returns Y (tests, benchmark): through the Numba dispatcher under the
    CUDA simulator (``ct``/``warps`` may be shrunk there to keep it fast), through the direct launch path on a
    real GPU. Inputs are checked exactly as in a session. ``rows`` overrides the decode kernel's K slice (it must
    divide group_size); ``repeat`` launches that many times on the same scratch (which each launch must leave
    zeroed) and returns the last result; ``gpt`` overrides the column groups per thread (1 or 2)."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_weights(qweight, qzeros, scales, sh, first=1)
    m = check_a_bias(a, bias, sh)
    lead = tuple(a.shape[:-1])
    if m == 0:
        return np.empty(lead + (N,), a.dtype)
    a16 = a.dtype == np.float16
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
        from .cuda_launch import current_device, sm_count
        sms = sms or sm_count(current_device())
        ct, warps = CT, WARPS
    sms = sms or 2
    tiles = -(-(N // 8) // ct)
    hb = int(bias is not None)
    if mt is None:
        grid = tiles * -(-m // warps)
        args = (da, dqw, dqz, dsc, db, dy, m, K, N, group_size, hb)
        if sim:
            _make_generic(a16, ct, warps)[grid, ct * warps](*args)
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
            kern = _make_gemv(mt, a16, ct, warps, gpt=gpt)
            for _ in range(repeat):
                kern[grid, ct * warps](*args)
    if not sim:
        p = lambda x: (x.device_ctypes_pointer.value, (x.size,)) if hasattr(x, "device_ctypes_pointer") else x  # noqa: E731
        for _ in range(repeat):
            launcher(a16, mt, gpt).launch(grid, BLOCK, 0, *[p(x) for x in args])
        cuda.synchronize()
    return dy.copy_to_host().view(a.dtype).reshape(lead + (N,))


class _Scratch:
    """The decode kernel's fp32 partials [size] and zeroed tile counters; one per CUDA stream."""

    def __init__(self, size, tiles):
        self.acc = cuda.device_array(max(size, 1), np.float32)
        self.cnt = cuda.to_device(np.zeros(max(tiles, 1), np.uint32))
        self.acc_arg = (self.acc.device_ctypes_pointer.value, (max(size, 1),))
        self.cnt_arg = (self.cnt.device_ctypes_pointer.value, (max(tiles, 1),))


class MatMulAWQCudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        from .cuda_launch import current_device, sm_count
        sh = self.sh = parse_attrs(self.attrs)
        self.a16 = self.in_types[0] == 10
        self.sms = sm_count(current_device())
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
        # partials for the largest M of each plan: splits x (rows per chunk x chunks) x N
        self.acc_size = max(splits * mt * ch for (mt, ch), (_, _, splits) in self.plans.items()) * sh.N
        self._first = _Scratch(self.acc_size, self.tiles)
        self._scratch = {}

    def _scratch_for(self, stream):
        s = self._scratch.get(stream)
        if s is None:
            s = self._first if not self._scratch else _Scratch(self.acc_size, self.tiles)
            self._scratch[stream] = s
        return s

    def compute(self, ctx, inputs):
        from .bridge import KernelError
        a, qw, qz, sc = (inputs[i] if i < len(inputs) else None for i in range(4))
        bias = inputs[4] if len(inputs) > 4 else None
        sh = self.sh
        check_weights(qw, qz, sc, sh, first=1)
        m = check_a_bias(a, bias, sh)
        y = ctx.output(0, tuple(a.shape[:-1]) + (sh.N,))
        if m == 0:
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
        s = self._scratch_for(ctx.stream)
        grid, rows, splits = self.plans[(mt, chunks(m, mt))]
        self.fast[mt].launch(grid, BLOCK, ctx.stream, *args, s.acc_arg, s.cnt_arg, m, sh.K, sh.N, sh.group_size,
                             rows, splits, hb)


KERNEL = MatMulAWQCudaKernel

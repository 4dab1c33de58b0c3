"""FusedFFNAWQ, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 each stored as MatMulAWQ's weight
(AutoAWQ GEMM layout; onnx_lowbit.awq). One launch; the fp16 weights are never written; SiLU * mul in the
epilogue.

Decode kernel (M <= 16): MatMulAWQ's decode kernel (matmulawq_cuda, whose device functions it uses) reading both
weights in the same pass: lane = column group c (one int32 = 8 columns of a qweight row; a warp reads 128
contiguous bytes of a row of each weight), warp = a slice of R rows of K inside one group; every thread loads
the qweight words of W1 AND W3 for its rows (2 * UNROLL loads in flight, software-pipelined, UNROLL per row
bucket; whole batches run without bounds checks), the x slice is staged once per block in shared memory as fp32
and used for both, nibbles are decoded in 32-bit ops (matmulawq_cuda: one shift per two nibbles, one LOP3 and one
FFMA per nibble; 3.4 SASS instructions per nibble in the hot loop), and per weight P[m][j] = sum x*v,
S[m] = sum x (shared) give s_j (C_j P - (C_j + z_j) S); zero points and scales are read after the hot loop.
Split-K partials of both products meet in shared memory (the block's warps) and, across the blocks of a column
tile, in an fp32 scratch acc[splits, 2, M, N] (plain stores, one slot per split); the last block of a tile
(threadfence + counter) sums the splits in split order (deterministic: the same bits on every run and replay),
applies the biases and SiLU * mul in fp32, stores S in X's type and resets the tile counter. As in MatMulAWQ
(matmulawq_cuda, "split-K memory"): the partials come per call from onnxruntime's allocator (``Context.scratch``;
the kernel's own per-stream buffer only with onnxruntime < 1.18), the tile counters stay the kernel's, one set per
CUDA stream (``ScratchPool``). With a single split (K <= 8R) the block writes S directly (no partials). M runs
in row buckets MT in {1, 2, 4} (2 x 4 x 8 accumulators per thread at most); M = 5..16 as row chunks of 4 in
neighbouring blocks (the weight reads are shared through L2).
Generic kernel (any M): thread = (row, column group), walks all of K for both weights; correct, not tuned.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from .dequantawq_cpu import parse_attrs
from .dequantawq_cuda import SIM, col_of, h2f
from .ffn4_common import check_x_biases, opt
from .fusedffnawq_cpu import check_both
from .kernels import Kernel
from .matmulawq_cuda import (ONE32, RMAX, TC_MIN_M, TC_WARPS, ScratchPool, _ld16, _ld32, _nib_scale, _nib_value,
                             _pair_word, _silu, _st16, _st32, _vnib, partial_floats, sum_splits, tc_ok, tc_run,
                             tc_setup)
from .matmulawq_cuda import plan as awq_plan

CT = 32
WARPS = 8
BLOCK = CT * WARPS
UNROLL = {1: 8, 2: 4, 4: 4}   # per row bucket: qweight words in flight per thread and weight (2 x UNROLL loads,
                              # pipelined); MT=1 measured 28.7 us with 8 against 29.9 with 4 (H100, LLaMA-7B)
MAX_REGISTERS = {1: 96, 2: 80, 4: 128}   # per row bucket: no local-memory spills (ptxas); MT=1 (77 registers):
                                          # 3 blocks of 256 per SM, so LLaMA-7B gate+up (344 blocks) is one wave
MT_BUCKETS = (1, 2, 4)
MAX_M_FAST = 16
DEFAULT_BLOCKS_PER_SM = 4
U0, U1, U3, U15 = (np.uint64(v) for v in (0, 1, 3, 15))
F0, F16 = np.float32(0.0), np.float32(16.0)


@cuda.jit(device=True, inline=True)
def _row2(mt, w1, w3, xs, xi, xstr, vj, p, sx, one):
    """One row k of both weights (w1, w3: uint32 words of 8 columns): P[wsel][m][j] += x[m] * v_j, S[m] += x[m],
    x[m] = xs[xi + m * xstr]."""
    for m in range(mt):
        sx[m] += xs[xi + uint32(m) * xstr]
    for wsel in range(2):
        w = w1 if wsel == 0 else w3
        for h in range(4):
            t = _pair_word(w, h)
            vj[2 * h] = _nib_value(t, False, one)
            vj[2 * h + 1] = _nib_value(t, True, one)
        for m in range(mt):
            xv = xs[xi + uint32(m) * xstr]
            for j in range(8):
                p[(wsel * mt + m) * 8 + j] += xv * vj[j]


def _make_gemv(mt, a16, ct=CT, warps=WARPS, unroll=None, max_registers=None):
    load = _ld16 if a16 else _ld32
    store = _st16 if a16 else _st32
    unroll = unroll or UNROLL[mt]
    block = ct * warps
    xs_size = mt * warps * RMAX
    red_size = 2 * warps * ct * 8
    p_size = 2 * mt * 8
    w_size = 2 * unroll
    wzero = uint32(0)

    @cuda.jit(**({} if SIM else {"max_registers": max_registers or MAX_REGISTERS[mt]}))
    def gemv(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, s, acc, cnt, m_dim, k_dim, n_dim, g_size, rows, splits,
             has_b1, has_b3):
        """x [M*K] (fp32 or fp16 bits), qw*/qz* uint32, sc* uint16 (fp16 bits), b1/b3 [N], s [M*N], acc float32
        [splits*2*M*N] (partials: any contents) and cnt uint32 [tiles] (zero between launches). Block b: row
        chunk b % chunks, then column tile and K split from b // chunks (as matmulawq_cuda)."""
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
        nw = n64 >> U3
        tiles = (nw + uint64(ct - 1)) // uint64(ct)
        nch = (m64 + uint64(mt - 1)) // uint64(mt)
        bid = uint64(cuda.blockIdx.x)
        m0 = (bid % nch) * uint64(mt)
        rest = bid // nch
        tile = rest % tiles
        span = r64 * uint64(warps)
        split = rest // tiles
        kb = split * span
        c = tile * uint64(ct) + lane
        k0 = kb + warp * r64
        kend = min(k0 + r64, k64)
        active = c < nw and k0 < kend
        wv = cuda.local.array(w_size, uint32)           # [weight][u]
        wn = cuda.local.array(w_size, uint32)
        if active:
            for u in range(unroll):
                kk = k0 + uint64(u)
                wv[u] = qw1[kk * nw + c] if kk < kend else wzero
                wv[unroll + u] = qw3[kk * nw + c] if kk < kend else wzero
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

        p = cuda.local.array(p_size, float32)           # [weight][m][j]
        sx = cuda.local.array(mt, float32)
        vj = cuda.local.array(8, float32)
        for t in range(p_size):
            p[t] = F0
        for m in range(mt):
            sx[m] = F0
        if active:
            xo = uint32(k0 - kb)
            xstr = uint32(span)
            nfull = (kend - k0) // uint64(unroll)     # whole batches: no bounds checks in the hot loop
            step = uint64(unroll) * nw
            base = k0 * nw + c
            b = U0
            while b < nfull:
                if b + U1 < nfull:                      # software pipeline: the next batch is in flight
                    nbase = base + step
                    for u in range(unroll):
                        wn[u] = qw1[nbase + uint64(u) * nw]
                        wn[unroll + u] = qw3[nbase + uint64(u) * nw]
                for u in range(unroll):
                    _row2(mt, wv[u], wv[unroll + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
                for t in range(w_size):
                    wv[t] = wn[t]
                base += step
                xo += uint32(unroll)
                b += U1
            rem = (kend - k0) - nfull * uint64(unroll)
            if rem > U0:                                # the last rows (< unroll) of a slice at the end of K
                if nfull > U0:
                    for u in range(unroll):
                        ok = uint64(u) < rem
                        wv[u] = qw1[base + uint64(u) * nw] if ok else wzero
                        wv[unroll + u] = qw3[base + uint64(u) * nw] if ok else wzero
                for u in range(unroll):
                    if uint64(u) < rem:
                        _row2(mt, wv[u], wv[unroll + u], xs, xo + uint32(u), xstr, vj, p, sx, one)
            # the slice's group: zero points and scales, read after the hot loop (fewer live registers in it)
            g = k0 // uint64(g_size)
            for wsel in range(2):
                z = uint32(qz1[g * nw + c] if wsel == 0 else qz3[g * nw + c])
                for j in range(8):
                    col = g * n64 + c * uint64(8) + uint64(col_of(j))
                    sc = h2f(sc1[col] if wsel == 0 else sc3[col])
                    cj = _nib_scale(j)
                    zc = cj + float32((z >> uint32(4 * j)) & uint32(15))
                    for m in range(mt):
                        t = (wsel * mt + m) * 8 + j
                        p[t] = sc * (cj * p[t] - zc * sx[m])

        cols = uint64(ct * 8)
        for m in range(mt):
            mg = m0 + uint64(m)
            if mg < m64:
                for wsel in range(2):
                    for j in range(8):
                        red[(uint64(wsel) * uint64(warps) + warp) * cols + lane * uint64(8) + uint64(col_of(j))] = \
                            p[(wsel * mt + m) * 8 + j]
                cuda.syncthreads()
                cl = tid
                while cl < cols:
                    g_ = F0
                    u_ = F0
                    for w_ in range(warps):
                        g_ += red[uint64(w_) * cols + cl]
                        u_ += red[(uint64(warps) + uint64(w_)) * cols + cl]
                    col = tile * cols + cl
                    if col < n64:
                        if splits == 1:
                            if has_b1:
                                g_ += load(b1, col)
                            if has_b3:
                                u_ += load(b3, col)
                            store(s, mg * n64 + col, _silu(g_) * u_)
                        else:
                            acc[(split * uint64(2) * m64 + mg) * n64 + col] = g_
                            acc[((split * uint64(2) + U1) * m64 + mg) * n64 + col] = u_
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
                    while mg < m64:
                        ai = mg * n64 + col
                        # split sp, weight w: ((sp * 2 + w) * M + m) * N + col; summed in split order
                        g_ = sum_splits(acc, ai, uint64(2) * m64 * n64, splits)
                        u_ = sum_splits(acc, ai + m64 * n64, uint64(2) * m64 * n64, splits)
                        if has_b1:
                            g_ += load(b1, col)
                        if has_b3:
                            u_ += load(b3, col)
                        store(s, ai, _silu(g_) * u_)
                        mg += U1
                cl += uint64(block)
            if tid == U0:
                cnt[tile] = uint32(0)

    return gemv


def _make_generic(a16, ct=CT, warps=WARPS):
    load = _ld16 if a16 else _ld32
    store = _st16 if a16 else _st32

    @cuda.jit
    def generic(x, qw1, qz1, sc1, qw3, qz3, sc3, b1, b3, s, m_dim, k_dim, n_dim, g_size, has_b1, has_b3):
        """Any M: thread = (row m, column group c), all of K, both weights."""
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
        out = cuda.local.array(16, float32)
        p = cuda.local.array(16, float32)
        for j in range(16):
            out[j] = F0
        k0 = U0
        g = U0
        while k0 < k64:
            k1 = min(k0 + g64, k64)
            for j in range(16):
                p[j] = F0
            sx = F0
            for k in range(k0, k1):
                xv = load(x, m * k64 + k)
                w1 = uint64(qw1[k * ng + c])
                w3 = uint64(qw3[k * ng + c])
                sx += xv
                for j in range(8):
                    p[j] += xv * _vnib(w1, j)
                    p[8 + j] += xv * _vnib(w3, j)
            z1 = uint64(qz1[g * ng + c])
            z3 = uint64(qz3[g * ng + c])
            for j in range(8):
                col = g * n64 + c * uint64(8) + uint64(col_of(j))
                out[j] += h2f(sc1[col]) * (F16 * p[j] - (F16 + float32((z1 >> uint64(4 * j)) & U15)) * sx)
                out[8 + j] += h2f(sc3[col]) * (F16 * p[8 + j] - (F16 + float32((z3 >> uint64(4 * j)) & U15)) * sx)
            k0 = k1
            g += U1
        for j in range(8):
            n = c * uint64(8) + uint64(col_of(j))
            gv = out[j]
            uv = out[8 + j]
            if has_b1:
                gv += load(b1, n)
            if has_b3:
                uv += load(b3, n)
            store(s, m * n64 + n, _silu(gv) * uv)

    return generic


# ------------------------------------------------------------------------------------------------- host side
def bucket(m):
    if m > MAX_M_FAST:
        return None
    for mt in MT_BUCKETS:
        if m <= mt:
            return mt
    return MT_BUCKETS[-1]


def chunks(m, mt):
    return -(-m // mt)


def decode_plan(m, K, N, group_size, sms, occupancy=DEFAULT_BLOCKS_PER_SM, ct=CT, warps=WARPS):  # noqa: N803
    """(grid, rows R, splits): MatMulAWQ's plan (matmulawq_cuda.plan) for this kernel's occupancy."""
    mt = bucket(m)
    nch = chunks(m, mt)
    tiles, r, splits = awq_plan(K, N, group_size, sms, ct, warps, occupancy, nch)
    return tiles * splits * nch, r, splits


def _sig(a16, fused):
    from .cuda_launch import Array
    t = Array(np.uint16) if a16 else Array(np.float32)
    w = [Array(np.uint32), Array(np.uint32), Array(np.uint16)]
    arrays = [t] + w + w + [t, t, t]
    if fused:
        return arrays + [Array(np.float32), Array(np.uint32)] + ["int64"] * 8
    return arrays + ["int64"] * 6


_launchers = {}


def launcher(a16, mt):
    from .cuda_launch import Launcher
    key = (a16, mt)
    if key not in _launchers:
        fn = _make_generic(a16) if mt is None else _make_gemv(mt, a16)
        lau = Launcher(fn, _sig(a16, mt is not None))
        lau.dispatcher = fn   # register / local memory queries (benchmark)
        _launchers[key] = lau
    return _launchers[key]


def blocks_per_sm(launcher_):
    from .matmulawq_cuda import blocks_per_sm as bps
    return bps(launcher_)


def run_arrays(x, w1, w3, group_size, K, N, b1=None, b3=None, *, sms=None, ct=CT, warps=WARPS,  # noqa: N803
               force_generic=False, rows=None, repeat=1, tc=None):
    """Runs the kernels on host arrays (tests, benchmark) and returns S; w1 / w3 = (qweight, qzeros, scales).
    Simulator: Numba dispatcher (``ct`` / ``warps`` may shrink the block); GPU: the direct launch path.
    ``rows`` overrides the K slice (must divide group_size); ``repeat`` launches that many times on the same
    scratch (each launch must leave the counters zeroed); ``tc``: the tensor-core kernel (matmulawq_cuda; default:
    where ``tc_ok`` and ``rows`` is not given)."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_both(w1, w3, sh)
    m = check_x_biases(x, b1, b3, K, N, 7, 8)
    lead = tuple(x.shape[:-1])
    if m == 0:
        return np.empty(lead + (N,), x.dtype)
    a16 = x.dtype == np.float16
    if tc is None:
        tc = not force_generic and rows is None and m >= TC_MIN_M and tc_ok(a16, m, K, group_size)
    if tc:
        return tc_run(x, w1, w3, b1, b3, group_size, K, N, repeat=repeat).reshape(lead + (N,))
    bits = np.uint16 if a16 else np.float32
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    dx = dev(x, bits)
    dw = [dev(a, dt) for w in (w1, w3) for a, dt in zip(w, (np.uint32, np.uint32, np.uint16))]
    ds = cuda.device_array(m * N, bits)
    db1 = dev(b1, bits) if b1 is not None else ds
    db3 = dev(b3, bits) if b3 is not None else ds
    if not SIM:
        from .cuda_launch import current_device, sm_count
        sms = sms or sm_count(current_device())
        ct, warps = CT, WARPS
    sms = sms or 2
    tiles = -(-(N // 8) // ct)
    hb1, hb3 = int(b1 is not None), int(b3 is not None)
    mt = None if force_generic else bucket(m)
    if mt is None:
        grid = tiles * -(-m // warps)
        args = (dx, *dw, db1, db3, ds, m, K, N, group_size, hb1, hb3)
        if SIM:
            _make_generic(a16, ct, warps)[grid, ct * warps](*args)
    else:
        occ = DEFAULT_BLOCKS_PER_SM if SIM else blocks_per_sm(launcher(a16, mt))
        grid, r, splits = decode_plan(m, K, N, group_size, sms, occ, ct, warps)
        if rows is not None:
            if group_size % rows or rows > RMAX:
                raise ValueError(f"rows must divide group_size and be <= {RMAX}")
            r, splits = rows, -(-K // (warps * rows))
            grid = tiles * splits * chunks(m, mt)
        dacc = cuda.to_device(np.zeros(max(1, splits * 2 * m * N), np.float32))
        dcnt = cuda.to_device(np.zeros(tiles, np.uint32))
        args = (dx, *dw, db1, db3, ds, dacc, dcnt, m, K, N, group_size, r, splits, hb1, hb3)
        if SIM:
            kern = _make_gemv(mt, a16, ct, warps)
            for _ in range(repeat):
                kern[grid, ct * warps](*args)
    if not SIM:
        from .cuda_launch import arg as p
        for _ in range(repeat):
            launcher(a16, mt).launch(grid, BLOCK, 0, *[p(a) for a in args])
        cuda.synchronize()
    return ds.copy_to_host().view(x.dtype).reshape(lead + (N,))


def scratch_size(plans, n):
    """fp32 elements of the partials for ``plans`` {M: (grid, rows, splits)}: splits x 2 x M x N at most."""
    return max(partial_floats(splits, 2, m, n) for m, (_, _, splits) in plans.items())


class FusedFFNAWQCudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; partials per call, per-stream counters live as long as it

    def __init__(self, **kw):
        super().__init__(**kw)
        from .cuda_launch import current_device, sm_count
        sh = self.sh = parse_attrs(self.attrs)
        self.a16 = self.in_types[0] == 10
        self.sms = sm_count(current_device())
        self.tiles = -(-sh.NG // CT)
        self.fast = {mt: launcher(self.a16, mt) for mt in MT_BUCKETS}   # compiled now, never on the hot path
        self.generic = launcher(self.a16, None)
        self.plans = {}
        for m in range(1, MAX_M_FAST + 1):
            occ = blocks_per_sm(self.fast[bucket(m)])
            self.plans[m] = decode_plan(m, sh.K, sh.N, sh.group_size, self.sms, occ)
        # per-split partials [splits, 2, M, N] fp32: per call from onnxruntime's allocator (the pool's, sized for the
        # largest plan, only for onnxruntime < 1.18); tile counters: the pool's, one set per CUDA stream
        self.tc, self.tc_plans, acc_size, cnt_size = tc_setup(self.a16, sh, 2, scratch_size(self.plans, sh.N),
                                                              self.tiles)
        # M = 1 with fp16 X: the two-weight tensor-core GEMV (matmulawq1_cuda) where it can take the shape
        from .matmulawq1_cuda import session_setup
        self.m1, acc_size, cnt_size = session_setup(self.a16, sh, self.sms, 2, acc_size, cnt_size)
        self.m8, acc_size, cnt_size = session_setup(self.a16, sh, self.sms, 2, acc_size, cnt_size, mr=8)
        self.scratch = ScratchPool(acc_size, cnt_size)

    def compute(self, ctx, inputs):
        from .bridge import KernelError
        x = opt(inputs, 0)
        w1 = tuple(opt(inputs, i) for i in (1, 2, 3))
        w3 = tuple(opt(inputs, i) for i in (4, 5, 6))
        b1, b3 = opt(inputs, 7), opt(inputs, 8)
        sh = self.sh
        check_both(w1, w3, sh)
        m = check_x_biases(x, b1, b3, sh.K, sh.N, 7, 8)
        s = ctx.output(0, tuple(x.shape[:-1]) + (sh.N,))
        if m == 0:
            return
        ptrs = x.ptr | s | (b1.ptr if b1 is not None else 0) | (b3.ptr if b3 is not None else 0)
        if ptrs & (1 if self.a16 else 3) or (w1[0].ptr | w1[1].ptr | w3[0].ptr | w3[1].ptr) & 3 or \
                (w1[2].ptr | w3[2].ptr) & 1:
            raise KernelError("inputs and the output must be aligned device buffers")
        hb1, hb3 = int(b1 is not None), int(b3 is not None)
        from .matmulawq1_cuda import SESSION_MAX_M, session_launch
        sp = self.m1 if m == 1 else self.m8 if m <= SESSION_MAX_M else None
        if sp is not None and session_launch(sp, ctx, self.scratch, x, w1, w3, b1, b3, s, sh.N, m):
            return
        if self.tc and TC_MIN_M <= m <= MAX_M_FAST and not (x.ptr | w1[2].ptr | w3[2].ptr) & 7:
            grid, gpt, splits = self.tc_plans[m]
            part = self.scratch.partials(ctx, partial_floats(splits, 2, m, sh.N))
            w = [(t.ptr, (t.size // (4 if i == 2 else 1),)) for ws in (w1, w3) for i, t in enumerate(ws)]
            sb = (s, (m * sh.N,))
            self.tc.launch(grid, 32 * TC_WARPS, ctx.stream, (x.ptr, (m * sh.K // 4,)), *w,
                           (b1.ptr, (sh.N,)) if hb1 else sb, (b3.ptr, (sh.N,)) if hb3 else sb, sb, part,
                           self.scratch.counters(ctx.stream), m, sh.K, sh.N, sh.group_size, gpt, splits, hb1, hb3)
            return
        args = [(x.ptr, (m * sh.K,))]
        for w in (w1, w3):
            args += [(t.ptr, (t.size,)) for t in w]
        args += [(b1.ptr, (sh.N,)) if hb1 else (s, (sh.N,)), (b3.ptr, (sh.N,)) if hb3 else (s, (sh.N,)),
                 (s, (m * sh.N,))]
        mt = bucket(m)
        if mt is None:
            self.generic.launch(self.tiles * -(-m // WARPS), BLOCK, ctx.stream, *args, m, sh.K, sh.N,
                                sh.group_size, hb1, hb3)
            return
        grid, rows, splits = self.plans[m]
        part = self.scratch.partials(ctx, partial_floats(splits, 2, m, sh.N))
        self.fast[mt].launch(grid, BLOCK, ctx.stream, *args, part, self.scratch.counters(ctx.stream), m, sh.K, sh.N,
                             sh.group_size, rows, splits, hb1, hb3)


KERNEL = FusedFFNAWQCudaKernel

"""FusedFFNNF4, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 stored as MatMulNF4's weights
(bitsandbytes NF4/FP4 blocks of W^T [N, K]; onnx_lowbit.nf4). One launch; the fp16/fp32 weights are never
written; SiLU * mul in the epilogue.

Decode kernel (M <= 16, K % 16 == 0, K <= 16384): thread t of a block owns word t (elements 16t .. 16t+15) of
every row of W1^T and W3^T and keeps those 16 x values of its MT rows (MT = 1 or 2; larger M runs as row chunks
in neighbouring blocks, which share the weight reads through L2) in registers, loaded once. A block covers all
of K (32 * ceil(K/512) threads) and owns a contiguous slice of columns (grid = SMs x resident blocks, so every SM
streams about the same bytes); it walks the slice COLS columns at a time: each thread loads word t of the 2*COLS
rows (a warp reads 256 contiguous bytes of each row) and the words' absmax, the next step's words being
prefetched while the current ones are decoded. Decoding: a byte-pair table in shared memory (256 uint64 entries,
the exact fp32 code values of the byte's high then low nibble; 16 copies so that each half-warp's 8-byte loads
hit 16 distinct bank pairs): one load and two FMAs per byte. The 2*COLS*MT partial sums are reduced across the
warp with a reduce-scatter (2*COLS*MT - 1 shuffles + the rest of the butterfly, instead of 5 per value), across
the block's warps through shared memory (double-buffered: one barrier per step), and COLS*MT threads apply the
biases and SiLU * mul in fp32 and store S in X's type. The kernel is generated as straight-line code (every
per-thread value has a constant name or index: no local-memory spills). Option pair=False: the 16-entry fp32
code table (one lookup per nibble).
Measured (H100, LLaMA-7B gate+up, M=1): 37.1 us against 51.0 us for two MatMulNF4 + silu*mul; ncu: latency
bound (0.6 instructions issued per cycle and scheduler, 35% of DRAM bandwidth). See docs/ffn4.md.
Generic kernel (any K, any M): one warp per column, element by element, both weights; correct, not tuned.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from . import nf4_common
from .dequantawq_cuda import SIM, as_f32, device
from .ffn4_common import check_x_biases, opt
from .fusedffnnf4_cpu import check_weights
from .kernels import Kernel
from .matmulawq_cuda import _ld16, _ld32, _st16, _st32
from .matmulnf4_cuda import _warp_sum

COLS = 4                  # columns per block step
MT_BUCKETS = (1, 2)       # rows per block (x kept in registers: 16 * MT floats per thread)
MAX_M_FAST = 16
MAX_WPR = 1024            # words per row the decode kernel takes (K <= 16384)
NWMAX = 32                # warps per block, at most
TAB_PAIR = 256 * 16       # byte-pair table, 16 copies (uint64 entries)
GEN_WARPS = 8
FULL = np.uint32(0xFFFFFFFF)
M32 = np.uint64(0xFFFFFFFF)
U32 = np.uint64(32)
DEFAULT_BLOCKS_PER_SM = 4

if SIM:
    def _silu(g):
        with np.errstate(over="ignore", invalid="ignore"):
            g = np.float32(g)
            return g / (np.float32(1.0) + np.exp(-g))
else:
    @device
    def _silu(g):
        return g / (float32(1.0) + math.exp(-g))


def red_index(lane, nv):
    """The partial-sum index lane ``lane`` holds after the reduce-scatter of ``nv`` values (host mirror)."""
    idx, s = 0, 0
    while (nv >> (s + 1)) >= 1:
        idx += ((lane >> (4 - s)) & 1) * (nv >> (s + 1))
        s += 1
    return idx


def _make_rs(nv):
    """Warp reduce-scatter of v[0..nv) (nv a power of two <= 32): returns, in every lane, the warp-wide sum of
    v[red_index(lane)]. GPU: straight-line shuffles (generated, so every index is a constant and v stays in
    registers); simulator (no shuffles): through shared memory."""
    steps = nv.bit_length() - 1
    if SIM:
        @cuda.jit(device=True)
        def rs(v, lane, simred, tid):
            for i in range(nv):
                simred[tid * nv + i] = v[i]
            cuda.syncthreads()
            idx = 0
            for s in range(steps):
                idx += ((lane >> (4 - s)) & 1) * (nv >> (s + 1))
            tot = float32(0.0)
            for j in range(32):
                tot += simred[(tid - lane + j) * nv + idx]
            cuda.syncthreads()
            return tot
        return rs
    lines = ["def rs(v, lane, simred, tid):"]
    h, off = nv // 2, 16
    while h >= 1:
        lines.append(f"    up = ((lane >> {off.bit_length() - 1}) & 1) != 0")
        for i in range(h):
            lines.append(f"    snd = v[{i}] if up else v[{i + h}]")
            lines.append(f"    kp = v[{i + h}] if up else v[{i}]")
            lines.append(f"    v[{i}] = kp + cuda.shfl_xor_sync(FULL, snd, {off})")
        h //= 2
        off //= 2
    while off >= 1:
        lines.append(f"    v[0] += cuda.shfl_xor_sync(FULL, v[0], {off})")
        off //= 2
    lines.append("    return v[0]")
    ns = {"cuda": cuda, "FULL": FULL}
    exec("\n".join(lines), ns)  # noqa: S102 - generated straight-line code, no outside input
    return cuda.jit(device=True, inline=True)(ns["rs"])


def _make_decode(mt, a16, pair=True, cols=COLS, prefetch=True):
    """The decode kernel for row bucket ``mt`` and ``cols`` columns per step, generated as straight-line code so
    that every per-thread value (16*mt x values, 2*cols words and scales in flight and prefetched, 2*cols*mt
    partial sums) has a constant name or index and stays in registers. ``pair``: byte-pair table (uint64
    entries: fp32 code[b >> 4] in the low half, code[b & 15] in the high half; 16 copies so that each half-warp
    reads 16 distinct bank pairs); else the 16-entry fp32 code table (one lookup per nibble)."""
    nv = 2 * cols * mt                  # partial sums per thread: [weight][column][row]
    steps = nv.bit_length() - 1
    low = 5 - steps                     # lane bits reduced by the final butterfly
    src = []
    a = src.append
    a("def decode(x, q1, am1, q3, am3, lut, b1, b3, s, m_dim, k_dim, n_dim, bs_shift, parts, has_b1, has_b3):")
    a(f"    tab = cuda.shared.array({TAB_PAIR if pair else 16}, {'uint64' if pair else 'uint32'})")
    a(f"    red = cuda.shared.array({2 * NWMAX * nv}, float32)")
    a(f"    simred = cuda.shared.array({1024 * nv if SIM else 1}, float32)")
    a(f"    pv = cuda.local.array({nv}, float32)")
    a("    tid = cuda.threadIdx.x")
    a("    nthreads = cuda.blockDim.x")
    a("    lane = tid & 31")
    a("    lane16 = uint32(tid & 15)")
    a("    warp = tid >> 5")
    a("    nwarps = nthreads >> 5")
    a("    i = tid")
    a(f"    while i < {TAB_PAIR if pair else 16}:")
    a("        tab[i] = lut[i >> 4]" if pair else "        tab[i] = lut[i]")
    a("        i += nthreads")
    a("    wpr = k_dim >> 4")
    a("    owns = tid < wpr")
    a(f"    nch = (m_dim + {mt - 1}) // {mt}")
    a("    bid = cuda.blockIdx.x")
    a(f"    m0 = (bid % nch) * {mt}")
    a("    part = bid // nch")
    a("    n_lo = part * n_dim // parts")
    a("    n_hi = (part + 1) * n_dim // parts")
    for m in range(mt):
        a(f"    okx = owns and m0 + {m} < m_dim")
        a(f"    xb = (m0 + {m}) * k_dim + tid * 16")
        for e in range(16):
            a(f"    x_{m}_{e} = load(x, xb + {e}) if okx else F0")
    a("    my_idx = 0")
    for st in range(steps):
        a(f"    my_idx += ((lane >> {4 - st}) & 1) * {nv >> (st + 1)}")
    a(f"    writer = (lane & {(1 << low) - 1}) == 0")

    def loads(prefix, base):
        for c in range(cols):
            a(f"    ok = owns and {base} + {c} < n_hi")
            a(f"    wi = ({base} + {c}) * wpr + tid")
            a(f"    {prefix}w1_{c} = q1[wi] if ok else U0")
            a(f"    {prefix}w3_{c} = q3[wi] if ok else U0")
            a(f"    {prefix}s1_{c} = am1[wi >> bs_shift] if ok else F0")
            a(f"    {prefix}s3_{c} = am3[wi >> bs_shift] if ok else F0")
    a("    n0 = n_lo")
    if prefetch:
        loads("", "n0")
    a("    cuda.syncthreads()")
    a("    buf = 0")
    a("    while n0 < n_hi:")
    ind = "    "
    body = []
    b_ = body.append
    b_("nn = n0 + %d" % cols)
    # prefetch the next step (predicated off past the slice), or load this one
    pre, base = ("n", "nn") if prefetch else ("", "n0")
    for c in range(cols):
        b_(f"ok = owns and {base} + {c} < n_hi")
        b_(f"wi = ({base} + {c}) * wpr + tid")
        b_(f"{pre}w1_{c} = q1[wi] if ok else U0")
        b_(f"{pre}w3_{c} = q3[wi] if ok else U0")
        b_(f"{pre}s1_{c} = am1[wi >> bs_shift] if ok else F0")
        b_(f"{pre}s3_{c} = am3[wi >> bs_shift] if ok else F0")
    for c in range(cols):
        for wsel in (1, 3):
            for m in range(mt):
                b_(f"acc_{m} = F0")
            for half in range(2):
                b_(f"wd = uint32(w{wsel}_{c} & M32)" if half == 0 else f"wd = uint32(w{wsel}_{c} >> U32)")
                for b in range(4):
                    b_(f"by = (wd >> uint32({8 * b})) & uint32(0xFF)")
                    if pair:
                        b_("ent = tab[(by << uint32(4)) | lane16]")
                        b_("c0 = as_f32(ent & M32)")
                        b_("c1 = as_f32(ent >> U32)")
                    else:
                        b_("c0 = as_f32(tab[by >> uint32(4)])")
                        b_("c1 = as_f32(tab[by & uint32(15)])")
                    e0 = half * 8 + 2 * b
                    for m in range(mt):
                        b_(f"acc_{m} += c0 * x_{m}_{e0}")
                        b_(f"acc_{m} += c1 * x_{m}_{e0 + 1}")
            for m in range(mt):
                idx = ((0 if wsel == 1 else 1) * cols + c) * mt + m
                b_(f"pv[{idx}] = acc_{m} * s{wsel}_{c}")
    b_("tot = rs(pv, lane, simred, tid)")
    b_("if writer:")
    b_(f"    red[(buf * {NWMAX} + warp) * {nv} + my_idx] = tot")
    b_("cuda.syncthreads()")
    b_(f"if tid < {cols * mt}:")
    b_(f"    c = tid // {mt}")
    b_(f"    m = tid - c * {mt}")
    b_("    n = n0 + c")
    b_("    if n < n_hi and m0 + m < m_dim:")
    b_("        g = F0")
    b_("        u = F0")
    b_("        for wj in range(nwarps):")
    b_(f"            g += red[(buf * {NWMAX} + wj) * {nv} + c * {mt} + m]")
    b_(f"            u += red[(buf * {NWMAX} + wj) * {nv} + ({cols} + c) * {mt} + m]")
    b_("        if has_b1:")
    b_("            g += load(b1, n)")
    b_("        if has_b3:")
    b_("            u += load(b3, n)")
    b_("        store(s, (m0 + m) * n_dim + n, silu(g) * u)")
    b_("buf ^= 1")
    for c in range(cols if prefetch else 0):
        for v in ("w1", "w3", "s1", "s3"):
            b_(f"{v}_{c} = n{v}_{c}")
    b_("n0 = nn")
    src.extend(ind + "    " + line for line in body)
    ns = {"cuda": cuda, "float32": float32, "uint32": uint32, "uint64": uint64, "as_f32": as_f32,
          "load": _ld16 if a16 else _ld32, "store": _st16 if a16 else _st32, "silu": _silu, "rs": _make_rs(nv),
          "F0": np.float32(0.0), "U0": np.uint64(0), "M32": M32, "U32": U32}
    exec("\n".join(src), ns)  # noqa: S102 - generated from constants only
    return cuda.jit(ns["decode"])


def _make_generic(a16, warps=GEN_WARPS):
    load = _ld16 if a16 else _ld32
    store = _st16 if a16 else _st32

    @cuda.jit
    def generic(x, q1, am1, q3, am3, code, b1, b3, s, m_dim, k_dim, n_dim, bs, has_b1, has_b3):
        """Any K, any M: warp = column n, lanes stride over K element by element (q1/q3 uint8)."""
        sm_code = cuda.shared.array(16, float32)
        red = cuda.shared.array(1024, float32)
        tid = cuda.threadIdx.x
        if tid < 16:
            sm_code[tid] = code[tid]
        cuda.syncthreads()
        lane = tid & 31
        n = cuda.blockIdx.x * warps + (tid >> 5)
        active = n < n_dim
        kk = k_dim if active else 0
        base = n * k_dim
        for m in range(m_dim):
            g = float32(0.0)
            u = float32(0.0)
            k = lane
            while k < kk:
                i = base + k
                sh = 4 if (i & 1) == 0 else 0
                xv = load(x, m * k_dim + k)
                j = i >> 1
                blk = i // bs
                g += sm_code[(int64(q1[j]) >> sh) & 15] * am1[blk] * xv
                u += sm_code[(int64(q3[j]) >> sh) & 15] * am3[blk] * xv
                k += 32
            g = _warp_sum(g, red, tid)
            u = _warp_sum(u, red, tid)
            if lane == 0 and active:
                if has_b1:
                    g += load(b1, n)
                if has_b3:
                    u += load(b3, n)
                store(s, m * n_dim + n, _silu(g) * u)

    return generic


# ------------------------------------------------------------------------------------------------- host side
def lut_for(code, pair=True):
    """The decode kernel's table: pair -> uint64 [256], entry b = fp32 bits of code[b >> 4] (low half, the first
    element of the byte) | code[b & 15] << 32; else the 16 fp32 code values' bits (uint32)."""
    code = np.ascontiguousarray(code, np.float32).view(np.uint32).astype(np.uint64)
    if not pair:
        return code.astype(np.uint32)
    b = np.arange(256)
    return (code[b >> 4] | (code[b & 15] << np.uint64(32))).astype(np.uint64)


def decode_ok(m, k):
    return 0 < m <= MAX_M_FAST and k % 16 == 0 and k // 16 <= MAX_WPR


def bucket(m):
    return 1 if m == 1 else 2


def threads(k):
    return 32 * -(-(k // 16) // 32)


def parts_for(n, nch, sms, occupancy, cols=COLS):
    """Column slices: about sms * occupancy blocks in all (one wave), never fewer than one step per slice."""
    return max(1, min(-(-n // cols), (sms * occupancy) // nch))


def _sig(a16, generic, pair=True):
    from .cuda_launch import Array
    t = Array(np.uint16) if a16 else Array(np.float32)
    q = Array(np.uint8) if generic else Array(np.uint64)
    tab = Array(np.float32) if generic else Array(np.uint64 if pair else np.uint32)
    return [t, q, Array(np.float32), q, Array(np.float32), tab, t, t, t] + ["int64"] * (6 if generic else 7)


_launchers = {}


def launcher(a16, mt, pair=True, cols=COLS, prefetch=True):
    """Direct-launch wrapper (compiled once per process): the decode kernel of bucket ``mt``, or the generic
    kernel for mt=None. ``.dispatcher`` is the Numba kernel (register / local memory queries)."""
    from .cuda_launch import Launcher
    key = (a16, mt, pair if mt else None, cols if mt else None, prefetch if mt else None)
    if key not in _launchers:
        fn = _make_generic(a16) if mt is None else _make_decode(mt, a16, pair, cols, prefetch)
        lau = Launcher(fn, _sig(a16, mt is None, pair))
        lau.dispatcher = fn
        _launchers[key] = lau
    return _launchers[key]


def blocks_per_sm(launcher_, block):
    import ctypes

    from .cuda_launch import check, libcuda
    fn = libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    v = ctypes.c_int(0)
    check(fn(ctypes.byref(v), launcher_.handle, block, 0), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return max(1, v.value)


def run_arrays(x, q1, am1, q3, am3, quant_type, block_size, K, N, b1=None, b3=None, *,  # noqa: N803
               force_generic=False, pair=True, cols=COLS, sms=None, repeat=1):
    """Runs the kernel on host arrays (tests, benchmark) and returns S: through the Numba dispatcher under the
    CUDA simulator, through the direct launch path on a GPU. Inputs are checked as in a session."""
    qt, bs, k, n, code = nf4_common.parse_attrs({"quant_type": quant_type, "block_size": block_size, "K": K, "N": N})
    check_weights(q1, am1, q3, am3, k, n, bs)
    m = check_x_biases(x, b1, b3, k, n, 5, 6)
    lead = tuple(x.shape[:-1])
    if m == 0:
        return np.empty(lead + (n,), x.dtype)
    a16 = x.dtype == np.float16
    bits = np.uint16 if a16 else np.float32
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    dx = dev(x, bits)
    ds = cuda.device_array(m * n, bits)
    db1 = dev(b1, bits) if b1 is not None else ds
    db3 = dev(b3, bits) if b3 is not None else ds
    dam1 = dev(np.asarray(am1, np.float32), np.float32)
    dam3 = dev(np.asarray(am3, np.float32), np.float32)
    generic = force_generic or not decode_ok(m, k)
    gw = 2 if SIM else GEN_WARPS       # fewer simulated threads
    if generic:
        args = (dx, dev(q1, np.uint8), dam1, dev(q3, np.uint8), dam3, cuda.to_device(code), db1, db3, ds,
                m, k, n, bs, int(b1 is not None), int(b3 is not None))
        grid, block, mt = -(-n // gw), 32 * gw, None
    else:
        mt = bucket(m)
        nch = -(-m // mt)
        block = threads(k)
        if SIM:
            occ = DEFAULT_BLOCKS_PER_SM
        else:
            occ = blocks_per_sm(launcher(a16, mt, pair, cols), block)
        if sms is None:
            if SIM:
                sms = 2
            else:
                from .cuda_launch import current_device, sm_count
                sms = sm_count(current_device())
        parts = parts_for(n, nch, sms, occ, cols)
        grid = nch * parts
        args = (dx, dev(q1, np.uint64), dam1, dev(q3, np.uint64), dam3, cuda.to_device(lut_for(code, pair)), db1, db3,
                ds, m, k, n, bs.bit_length() - 5, parts, int(b1 is not None), int(b3 is not None))
    if SIM:
        kern = _make_generic(a16, gw) if generic else _make_decode(mt, a16, pair, cols)
        for _ in range(repeat):
            kern[grid, block](*args)
    else:
        p = lambda a: (a.device_ctypes_pointer.value, (a.size,)) if hasattr(a, "device_ctypes_pointer") else a  # noqa: E731
        lau = launcher(a16, mt, pair, cols)
        for _ in range(repeat):
            lau.launch(grid, block, 0, *[p(a) for a in args])
        cuda.synchronize()
    return ds.copy_to_host().view(x.dtype).reshape(lead + (n,))


class FusedFFNNF4CudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes and pointer alignment (see plans.py)

    def __init__(self, **kw):
        super().__init__(**kw)
        from .cuda_launch import current_device, sm_count
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.a16 = self.in_types[0] == 10
        self.lut = cuda.to_device(lut_for(code))
        self.code = cuda.to_device(code)
        self.lut_arg = (self.lut.device_ctypes_pointer.value, (self.lut.size,))
        self.code_arg = (self.code.device_ctypes_pointer.value, (16,))
        self.generic = launcher(self.a16, None)
        self.sms = sm_count(current_device())
        self.fast, self.parts = {}, {}
        if self.k % 16 == 0 and self.k // 16 <= MAX_WPR:
            self.block = threads(self.k)
            for mt in MT_BUCKETS:   # compiled and planned now, never on the hot path
                self.fast[mt] = launcher(self.a16, mt)
                occ = blocks_per_sm(self.fast[mt], self.block)
                for m in range(1, MAX_M_FAST + 1):
                    if bucket(m) == mt:
                        self.parts[m] = parts_for(self.n, -(-m // mt), self.sms, occ)

    def compute(self, ctx, inputs):
        from .bridge import KernelError
        x, q1, am1, q3, am3, b1, b3 = (opt(inputs, i) for i in range(7))
        check_weights(q1, am1, q3, am3, self.k, self.n, self.bs)
        m = check_x_biases(x, b1, b3, self.k, self.n, 5, 6)
        k, n = self.k, self.n
        s = ctx.output(0, tuple(x.shape[:-1]) + (n,))
        if m == 0:
            return
        if (x.ptr | s | (b1.ptr if b1 is not None else 0) | (b3.ptr if b3 is not None else 0)) & \
                (1 if self.a16 else 3) or am1.ptr & 3 or am3.ptr & 3:
            raise KernelError("inputs and the output must be aligned device buffers")
        hb1, hb3 = int(b1 is not None), int(b3 is not None)
        common = [(x.ptr, (m * k,))]
        tail = [(b1.ptr, (n,)) if hb1 else (s, (n,)), (b3.ptr, (n,)) if hb3 else (s, (n,)), (s, (m * n,))]
        fast = m in self.parts and not ((q1.ptr | q3.ptr) & 7)
        if fast:
            mt = bucket(m)
            parts = self.parts[m]
            self.fast[mt].launch(-(-m // mt) * parts, self.block, ctx.stream, *common,
                                 (q1.ptr, (q1.size // 8,)), (am1.ptr, (am1.size,)), (q3.ptr, (q3.size // 8,)),
                                 (am3.ptr, (am3.size,)), self.lut_arg, *tail, m, k, n, self.bs.bit_length() - 5,
                                 parts, hb1, hb3)
        else:
            self.generic.launch(-(-n // GEN_WARPS), 32 * GEN_WARPS, ctx.stream, *common, (q1.ptr, (q1.size,)),
                                (am1.ptr, (am1.size,)), (q3.ptr, (q3.size,)), (am3.ptr, (am3.size,)), self.code_arg,
                                *tail, m, k, n, self.bs, hb1, hb3)


KERNEL = FusedFFNNF4CudaKernel

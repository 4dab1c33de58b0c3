"""FusedFFNNF4, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 stored as MatMulNF4's weights
(bitsandbytes NF4/FP4 blocks of W^T [N, K]; onnx_lowbit.nf4). One launch; the fp16/fp32 weights are never
written; SiLU * mul in the epilogue.

Decode kernel (M <= 16, K % 16 == 0, K <= 16384): thread t of a block owns word t (elements 16t .. 16t+15) of
every row of W1^T and W3^T and keeps those 16 x values of its MT rows (MT = 1 or 2; larger M runs as row chunks
in neighbouring blocks, which share the weight reads through L2) in registers, loaded once. A block covers all
of K (32 * ceil(K/512) threads) and owns a contiguous slice of columns (grid = SMs x resident blocks, so every SM
streams about the same bytes); it walks the slice COLS columns at a time: each thread loads word t of the 2*COLS
rows (a warp reads 256 contiguous bytes of each row; all 2*COLS 8-byte loads are issued before any is used) and
the two words' absmax, decodes in registers and accumulates the 2*COLS*MT partial sums. Partials are reduced
across the warp with a reduce-scatter (2*COLS*MT - 1 shuffles + the rest of the butterfly, instead of 5 per value),
across the block's warps through shared memory (double-buffered: one barrier per step), and COLS*MT threads
apply the biases and SiLU * mul in fp32 and store S in X's type.
  Decoding: fp16 X uses a byte-pair table (256 entries, each the two code values of a byte as fp16x2),
replicated 32 times in shared memory so that lane l always reads bank l (one conflict-free 4-byte load per
byte); the code values are then rounded to fp16 (relative error <= 2^-11 per weight, inside fp16's output
rounding; products and sums stay fp32). fp32 X uses the exact fp32 16-entry code table (one load per nibble).
Generic kernel (any K, any M): one warp per column, element by element, both weights; correct, not tuned.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from . import nf4_common
from .dequantawq_cuda import SIM, as_f32, device, h2f
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
TAB_H2 = 256 * 32         # replicated byte-pair table (uint32 entries)
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


def _make_decode(mt, a16, h2, cols=COLS):
    nv = 2 * cols * mt                  # partial sums per thread: [weight][column][row]
    steps = nv.bit_length() - 1
    low = 5 - steps                     # lane bits reduced by the final butterfly
    rs = _make_rs(nv)
    load = _ld16 if a16 else _ld32
    store = _st16 if a16 else _st32
    tab_size = TAB_H2 if h2 else 16
    red_size = 2 * NWMAX * nv
    sim_size = 1024 * nv if SIM else 1
    xr_size = 16 * mt

    @cuda.jit
    def decode(x, q1, am1, q3, am3, lut, b1, b3, s, m_dim, k_dim, n_dim, bs_shift, parts, has_b1, has_b3):
        """x [M*K] (fp32, or fp16 bits), q1/q3 uint64 [N*K/16], am1/am3 float32, lut uint32 (h2: 256 byte-pair
        entries; else the 16 fp32 code bits), b1/b3 [N] (X's type), s [M*N]. Block b: row chunk b % chunks,
        column slice b // chunks of ``parts``."""
        tab = cuda.shared.array(tab_size, uint32)
        red = cuda.shared.array(red_size, float32)
        simred = cuda.shared.array(sim_size, float32)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        lane = tid & 31
        warp = tid >> 5
        nwarps = nthreads >> 5
        i = tid
        while i < tab_size:
            tab[i] = lut[i >> 5] if h2 else lut[i]
            i += nthreads
        k64 = k_dim
        wpr = k64 >> 4
        owns = tid < wpr
        nch = (m_dim + mt - 1) // mt
        bid = cuda.blockIdx.x
        m0 = (bid % nch) * mt
        part = bid // nch
        n_lo = part * n_dim // parts
        n_hi = (part + 1) * n_dim // parts
        xr = cuda.local.array(xr_size, float32)
        for m in range(mt):
            for e in range(16):
                v = float32(0.0)
                if owns and m0 + m < m_dim:
                    v = load(x, (m0 + m) * k64 + tid * 16 + e)
                xr[m * 16 + e] = v
        my_idx = 0
        for st in range(steps):
            my_idx += ((lane >> (4 - st)) & 1) * (nv >> (st + 1))
        writer = (lane & ((1 << low) - 1)) == 0
        cuda.syncthreads()
        pv = cuda.local.array(nv, float32)
        wv1 = cuda.local.array(cols, uint64)
        wv3 = cuda.local.array(cols, uint64)
        acc = cuda.local.array(mt, float32)
        sv1 = cuda.local.array(cols, float32)
        sv3 = cuda.local.array(cols, float32)
        buf = 0
        n0 = n_lo
        while n0 < n_hi:                          # block-uniform: every thread reaches every barrier
            for c in range(cols):                 # all 2*cols loads first
                ok = owns and n0 + c < n_hi
                wi = (n0 + c) * wpr + tid
                wv1[c] = q1[wi] if ok else np.uint64(0)
                wv3[c] = q3[wi] if ok else np.uint64(0)
                sv1[c] = am1[wi >> bs_shift] if ok else float32(0.0)
                sv3[c] = am3[wi >> bs_shift] if ok else float32(0.0)
            for c in range(cols):
                for wsel in range(2):
                    w = wv1[c] if wsel == 0 else wv3[c]
                    sc = sv1[c] if wsel == 0 else sv3[c]
                    for m in range(mt):
                        acc[m] = float32(0.0)
                    for half in range(2):
                        word = uint32((w >> U32) if half == 1 else (w & M32))
                        for b in range(4):
                            byte = (word >> uint32(8 * b)) & uint32(0xFF)
                            if h2:
                                ent = tab[(byte << uint32(5)) | uint32(lane)]
                                c0 = h2f(ent & uint32(0xFFFF))
                                c1 = h2f(ent >> uint32(16))
                            else:
                                c0 = as_f32(tab[byte >> uint32(4)])
                                c1 = as_f32(tab[byte & uint32(15)])
                            e0 = half * 8 + 2 * b
                            for m in range(mt):
                                acc[m] += c0 * xr[m * 16 + e0]
                                acc[m] += c1 * xr[m * 16 + e0 + 1]
                    for m in range(mt):
                        pv[(wsel * cols + c) * mt + m] = acc[m] * sc
            tot = rs(pv, lane, simred, tid)
            if writer:
                red[(buf * NWMAX + warp) * nv + my_idx] = tot
            cuda.syncthreads()
            if tid < cols * mt:
                c = tid // mt
                m = tid - c * mt
                n = n0 + c
                if n < n_hi and m0 + m < m_dim:
                    g = float32(0.0)
                    u = float32(0.0)
                    for wi_ in range(nwarps):
                        g += red[(buf * NWMAX + wi_) * nv + c * mt + m]
                        u += red[(buf * NWMAX + wi_) * nv + (cols + c) * mt + m]
                    if has_b1:
                        g += load(b1, n)
                    if has_b3:
                        u += load(b3, n)
                    store(s, (m0 + m) * n_dim + n, _silu(g) * u)
            buf ^= 1
            n0 += cols

    return decode


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
def lut_for(code, h2):
    """uint32 table: h2 -> 256 byte-pair entries (fp16 code[b >> 4] in the low half, code[b & 15] in the high);
    else the 16 fp32 code values' bits."""
    code = np.asarray(code, np.float32)
    if not h2:
        return code.view(np.uint32).copy()
    h = code.astype(np.float16).view(np.uint16).astype(np.uint32)
    b = np.arange(256)
    return (h[b >> 4] | (h[b & 15] << np.uint32(16))).astype(np.uint32)


def decode_ok(m, k):
    return 0 < m <= MAX_M_FAST and k % 16 == 0 and k // 16 <= MAX_WPR


def bucket(m):
    return 1 if m == 1 else 2


def threads(k):
    return 32 * -(-(k // 16) // 32)


def parts_for(n, nch, sms, occupancy, cols=COLS):
    """Column slices: about sms * occupancy blocks in all (one wave), never fewer than one step per slice."""
    return max(1, min(-(-n // cols), (sms * occupancy) // nch))


def _sig(a16, generic):
    from .cuda_launch import Array
    t = Array(np.uint16) if a16 else Array(np.float32)
    q = Array(np.uint8) if generic else Array(np.uint64)
    tab = Array(np.float32) if generic else Array(np.uint32)
    return [t, q, Array(np.float32), q, Array(np.float32), tab, t, t, t] + ["int64"] * (6 if generic else 7)


_launchers = {}


def launcher(a16, mt, h2=None, cols=COLS):
    """Direct-launch wrapper (compiled once per process): the decode kernel of bucket ``mt`` (h2 defaults to
    a16), or the generic kernel for mt=None."""
    from .cuda_launch import Launcher
    h2 = a16 if h2 is None else h2
    key = (a16, mt, h2 if mt else None, cols if mt else None)
    if key not in _launchers:
        fn = _make_generic(a16) if mt is None else _make_decode(mt, a16, h2, cols)
        _launchers[key] = Launcher(fn, _sig(a16, mt is None))
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
               force_generic=False, h2=None, cols=COLS, sms=None, repeat=1):
    """Runs the kernel on host arrays (tests, benchmark) and returns S: through the Numba dispatcher under the
    CUDA simulator, through the direct launch path on a GPU. Inputs are checked as in a session."""
    qt, bs, k, n, code = nf4_common.parse_attrs({"quant_type": quant_type, "block_size": block_size, "K": K, "N": N})
    check_weights(q1, am1, q3, am3, k, n, bs)
    m = check_x_biases(x, b1, b3, k, n, 5, 6)
    lead = tuple(x.shape[:-1])
    if m == 0:
        return np.empty(lead + (n,), x.dtype)
    a16 = x.dtype == np.float16
    h2 = a16 if h2 is None else h2
    bits = np.uint16 if a16 else np.float32
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    dx = dev(x, bits)
    ds = cuda.device_array(m * n, bits)
    db1 = dev(b1, bits) if b1 is not None else ds
    db3 = dev(b3, bits) if b3 is not None else ds
    dam1 = dev(np.asarray(am1, np.float32), np.float32)
    dam3 = dev(np.asarray(am3, np.float32), np.float32)
    generic = force_generic or not decode_ok(m, k)
    if generic:
        args = (dx, dev(q1, np.uint8), dam1, dev(q3, np.uint8), dam3, cuda.to_device(code), db1, db3, ds,
                m, k, n, bs, int(b1 is not None), int(b3 is not None))
        grid, block, mt = -(-n // GEN_WARPS), 32 * GEN_WARPS, None
    else:
        mt = bucket(m)
        nch = -(-m // mt)
        block = threads(k)
        if SIM:
            occ = DEFAULT_BLOCKS_PER_SM
        else:
            occ = blocks_per_sm(launcher(a16, mt, h2, cols), block)
        if sms is None:
            if SIM:
                sms = 2
            else:
                from .cuda_launch import current_device, sm_count
                sms = sm_count(current_device())
        parts = parts_for(n, nch, sms, occ, cols)
        grid = nch * parts
        args = (dx, dev(q1, np.uint64), dam1, dev(q3, np.uint64), dam3, cuda.to_device(lut_for(code, h2)), db1, db3,
                ds, m, k, n, bs.bit_length() - 5, parts, int(b1 is not None), int(b3 is not None))
    if SIM:
        kern = _make_generic(a16) if generic else _make_decode(mt, a16, h2, cols)
        for _ in range(repeat):
            kern[grid, block](*args)
    else:
        p = lambda a: (a.device_ctypes_pointer.value, (a.size,)) if hasattr(a, "device_ctypes_pointer") else a  # noqa: E731
        lau = launcher(a16, mt, h2, cols)
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
        self.lut = cuda.to_device(lut_for(code, self.a16))
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

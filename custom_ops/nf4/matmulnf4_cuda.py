"""MatMulNF4, CUDA face.

Decode kernel (K % 16 == 0, M <= 16): one warp per output column n walks that column's packed row of W^T in
8-byte words (16 nibbles, always inside one absmax block since block sizes are multiples of 16), four words in
flight per lane, decodes nibbles through the 16-entry code table in shared memory, multiplies with x (read
through L1; x is tiny and shared by all warps), scales each word's partial sum by its block's absmax, and
reduces across the warp with shuffles. The fp16/fp32 weight is never written.
M=1 kernel (K % 16 == 0, K <= 16384): the decode generator of decode_cuda (shared with FusedFFNNF4) in its one-weight mode (thread t owns
word t of every row with its 16 x values in registers, a block streams a contiguous slice of columns M1_COLS at
a time with the next step's words in flight, 32-bit index math, warp reduce-scatter and one barrier per step).
Decoding below K = 4096 through the 16-entry code table in static shared memory, which is faster there than the
64 KiB byte-pair table (the pair table's shared memory caps a 128-thread block at 3 per SM); from K = 4096 on
through the pair table, built while the first words load (3-5% faster there; BENCHMARKS.md,
benchmarks/nf4shapes_gpu.py). With fp16 A from K = 4096 (M1_H2_MIN_K) the packed-fp16 decode instead (one
fma.rn.f16x2 per byte in chains of 2, as FusedFFNNF4's; ``M1_H2``): 14.45 against 15.22 us at 4096 x 11008, 7.94
against 8.75 at 8192 x 2048 (H100); ONNX_LOWBIT_FP32_DECODE=1 keeps fp32 arithmetic. From K = 4096 with K % 32 == 0
(M1_WIDE_MIN_K) chains of 4 with 16 bytes per thread and row (``wide``): 13.05-13.26 against 13.96-14.02 us at
4096 x 11008, 4-13% at every shape measured (H100, 2026-11-27).
Column slices are sized so that every block walks the same number of steps.
Generic kernel (any K, any M): same warp-per-column scheme, element by element; correct, not tuned (prefill).
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda, float32, uint32, uint64

from ..device import half2, launch as cuda_launch
from ..device.launch import Array, Launcher
from ..device.ptx import warp_sum
from ..device.target import tc_device
from ..runtime.kernels import Kernel
from . import common as nf4_common, nf4tc_cuda
from .decode_cuda import make_decode

WARPS_PER_BLOCK = 8
MAX_M_FAST = 16
RED_SIZE = 1024
M1_COLS = 4                 # columns per step of the M=1 kernel, with the next step's 4 words prefetched
M1_PREFETCH = True
M1_PAIR_MIN_K = 4096        # the byte-pair table from this K on, else the 16-entry table. H100, x[1, K] fp16,
                            # weights cycled past L2 (nf4shapes_gpu.py), us, 16-entry / pair (built early) / the
                            # old default (pair, 8 columns, no prefetch): 2048x2048 4.73 / 5.35 / 5.61, 2048x4096
                            # 5.94 / 6.93 / 7.10, 8192x2048 8.76 / 8.75 / 9.87, 4096x11008 15.96 / 15.22 / 18.94
M1_PAIR = False             # _make_m1's default
M1_MAX_REGISTERS = 80       # ptxas limit of the M=1 kernel (no spills)
M1_H2 = 2                   # fp16 A, K >= M1_H2_MIN_K: the M=1 kernel's packed-fp16 decode, chains of this many
M1_H2_MIN_K = 4096          # bytes (0: fp32 arithmetic; see fusedffnnf4_cuda.H2). H100, weights past L2 (nf4shapes_gpu
                            # .py), us, h2 / 16-entry table: 4096x11008 14.45 / 15.79 (the pair table, used there
                            # before: 15.22), 8192x2048 7.94 / 8.53 (pair 8.75); below K = 4096 its 64 KiB table
                            # halves the resident blocks: 2048x2048 4.97 / 4.68, 2048x4096 6.28 / 5.88
M1_WIDE_MIN_K = 4096        # fp16 A, K % 32 == 0 from this K: chains of M1_H2_WIDE bytes with two words (16 bytes,
M1_H2_WIDE = 4              # one load) per thread and row (``wide``, as FusedFFNNF4's; 0: off). H100, weights past L2
                            # (nf4shapes_gpu.py, BENCHMARKS.md session 27), us, wide / chains of 2: 4096x11008 13.05-
                            # 13.26 / 13.96-14.02, 8192x2048 7.30 / 7.68-7.77, 4096x4096 7.55 / 7.85-8.01, 4096x14336
                            # 16.12 / 17.31-17.69, 14336x4096 15.90 / 18.02-18.08, 5120x13824 17.78-17.90 / 20.06-20.21
M2_DECODE = True            # fp16 A at M = 2 .. M2_MAX_M where m1_wide: the decode generator's two-row kernel (mt = 2,
M2_MAX_M = 4                # wide, chains of M1_H2_WIDE, row chunks of 2; ``m2``) instead of nf4tc. H100, weights past
                            # L2, us, two-row / tensor-core (nf4shapes_gpu.py --mm-m M, BENCHMARKS.md session 28):
                            # M=2 4096x11008 15.44 / 18.8 (session 27's figure), 8192x2048 9.01 / 11.84, 4096x14336
                            # 18.68 / 27.43, 5120x13824 22.67 / 32.86; M=3 21.82 / 21.78, 11.14 / 12.13, 27.62 /
                            # 28.05; M=4 21.87 / 22.55, 11.13 / 12.14, 27.63 / 28.45 (from M=3 two row chunks read
                            # the weight twice)
TC_MIN_M = 2                # fp16 A from this M on: the tensor-core kernel (nf4tc_cuda); H100 4096 x 11008
                            # (BENCHMARKS.md): M=1 23.3 us against 14.7 for the M=1 kernel (kept), M=2 23.7 /
                            # 50.1, M=4 25.0 / 82.1, M=16 46.1 / 1676.6 (generic)
TAB_BYTES = 255 * 256 + 16 * 8  # byte-pair table (dynamic shared memory): byte v, copy l at v * 256 + l * 8
U0, U1, U4, U15, U16, U32 = (np.uint64(v) for v in (0, 1, 4, 15, 16, 32))
FULL = np.uint32(0xFFFFFFFF)


@cuda.jit(device=True, inline=True)
def _word_dot(w, sm_code, xs, xb, wpr):
    """sum_e code[nib_e(w)] * x[16 w + e] for the 16 nibbles of a little-endian word (even element = high nibble),
    x read from the transposed shared copy: x[16 w + e] = xs[xb + e * wpr]."""
    lo = uint32(w & np.uint64(0xFFFFFFFF))
    hi = uint32(w >> np.uint64(32))
    acc = float32(0.0)
    for t in range(4):
        b = (lo >> uint32(8 * t)) & uint32(0xFF)
        acc += sm_code[b >> uint32(4)] * xs[xb + uint64(2 * t) * wpr]
        acc += sm_code[b & uint32(15)] * xs[xb + uint64(2 * t + 1) * wpr]
    for t in range(4):
        b = (hi >> uint32(8 * t)) & uint32(0xFF)
        acc += sm_code[b >> uint32(4)] * xs[xb + uint64(2 * t + 8) * wpr]
        acc += sm_code[b & uint32(15)] * xs[xb + uint64(2 * t + 9) * wpr]
    return acc


def _make_fast():
    @cuda.jit
    def gemv16(a, q64, absmax, code, bias, has_bias, y, m_dim, k_dim, n_dim, bs_shift):
        """a [M*K] (f32/f16), q64 [N*K/16] words, absmax [N*K/bs], y [M*N]; bs_shift = log2(block_size) - 4.

        x is staged once per block in shared memory, transposed to xs[m*K + e*wpr + w] (w: word in the row,
        e: element in the word) so that the 32 lanes, which read 32 consecutive words, hit 32 banks. Blocks are
        persistent (grid-stride over columns) so x is staged only a few times per SM."""
        sm_code = cuda.shared.array(16, dtype=float32)
        red = cuda.shared.array(RED_SIZE, dtype=float32)
        xs = cuda.shared.array(0, dtype=float32)
        tid = cuda.threadIdx.x
        if tid < 16:
            sm_code[tid] = code[tid]
        k64 = uint64(k_dim)
        wpr = k64 >> U4                      # words per row
        total = uint64(m_dim) * k64
        idx = uint64(tid)
        while idx < total:
            m = idx // k64
            k = idx - m * k64
            xs[m * k64 + (k & U15) * wpr + (k >> U4)] = float32(a[idx])
            idx += uint64(cuda.blockDim.x)
        cuda.syncthreads()
        lane = uint64(tid & 31)
        warp = uint64(tid >> 5)
        acc = cuda.local.array(MAX_M_FAST, dtype=float32)
        nb = uint64(cuda.blockIdx.x) * uint64(WARPS_PER_BLOCK)
        nstep = uint64(cuda.gridDim.x) * uint64(WARPS_PER_BLOCK)
        while nb < uint64(n_dim):            # block-uniform trip count: every warp reaches every reduction
            n = nb + warp
            active = n < uint64(n_dim)
            wlim = wpr if active else U0
            row = n * wpr
            for m in range(m_dim):
                acc[m] = float32(0.0)
            j = lane
            while j + uint64(96) < wlim:     # 4 words per lane in flight
                w0 = q64[row + j]
                w1 = q64[row + j + uint64(32)]
                w2 = q64[row + j + uint64(64)]
                w3 = q64[row + j + uint64(96)]
                s0 = absmax[(row + j) >> uint64(bs_shift)]
                s1 = absmax[(row + j + uint64(32)) >> uint64(bs_shift)]
                s2 = absmax[(row + j + uint64(64)) >> uint64(bs_shift)]
                s3 = absmax[(row + j + uint64(96)) >> uint64(bs_shift)]
                for m in range(m_dim):
                    xb = uint64(m) * k64 + j
                    acc[m] += (_word_dot(w0, sm_code, xs, xb, wpr) * s0
                               + _word_dot(w1, sm_code, xs, xb + uint64(32), wpr) * s1
                               + _word_dot(w2, sm_code, xs, xb + uint64(64), wpr) * s2
                               + _word_dot(w3, sm_code, xs, xb + uint64(96), wpr) * s3)
                j += uint64(128)
            while j < wlim:
                w0 = q64[row + j]
                s0 = absmax[(row + j) >> uint64(bs_shift)]
                for m in range(m_dim):
                    acc[m] += _word_dot(w0, sm_code, xs, uint64(m) * k64 + j, wpr) * s0
                j += uint64(32)
            for m in range(m_dim):
                v = warp_sum(acc[m], red, tid)
                if lane == U0 and active:
                    if has_bias:
                        v += float32(bias[n])
                    y[uint64(m) * uint64(n_dim) + n] = v
            nb += nstep

    return gemv16


def _make_m1(COLS=None, prefetch=M1_PREFETCH, max_registers=None, pair=M1_PAIR, early=False, nib=False,  # noqa: N803
             h2=0, wide=False, groups=1):
    """M = 1, K % 16 == 0, K / 16 <= 1024: the decode kernel generator of decode_cuda (FusedFFNNF4's too) in its one-weight mode
    (thread t owns word t of every row with its 16 x values in registers; a block walks a contiguous slice of
    columns, M1_COLS per step (prefetch=True: the next step's words in flight too); byte-pair table in dynamic
    shared memory addressed by one PRMT per byte; 32-bit index math; warp reduce-scatter + one barrier per
    step). Signature (a, q64, absmax, code, bias, has_bias, y, k_dim, n_dim, bs_shift); column slices = grid
    size; dynamic shared memory TAB_BYTES (a Launcher of it needs dynamic_shared=TAB_BYTES; none with pair=False:
    the 16-entry table). ``early``: the table is built while the first step's words load (with prefetch).
    ``h2`` (fp16 A only; 2 or 4): the packed-fp16 decode with chains of h2 bytes (decode_cuda.make_decode; its
    64 KiB table like the pair table's), ``wide``: with it, 16 bytes per thread and row. ``groups``: blocks of that
    many thread groups sharing one table (column slices = grid size x groups; decode_cuda.make_decode)."""
    return make_decode(1, False, pair, COLS or M1_COLS, prefetch, max_registers or M1_MAX_REGISTERS, matmul=True,
                        early=early, nib=nib, h2=h2, wide=wide, groups=groups)


def _make_generic():
    @cuda.jit
    def generic(a, q8, absmax, code, bias, has_bias, y, m_dim, k_dim, n_dim, bs):
        sm_code = cuda.shared.array(16, dtype=float32)
        red = cuda.shared.array(RED_SIZE, dtype=float32)
        tid = cuda.threadIdx.x
        if tid < 16:
            sm_code[tid] = code[tid]
        cuda.syncthreads()
        lane = uint64(tid & 31)
        n = uint64(cuda.blockIdx.x) * uint64(WARPS_PER_BLOCK) + uint64(tid >> 5)
        active = n < uint64(n_dim)
        k64 = uint64(k_dim) if active else U0
        base = n * k64
        for m in range(m_dim):
            acc = float32(0.0)
            k = lane
            while k < k64:
                i = base + k
                byte = uint64(q8[i >> U1])
                nib = (byte >> U4) if (i & U1) == U0 else (byte & U15)
                acc += sm_code[nib] * float32(absmax[i // uint64(bs)]) * float32(a[uint64(m) * k64 + k])
                k += uint64(32)
            v = warp_sum(acc, red, tid)
            if lane == U0 and active:
                if has_bias:
                    v += float32(bias[n])
                y[uint64(m) * uint64(n_dim) + n] = v

    return generic


GEMV16 = _make_fast()
_M1 = {}


def m1_pair(k):
    return k >= M1_PAIR_MIN_K


def gemv_m1(pair=False, h2=0, wide=False):
    """The default M=1 kernel with the 16-entry or (pair) the byte-pair table, or (h2, fp16 A) the packed-fp16
    decode, with 16 bytes per thread and row (``wide``) or 8 (built on first use: decode_cuda.make_decode)."""
    key = (pair and not h2, h2, bool(h2 and wide))
    if key not in _M1:
        _M1[key] = _make_m1(pair=key[0], early=key[0], h2=h2, wide=key[2])
    return _M1[key]


def m1_wide(dtype, k):
    """Whether the M=1 kernel reads 16 bytes per thread and row with chains of M1_H2_WIDE (fp16 A, K % 32 == 0, K >=
    M1_WIDE_MIN_K; not with ONNX_LOWBIT_FP32_DECODE=1)."""
    return bool(M1_H2_WIDE) and np.dtype(dtype) == np.float16 and k >= M1_WIDE_MIN_K and k % 32 == 0 \
        and not half2.fp32_decode()


def m1_h2(dtype, k):
    """The M=1 kernel's fp16 chain length for A of ``dtype`` and K = ``k``: M1_H2_WIDE where m1_wide, else M1_H2 for
    fp16 from K = M1_H2_MIN_K (0 with ONNX_LOWBIT_FP32_DECODE=1), else 0 (fp32 arithmetic)."""
    if m1_wide(dtype, k):
        return M1_H2_WIDE
    return M1_H2 if np.dtype(dtype) == np.float16 and k >= M1_H2_MIN_K and not half2.fp32_decode() else 0
GENERIC = _make_generic()


MAX_X_SHARED = 160 * 1024   # bytes of transposed x a block may stage (M * K * 4)
BLOCKS_PER_SM = 4


def m1_path(m, k):
    return m == 1 and k % 16 == 0 and k // 16 <= 1024


def m2_path(m, k, dtype):
    """Whether M2_DECODE routes this product to the two-row decode kernel (``m2``)."""
    return M2_DECODE and 2 <= m <= M2_MAX_M and m1_wide(dtype, k) and k // 16 <= 1024


def gemv_m2():
    """The two-row decode kernel (wide, chains of M1_H2_WIDE; ptxas's register count; built on first use)."""
    if "m2" not in _M1:
        _M1["m2"] = make_decode(2, False, False, M1_COLS, True, None, matmul=True, h2=M1_H2_WIDE, wide=True)
    return _M1["m2"]


def m2_grid(m, n, sms, occupancy):
    """Row chunks of 2 times one wave of column slices (every slice the same number of steps)."""
    nch = -(-m // 2)
    return nch * nf4_common.even_parts(math.ceil(n / M1_COLS), max(1, sms * occupancy // nch))


def m1_block(k, wide=False):
    """Threads of an M=1 block: one per 8-byte word of a row (wide: per 16 bytes), whole warps."""
    return max(32, 32 * -(-(k // (32 if wide else 16)) // 32))


def m1_grid(n, sms=132, k=4096, cols=M1_COLS, pair=None, wide=False):
    """One wave of column slices, every slice the same number of steps (nf4_common.even_parts): blocks per SM
    bounded by threads, registers (M1_MAX_REGISTERS per thread) and, for the pair table, its 64 KiB of shared
    memory (3 per SM)."""
    block = m1_block(k, wide)
    pair = m1_pair(k) if pair is None else pair
    per_sm = max(1, min(3 if pair else 32, 2048 // block, 65536 // (block * M1_MAX_REGISTERS)))
    return nf4_common.even_parts(math.ceil(n / cols), sms * per_sm)


def fast_path(m, k):
    return m <= MAX_M_FAST and k % 16 == 0 and m * k * 4 <= MAX_X_SHARED


def grid(n):
    return math.ceil(n / WARPS_PER_BLOCK)


def fast_grid(n, sms=132):
    return max(1, min(grid(n), sms * BLOCKS_PER_SM))


def plan(m, k, n, bs, sms, h2=0, wide=False):
    """(mode, grid, block, shared bytes) for an M x K x N product (``h2``: the M=1 kernel's packed-fp16 decode,
    ``wide``: with 16 bytes per thread and row)."""
    if m1_path(m, k):
        big = m1_pair(k) or bool(h2)    # 64 KiB of table
        wide = bool(h2 and wide)
        return "m1", m1_grid(n, sms, k, pair=big, wide=wide), m1_block(k, wide), TAB_BYTES if big else 0
    if fast_path(m, k):
        return "fast", fast_grid(n, sms), 32 * WARPS_PER_BLOCK, m * k * 4
    return "generic", grid(n), 32 * WARPS_PER_BLOCK, 0


def _args(mode, a, q, absmax, code, bias, has_bias, y, m, k, n, bs, nq):
    """Launch arguments; arrays as (pointer, shape) pairs."""
    if mode == "m1":
        return [a, (q[0], (nq,)), absmax, code, bias, has_bias, y, k, n, bs.bit_length() - 5]
    if mode in ("fast", "m2"):
        return [a, (q[0], (nq,)), absmax, code, bias, has_bias, y, m, k, n, bs.bit_length() - 5]
    return [a, q, absmax, code, bias, has_bias, y, m, k, n, bs]


def run_arrays(a, q, absmax, code, k, n, bs, bias=None, mode=None, m1_opts=None):
    """Runs the CUDA kernel on host arrays (tests): dispatcher under the simulator, Launcher on a GPU.
    ``m1_opts``: keyword arguments of _make_m1 for a variant of the M=1 kernel."""
    lead = a.shape[:-1]
    a2 = np.ascontiguousarray(a).reshape(-1)
    m = a2.size // k
    y = np.zeros(m * n, a.dtype)
    if m == 0:
        return y.reshape(*lead, n)
    b = np.ascontiguousarray(bias if bias is not None else np.zeros(1, a.dtype), dtype=a.dtype)
    sim = bool(config.ENABLE_CUDASIM)
    sms = 2 if sim else _sms()
    h2, wide = m1_h2(a.dtype, k), m1_wide(a.dtype, k)
    pmode, g, block, shmem = plan(m, k, n, bs, sms, h2, wide)
    mode = mode or ("m2" if m2_path(m, k, a.dtype) else pmode)
    if mode == "m2":
        occ = 3 if sim else max(1, _launcher("m2", a.dtype).blocks_per_sm(m1_block(k, True)))
        g, block, shmem = m2_grid(m, n, sms, occ), m1_block(k, True), TAB_BYTES
    elif mode != pmode:
        g, block, shmem = {"fast": (fast_grid(n, sms), 32 * WARPS_PER_BLOCK, m * k * 4),
                           "generic": (grid(n), 32 * WARPS_PER_BLOCK, 0)}[mode]
    if m1_opts and mode == "m1":    # the variant's own grid and table
        pair = m1_opts.get("pair", M1_PAIR) or bool(m1_opts.get("h2"))
        g = m1_grid(n, sms, k, m1_opts.get("COLS") or M1_COLS, pair, m1_opts.get("wide", False))
        shmem = TAB_BYTES if pair else 0
        block = m1_block(k, m1_opts.get("wide", False))
    words = mode in ("m1", "fast", "m2")
    dev = [cuda.to_device(a2), cuda.to_device(q.reshape(-1).view(np.uint64) if words else q.reshape(-1)),
           cuda.to_device(absmax.reshape(-1).astype(np.float32)), cuda.to_device(half2.code_with_scale(code)),
           cuda.to_device(b),
           cuda.to_device(y)]
    if sim:
        da, dq, dam, dc, db, dy = dev
        tail = {"m1": [k, n, bs.bit_length() - 5], "fast": [m, k, n, bs.bit_length() - 5],
                "m2": [m, k, n, bs.bit_length() - 5], "generic": [m, k, n, bs]}[mode]
        kern = ((_make_m1(**m1_opts) if m1_opts else gemv_m1(m1_pair(k), h2, wide)) if mode == "m1" else
                gemv_m2() if mode == "m2" else {"fast": GEMV16, "generic": GENERIC}[mode])
        kern[g, block, 0, shmem](da, dq, dam, dc, db, int(bias is not None), dy, *tail)
    else:
        pa = [(d.device_ctypes_pointer.value, d.shape) for d in dev]
        args = _args(mode, pa[0], pa[1], pa[2], pa[3], pa[4], int(bias is not None), pa[5], m, k, n, bs,
                     k * n // 16)
        lau = _launcher(mode, a.dtype, m1_pair(k), h2, wide)
        if m1_opts and mode == "m1":
            lau = Launcher(_make_m1(**m1_opts), lau._sig, dynamic_shared=shmem)
        lau.launch(g, block, 0, *args, shmem=shmem)
        cuda.synchronize()
    return dev[5].copy_to_host().reshape(*lead, n)


def int4_m1_ok(k, n, bs):
    """Shapes the experimental int4 (MatMulNBits layout) M=1 kernel takes: K % 16 == 0, K <= 16384, block size a
    power of two >= 16 with K % (2 * bs) == 0 (whole blocks per row, whole zero-point bytes per row)."""
    return (k % 16 == 0 and k // 16 <= 1024 and bs >= 16 and bs & (bs - 1) == 0 and k % (2 * bs) == 0
            and n >= 1)


_int4 = {}


def run_int4_m1(a, b, scales, zero_points, k, n, bs, bias=None, cols=None, launch_only=False):
    """The M=1 decode generator in its experimental int4 mode (``decode_cuda.make_decode(..., int4=True)``) on int4 weights
    in onnxruntime's MatMulNBits layout (B uint8 [N, K/bs, bs/2], scales [N * K/bs] in A's dtype, zero_points uint8
    [N * K/bs / 2] or None for 8): Y[1, N] = A[1, K] . W. For tests and benchmarks only (no op runs it). Host
    arrays in, Y out; ``launch_only``: a callable that launches on device arrays already made (benchmark)."""
    if not int4_m1_ok(k, n, bs):
        raise ValueError(f"int4 M=1 kernel: K={k}, N={n}, block {bs} not supported")
    sim = bool(config.ENABLE_CUDASIM)
    cols = cols or M1_COLS
    sms = 2 if sim else _sms()
    g = m1_grid(n, sms, k, cols, False)
    block = m1_block(k)
    dt = np.dtype(a.dtype)
    key = (dt.str, cols)
    if key not in _int4:
        fn = make_decode(1, False, False, cols, True, M1_MAX_REGISTERS, matmul=True, int4=True)
        lau = None
        if not sim:
            lau = Launcher(fn, [Array(dt), Array(np.uint64), Array(dt), Array(np.uint8), Array(np.float32),
                                Array(dt), "int32", Array(dt), "int64", "int64", "int64", "int32"])
        _int4[key] = (fn, lau)
    fn, lau = _int4[key]
    code = cuda.to_device(np.arange(16, dtype=np.float32))
    has_zp = int(zero_points is not None)
    zp = np.ascontiguousarray(zero_points if has_zp else np.zeros(1, np.uint8), np.uint8).reshape(-1)
    bb = np.ascontiguousarray(bias if bias is not None else np.zeros(1, dt), dtype=dt)
    dev = [cuda.to_device(np.ascontiguousarray(a, dt).reshape(-1)),
           cuda.to_device(np.ascontiguousarray(b, np.uint8).reshape(-1).view(np.uint64)),
           cuda.to_device(np.ascontiguousarray(scales, dt).reshape(-1)), cuda.to_device(zp), code,
           cuda.to_device(bb), cuda.device_array(n, dt)]
    tail = (k, n, bs.bit_length() - 5, has_zp)

    def launch(stream=0):
        if sim:
            fn[g, block](dev[0], dev[1], dev[2], dev[3], dev[4], dev[5], int(bias is not None), dev[6], *tail)
        else:
            pa = [(d.device_ctypes_pointer.value, d.shape) for d in dev]
            lau.launch(g, block, stream, *pa[:6], int(bias is not None), pa[6], *tail)
    if launch_only:
        return launch, dev
    launch()
    cuda.synchronize()
    return dev[6].copy_to_host().reshape(1, n)


_launchers = {}


def _launcher(mode, dtype, pair=False, h2=0, wide=False):
    """The direct-launch wrapper of a mode's kernel (``pair``: the M=1 kernel's byte-pair table variant, ``h2``:
    its packed-fp16 decode, ``wide``: with 16 bytes per thread and row)."""
    key = (mode, np.dtype(dtype).str) + ((pair and not h2, h2, bool(h2 and wide)) if mode == "m1" else ())
    if key not in _launchers:
        if mode == "m1":
            sig = [Array(dtype), Array(np.uint64), Array(np.float32), Array(np.float32), Array(dtype), "int32",
                   Array(dtype), "int64", "int64", "int64"]
            _launchers[key] = Launcher(gemv_m1(pair, h2, wide), sig, dynamic_shared=TAB_BYTES if pair or h2 else 0)
        elif mode == "m2":
            sig = [Array(dtype), Array(np.uint64), Array(np.float32), Array(np.float32), Array(dtype), "int32",
                   Array(dtype), "int64", "int64", "int64", "int64"]
            _launchers[key] = Launcher(gemv_m2(), sig, dynamic_shared=TAB_BYTES)
        else:
            qdt = np.uint64 if mode == "fast" else np.uint8
            sig = [Array(dtype), Array(qdt), Array(np.float32), Array(np.float32), Array(dtype), "int32",
                   Array(dtype), "int64", "int64", "int64", "int64"]
            _launchers[key] = Launcher(GEMV16 if mode == "fast" else GENERIC, sig,
                                       dynamic_shared=MAX_X_SHARED if mode == "fast" else 0)
    return _launchers[key]


def _sms():
    return cuda_launch.sm_count(cuda_launch.current_device())


class MatMulNF4CudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.dtype = np.float32 if self.in_types[0] == 1 else np.float16
        self.code = cuda.to_device(half2.code_with_scale(code))  # once, at session creation (the h2 kernel reads
        # entries 16, 17: half2.h2_scale and its inverse)
        self.code_ptr = self.code.device_ctypes_pointer.value
        self.h2, self.wide = m1_h2(self.dtype, self.k), m1_wide(self.dtype, self.k)
        self.launchers = {mode: _launcher(mode, self.dtype, m1_pair(self.k), self.h2, self.wide)
                          for mode in ("m1", "fast", "generic")}
        self.sms = _sms()
        self.m2 = None      # M = 2 .. M2_MAX_M: the two-row decode kernel (M2_DECODE; launcher, block, grid per M)
        if m2_path(2, self.k, self.dtype):
            lau = _launcher("m2", self.dtype)
            blk = m1_block(self.k, True)
            occ = max(1, lau.blocks_per_sm(blk))
            self.m2 = lau, blk, {m: m2_grid(m, self.n, self.sms, occ) for m in range(2, M2_MAX_M + 1)}
        self.tc = None      # the tensor-core decode kernel (fp16 A, M = TC_MIN_M .. 16; nf4tc_cuda)
        if self.dtype == np.float16 and nf4tc_cuda.ok(True, TC_MIN_M, self.k, self.n, self.bs) and tc_device():
            self.tc = nf4tc_cuda.SessionKernels(1, self.n, self.sms, self.k, self.bs)
            self.tc_half = nf4tc_cuda.half_sizes(self.n, self.k, self.bs)    # (rows, words, absmax) of a half
            self.tc_lut = cuda.to_device(nf4tc_cuda.lut(code))

    def compute(self, ctx, inputs):
        a, q, absmax = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs)
        m = nf4_common.check_a(a, self.k, bias, self.n)
        y = ctx.output(0, a.shape[:-1] + (self.n,))
        if m == 0:
            return
        bptr = bias.ptr if bias is not None else y  # never read without has_bias
        if self.m2 is not None and m in self.m2[2] and not ((a.ptr | q.ptr) & 15 or absmax.ptr & 3):
            lau, blk, grids = self.m2
            lau.launch(grids[m], blk, ctx.stream, *_args("m2", (a.ptr, (m * self.k,)), (q.ptr, ()),
                                                          (absmax.ptr, (absmax.size,)), (self.code_ptr, (18,)),
                                                          (bptr, (self.n,)), int(bias is not None),
                                                          (y, (m * self.n,)), m, self.k, self.n, self.bs,
                                                          self.k * self.n // 16), shmem=TAB_BYTES)
            return
        if self.tc is not None and TC_MIN_M <= m <= 16 and not ((a.ptr | q.ptr) & 7 or absmax.ptr & 3):
            lau, grid_, block, parts, halves = self.tc.pick(m)
            hb = int(bias is not None)
            if halves:      # the weight's two halves of rows as the kernel's W1 / W3 (N / 2 rows each)
                n, w, am_ = self.tc_half
            else:
                n, w, am_ = self.n, q.size // 8, absmax.size
            w1 = ((q.ptr, (w,)), (absmax.ptr, (am_,)))
            w3 = ((q.ptr + 8 * w, (w,)), (absmax.ptr + 4 * am_, (am_,))) if halves else w1
            b3 = (bptr + 2 * n, (n,)) if halves and hb else (bptr, (n,))
            lau.launch(grid_, block, ctx.stream, (a.ptr, (m * self.k // 4,)), *w1, *w3,
                       (self.tc_lut.device_ctypes_pointer.value, (256,)), (bptr, (n,)), b3, (y, (m * self.n,)), m,
                       self.k, n, self.bs.bit_length() - 1, parts, hb, hb if halves else 0)
            return
        mode, g, block, shmem = plan(m, self.k, self.n, self.bs, self.sms, self.h2, self.wide)
        if mode != "generic" and (q.ptr & (15 if mode == "m1" and self.wide else 7) or mode == "m1" and a.ptr & 15):
            # 8-byte words (wide: 16-byte loads of them), 16-byte loads of A: aligned buffers (onnxruntime's always are)
            mode, g, block, shmem = "generic", grid(self.n), 32 * WARPS_PER_BLOCK, 0
        args = _args(mode, (a.ptr, (m * self.k,)), (q.ptr, (q.size,)), (absmax.ptr, (absmax.size,)),
                     (self.code_ptr, (18,)), (bptr, (self.n,)), int(bias is not None), (y, (m * self.n,)), m,
                     self.k, self.n, self.bs, self.k * self.n // 16)
        self.launchers[mode].launch(g, block, ctx.stream, *args, shmem=shmem)


KERNEL = MatMulNF4CudaKernel

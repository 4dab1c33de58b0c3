"""MatMulNF4, CUDA face: Y = A W^T + bias with W^T stored as bitsandbytes NF4/FP4 blocks (onnx_lowbit.nf4).

``ROUTES`` (below) says which kernel serves a call; ``MatMulNF4CudaKernel`` builds the call's Case and launches the
row's kernel. The kernels:

* ``m1.*`` (M = 1, K % 16 == 0, K <= 16384): the decode generator of decode_cuda (shared with FusedFFNNF4) in its
  one-weight mode (thread t owns word t of every row with its 16 x values in registers, a block streams a
  contiguous slice of columns COLS at a time with the next step's words in flight, 32-bit index math, warp
  reduce-scatter and one barrier per step; column slices sized so that every block walks the same number of
  steps). Decoding below K = 4096 through the 16-entry code table in static shared memory (``m1.table16``), faster
  there than the 64 KiB byte-pair table (whose shared memory caps a 128-thread block at 3 per SM); from K = 4096
  through the pair table, built while the first words load (``m1.pair``, 3-5% faster there). With fp16 A from
  K = 4096 the packed-fp16 decode instead (``m1.h2``: one fma.rn.f16x2 per byte in chains of 2, as FusedFFNNF4's):
  14.45 against 15.22 us at 4096 x 11008, 7.94 against 8.75 at 8192 x 2048 (H100); ONNX_LOWBIT_FP32_DECODE=1 keeps
  fp32 arithmetic. From K = 4096 with K % 32 == 0 chains of 4 with 16 bytes per thread and row (``m1.h2wide``):
  13.05-13.26 against 13.96-14.02 us at 4096 x 11008, 4-13% at every shape measured (H100, 2026-11-27). For
  quant_type int4 (onnxruntime-genai's MatMulNBits grid, what ``onnx-lowbit genai`` converts) with fp16 A the
  packed-fp16 decode without a table (``m1.u4wide``, chains of 4, 16 bytes per thread and row; ``m1.u4`` where K %
  32 != 0): the levels come from the nibbles by bit operations (half2.u4_src), so no block builds or reads a table:
  7-10% faster than the tables' routes at genai's decode shapes (H200, the U4 figures below).
* ``m2`` (fp16 A, M = 2..4 where m1.h2wide serves M = 1): the generator's two-row kernel (rows in chunks of 2).
* ``nf4tc.*`` (fp16 A, M = 2..16 on GPUs with mma.sync): nf4tc_cuda's tensor-core decode, from M = 8 through its
  two-weight kernel on the weight's two halves of rows (``halves``), from M = 9 with both row chunks in one block.
* ``prefill`` (fp16 A, M >= 17, cuBLAS and scratch): W^T dequantised to fp16 scratch, one cuBLAS GEMM
  (nf4/prefill_cuda).
* ``fast`` / ``generic``: gemv_cuda's warp-per-column kernels (M <= 16 with x in shared memory; anything else).

The attribute accuracy_level is checked and otherwise ignored: every level computes with float activations here (at
least the accuracy asked for; level 4's int8 activations are the CPU face's, onnx_lowbit.nf4_int8).
"""
from __future__ import annotations

import math

import numpy as np

from ..device import cublas, half2
from ..device.launch import Array
from ..runtime.kernels import Kernel
from ..runtime.routing import Case, Route, always, route
from ..device import host
from . import common as nf4_common, nf4tc_cuda, prefill_cuda
from .common import case_align, case_f16, case_fp32_decode
from .decode_cuda import COLS, TAB_BYTES, make_decode, threads
from .gemv_cuda import GEMV16, GENERIC, MAX_M_FAST, WARPS_PER_BLOCK

M1_PAIR_MIN_K = 4096        # the byte-pair table from this K on, else the 16-entry table. H100, x[1, K] fp16,
                            # weights cycled past L2 (nf4shapes_gpu.py), us, 16-entry / pair (built early) / the
                            # old default (pair, 8 columns, no prefetch): 2048x2048 4.73 / 5.35 / 5.61, 2048x4096
                            # 5.94 / 6.93 / 7.10, 8192x2048 8.76 / 8.75 / 9.87, 4096x11008 15.96 / 15.22 / 18.94
M1_MAX_REGISTERS = 80       # ptxas limit of the M=1 kernels (no spills)
M1_H2 = 2                   # fp16 A, K >= M1_H2_MIN_K: the M=1 kernel's packed-fp16 decode, chains of this many
M1_H2_MIN_K = 4096          # bytes (see fusedffnnf4_cuda). H100, weights past L2 (nf4shapes_gpu
                            # .py), us, h2 / 16-entry table: 4096x11008 14.45 / 15.79 (the pair table, used there
                            # before: 15.22), 8192x2048 7.94 / 8.53 (pair 8.75); below K = 4096 its 64 KiB table
                            # halves the resident blocks: 2048x2048 4.97 / 4.68, 2048x4096 6.28 / 5.88
M1_WIDE_MIN_K = 4096        # fp16 A, K % 32 == 0 from this K: chains of M1_H2_WIDE bytes with two words (16 bytes,
M1_H2_WIDE = 4              # one load) per thread and row (``wide``, as FusedFFNNF4's). H100, weights past L2
                            # (nf4shapes_gpu.py, BENCHMARKS.md session 27), us, wide / chains of 2: 4096x11008 13.05-
                            # 13.26 / 13.96-14.02, 8192x2048 7.30 / 7.68-7.77, 4096x4096 7.55 / 7.85-8.01, 4096x14336
                            # 16.12 / 17.31-17.69, 14336x4096 15.90 / 18.02-18.08, 5120x13824 17.78-17.90 / 20.06-20.21
M2_MAX_M = 4                # fp16 A at M = 2 .. M2_MAX_M where m1.h2wide serves M = 1: the decode generator's two-row
                            # kernel (mt = 2, wide, chains of M1_H2_WIDE, row chunks of 2; ``m2``) instead of nf4tc.
                            # H100, weights past L2, us, two-row / tensor-core (nf4shapes_gpu.py --mm-m M, BENCHMARKS.md
                            # session 28): M=2 4096x11008 15.44 / 18.8 (session 27's figure), 8192x2048 9.01 / 11.84,
                            # 4096x14336 18.68 / 27.43, 5120x13824 22.67 / 32.86; M=3 21.82 / 21.78, 11.14 / 12.13,
                            # 27.62 / 28.05; M=4 21.87 / 22.55, 11.13 / 12.14, 27.63 / 28.45 (from M=3 two row chunks
                            # read the weight twice)
U4 = True                   # quant_type "int4" (genai's MatMulNBits grid) with fp16 A at M = 1: the table-free decode
                            # (decode_cuda's u4: half2.u4_src), m1.u4wide where K % 32 == 0, else m1.u4. H200,
                            # weights past L2 (nf4shapes_gpu.py --quant int4 --bs 32, 2026-12-01), us, u4wide / the
                            # tables' route: 2048x6144 5.86 / 6.50, 2048x2048 3.67 / 3.96, 8192x2048 6.57 / 7.21,
                            # 2048x4096 4.93 / 5.26 (two rounds each, within 0.04 us)
U4_WIDE_MIN_K = 32          # m1.u4wide from this K (K % 32 == 0), m1.u4 (chains of 2, 8 bytes per thread) below
TC_MIN_M = 2                # fp16 A from this M on: the tensor-core kernel (nf4tc_cuda); H100 4096 x 11008
                            # (BENCHMARKS.md): M=1 23.3 us against 14.7 for the M=1 kernel (kept), M=2 23.7 /
                            # 50.1, M=4 25.0 / 82.1, M=16 46.1 / 1676.6 (generic)
MAX_X_SHARED = 160 * 1024   # bytes of transposed x a ``fast`` block may stage (M * K * 4)
BLOCKS_PER_SM = 4           # ``fast``: persistent blocks per SM


# ------------------------------------------------------------------------------------------------- routing
def _m1(c):
    return c.m == 1 and c.k % 16 == 0 and c.k // 16 <= 1024


def _wide(c):
    """The wide packed-fp16 decode's shapes (m1.h2wide; m2's)."""
    return case_f16(c) and c.k >= M1_WIDE_MIN_K and c.k % 32 == 0 and c.k // 16 <= 1024 and not case_fp32_decode(c)


def _u4(c):
    """The table-free int4 decode takes the call (quant_type int4, fp16 A, not ONNX_LOWBIT_FP32_DECODE; M = 1)."""
    return U4 and c.opt("int4") and case_f16(c) and not case_fp32_decode(c) and _m1(c)


def _m1_table(c):
    """The M = 1 kernel's decode for this call's A and K: 'h2wide', 'h2' (packed fp16), 'pair' or 'table16'."""
    if _wide(c):
        return "h2wide"
    if case_f16(c) and c.k >= M1_H2_MIN_K and not case_fp32_decode(c):
        return "h2"
    return "pair" if c.k >= M1_PAIR_MIN_K else "table16"


def _tc(c, lo, hi):
    """nf4tc takes the call at M = lo .. hi (fp16 A, tensor cores, its shapes, A and Q 8-byte aligned)."""
    return (case_f16(c) and c.tc and lo <= c.m <= hi and nf4tc_cuda.ok(True, c.m, c.k, c.n, c.bs)
            and case_align(c, "a") >= 8 and case_align(c, "q") >= 8 and case_align(c, "am") >= 4)


def _halves(c):
    return nf4tc_cuda.use_halves(c.n, c.k, c.bs)


ROUTES = (
    Route("generic", "forced (tests): opts path = 'generic'", lambda c: c.opt("path") == "generic"),
    Route("fast", "forced (tests): opts path = 'fast'", lambda c: c.opt("path") == "fast"),
    Route("m2", "fp16 A, M = 2 .. M2_MAX_M (4), K >= M1_WIDE_MIN_K (4096), K % 32 == 0, K <= 16384, not "
          "ONNX_LOWBIT_FP32_DECODE; A, Q 16-byte and absmax 4-byte aligned",
          lambda c: 2 <= c.m <= M2_MAX_M and _wide(c) and case_align(c, "a") >= 16 and case_align(c, "q") >= 16
          and case_align(c, "am") >= 4, "BENCHMARKS.md NF4 (M = 2 rows); lab-log session 28 (0e56466)"),
    Route("nf4tc.halves.rc2", "fp16 A, tensor cores, M = 9 .. 16, K % 64 == 0, block >= 64, N even with whole absmax "
          "blocks per half; A, Q 8-byte, absmax 4-byte aligned",
          lambda c: _tc(c, max(nf4tc_cuda.HALVES_MIN_M, nf4tc_cuda.RC2_MIN_M), 16) and _halves(c),
          "BENCHMARKS.md NF4 ('From M = 8 ... two halves'); lab-log session 26 (a033718)"),
    Route("nf4tc.halves.rc1", "as above at M = 8", lambda c: _tc(c, nf4tc_cuda.HALVES_MIN_M, 16) and _halves(c),
          "lab-log session 26 (a033718)"),
    Route("nf4tc.rc2", "fp16 A, tensor cores, M = 9 .. 16 (odd N), shapes and alignment as above",
          lambda c: _tc(c, nf4tc_cuda.RC2_MIN_M, 16), "lab-log session 25 (8f7e4e7)"),
    Route("nf4tc.rc1", "fp16 A, tensor cores, M = TC_MIN_M (2) .. 8, shapes and alignment as above",
          lambda c: _tc(c, TC_MIN_M, 16), "BENCHMARKS.md NF4 (the TC_MIN_M figures; acda774)"),
    Route("m1.u4wide", "M = 1, quant_type int4, fp16 A, K % 32 == 0, K >= U4_WIDE_MIN_K (32), K <= 16384, not "
          "ONNX_LOWBIT_FP32_DECODE; A, Q 16-byte aligned",
          lambda c: _u4(c) and c.k % 32 == 0 and c.k >= U4_WIDE_MIN_K and case_align(c, "a") >= 16
          and case_align(c, "q") >= 16, "BENCHMARKS.md NF4 (int4 at M = 1)"),
    Route("m1.u4", "M = 1, quant_type int4, fp16 A, K % 16 == 0, K <= 16384 where m1.u4wide does not apply, not "
          "ONNX_LOWBIT_FP32_DECODE; A 16-byte, Q 8-byte aligned",
          lambda c: _u4(c) and case_align(c, "a") >= 16 and case_align(c, "q") >= 8,
          "BENCHMARKS.md NF4 (int4 at M = 1)"),
    Route("m1.h2wide", "M = 1, fp16 A, K >= M1_WIDE_MIN_K (4096), K % 32 == 0, K <= 16384, not "
          "ONNX_LOWBIT_FP32_DECODE; A, Q 16-byte aligned",
          lambda c: _m1(c) and _m1_table(c) == "h2wide" and case_align(c, "a") >= 16 and case_align(c, "q") >= 16,
          "BENCHMARKS.md NF4 (MatMulNF4 M = 1 rows); lab-log session 27 (14188a5)"),
    Route("m1.h2", "M = 1, fp16 A, K >= M1_H2_MIN_K (4096), K % 16 == 0 (not 32), K <= 16384, not "
          "ONNX_LOWBIT_FP32_DECODE; A 16-byte, Q 8-byte aligned",
          lambda c: _m1(c) and _m1_table(c) == "h2" and case_align(c, "a") >= 16 and case_align(c, "q") >= 8,
          "lab-log sessions 19-20 (6b998ae)"),
    Route("m1.pair", "M = 1, K >= M1_PAIR_MIN_K (4096), K % 16 == 0, K <= 16384 (fp32 A, or ONNX_LOWBIT_FP32_DECODE); "
          "A 16-byte, Q 8-byte aligned",
          lambda c: _m1(c) and _m1_table(c) == "pair" and case_align(c, "a") >= 16 and case_align(c, "q") >= 8,
          "the M1_PAIR_MIN_K figures (nf4shapes_gpu.py; 3d1c1ab)"),
    Route("m1.table16", "M = 1, K < 4096, K % 16 == 0; A 16-byte, Q 8-byte aligned",
          lambda c: _m1(c) and _m1_table(c) == "table16" and case_align(c, "a") >= 16 and case_align(c, "q") >= 8,
          "the M1_PAIR_MIN_K figures (nf4shapes_gpu.py; 3d1c1ab)"),
    Route("generic", "M = 1, K % 16 == 0, K <= 16384 with A or Q not aligned as its row above asks", _m1,
          "correctness fallback"),
    Route("fast", "M <= 16, K % 16 == 0, M * K * 4 <= MAX_X_SHARED (160 KiB); Q 8-byte aligned",
          lambda c: c.m <= MAX_M_FAST and c.k % 16 == 0 and c.m * c.k * 4 <= MAX_X_SHARED and case_align(c, "q") >= 8,
          "the kernel before the decode kernels (no measured alternative at these calls)"),
    Route("prefill", prefill_cuda.WHEN, prefill_cuda.takes, "H200, 2026-11-29: BENCHMARKS.md (MatMulNF4 prefill)"),
    Route("generic", "any other call (M > 16 where the prefill row does not apply: fp32 A, no cuBLAS, no scratch)",
          always, "correctness fallback"),
)

# kernel name -> (how it launches, its configuration): m1 (pair table, packed-fp16 chain length, wide, int4 u4)
KERNELS = {"m1.table16": ("m1", (False, 0, False, False)), "m1.pair": ("m1", (True, 0, False, False)),
           "m1.h2": ("m1", (False, M1_H2, False, False)), "m1.h2wide": ("m1", (False, M1_H2_WIDE, True, False)),
           "m1.u4": ("m1", (False, M1_H2, False, True)), "m1.u4wide": ("m1", (False, M1_H2_WIDE, True, True)),
           "m2": ("m2", None), "nf4tc.rc1": ("tc", (1, False)), "nf4tc.rc2": ("tc", (2, False)),
           "nf4tc.halves.rc1": ("tc", (1, True)), "nf4tc.halves.rc2": ("tc", (2, True)),
           "fast": ("fast", None), "generic": ("generic", None), "prefill": ("prefill", None)}


def case(dtype, m, k, n, bs, tc=True, fp32_decode=False, align=(16, 16, 4), path=None, blas=True, scratch=True,
         int4=False):
    """The Case of a call: A's ``dtype``, M, K, N, the block size, whether the GPU has tensor cores, the
    ONNX_LOWBIT_FP32_DECODE switch, the alignments (A, Q, absmax; capped at 16, 16, 4), a forced path (tests), the
    prefill row's switches: cuBLAS found, the call has onnxruntime's scratch memory; ``int4``: quant_type int4."""
    aligned = tuple(align) == (16, 16, 4)
    opts = [("fp32_decode", True)] if fp32_decode else []
    if int4:
        opts.append(("int4", True))
    opts += [("cublas", bool(blas)), ("scratch", bool(scratch))]
    if not aligned:
        opts += [("a_align", align[0]), ("am_align", align[2]), ("q_align", align[1])]
    if path:
        opts.append(("path", path))
    return Case(np.dtype(dtype).name, m, k, n, aligned=aligned, tc=tc, bs=bs, opts=tuple(sorted(opts)))


# ------------------------------------------------------------------------------------------------- launches
def table_bytes(how, cfg):
    """The dynamic shared memory of a KERNELS entry (how, cfg) of kind m1 / m2: the 64 KiB decode table for m2 and
    for m1's byte-pair and packed-fp16 kernels; none for m1.table16 (its 16 entries are static) and the int4 kernels
    (no table)."""
    big = how == "m2" or how == "m1" and (cfg[0] or bool(cfg[1]) and not cfg[3])
    return TAB_BYTES if big else 0


def m1_grid(n, sms, k, pair, wide):
    """One wave of column slices, every slice the same number of steps (nf4_common.even_parts): blocks per SM
    bounded by threads, registers (M1_MAX_REGISTERS per thread) and, for a 64 KiB table (``pair``), its shared
    memory (3 per SM)."""
    block = threads(k, wide)
    per_sm = max(1, min(3 if pair else 32, 2048 // block, 65536 // (block * M1_MAX_REGISTERS)))
    return nf4_common.even_parts(math.ceil(n / COLS), sms * per_sm)


def m2_grid(m, n, sms, occupancy):
    """Row chunks of 2 times one wave of column slices (every slice the same number of steps)."""
    nch = -(-m // 2)
    return nch * nf4_common.even_parts(math.ceil(n / COLS), max(1, sms * occupancy // nch))


def grid(n):
    return math.ceil(n / WARPS_PER_BLOCK)


def fast_grid(n, sms=132):
    return max(1, min(grid(n), sms * BLOCKS_PER_SM))


_launchers = {}


def launcher(name, dtype):
    """The direct-launch wrapper of kernel ``name`` (a KERNELS key; nf4tc.*: nf4tc_cuda's) for A of ``dtype``
    (compiled once per process; under the simulator a SimLauncher answering 3 resident blocks per SM)."""
    how, cfg = KERNELS[name]
    if how == "tc":
        return nf4tc_cuda.launcher(2 if cfg[1] else 1, nf4tc_cuda.warps_for(cfg[0]), cfg[0], cfg[1])
    key = (name, np.dtype(dtype).str)
    if key not in _launchers:
        m_arg = [] if how == "m1" else ["int64"]
        sig = ([Array(dtype), Array(np.uint8 if how == "generic" else np.uint64), Array(np.float32),
                Array(np.float32), Array(dtype), "int32", Array(dtype)] + m_arg + ["int64"] * 3)
        if how == "m1":
            pair, h2, wide, u4 = cfg
            fn = make_decode(1, False, pair, M1_MAX_REGISTERS, matmul=True, early=pair, h2=h2, wide=wide, u4=u4)
        elif how == "m2":
            fn = make_decode(2, False, False, None, matmul=True, h2=M1_H2_WIDE, wide=True)
        else:
            fn = GEMV16 if how == "fast" else GENERIC
        shared = table_bytes(how, cfg) if how in ("m1", "m2") else MAX_X_SHARED if how == "fast" else 0
        _launchers[key] = host.launcher(fn, sig, dynamic_shared=shared, sim_blocks=3, pdl=how in ("m1", "m2"))
    return _launchers[key]


class MatMulNF4CudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes and pointer alignment; see plans.py
    path = None          # tests: a kernel ROUTES' forced rows name ('generic', 'fast')

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.level = nf4_common.parse_level(self.attrs)   # checked; every level computes in float here (a minimum)
        self.dtype = np.dtype(np.float32 if self.in_types[0] == 1 else np.float16)
        self.code = host.Table(half2.code_with_scale(code))  # the h2 kernels read entries 16, 17 (its scale)
        self.tc_lut = host.Table(nf4tc_cuda.lut(code))
        self.sms = host.sm_count()
        self.tc = host.tensor_cores()
        self.fp32_decode = half2.fp32_decode()      # ONNX_LOWBIT_FP32_DECODE, read here only
        self.blas = cublas.load() is not None       # else the generic kernel serves every M > 16
        self.pdl = 1 in self.constants and 2 in self.constants  # m1 / m2 read Q, absmax before pdl.wait
        self.prepared = {}
        for m in range(1, MAX_M_FAST + 1):          # compiled and planned now, never on the hot path
            self.prepare(route(ROUTES, self.case(m)).kernel)
        self.prepare("generic")
        if route(ROUTES, self.case(prefill_cuda.PREFILL_MIN_M)).kernel == "prefill":
            self.prepare("prefill")

    def case(self, m, align=(16, 16, 4), scratch=True):
        """The routing Case of a call at M = m (``scratch``: the call has onnxruntime's scratch, as sessions on
        onnxruntime >= 1.18 and runtime/direct calls do)."""
        return case(self.dtype, m, self.k, self.n, self.bs.size, self.tc, self.fp32_decode, align, self.path,
                    self.blas, scratch, self.qt == "int4")

    def prepare(self, name):
        """(launcher, block, shared bytes, resident blocks per SM or the grid) of kernel ``name`` for this node."""
        if name not in self.prepared:
            how, cfg = KERNELS[name]
            if how == "prefill":
                self.prepared[name] = prefill_cuda.prepare()
                return self.prepared[name]
            lau = launcher(name, self.dtype)
            if how == "m1":
                wide, u4 = cfg[2], cfg[3]
                tab = table_bytes(how, cfg)
                block = threads(self.k, wide)
                if u4:      # no table: one wave of the resident blocks the driver counts from the compiled
                    #         kernel's registers (at most M1_MAX_REGISTERS); the table kernels keep m1_grid's
                    #         estimate, the grid their routes were measured with
                    per_sm = max(1, min(32, lau.blocks_per_sm(block)))
                    g = nf4_common.even_parts(math.ceil(self.n / COLS), self.sms * per_sm)
                else:
                    g = m1_grid(self.n, self.sms, self.k, tab > 0, wide)
                prep = lau, block, tab, g
            elif how == "m2":
                block = threads(self.k, True)
                prep = lau, block, table_bytes(how, cfg), max(1, lau.blocks_per_sm(block))
            elif how == "tc":
                prep = nf4tc_cuda.session_mode(1, *cfg)
            elif how == "fast":
                prep = lau, 32 * WARPS_PER_BLOCK, None, fast_grid(self.n, self.sms)
            else:
                prep = lau, 32 * WARPS_PER_BLOCK, 0, grid(self.n)
            self.prepared[name] = prep
        return self.prepared[name]

    def compute(self, ctx, inputs):
        a, q, absmax = inputs[0], inputs[1], inputs[2]
        bias = inputs[3] if len(inputs) > 3 else None
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs)
        m = nf4_common.check_a(a, self.k, bias, self.n)
        y = ctx.output(0, a.shape[:-1] + (self.n,))
        if m == 0:
            return
        align = host.alignment(a.ptr), host.alignment(q.ptr), host.alignment(absmax.ptr, cap=4)
        name = route(ROUTES, self.case(m, align, ctx.has_scratch)).kernel
        how, cfg = KERNELS[name]
        k, n, hb = self.k, self.n, int(bias is not None)
        bptr = bias.ptr if bias is not None else y  # never read without has_bias
        if how == "prefill":
            prefill_cuda.run(ctx, m, k, n, self.bs, self.sms, self.prepare(name), self.code.ptr, a, q, absmax, bias, y)
            return
        if how == "tc":
            self._launch_tc(ctx, m, a, q, absmax, bptr, hb, y, *cfg)
            return
        lau, block, shmem, g = self.prepare(name)
        ab = [(a.ptr, (m * k,)), (q.ptr, (q.size if how == "generic" else k * n // 16,)), (absmax.ptr, (absmax.size,)),
              self.code.arg, (bptr, (n,)), hb, (y, (m * n,))]
        if how == "m1":
            lau.launch(g, block, ctx.stream, *ab, k, n, self.bs.log2_words, shmem=shmem, pdl=self.pdl)
        elif how == "m2":
            lau.launch(m2_grid(m, n, self.sms, g), block, ctx.stream, *ab, m, k, n, self.bs.log2_words, shmem=shmem,
                       pdl=self.pdl)
        elif how == "fast":
            lau.launch(g, block, ctx.stream, *ab, m, k, n, self.bs.log2_words, shmem=m * k * 4)
        else:
            lau.launch(g, block, ctx.stream, *ab, m, k, n, self.bs.size, shmem=shmem)

    def _launch_tc(self, ctx, m, a, q, absmax, bptr, hb, y, rc, halves):
        lau, block, occ = self.prepare(f"nf4tc.{'halves.' if halves else ''}rc{rc}")
        if halves:      # the weight's two halves of rows as the kernel's W1 / W3 (N / 2 rows each)
            n, w, am_ = nf4tc_cuda.half_sizes(self.n, self.k, self.bs.size)
        else:
            n, w, am_ = self.n, q.size // 8, absmax.size
        nch = nf4tc_cuda.chunks(m, rc)
        parts = nf4tc_cuda.parts_for(n, nch, self.sms, occ)
        w1 = ((q.ptr, (w,)), (absmax.ptr, (am_,)))
        w3 = ((q.ptr + 8 * w, (w,)), (absmax.ptr + 4 * am_, (am_,))) if halves else w1
        b3 = (bptr + 2 * n, (n,)) if halves and hb else (bptr, (n,))
        lau.launch(nch * parts, block, ctx.stream, (a.ptr, (m * self.k // 4,)), *w1, *w3, (self.tc_lut.ptr, (256,)),
                   (bptr, (n,)), b3, (y, (m * self.n,)), m, self.k, n, self.bs.log2, parts, hb, hb if halves else 0)


KERNEL = MatMulNF4CudaKernel

"""FusedFFNNF4, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 stored as MatMulNF4's weights
(bitsandbytes NF4/FP4 blocks of W^T [N, K]; onnx_lowbit.nf4). Up to M = 16 one launch that never writes the
fp16/fp32 weights, SiLU * mul in its epilogue; past it (fp16 X) the prefill route below.

Decode kernel (M <= 16, K % 16 == 0, K <= 16384): thread t of a block owns word t (elements 16t .. 16t+15) of
every row of W1^T and W3^T and keeps those 16 x values of its MT rows (MT = 1 or 2; larger M runs as row chunks
in neighbouring blocks, which share the weight reads through L2) in registers, loaded once. A block covers all
of K (32 * ceil(K/512) threads) and owns a contiguous slice of columns (grid = SMs x resident blocks, so every SM
streams about the same bytes); it walks the slice COLS columns at a time: each thread loads word t of the 2*COLS
rows (a warp reads 256 contiguous bytes of each row) and the words' absmax, the next step's words being
prefetched while the current ones are decoded (a step that reaches past the slice reads its last column again,
never stored; threads past K read a valid word with x = 0 and scale 0). Index math is 32-bit (inline PTX: Numba
types uint32 (op) uint32 as 64-bit). Decoding: a byte-pair table in dynamic shared memory (TAB_BYTES, 64 KiB:
entry of byte v for copy l at v * 256 + l * 8, the exact fp32 code values of the byte's high then low nibble,
16 copies so that each half-warp's 8-byte loads hit 16 distinct bank pairs); the entry's address is one PRMT
(byte b of the word into bits 8..15, the lane's copy offset into bits 0..7) and the load LDS [R + UR]: per byte
one PRMT, one LDS.64 and two FFMAs (SASS of the MT=1 step loop, every warp's path: 424 instructions for 128
nibbles, 3.3 per nibble; 80 registers, no spills; 3 blocks of 256 threads per SM). The 2*COLS*MT partial sums
are reduced across the warp with a reduce-scatter (2*COLS*MT - 1 shuffles + the rest of the butterfly, instead
of 5 per value), across the block's warps through shared memory (double-buffered: one barrier per step), and
COLS*MT threads apply the biases and SiLU * mul in fp32 and store S in X's type. The kernel is generated as
straight-line code (every per-thread value has a constant name or index: no local-memory spills). With
pair=False the 16-entry fp32 code table (one lookup per nibble), the default at M=1 (``decode.mt1.nib``) for fp32
X: no 64 KiB of shared memory per block, so twice the blocks per SM at K = 2048 and, at these latency-bound sizes,
faster at every K measured (BENCHMARKS.md, session 13). The same generator (matmul=True) builds MatMulNF4's M=1
kernel; it lives in nf4/decode_cuda.py (``make_decode``).
Measured before this decode (H100, LLaMA-7B gate+up, M=1; 6.1 SASS instructions per nibble): 37.1 us against
51.0 us for two MatMulNF4 + silu*mul; ncu: latency bound (0.6 instructions issued per cycle and scheduler, 35%
of DRAM bandwidth). The PRMT decode, first GPU run (2026-11-24): correct (3.1e-4), 40.7 us, but on 132 blocks:
``blocks_per_sm`` asked for the occupancy before the kernel's 64 KiB opt-in and got 0 (1 block per SM); the
query (``Launcher.blocks_per_sm``) now opts the kernel in first. See docs/ffn4.md.
With fp16 X at M=1 the default since 2026-11-26 is the packed-fp16 decode (``h2``, ``decode.mt1.h2``): one PRMT,
one LDS and one fma.rn.f16x2 per byte in chains of 2 bytes summed in fp32; LLaMA-7B gate+up 24.8 against 25.6 us
(H100), 21.8 against 25.1 (H200); from K = 4096 with two words (16 bytes, one load) per thread and row
(``decode.mt1.wide``): 24.1 us.
X is read with 16-byte loads (half2.ldx8; element loads asked a warp for 32 sectors each and held the prologue for
~2 us), and from K = 4096 the chains are 4 bytes long (chains of 4): LLaMA-7B gate+up 21.05-21.80 us at M = 1 (H100,
2026-11-26; chains of 2: 21.7-22.4), 23.4-24.1 at M = 2 (26.9-27.3 for the pair table); that wide decode's step
loop is written out twice with the word buffers' roles swapped (``pingpong``): 21.64 against 21.87 us at M = 1,
22.84 against 23.70 at M = 2 (H100, medians of 4 rounds). On the H100 (GROUPS_CARDS) the M = 1 wide decode's blocks
are 3 thread groups sharing one table (``decode.mt1.wide.g3``): 20.64-21.49 against 21.08-21.83 us (three machines).
With fp16 X at M = 1, 2 and K = 1024 .. 3072 (WARPCOLS) sessions take the warp-column kernel of nf4warp_cuda
instead (a warp, or a pair of warps, owns whole columns: no barrier per step; 13-38% faster there, BENCHMARKS.md).
Prefill (fp16 X, M >= 17, cuBLAS and onnxruntime's scratch; ffn/fusedffn4_prefill_cuda): W1^T, then W3^T
dequantised into fp16 [N, K] scratch by DequantNF4's transposed kernel, each right before its GEMM (FusedFFN's
cuBLAS path, fp16 G), then the SiLU * mul kernel.
Generic kernel (any K, any M): one warp per column, element by element, both weights; correct, not tuned.
``ROUTES`` (below) says which kernel serves a call; ``FusedFFNNF4CudaKernel`` builds the call's Case and launches
the row's kernel.
"""
from __future__ import annotations


import numpy as np
from numba import cuda, float32, int64

from ..device import cublas, half2
from ..device.inputs import check_x_biases
from ..device.memory import ld16, ld32, st16, st32
from ..device.mma import silu
from ..device.ptx import warp_sum
from ..device.splitk import ScratchPool
from ..device.target import SIM
from ..device import host
from ..nf4 import common as nf4_common, dequantnf4_cuda as dq, nf4mma_cuda, nf4tc_cuda, nf4warp_cuda
from ..nf4 import prefill_cuda as nf4_prefill
from ..nf4.common import case_align, case_f16, case_fp32_decode, check_weights
from ..nf4.decode_cuda import COLS, TAB_BYTES, lut_for, make_decode, sig, threads
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route
from . import fusedffn4_prefill_cuda as p4
from .common4 import opt

MAX_M_FAST = 16           # the decode kernels' rows (row chunks of 1 or 2)
MAX_WPR = 1024            # words per row the decode kernels take (K <= 16384)
GEN_WARPS = 2 if SIM else 8     # the generic kernel's warps per block (fewer simulated threads)
DEFAULT_BLOCKS_PER_SM = 4       # the decode kernels' occupancy under the simulator
WIDE_MIN_K = 4096         # fp16 X, K % 32 == 0 from this K: the wide packed-fp16 decode (decode.mt*.wide)
GROUPS_CARDS = ("H100",)  # device names (substrings) whose M = 1 wide decode runs blocks of thread groups (.g3)
# The decode kernel variants sessions take: name -> make_decode's row bucket and table options (pair, early, nib, h2
# chain length, wide, pingpong, thread groups). What decided them (H100 unless said, weights cycled past L2,
# benchmarks/nf4shapes_gpu.py, BENCHMARKS.md):
#   decode.mt1.nib (fp32 X, M = 1; fp16 X with ONNX_LOWBIT_FP32_DECODE=1): the 16-entry table addressed by PRMT:
#     25.5 us against 27.1 at 4096 -> 2 x 11008, 14.0 against 14.5 at 2048 -> 2 x 8192; the 16-entry table beat the
#     pair table at M = 1: 14.6 us against 17.0 at 2048 -> 2 x 8192 (6 blocks of 128 threads per SM instead of 3),
#     27.0 against 28.5 at 4096 -> 2 x 11008.
#   decode.mt2.pair (M >= 2 where the wide decode does not apply): the byte-pair table (124 registers) stays faster at
#     M = 2: 27.5 against 32.9 us at 4096; built while the first words load: 15.4 / 27.5 us against 16.0 / 28.5.
#   decode.mt1.h2 (fp16 X, M = 1, below WIDE_MIN_K or K % 32 != 0): the packed-fp16 decode, chains of 2, against the
#     fp32 decode (nib): LLaMA-7B gate+up H100 24.8 / 25.6, H200 21.8 / 25.1; 2048 -> 2 x 8192 H100 12.5 / 14.2,
#     H200 12.0 / 13.7. Chains of 4 with 8 columns a step (before the 16-byte X loads): H100 23.8 us at 4096.
#   decode.mt1.wide, decode.mt2.wide (fp16 X, K >= WIDE_MIN_K, K % 32 == 0): chains of 4 with two words (16 bytes,
#     one ld.global.nc.L1::no_allocate.v4) per thread and row (half the threads and absmax loads). LLaMA-7B gate+up,
#     us (2026-11-26, after the 16-byte X loads): M=2 chains of 4 23.38 / 23.86 / 24.09 against 26.85 / 27.32 for the
#     pair table (chains of 2: 26.47 / 26.93 / 27.05); M=1 chains of 4 21.05 / 21.80 / 21.25 (mean 21.37) against
#     21.89 / 21.68 / 22.44 / 21.99 (mean 22.0) for chains of 2. Rounding (benchmarks/h2_error.py, RMS of x W^T):
#     3.9e-4 against 3.2e-4 (zero-mean X). At 2048 -> 2 x 8192 the 64-thread blocks are slower (M=1 13.07 against
#     12.31; M=2 15.42 / 15.03), hence WIDE_MIN_K. Their step loop written out twice with the word buffers' roles
#     swapped (``pingpong``: no copies of the prefetched words; 116 registers), medians of 4 rounds (BENCHMARKS.md,
#     session 26): M=1 21.64 against 21.87 us, M=2 22.84 against 23.70; H200 M=1 17.95 against 18.28.
#   decode.mt1.wide.g3 (GROUPS_CARDS, where one-group blocks fit 3 per SM and the grouped block fits): 3 thread
#     groups per block sharing one 64 KiB table (one table build and copy per SM instead of 3). Medians of 3 rounds
#     (session 27), us, 3 groups / 1: H100 4096 -> 2 x 11008 20.72 / 21.08 and (another machine) 21.49 / 21.83,
#     4096 -> 2 x 14336 27.34 / 27.64, 5120 -> 2 x 13824 32.62 / 33.96; H200 18.08 / 17.86, 23.98 / 23.12, 24.65 /
#     25.36 (so not there). H100 M=1: 2 groups 21.12, 4 (16 warps, 115 blocks) 21.15; M=2 (146 registers: 1 block
#     of 2 or 3 groups per SM) 26.2 / 24.2 against 22.9.
DECODE = {  # name: (mt, pair, early, nib, h2, wide, pingpong, groups)
    "decode.mt1.nib": (1, False, False, True, 0, False, False, 1),
    "decode.mt2.pair": (2, True, True, False, 0, False, False, 1),
    "decode.mt1.h2": (1, False, False, False, 2, False, False, 1),
    "decode.mt1.wide": (1, False, False, False, 4, True, True, 1),
    "decode.mt1.wide.g3": (1, False, False, False, 4, True, True, 3),
    "decode.mt2.wide": (2, False, False, False, 4, True, True, 1),
}
WARPCOLS = {(1, 1): (8, 1), (2, 1): (8, 1),   # fp16 X, (M, K / 1024) -> (warps per block, warps per column): the
            (1, 2): (8, 1), (2, 2): (8, 2),   # warp-column kernel (nf4warp_cuda: a warp, or a pair of warps on
            (1, 3): (6, 1)}                   # halves of K, owns whole columns; no barrier per step). H100, weights
# past L2 (nf4shapes_gpu.py, 2026-11-26), us, against the block kernel's default in the same run: 1024 -> 2 x 4096 M=1
# 4.89 / 6.75, M=2 6.11 / 9.87; 2048 -> 2 x 8192 M=1 10.16 / 12.68 and 10.22 / 12.61 (6 warps: 10.86-11.05 against
# 12.43-12.95), M=2 (pairs) 12.24 / 15.13; 3072 -> 2 x 8192 M=1 14.78 / 17.06. Not taken: 3072 at M=2 (96 registers of
# X, spills: 34.0 against 17.8), 4096 (M=1 22.8 at best against 21.4-22.5, pairs 21.51 against 21.75, a tie; M=2 26.7
# against 23.6)
TC_MIN_M = 3              # fp16 X from this M on: the tensor-core kernel (nf4tc_cuda); H100, LLaMA-7B gate+up
                          # (BENCHMARKS.md): M=1 42.4 us against 31.7 for the decode kernel, M=2 43.3 / 31.7,
                          # M=3 43.8 / 47.8, M=8 46.8 / 84.6, M=16 75.3 / 156.3
MMA_M = (3, 4)            # fp16 X at these M and K * N >= MMA_MIN_KN: the balanced tensor-core kernel
MMA_MIN_KN = 1 << 25      # (nf4mma_cuda) instead of nf4tc. H200, weights cycled past L2 (benchmarks/nf4mma_gpu.py,
                          # BENCHMARKS.md), us, nf4mma / nf4tc: 4096 -> 2 x 11008 M=3 33.5 / 41.3, M=4 33.9 / 41.6;
                          # 2048 -> 2 x 8192 M=3 19.1 / 17.5, M=4 19.6 / 17.5 (the crossover lies between the two
                          # sizes); M=1 30.4 against 26.4 for the decode kernel, M=2 32.5 / 26.9; the H100 agrees


def _make_generic(a16, warps=GEN_WARPS):
    load = ld16 if a16 else ld32
    store = st16 if a16 else st32

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
            g = warp_sum(g, red, tid)
            u = warp_sum(u, red, tid)
            if lane == 0 and active:
                if has_b1:
                    g += load(b1, n)
                if has_b3:
                    u += load(b3, n)
                store(s, m * n_dim + n, silu(g) * u)

    return generic



# ------------------------------------------------------------------------------------------------- routing
def _tc(c, lo, hi):
    """fp16 X at M = lo .. hi on a GPU with tensor cores, nf4tc's shapes (K % 64 == 0, block >= 64, K * N < 2^32)."""
    return case_f16(c) and c.tc and lo <= c.m <= hi and nf4tc_cuda.ok(True, c.m, c.k, c.n, c.bs)


def _warp_name(m, ch, split):
    return f"nf4warp.mt{m}.c{ch}" + (".s2" if split == 2 else "")


WARP_KERNELS = {_warp_name(m, ch, split): (m, ch) for (m, ch), (_, split) in WARPCOLS.items()}


def warpcols(c):
    """The warp-column kernel WARPCOLS gives this call ('nf4warp.mt<M>.c<K/1024>', '.s2' for pairs of warps), or
    None (also with ONNX_LOWBIT_FP32_DECODE=1: it is a packed-fp16 decode)."""
    plan = WARPCOLS.get((c.m, c.k // nf4warp_cuda.CHUNK))
    if plan is None or case_fp32_decode(c) or not nf4warp_cuda.ok(c.m, c.k, case_f16(c), plan[1]):
        return None
    return _warp_name(c.m, c.k // nf4warp_cuda.CHUNK, plan[1])


def decode_ok(m, k):
    return 0 < m <= MAX_M_FAST and k % 16 == 0 and k // 16 <= MAX_WPR


def bucket(m):
    return 1 if m == 1 else 2


def decode_kernel(c):
    """The block decode variant (a DECODE name) of this call's row bucket, X type, K and switches."""
    h2 = case_f16(c) and not case_fp32_decode(c)
    wide = h2 and c.k >= WIDE_MIN_K and c.k % 32 == 0
    if bucket(c.m) == 2:
        return "decode.mt2.wide" if wide else "decode.mt2.pair"
    if wide:
        return "decode.mt1.wide.g3" if c.opt("grouped") else "decode.mt1.wide"
    return "decode.mt1.h2" if h2 else "decode.mt1.nib"


def _decode(c, name):
    """The decode variant ``name`` takes the call: decode_ok, its variant, X 16-byte and Q1 / Q3 8-byte (wide:
    16-byte) aligned."""
    return (decode_ok(c.m, c.k) and decode_kernel(c) == name and case_align(c, "x") >= 16
            and case_align(c, "q") >= (16 if DECODE[name][5] else 8))


_SESSION_27 = "BENCHMARKS.md NF4 (H100 x3 row); lab-log session 27 (73ab0e3)"
ROUTES = (
    Route("generic", "forced (tests): opts path = 'generic'", lambda c: c.opt("path") == "generic"),
    Route("nf4mma", "fp16 X, tensor cores, M in MMA_M (3, 4), K * N >= MMA_MIN_KN (2^25), K % 128 == 0, block >= "
          "64, M * K <= 16384; X, Q1, Q3 16-byte aligned",
          lambda c: _tc(c, 1, 16) and c.m in MMA_M and nf4mma_cuda.ok(True, c.m, c.k, c.n, c.bs)
          and c.k * c.n >= MMA_MIN_KN and case_align(c, "x") >= 16 and case_align(c, "q") >= 16,
          "BENCHMARKS.md NF4 (M = 3 / 4 on nf4mma); the MMA_MIN_KN figures (e3d5170)"),
    Route("nf4tc.rc2", "fp16 X, tensor cores, M = 9 .. 16, K % 64 == 0, block >= 64; X, Q1, Q3 8-byte aligned",
          lambda c: _tc(c, nf4tc_cuda.RC2_MIN_M, 16) and case_align(c, "x") >= 8 and case_align(c, "q") >= 8,
          "BENCHMARKS.md NF4 (M = 9 / 12 / 16); lab-log session 25 (8f7e4e7)"),
    Route("nf4tc.rc1", "as above at M = TC_MIN_M (3) .. 8",
          lambda c: _tc(c, TC_MIN_M, 16) and case_align(c, "x") >= 8 and case_align(c, "q") >= 8,
          "the TC_MIN_M figures (BENCHMARKS.md NF4; acda774)"),
) + tuple(
    Route(_warp_name(m, ch, split),
          f"fp16 X, M = {m}, K = {1024 * ch} (WARPCOLS: {warps} warps per block"
          + (", pairs of warps on halves of K" if split == 2 else "") + "), not ONNX_LOWBIT_FP32_DECODE; X, Q1, Q3 "
          "16-byte aligned",
          lambda c, name=_warp_name(m, ch, split): warpcols(c) == name
          and case_align(c, "x") >= 16 and case_align(c, "q") >= 16,
          "the WARPCOLS figures (BENCHMARKS.md NF4, 2048 -> 2 x 8192 row); lab-log session 21 (c9c815d)")
    for (m, ch), (warps, split) in WARPCOLS.items()
) + (
    Route("decode.mt1.wide.g3", "fp16 X, M = 1, K >= WIDE_MIN_K (4096), K % 32 == 0, K <= 16384, not "
          "ONNX_LOWBIT_FP32_DECODE, on GROUPS_CARDS (H100) where blocks of 3 groups fit (opts grouped); X, Q1, Q3 "
          "16-byte aligned", lambda c: _decode(c, "decode.mt1.wide.g3"), _SESSION_27),
    Route("decode.mt1.wide", "as above elsewhere",
          lambda c: _decode(c, "decode.mt1.wide"), "BENCHMARKS.md NF4; lab-log session 26 (8349ad2)"),
    Route("decode.mt2.wide", "fp16 X, M = 2 .. 16, K >= WIDE_MIN_K (4096), K % 32 == 0, K <= 16384, not "
          "ONNX_LOWBIT_FP32_DECODE; X, Q1, Q3 16-byte aligned", lambda c: _decode(c, "decode.mt2.wide"),
          "BENCHMARKS.md NF4 (M = 2 row); lab-log session 26 (8349ad2)"),
    Route("decode.mt1.h2", "fp16 X, M = 1, K % 16 == 0, K <= 16384 (below 4096 or K % 32 != 0), not "
          "ONNX_LOWBIT_FP32_DECODE; X 16-byte, Q1, Q3 8-byte aligned", lambda c: _decode(c, "decode.mt1.h2"),
          "the decode.mt1.h2 figures (BENCHMARKS.md NF4; c9faa9f)"),
    Route("decode.mt1.nib", "M = 1, K % 16 == 0, K <= 16384: fp32 X, or fp16 with ONNX_LOWBIT_FP32_DECODE; X "
          "16-byte, Q1, Q3 8-byte aligned", lambda c: _decode(c, "decode.mt1.nib"),
          "the decode.mt1.nib figures (9217596)"),
    Route("decode.mt2.pair", "M = 2 .. 16, K % 16 == 0, K <= 16384, where decode.mt2.wide does not apply; X "
          "16-byte, Q1, Q3 8-byte aligned", lambda c: _decode(c, "decode.mt2.pair"),
          "the decode.mt2.pair figures (3d1c1ab)"),
    Route("prefill", p4.WHEN.format(layout="DequantNF4's transposed kernel, W^T [N, K]", op="with op T"), p4.takes,
          p4.MEASURED),
    Route("generic", "any other call (M > 16 where the prefill row does not apply: fp32 X, no cuBLAS, no scratch "
          "memory; K % 16 != 0; unaligned)", always, "correctness fallback"),
)


def case(dtype, m, k, n, bs, tc=True, fp32_decode=False, grouped=False, align=(16, 16), path=None, cublas_ok=False,
         scratch=False):
    """The Case of a call: X's ``dtype``, M, K, N, the block size, whether the GPU has tensor cores, the
    ONNX_LOWBIT_FP32_DECODE switch, whether the wide M = 1 decode runs blocks of 3 thread groups here (``grouped``),
    the alignments (X; Q1 and Q3; capped at 16), a forced path (tests), whether cuBLAS was found (``cublas_ok``) and
    the call has onnxruntime's scratch (``scratch``): the prefill row's switches."""
    aligned = tuple(align) == (16, 16)
    opts = [("fp32_decode", True)] if fp32_decode else []
    opts += [("grouped", True)] if grouped else []
    opts += [("cublas", True)] if cublas_ok else []
    opts += [("scratch", True)] if scratch else []
    opts += [] if aligned else [("q_align", align[1]), ("x_align", align[0])]
    opts += [("path", path)] if path else []
    return Case(np.dtype(dtype).name, m, k, n, aligned=aligned, tc=tc, bs=bs, opts=tuple(sorted(opts)))


# ------------------------------------------------------------------------------------------------- launches
def parts_for(n, nch, sms, occupancy, groups=1):
    """Column slices: at most sms * occupancy blocks in all (one wave), every slice the same number of steps
    (nf4_common.even_parts); with ``groups`` per block, a multiple of groups (the grid is nch * parts / groups)."""
    parts = nf4_common.even_parts(-(-n // COLS), max(1, (sms * occupancy * groups) // nch))
    return -(-parts // groups) * groups


def grouped_card():
    """Whether the current device is one GROUPS_CARDS names."""
    name = getattr(cuda.get_current_device(), "name", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return any(c in name for c in GROUPS_CARDS)


_launchers = {}


def launcher(a16, name):
    """Direct-launch wrapper (compiled once per process) of the DECODE variant ``name`` or (name 'generic') the
    generic kernel, for fp16 (``a16``) or fp32 X; under the simulator a SimLauncher answering DEFAULT_BLOCKS_PER_SM.
    ``.dispatcher`` is the Numba kernel (register / local memory queries)."""
    key = (a16, name)
    if key not in _launchers:
        if name == "generic":
            _launchers[key] = host.launcher(_make_generic(a16), sig(a16, True))
        else:
            mt, pair, early, nib, h2, wide, pingpong, groups = DECODE[name]
            fn = make_decode(mt, a16, pair, pingpong=pingpong, early=early, nib=nib, h2=h2, wide=wide, groups=groups)
            _launchers[key] = host.launcher(fn, sig(a16, False, pair), dynamic_shared=TAB_BYTES if pair or h2 else 0,
                                            sim_blocks=DEFAULT_BLOCKS_PER_SM, pdl=True)
    return _launchers[key]


def blocks_per_sm(launcher_, block):
    """Resident blocks per SM with the launcher's 64 KiB of dynamic shared memory (at least 1)."""
    return max(1, launcher_.blocks_per_sm(block))


def grouped(a16, k):
    """Whether the M = 1 wide decode runs as decode.mt1.wide.g3 here: on a card GROUPS_CARDS names (any under the
    simulator), where one-group blocks fit 3 per SM (the table, not registers, bounds them) and the grouped block
    fits at all."""
    g = DECODE["decode.mt1.wide.g3"][7]
    if SIM:
        return DEFAULT_BLOCKS_PER_SM >= g
    if not grouped_card():
        return False
    one, grp = launcher(a16, "decode.mt1.wide"), launcher(a16, "decode.mt1.wide.g3")
    return blocks_per_sm(one, threads(k, True)) >= g and grp.blocks_per_sm(threads(k, True) * g) >= 1


class FusedFFNNF4CudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes and pointer alignment (see plans.py)
    path = None          # tests: 'generic' forces ROUTES' first row

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.level = nf4_common.parse_level(self.attrs)   # checked; every level computes in float here (a minimum)
        self.a16 = self.in_types[0] == 10
        self.code_host, self.code = code, host.Table(code)
        self.tc_lut = host.Table(nf4tc_cuda.lut(code))
        self.luts = {}
        self.sms = host.sm_count()
        self.tc = host.tensor_cores()
        self.fp32_decode = half2.fp32_decode()      # ONNX_LOWBIT_FP32_DECODE, read here only
        wide_k = self.a16 and not self.fp32_decode and self.k >= WIDE_MIN_K and self.k % 32 == 0 and \
            decode_ok(1, self.k)
        self.grouped = bool(wide_k) and grouped(self.a16, self.k)
        self.blas = cublas.load() is not None       # else the generic kernel serves every M > 16
        self.pdl = all(i in self.constants for i in (1, 2, 3, 4))  # the decode kernels read them before pdl.wait
        self.prepared = {}
        for m in range(1, MAX_M_FAST + 1):          # compiled and planned now, never on the hot path
            self.prepare(route(ROUTES, self.case(m)).kernel)
        self.prepare("generic")
        if route(ROUTES, self.case(p4.PREFILL_MIN_M)).kernel == "prefill":
            self.prepare("prefill")

    def case(self, m, align=(16, 16), scratch=True):
        """The routing Case of a call at M = m (``align``: X's, Q1 and Q3's; ``scratch``: the call has onnxruntime's
        scratch, as sessions on onnxruntime >= 1.18 and runtime/direct calls do)."""
        return case("float16" if self.a16 else "float32", m, self.k, self.n, self.bs.size, self.tc, self.fp32_decode,
                    self.grouped, align, self.path, self.blas, scratch)

    def lut(self, pair, h2):
        """(pointer, shape) of a decode table; one copy per table (the h2 one serves every chain length)."""
        key = (pair and not h2, bool(h2))
        if key not in self.luts:
            self.luts[key] = host.Table(lut_for(self.code_host, pair, h2))
        return self.luts[key].arg

    def prepare(self, name):
        """What a launch of kernel ``name`` needs for this node (built once)."""
        if name not in self.prepared:
            if name == "nf4mma":
                lau = nf4mma_cuda.launcher()
                shm = nf4mma_cuda.shared_bytes()
                blocks = nf4mma_cuda.plan_blocks(self.k, self.n, self.sms,
                                                 max(1, lau.blocks_per_sm(32 * nf4mma_cuda.WARPS, shm)))
                pf, nc = nf4mma_cuda.scratch(blocks, self.k, self.n)
                prep = lau, shm, blocks, ScratchPool(pf, nc), pf
            elif name.startswith("nf4tc."):
                prep = nf4tc_cuda.session_mode(2, 1 if name == "nf4tc.rc1" else 2, False)
            elif name.startswith("nf4warp."):
                mt, ch = WARP_KERNELS[name]
                warps, split = WARPCOLS[(mt, ch)]
                warps = 2 * split if SIM else warps       # fewer simulated threads
                lau = nf4warp_cuda.launcher(ch, split=split, mt=mt)
                prep = lau, 32 * warps, nf4warp_cuda.grid_for(lau, warps, self.sms), self.lut(False, True)
            elif name == "generic":
                prep = launcher(self.a16, name), 32 * GEN_WARPS, -(-self.n // GEN_WARPS)
            elif name == "prefill":     # DequantNF4's transposed kernels (fp32 absmax -> fp16 W^T), as it routes them
                p4.prepare()
                prep = nf4_prefill.dequant_launchers()
            else:
                mt, pair, _, _, h2, wide, _, groups = DECODE[name]
                lau = launcher(self.a16, name)
                block = threads(self.k, wide) * groups
                occ = blocks_per_sm(lau, block)
                parts = {m: parts_for(self.n, -(-m // mt), self.sms, occ, groups)
                         for m in range(1, MAX_M_FAST + 1) if bucket(m) == mt}
                prep = lau, block, parts, groups, self.lut(pair, h2)
            self.prepared[name] = prep
        return self.prepared[name]

    def compute(self, ctx, inputs):
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
        name = route(ROUTES, self.case(m, (host.alignment(x.ptr), host.alignment(q1.ptr, q3.ptr)),
                                       ctx.has_scratch)).kernel
        if name == "prefill":
            self._prefill(ctx, m, x, ((q1, am1), (q3, am3)), b1, b3, s)
            return
        hb1, hb3 = int(b1 is not None), int(b3 is not None)
        tail = [(b1.ptr, (n,)) if hb1 else (s, (n,)), (b3.ptr, (n,)) if hb3 else (s, (n,)), (s, (m * n,))]
        w8 = [(q1.ptr, (q1.size // 8,)), (am1.ptr, (am1.size,)), (q3.ptr, (q3.size // 8,)), (am3.ptr, (am3.size,))]
        prep = self.prepare(name)
        if name == "nf4mma":
            lau, shm, blocks, pool, pf = prep
            lau.launch(blocks, 32 * nf4mma_cuda.WARPS, ctx.stream, (x.ptr, (m * k // 2,)),
                       (q1.ptr, (q1.size // 4,)), (am1.ptr, (am1.size,)), (q3.ptr, (q3.size // 4,)),
                       (am3.ptr, (am3.size,)), (self.tc_lut.ptr, (256,)), *tail, pool.partials(ctx, pf),
                       pool.counters(ctx.stream), m, k, n, self.bs.log2, blocks, hb1, hb3, shmem=shm)
        elif name.startswith("nf4tc."):
            lau, block, occ = prep
            rc = 1 if name == "nf4tc.rc1" else 2
            parts = nf4tc_cuda.parts_for(n, nf4tc_cuda.chunks(m, rc), self.sms, occ)
            lau.launch(nf4tc_cuda.chunks(m, rc) * parts, block, ctx.stream, (x.ptr, (m * k // 4,)), *w8,
                       (self.tc_lut.ptr, (256,)), *tail, m, k, n, self.bs.log2, parts, hb1, hb3)
        elif name.startswith("nf4warp."):
            lau, block, grid, lut = prep
            lau.launch(grid, block, ctx.stream, (x.ptr, (m * k,)), *w8, lut, *tail, m, k, n, self.bs.log2_words,
                       grid, hb1, hb3, pdl=self.pdl)
        elif name == "generic":
            lau, block, grid = prep
            lau.launch(grid, block, ctx.stream, (x.ptr, (m * k,)), (q1.ptr, (q1.size,)), (am1.ptr, (am1.size,)),
                       (q3.ptr, (q3.size,)), (am3.ptr, (am3.size,)), self.code.arg, *tail, m, k, n, self.bs.size,
                       hb1, hb3)
        else:
            lau, block, parts, groups, lut = prep
            mt = DECODE[name][0]
            lau.launch(-(-m // mt) * parts[m] // groups, block, ctx.stream, (x.ptr, (m * k,)), *w8, lut, *tail, m, k,
                       n, self.bs.log2_words, parts[m], hb1, hb3, pdl=self.pdl)

    def _prefill(self, ctx, m, x, ws, b1, b3, s):
        """The prefill route (ffn/fusedffn4_prefill_cuda): W1^T, W3^T [N, K] dequantised to fp16 scratch by
        DequantNF4's kernel (the one its ROUTES picks for Q's alignment), then FusedFFN's cuBLAS path."""
        kind = nf4_prefill.route_dequant(self.k, self.n, self.bs.size, ws[0][0].ptr, ws[1][0].ptr)
        lau, var = self.prepare("prefill")[kind]

        def dequant(i, ptr):
            dq.launch_transposed(lau, var, ctx.stream, True, *ws[i], self.code.ptr, ptr, self.k * self.n, self.bs,
                                 self.sms)

        p4.run(ctx, m, self.k, self.n, False, dequant, x.ptr, b1.ptr if b1 is not None else 0,
               b3.ptr if b3 is not None else 0, s)


KERNEL = FusedFFNNF4CudaKernel

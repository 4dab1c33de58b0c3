"""FusedFFNNF4, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 stored as MatMulNF4's weights
(bitsandbytes NF4/FP4 blocks of W^T [N, K]; onnx_lowbit.nf4). One launch; the fp16/fp32 weights are never
written; SiLU * mul in the epilogue.

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
straight-line code (every per-thread value has a constant name or index: no local-memory spills). Option
pair=False: the 16-entry fp32 code table (one lookup per nibble), the default at M=1 (PAIR) for fp32 X: no 64 KiB of
shared memory per block, so twice the blocks per SM at K = 2048 and, at these latency-bound sizes, faster at every
K measured (BENCHMARKS.md, session 13). The same generator (matmul=True) builds MatMulNF4's M=1 kernel.
Measured before this decode (H100, LLaMA-7B gate+up, M=1; 6.1 SASS instructions per nibble): 37.1 us against
51.0 us for two MatMulNF4 + silu*mul; ncu: latency bound (0.6 instructions issued per cycle and scheduler, 35%
of DRAM bandwidth). The PRMT decode, first GPU run (2026-11-24): correct (3.1e-4), 40.7 us, but on 132 blocks:
``blocks_per_sm`` asked for the occupancy before the kernel's 64 KiB opt-in and got 0 (1 block per SM); the
query (``Launcher.blocks_per_sm``) now opts the kernel in first. See docs/ffn4.md.
With fp16 X at M=1 the default since 2026-11-26 is the packed-fp16 decode (``h2``, H2): one PRMT, one LDS and
one fma.rn.f16x2 per byte in chains of 2 bytes summed in fp32; LLaMA-7B gate+up 24.8 against 25.6 us (H100),
21.8 against 25.1 (H200); from K = 4096 with two words (16 bytes, one load) per thread and row (WIDE): 24.1 us.
X is read with 16-byte loads (half2.ldx8; element loads asked a warp for 32 sectors each and held the prologue for
~2 us), and from K = 4096 the chains are 4 bytes long (H2_WIDE): LLaMA-7B gate+up 21.05-21.80 us at M = 1 (H100,
2026-11-26; chains of 2: 21.7-22.4), 23.4-24.1 at M = 2 (26.9-27.3 for the pair table); that wide decode's step
loop is written out twice with the word buffers' roles swapped (PINGPONG_WIDE): 21.64 against 21.87 us at M = 1,
22.84 against 23.70 at M = 2 (H100, medians of 4 rounds). On the H100 (GROUPS_CARDS) the M = 1 wide decode's blocks
are 3 thread groups sharing one table (GROUPS, ``groups``): 20.64-21.49 against 21.08-21.83 us (three machines).
With fp16 X at M = 1, 2 and K = 1024 .. 3072 (WARPCOLS) sessions take the warp-column kernel of nf4warp_cuda
instead (a warp, or a pair of warps, owns whole columns: no barrier per step; 13-38% faster there, BENCHMARKS.md).
Generic kernel (any K, any M): one warp per column, element by element, both weights; correct, not tuned.
"""
from __future__ import annotations

import re

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from . import half2, nf4_common, nf4mma_cuda, nf4tc_cuda, nf4warp_cuda
from .dequantawq_cuda import SIM, as_f32, h2f, pack_h2
from .ffn4_common import check_x_biases, opt
from .fusedffn_cuda import LOAD, _make_ld4
from .fusedffnnf4_cpu import check_weights
from .kernels import Kernel
from .matmulawq_cuda import _ld16, _ld32, _silu, _st16, _st32
from .matmulnf4_cuda import (TAB_BYTES, _warp_sum, add32, f2u, hfma2, lds32, lds64, m1_block, mad32, min32, prmt,
                             shr32, tc_device)

COLS = 4                  # columns per block step
MAX_REGISTERS = {1: 80}   # ptxas limit per row bucket (MT=1: 80, no spills, 3 blocks of 256 threads per SM)
MT_BUCKETS = (1, 2)       # rows per block (x kept in registers: 16 * MT floats per thread)
MAX_M_FAST = 16
MAX_WPR = 1024            # words per row the decode kernel takes (K <= 16384)
NWMAX = 32                # warps per block, at most
GEN_WARPS = 8
FULL = np.uint32(0xFFFFFFFF)
M32 = np.uint64(0xFFFFFFFF)
U32 = np.uint64(32)
DEFAULT_BLOCKS_PER_SM = 4
_ld4w = _make_ld4(LOAD)     # wide: a 16-byte chunk of a weight row, streamed past L1
NIB = {1: True, 2: False}   # per row bucket: the 16-entry table addressed by PRMT (``nib``; pair=False only).
                            # H100, M=1, weights cycled past L2 (benchmarks/nf4shapes_gpu.py, BENCHMARKS.md): 25.5 us
                            # against 27.1 at 4096 -> 2 x 11008, 14.0 against 14.5 at 2048 -> 2 x 8192
H2 = {1: 2, 2: 0}          # per row bucket, fp16 X only: the packed-fp16 decode with chains of this many products
                            # (0: off; ``h2``, see _make_decode). Weights cycled past L2, M=1 (benchmarks/
                            # nf4shapes_gpu.py, BENCHMARKS.md), us, against the fp32 decode (nib): LLaMA-7B gate+up
                            # H100 24.8 / 25.6, H200 21.8 / 25.1; 2048 -> 2 x 8192 H100 12.5 / 14.2, H200 12.0 / 13.7.
                            # Below WIDE_MIN_K; from it H2_WIDE (chains of 4) applies. Earlier (before the 16-byte X
                            # loads), chains of 4 measured H100 23.8 us at 4096 with 8 columns a step, and at M=2
                            # against the pair table H100 27.4 / 27.5, H200 26.1 / 27.0
WIDE = {1: True, 2: True}   # per row bucket, fp16 X, K % 32 == 0 and K >= WIDE_MIN_K: the h2 decode with chains of
WIDE_MIN_K = 4096           # H2_WIDE[mt] and two words (16 bytes) per thread and row, one ld.global.nc.L1::no_allocate
H2_WIDE = {1: 4, 2: 4}      # .v4 each (half the threads and absmax loads). H100, weights past L2 (nf4shapes_gpu.py,
                            # 2026-11-26 after the 16-byte X loads), LLaMA-7B gate+up, us: M=2 chains of 4 23.38 /
                            # 23.86 / 24.09 against 26.85 / 27.32 for the pair table (chains of 2: 26.47 / 26.93 /
                            # 27.05); M=1 chains of 4 21.05 / 21.80 / 21.25 (mean 21.37) against 21.89 / 21.68 / 22.44
                            # / 21.99 (mean 22.0) for chains of 2. Rounding (benchmarks/h2_error.py, RMS of x W^T):
                            # 3.9e-4 against 3.2e-4 (zero-mean X). At 2048 -> 2 x 8192 the 64-thread blocks are slower
                            # (M=1 13.07 against 12.31; M=2 15.42 / 15.03), hence the bound
PINGPONG_WIDE = True        # the wide decode's step loop written out twice with the word buffers' roles swapped
                            # (``pingpong``: no copies of the prefetched words; 116 registers). H100, LLaMA-7B
                            # gate+up, weights past L2, medians of 4 rounds (BENCHMARKS.md, session 26): M=1 21.64
                            # against 21.87 us, M=2 22.84 against 23.70; H200 M=1 17.95 against 18.28
GROUPS = {1: 3, 2: 1}       # per row bucket, the wide decode: thread groups per block sharing one 64 KiB table
                            # (``groups``, where one-group blocks fit this many per SM: one table build and copy
                            # per SM instead of 3), on the cards GROUPS_CARDS names. Weights past L2, medians of 3
                            # rounds (nf4shapes_gpu.py, BENCHMARKS.md session 27), us, 3 groups / 1: H100 4096 ->
                            # 2 x 11008 20.72 / 21.08 and (another machine) 21.49 / 21.83, 4096 -> 2 x 14336 27.34 /
                            # 27.64, 5120 -> 2 x 13824 32.62 / 33.96; H200 18.08 / 17.86, 23.98 / 23.12, 24.65 /
                            # 25.36 (so not there). H100 M=1: 2 groups 21.12, 4 (16 warps, 115 blocks) 21.15; M=2
                            # (146 registers: 1 block of 2 or 3 groups per SM) 26.2 / 24.2 against 22.9
GROUPS_CARDS = ("H100",)    # device names (substrings) that take GROUPS
EARLY = {1: False, 2: True}  # M=2 (pair table): built while the first words load; 15.4 / 27.5 us against 16.0 / 28.5
PAIR = {1: False, 2: True}  # per row bucket: the byte-pair table (else the 16-entry table). H100, M=1, weights
                            # cycled past L2 (benchmarks/nf4shapes_gpu.py): the 16-entry table 14.6 us against
                            # 17.0 at 2048 -> 2 x 8192 (6 blocks of 128 threads per SM instead of 3: no 64 KiB
                            # table), 27.0 against 28.5 at 4096 -> 2 x 11008; at M=2 (MT=2, 124 registers) the
                            # pair table stays faster at 4096 (27.5 against 32.9 us)
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


@cuda.jit(device=True, inline=True)
def _zval(zp, j, has_zp):
    """Zero point of flat block j (MatMulNBits packing: two per byte, even block in the low nibble), or 8."""
    if has_zp:
        return float32((uint32(zp[j >> uint32(1)]) >> ((j & uint32(1)) << uint32(2))) & uint32(15))
    return float32(8.0)


def _make_decode(mt, a16, pair=True, cols=COLS, prefetch=True, max_registers=None, matmul=False, pingpong=False,
                 early=False, int4=False, nib=False, h2=False, wide=False, am16=False, vec_table=None, groups=1):
    """The decode kernel for row bucket ``mt`` and ``cols`` columns per step, generated as straight-line code so
    that every per-thread value (16*mt x values, 2*cols words and scales in flight and prefetched, 2*cols*mt
    partial sums) has a constant name or index and stays in registers. Integer work is 32-bit (uint32 indices:
    N * K / 16 < 2^32). ``pair``: byte-pair table in dynamic shared memory (TAB_BYTES; entry of byte v for copy l
    at byte offset v * 256 + l * 8: fp32 code[v >> 4] in the low half, code[v & 15] in the high half), addressed
    by one PRMT per byte (the byte into bits 8..15, the lane's copy l = lane & 15 into bits 3..6: each half-warp
    reads 16 distinct bank pairs); else the 16-entry fp32 code table (a shift, a mask and a load per nibble).
    ``max_registers``: ptxas limit (default MAX_REGISTERS[mt]). ``matmul``: MatMulNF4's M=1 kernel instead (one
    weight, y = x W^T + bias, matmulnf4_cuda's signature: x / y / bias in their own dtype, the 16 fp32 code
    values from which the pair table is built, column slices from the grid size; mt = 1); with mt = 2 its M <= 16
    kernel (rows in chunks of 2, m_dim after s in the signature, grid = row chunks x column slices).
    ``pingpong`` (with prefetch): the step loop unrolled twice with the two word buffers' roles swapped, instead
    of copying the prefetched words into the current ones (fewer moves, twice the code). ``early`` (with
    prefetch): x and the first step's words are loaded before the table is built, so the table build overlaps
    their latency (matters when a block has only a few steps). matmul with pair=False: the 16-entry table built
    from the 16 code values (no dynamic shared memory: occupancy bound by registers only). ``int4`` (with matmul;
    experimental, benchmark and tests only, no op uses it yet): int4 weights with zero points in onnxruntime's
    MatMulNBits layout (N-major blocks, element k of a block in byte k // 2, even k in the LOW nibble; scales [N *
    K/bs] in x's dtype; zero points uint8 [N * K/bs / 2], even block in the low nibble, or 8 without them; needs
    K % (2 * bs) == 0): the 16-entry table holds 0..15, and each word's sum becomes (sum q x - z sum x) * s with
    sum x of the thread's 16 x values computed once. Signature (x, q1, scales, zp, lut, b1, has_b1, s, k_dim, n_dim,
    bs_shift, has_zp). ``nib`` (with pair=False): the 16-entry table as 32 lane copies in static shared memory
    (entry v of lane l at byte v * 256 + 4 l, 4 KiB): each word's nibbles are split into two words of bytes (one
    AND, one shift + AND per 8 nibbles) and each nibble's table address is one PRMT (nibble byte into bits 8..15,
    4 * lane into bits 0..7) instead of a shift and a mask. ``h2`` = c (2 or 4; fp16 X, two weights; replaces
    pair / nib): packed-fp16 decode. Each row of X is scaled by p = 2^(11 - floor(log2 max|x|)) (the row's largest
    |x| over the block: |x p| < 2^12, so a chain of c <= 4 products with code values |a v| < 2 stays below 2^15 and
    never overflows; tiny rows become normal fp16) and held as 8 half2 registers; the table holds the byte-pair
    values times a = half2.h2_scale(code) (1.3662 for NF4: it halves the fp16 rounding of the levels) as fp16 (high
    nibble's value in the low half), 32 lane copies in dynamic shared memory (byte v, lane l at byte v * 256 + 4 l),
    addressed by one PRMT per byte. Per byte: one PRMT, one LDS, one fma.rn.f16x2 into a chain of c bytes; each
    word's chains are converted to fp32 and summed (hsum2) and scaled by the absmax; the epilogue multiplies by
    1 / (p a). NaN / Inf in X stay non-finite (p = 1 for a row whose max is Inf). Error: benchmarks/h2_error.py.
    ``vec_table`` (h2): the table build's store width (half2.h2_table_src; default half2.VEC_TABLE, 16-byte stores).
    ``am16`` (experimental, benchmarks only: no op takes it): absmax as fp16 bits (uint16 arrays) instead of fp32;
    H100, LLaMA-7B gate+up M=1: 21.0-21.3 us against 21.4-22.3 for fp32 absmax in the same runs (BENCHMARKS.md,
    session 22), short of a reason to leave bitsandbytes' fp32 absmax.
    ``groups`` = G: a block is G thread groups of the one-group block's size, each on its own column slice (part
    (bid // nch) * G + group; the host passes G times the parts, matmul: G x the grid), sharing one table (one build,
    one 64 KiB copy per G groups: more warps per SM where the table bounds the resident blocks). The groups' step
    loops run the same number of steps (the longest slice's; past its own slice a group's loads are clamped and
    nothing is stored), since the per-step barrier is the block's."""
    if h2 and (int4 or not (a16 or matmul) or h2 not in (2, 4)):
        raise ValueError("h2 (the fp16 chain length, 2 or 4) is a mode for fp16 X (matmul: X's own dtype)")
    if h2:
        pair = nib = False
    if wide and not h2:
        raise ValueError("wide (two words per thread and row) is a mode of the h2 decode")
    ne = 32 if wide else 16             # elements of K per thread
    if int4:
        if not matmul:
            raise ValueError("int4 is a mode of the one-weight (matmul=True) kernel")
        pair = False
    nw = 1 if matmul else 2
    if max_registers is None and cols == COLS and prefetch and not wide:
        max_registers = MAX_REGISTERS.get(mt)       # the default geometry; variants and wide: ptxas's choice
    nv = nw * cols * mt                 # partial sums per thread: [weight][column][row]
    steps = nv.bit_length() - 1
    low = 5 - steps                     # lane bits reduced by the final butterfly
    src = []
    a = src.append
    if int4:
        a("def decode(x, q1, am1, zp1, lut, b1, has_b1, s, k_dim, n_dim, bs_shift, has_zp):")
        a("    m_dim = 1")
        a(f"    parts = int64(cuda.gridDim.x){f' * int64({groups})' if groups > 1 else ''}")
    elif matmul and mt > 1:     # M rows in row chunks of mt: grid = chunks x slices
        a("def decode(x, q1, am1, lut, b1, has_b1, s, m_dim, k_dim, n_dim, bs_shift):")
        a(f"    parts = (int64(cuda.gridDim.x) // ((int64(m_dim) + int64({mt - 1})) // int64({mt})))"
          f"{f' * int64({groups})' if groups > 1 else ''}")
    elif matmul:
        a("def decode(x, q1, am1, lut, b1, has_b1, s, k_dim, n_dim, bs_shift):")
        a("    m_dim = 1")
        a(f"    parts = int64(cuda.gridDim.x){f' * int64({groups})' if groups > 1 else ''}")
    else:
        a("def decode(x, q1, am1, q3, am3, lut, b1, b3, s, m_dim, k_dim, n_dim, bs_shift, parts, has_b1, has_b3):")
    nib = nib and not pair
    if pair:
        a("    tab = cuda.shared.array(0, uint64)")
    elif h2:
        a("    tab = cuda.shared.array(0, uint32)")
        a(f"    xmax = cuda.shared.array({NWMAX * mt}, float32)")
    elif nib:
        a("    tab = cuda.shared.array(1024, uint32)")
    else:
        a("    tab = cuda.shared.array(16, uint32)")
    a(f"    red = cuda.shared.array({2 * NWMAX * nv}, float32)")
    a(f"    simred = cuda.shared.array({1024 * nv if SIM else 1}, float32)")
    a(f"    pv = cuda.local.array({nv}, float32)")
    a("    tid = uint32(cuda.threadIdx.x)")
    a("    nthreads = uint32(cuda.blockDim.x)")
    a("    lane = tid & U31")
    a("    warp = tid >> U5")
    a("    nwarps = nthreads >> U5")
    tg = "tid"          # the thread's index in its group
    if groups > 1:
        tg = "tg"
        a(f"    gthreads = nthreads // uint32({groups})")
        a("    grp = tid // gthreads")
        a("    tg = uint32(tid - grp * gthreads)")
        a("    gwarps = gthreads >> U5")
    tsrc = ["    i = tid"]      # the table build: emitted before or (early) after the first loads
    t_ = tsrc.append

    if pair:        # unrolled by 4 (independent loads and stores in flight), then the remainder
        ent = ("uint64(f2u(lut[(I >> U4) >> U4])) | (uint64(f2u(lut[(I >> U4) & U15])) << U32)" if matmul else
               "lut[I >> U4]")   # matmul: from the 16 fp32 code values: low half code[v >> 4], high half code[v & 15]
        iu4 = ("i", "i1", "i2", "i3")   # entries i + u * nthreads: their loads before their stores
        t_("    n3 = nthreads * U3")
        t_("    while i + n3 < U4096:")
        for u, iu in enumerate(iu4):
            if u:
                t_(f"        {iu} = i + nthreads * uint32({u})")
            t_(f"        e{u} = {ent.replace('I', iu)}")
        for u, iu in enumerate(iu4):
            t_(f"        tab[(({iu} >> U4) << U5) | ({iu} & U15)] = e{u}")
        t_("        i = uint32(i + (nthreads << uint32(2)))")
        t_("    while i < U4096:")
        t_(f"        tab[((i >> U4) << U5) | (i & U15)] = {ent.replace('I', 'i')}")
    elif h2:       # half2.h2_table_src: the values are the code values times half2.h2_scale (matmul: built from
                   # lut[0..16]; else the host's lut)
        tsrc[:] = half2.h2_table_src(matmul, vec_table)
    elif nib:      # 512 stores: entry i >> 5, lane copy i & 31
        t_("    while i < uint32(512):")
        t_("        tab[((i >> U5) << uint32(6)) | (i & U31)] = f2u(lut[i >> U5])" if matmul else
           "        tab[((i >> U5) << uint32(6)) | (i & U31)] = lut[i >> U5]")
    else:
        t_("    while i < U16:")
        t_("        tab[i] = f2u(lut[i])" if matmul else "        tab[i] = lut[i]")
    if not h2:
        t_("        i = uint32(i + nthreads)")
    if not (early and prefetch):
        src.extend(tsrc)
    a("    lane8 = (tid & U15) << U3")
    a("    lane4 = lane << uint32(2)")
    # a thread's unit of each row: one 8-byte word, or (wide, K % 32 == 0) two words read as one 16-byte chunk;
    # wpr units per row, absmax block of unit i: i >> sh
    a(f"    wpr = uint32(k_dim) >> {'U5' if wide else 'U4'}")
    a(f"    sh = uint32(bs_shift){' - U1' if wide else ''}")
    a(f"    owns = {tg} < wpr")
    a(f"    tcl = {tg} if owns else wpr - U1   # non-owners (last warp) read a valid unit; their x and scales are 0")
    a(f"    nch = (uint32(m_dim) + uint32({mt - 1})) // uint32({mt})")
    a("    bid = uint32(cuda.blockIdx.x)")
    a(f"    m0 = uint32(bid % nch) * uint32({mt})")
    a("    part = uint32(bid // nch)" + (f" * uint32({groups}) + grp" if groups > 1 else ""))
    a("    n_lo = uint32(int64(part) * n_dim // parts)")
    a("    n_hi = uint32(int64(part + U1) * n_dim // parts)")
    a("    mdim = uint32(m_dim)")
    a("    ndim = uint32(n_dim)")
    for m in range(mt):
        a(f"    okx = owns and m0 + uint32({m}) < mdim")
        a(f"    xb = uint32(uint32((m0 + uint32({m})) * uint32(k_dim)) + ({tg} << {'U5' if wide else 'U4'}))")
        a("    if okx:     # 16-byte loads (X's base 16-byte aligned: the hosts check)")
        for e in range(0, ne, 8):
            a("        " + ", ".join(f"x_{m}_{e + j}" for j in range(8)) + f" = ldx8(x, (xb >> U3) + uint32({e // 8}))")
        a("    else:")
        for e in range(ne):
            a(f"        x_{m}_{e} = F0")
        if int4:
            a(f"    xsum_{m} = " + " + ".join(f"x_{m}_{e}" for e in range(16)))
        if h2:      # the row's largest |x| over the block (NaN ignored), for its power-of-two scale: a tree of
                    # fmax (depth 5 for 32 values; a chain took ~6% of the kernel's warp time), then the warp's max
            lv = [f"abs(x_{m}_{e})" for e in range(ne)]
            t = 0
            while len(lv) > 1:
                nxt = []
                for i in range(0, len(lv) - 1, 2):
                    a(f"    xt{t} = fmax({lv[i]}, {lv[i + 1]})")
                    nxt.append(f"xt{t}")
                    t += 1
                lv = nxt + lv[len(lv) - len(lv) % 2:]
            a(f"    xm = warp_max({lv[0]}, simred, tid)")
            a("    if lane == U0:")
            a(f"        xmax[uint32({m * NWMAX}) + warp] = xm")
    a("    my_idx = uint32(0)")
    for st in range(steps):
        a(f"    my_idx += ((lane >> uint32({4 - st})) & U1) * uint32({nv >> (st + 1)})")
    a(f"    writer = (lane & uint32({(1 << low) - 1})) == uint32(0)")
    for c in range(1, cols + 1):
        a(f"    cw_{c} = wpr * uint32({c})")
    a("    cw_0 = uint32(0)")
    a("    last = n_hi - U1 if n_lo < n_hi else n_lo    # a valid row even for an empty slice (grid > N)")
    n_end = "n_hi"
    if groups > 1:      # every group walks the longest slice's steps (the barrier is the block's)
        n_end = "n_stop"
        a("    mc = uint32((int64(n_dim) + parts - int64(1)) // parts)")
        a(f"    n_stop = add32(n_lo, ((mc + uint32({cols - 1})) // uint32({cols})) * uint32({cols}))")

    def loads(out, prefix, nbase, wbase, ind):
        """Loads of the step at column nbase (word index of its first column: wbase): unchecked when the whole
        step is inside the slice, else with the columns clamped to the slice's last one (never stored)."""
        out(f"{ind}if add32({nbase}, uint32({cols})) <= n_hi:")
        for c in range(cols):
            out(f"{ind}    wi_{c} = add32({wbase}, cw_{c})")
        out(f"{ind}else:")
        for c in range(cols):
            out(f"{ind}    wi_{c} = mad32(min32(add32({nbase}, uint32({c})), last), wpr, tcl)")
        for c in range(cols):
            for w in (1,) if matmul else (1, 3):
                if wide:    # 16 bytes: the two words as 4 uint32 halves, low first
                    out(f"{ind}" + ", ".join(f"{prefix}w{w}_{c}_{h}" for h in range(4)) + f" = ld4(q{w}, wi_{c})")
                else:
                    out(f"{ind}{prefix}w{w}_{c} = q{w}[wi_{c}]")
            cvt = "h2f" if am16 else "float32"     # am16: absmax as fp16 bits
            out(f"{ind}{prefix}s1_{c} = {cvt}(am1[shr32(wi_{c}, sh)]) if owns else F0")
            if int4:
                out(f"{ind}{prefix}z1_{c} = zval(zp1, shr32(wi_{c}, sh), has_zp)")
            if not matmul:
                out(f"{ind}{prefix}s3_{c} = {cvt}(am3[shr32(wi_{c}, sh)]) if owns else F0")

    a("    n0 = n_lo")
    a("    wb = mad32(n_lo, wpr, tcl)")
    if prefetch:
        loads(a, "", "n0", "wb", "    ")
    if early and prefetch:
        src.extend(tsrc)
    a("    cuda.syncthreads()")
    if h2:
        a("    ia = lut[17]" if matmul else "    ia = as_f32(lut[U256])")
        for m in range(mt):     # p = 2^(11 - floor(log2 max|x|)): |x p| < 2^12, a chain of 4 products < 2^15
            a("    xm = F0")
            a("    wj = uint32(0)")
            a("    while wj < nwarps:")
            a(f"        av = xmax[uint32({m * NWMAX}) + wj]")
            a("        xm = av if av > xm else xm")
            a("        wj = uint32(wj + U1)")
            a("    eb = (f2u(xm) >> uint32(23)) & uint32(255)")
            a("    okp = eb >= uint32(11) and eb != uint32(255)")
            a(f"    p_{m} = as_f32((uint32(265) - eb) << uint32(23)) if okp else F1")
            a(f"    ip_{m} = (as_f32((eb - uint32(11)) << uint32(23)) if okp else F1) * ia   # and 1 / h2_scale")
            for j in range(ne // 2):
                a(f"    x2_{m}_{j} = pack_h2(x_{m}_{2 * j} * p_{m}, x_{m}_{2 * j + 1} * p_{m})")
    a("    buf = uint32(0)")
    a(f"    while n0 < {n_end}:")
    body = []
    b_ = body.append
    b_("nn = add32(n0, uint32(%d))" % cols)
    b_(f"wbn = add32(wb, cw_{cols})")
    if prefetch:        # the next step's words (clamped past the slice: never stored)
        loads(b_, "n", "nn", "wbn", "")
    else:
        loads(b_, "", "n0", "wb", "")
    nch2 = ne // 2 // h2 if h2 else 0   # fp16 chains per row and step (h2 bytes each)
    for c in range(cols if h2 else 0):
        for wsel in (1,) if matmul else (1, 3):
            for half in range(ne // 8):
                if wide:
                    b_(f"wd = w{wsel}_{c}_{half}")
                else:
                    b_(f"wd = uint32(w{wsel}_{c} & M32)" if half == 0 else f"wd = uint32(w{wsel}_{c} >> U32)")
                for b in range(4):
                    j = half * 4 + b
                    b_(f"t = lds32(tab, prmt(wd, lane4, SEL_{b}))")
                    for m in range(mt):
                        hv = f"h{j // h2}_{m}"
                        b_(f"{hv} = hfma2(t, x2_{m}_{j}, {'H0' if j % h2 == 0 else hv})")
            for m in range(mt):
                idx = ((0 if wsel == 1 else 1) * cols + c) * mt + m
                tot = " + ".join(f"hsum2(h{2 * i}_{m}, h{2 * i + 1}_{m})" for i in range(nch2 // 2))
                b_(f"pv[{idx}] = ({tot}) * s{wsel}_{c}")
    for c in range(0 if h2 else cols):
        for wsel in (1,) if matmul else (1, 3):
            for m in range(mt):
                b_(f"acc_{m} = F0")
            for half in range(2):
                b_(f"wd = uint32(w{wsel}_{c} & M32)" if half == 0 else f"wd = uint32(w{wsel}_{c} >> U32)")
                if nib:
                    b_("wl = wd & NIBS")                 # the low nibble of each byte, as a byte
                    b_("wh = (wd >> U4) & NIBS")         # the high nibble of each byte
                for b in range(4):
                    e0 = half * 8 + 2 * b
                    if pair:
                        b_(f"ent = lds64(tab, prmt(wd, lane8, SEL_{b}))")
                        b_("c0 = as_f32(ent & M32)")
                        b_("c1 = as_f32(ent >> U32)")
                    elif nib:
                        b_(f"c0 = as_f32(lds32(tab, prmt(wh, lane4, SEL_{b})))")
                        b_(f"c1 = as_f32(lds32(tab, prmt(wl, lane4, SEL_{b})))")
                    else:       # element 2b = high nibble of byte b (bits 8b+4..8b+7), 2b+1 = low nibble
                        b_(f"c0 = as_f32(lds32(tab, (wd >> uint32({8 * b + 2})) & U60))")
                        b_(f"c1 = as_f32(lds32(tab, (wd >> uint32({8 * b - 2})) & U60))" if b else
                           "c1 = as_f32(lds32(tab, (wd << uint32(2)) & U60))")
                    e_hi, e_lo = (e0 + 1, e0) if int4 else (e0, e0 + 1)   # int4: element 2b in the low nibble
                    for m in range(mt):
                        b_(f"acc_{m} += c0 * x_{m}_{e_hi}")
                        b_(f"acc_{m} += c1 * x_{m}_{e_lo}")
            for m in range(mt):
                idx = ((0 if wsel == 1 else 1) * cols + c) * mt + m
                if int4:
                    b_(f"pv[{idx}] = (acc_{m} - z1_{c} * xsum_{m}) * s1_{c}")
                else:
                    b_(f"pv[{idx}] = acc_{m} * s{wsel}_{c}")
    b_("tot = rs(pv, lane, simred, tid)")
    b_("if writer:")
    b_(f"    red[mad32(mad32(buf, uint32({NWMAX}), warp), uint32({nv}), my_idx)] = tot")
    b_("cuda.syncthreads()")
    b_(f"if {tg} < uint32({cols * mt}):")
    b_(f"    c = {tg} // uint32({mt})")
    b_(f"    m = uint32({tg} - c * uint32({mt}))")
    b_("    n = add32(n0, c)")
    b_("    if n < n_hi and add32(m0, m) < mdim:")
    b_("        g = F0")
    if not matmul:
        b_("        u = F0")
    b_(f"        r = mad32(buf, uint32({NWMAX * nv}), mad32(c, uint32({mt}), m))")
    if groups > 1:      # the group's warps' partials
        b_(f"        r = mad32(grp * gwarps, uint32({nv}), r)")
    b_("        wj = uint32(0)")
    b_(f"        while wj < {'gwarps' if groups > 1 else 'nwarps'}:")
    b_("            g += red[r]")
    if not matmul:
        b_(f"            u += red[r + uint32({cols * mt})]")
    b_(f"            r = add32(r, uint32({nv}))")
    b_("            wj = add32(wj, U1)")
    if h2:              # undo the rows' power-of-two scale
        b_("        ipm = " + " if m == U0 else ".join(f"ip_{m}" for m in range(mt)))
        b_("        g *= ipm")
        if not matmul:
            b_("        u *= ipm")
    if matmul:
        b_("        if has_b1:")
        b_("            g += float32(b1[n])")
        b_("        s[n] = g" if mt == 1 else "        s[mad32(add32(m0, m), ndim, n)] = g")
    else:
        b_("        if has_b1:")
        b_("            g += load(b1, n)")
        b_("        if has_b3:")
        b_("            u += load(b3, n)")
        b_("        store(s, mad32(add32(m0, m), ndim, n), silu(g) * u)")
    b_("buf ^= U1")
    b_("n0 = nn")
    b_("wb = wbn")
    if prefetch and pingpong:
        swap = re.compile(r"\b(n?)((?:w1|w3|s1|s3|z1)_\d+(?:_\d)?)\b")
        src.extend("        " + line for line in body)
        src.append(f"        if n0 >= {n_end}:")
        src.append("            break")
        src.extend("        " + swap.sub(lambda mo: ("" if mo.group(1) else "n") + mo.group(2), line) for line in body)
    else:
        for c in range(cols if prefetch else 0):
            for v in ("w1", "s1", "z1") if int4 else ("w1", "s1") if matmul else ("w1", "w3", "s1", "s3"):
                for sfx in ([f"_{h}" for h in range(4)] if wide and v[0] == "w" else [""]):
                    b_(f"{v}_{c}{sfx} = n{v}_{c}{sfx}")
        src.extend("        " + line for line in body)
    ns = {"cuda": cuda, "float32": float32, "uint32": uint32, "uint64": uint64, "int64": int64, "as_f32": as_f32,
          "load": _ld16 if a16 else _ld32, "store": _st16 if a16 else _st32, "silu": _silu, "rs": _make_rs(nv),
          "prmt": prmt, "lds64": lds64, "lds32": lds32, "add32": add32, "mad32": mad32, "shr32": shr32,
          "min32": min32, "f2u": f2u, "zval": _zval, "hfma2": hfma2, "hsum2": half2.hsum2,
          "pack_h2": pack_h2, "h2f": h2f, "warp_max": half2.warp_max, "fmax": half2.fmax, "ld4": _ld4w,
          "ldx8": half2.ldx8, "sts4": half2.sts4,
          "F0": np.float32(0.0), "F1": np.float32(1.0), "H0": np.uint32(0), "M32": M32, "U32": U32,
          "NIBS": np.uint32(0x0F0F0F0F)}
    ns.update({f"U{v}": np.uint32(v) for v in (0, 1, 3, 4, 5, 15, 16, 31, 60, 256, 4096)})
    # PRMT selectors: output byte 0 = lane8 (byte 4 of b:a), byte 1 = byte b of the word, bytes 2, 3 = 0 (byte 5)
    ns.update({f"SEL_{b}": np.uint32(0x5504 | (b << 4)) for b in range(4)})
    exec("\n".join(src), ns)  # noqa: S102 - generated from constants only
    opts = {} if SIM or not max_registers else {"max_registers": max_registers}
    return cuda.jit(**opts)(ns["decode"])


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
def lut_for(code, pair=True, h2=False):
    """The decode kernel's table: pair -> uint64 [256], entry b = fp32 bits of code[b >> 4] (low half, the first
    element of the byte) | code[b & 15] << 32; h2 -> uint32 [257], the same two values times a = half2.h2_scale(code)
    as fp16 bits (RNE), then the fp32 bits of 1 / a; else the 16 fp32 code values' bits (uint32)."""
    if h2:
        a = half2.h2_scale(code)
        c16 = (np.ascontiguousarray(code, np.float32) * a).astype(np.float16).view(np.uint16).astype(np.uint32)
        b = np.arange(256)
        tab = (c16[b >> 4] | (c16[b & 15] << np.uint32(16))).astype(np.uint32)
        return np.append(tab, (np.float32(1) / a).view(np.uint32))
    code = np.ascontiguousarray(code, np.float32).view(np.uint32).astype(np.uint64)
    if not pair:
        return code.astype(np.uint32)
    b = np.arange(256)
    return (code[b >> 4] | (code[b & 15] << np.uint64(32))).astype(np.uint64)


def decode_ok(m, k):
    return 0 < m <= MAX_M_FAST and k % 16 == 0 and k // 16 <= MAX_WPR


def bucket(m):
    return 1 if m == 1 else 2


def threads(k, wide=False):
    return m1_block(k, wide)


def parts_for(n, nch, sms, occupancy, cols=COLS, groups=1):
    """Column slices: at most sms * occupancy blocks in all (one wave), every slice the same number of steps
    (nf4_common.even_parts); with ``groups`` per block, a multiple of groups (the grid is nch * parts / groups)."""
    parts = nf4_common.even_parts(-(-n // cols), max(1, (sms * occupancy * groups) // nch))
    return -(-parts // groups) * groups


def _sig(a16, generic, pair=True, am16=False):
    from .cuda_launch import Array
    t = Array(np.uint16) if a16 else Array(np.float32)
    q = Array(np.uint8) if generic else Array(np.uint64)
    tab = Array(np.float32) if generic else Array(np.uint64 if pair else np.uint32)
    am = Array(np.uint16) if am16 else Array(np.float32)
    return [t, q, am, q, am, tab, t, t, t] + ["int64"] * (6 if generic else 7)


_launchers = {}


fp32_decode = half2.fp32_decode


def warpcols_plan(m, k, a16, bs):
    """(warps per block, warps per column) of the warp-column kernel for this call (WARPCOLS), or None for the
    block kernels (also with ONNX_LOWBIT_FP32_DECODE=1: it is a packed-fp16 decode)."""
    plan = WARPCOLS.get((m, k // nf4warp_cuda.CHUNK))
    if plan is None or fp32_decode() or not nf4warp_cuda.ok(m, k, a16, bs, plan[1]):
        return None
    return plan


def groups_for(mt, h2, wide, occ1, occ=None):
    """Thread groups per block of the decode kernel: GROUPS[mt] for the packed-fp16 wide decode where one-group blocks
    fit that many per SM (``occ1``: the table, not registers, bounds them) and the grouped block fits at all (``occ``,
    its resident blocks per SM, a callable asked only then); else 1."""
    g = GROUPS.get(mt, 1) if h2 and wide else 1
    return g if g > 1 and occ1 >= g and (occ is None or occ(g) >= 1) else 1


def grouped_card():
    """Whether the current device is one GROUPS_CARDS names."""
    name = getattr(cuda.get_current_device(), "name", b"")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return any(c in name for c in GROUPS_CARDS)


def pick_groups(a16, mt, h2, wide, k, pingpong):
    """groups_for with the occupancies of the session's launchers on a card GROUPS_CARDS names, else 1 (the
    simulator: DEFAULT_BLOCKS_PER_SM, any card)."""
    if SIM:
        return groups_for(mt, h2, wide, DEFAULT_BLOCKS_PER_SM)
    if not grouped_card():
        return 1
    lau = lambda g: launcher(a16, mt, h2=h2, wide=wide, pingpong=pingpong, groups=g)  # noqa: E731
    return groups_for(mt, h2, wide, blocks_per_sm(lau(1), threads(k, wide)),
                      lambda g: lau(g).blocks_per_sm(threads(k, wide) * g))


def pingpong_for(wide, prefetch=True):
    """Whether the decode kernel runs its step loop with two word buffers (PINGPONG_WIDE: the wide decode's)."""
    return bool(wide and prefetch and PINGPONG_WIDE)


def table_choice(mt, pair=None, early=None, nib=None, h2=None, a16=True, wide=None, k=None):
    """(pair, early, nib, h2, wide) of row bucket ``mt``'s decode kernel: the given values, else the defaults PAIR /
    EARLY / NIB / H2 (with fp16 X from K = WIDE_MIN_K, K % 32 == 0: WIDE with chains of H2_WIDE; h2 only with fp16 X;
    it replaces the pair and nib tables and early; wide only with h2 and, when ``k`` is given, K % 32 == 0)."""
    big = k is not None and k >= WIDE_MIN_K and k % 32 == 0 and WIDE.get(mt, False) and wide is not False
    if not a16:
        h2 = 0
    elif h2 is None:
        h2 = 0 if fp32_decode() else H2_WIDE[mt] if big else H2.get(mt, 0)
    h2 = int(h2)
    if wide is None:
        wide = WIDE.get(mt, False) and (k is None or k >= WIDE_MIN_K)
    wide = bool(h2) and bool(wide) and (k is None or k % 32 == 0)
    return ((PAIR.get(mt, True) if pair is None else pair) and not h2,
            (EARLY.get(mt, False) and not h2 if early is None else early),
            (NIB.get(mt, False) if nib is None else nib) and not h2, h2, wide)


def launcher(a16, mt, pair=None, cols=COLS, prefetch=True, pingpong=False, max_registers=None, early=None,
             nib=None, h2=None, wide=None, am16=False, vec_table=None, groups=1):
    """Direct-launch wrapper (compiled once per process): the decode kernel of bucket ``mt``, or the generic
    kernel for mt=None. ``.dispatcher`` is the Numba kernel (register / local memory queries)."""
    from .cuda_launch import Launcher
    pair, early, nib, h2, wide = table_choice(mt, pair, early, nib, h2, a16, wide)
    vec_table = half2.VEC_TABLE if vec_table is None else vec_table
    key = (a16, mt) + ((pair, cols, prefetch, pingpong, max_registers, early, nib, h2, wide, am16, vec_table, groups)
                       if mt else ())
    if key not in _launchers:
        fn = _make_generic(a16) if mt is None else _make_decode(mt, a16, pair, cols, prefetch, max_registers,
                                                                 pingpong=pingpong, early=early, nib=nib, h2=h2,
                                                                 wide=wide, am16=am16, vec_table=vec_table,
                                                                 groups=groups)
        lau = Launcher(fn, _sig(a16, mt is None, pair, am16), dynamic_shared=TAB_BYTES if mt and (pair or h2) else 0)
        lau.dispatcher = fn
        _launchers[key] = lau
    return _launchers[key]


def blocks_per_sm(launcher_, block):
    """Resident blocks per SM with the launcher's 64 KiB of dynamic shared memory (at least 1)."""
    return max(1, launcher_.blocks_per_sm(block))


def run_arrays(x, q1, am1, q3, am3, quant_type, block_size, K, N, b1=None, b3=None, *,  # noqa: N803
               force_generic=False, pair=None, cols=COLS, prefetch=True, pingpong=None, max_registers=None, sms=None,
               repeat=1, early=None, nib=None, h2=None, wide=None, groups=None):
    """Runs the kernel on host arrays (tests, benchmark) and returns S: through the Numba dispatcher under the
    CUDA simulator, through the direct launch path on a GPU. Inputs are checked as in a session."""
    qt, bs, k, n, code = nf4_common.parse_attrs({"quant_type": quant_type, "block_size": block_size, "K": K, "N": N})
    check_weights(q1, am1, q3, am3, k, n, bs)
    m = check_x_biases(x, b1, b3, k, n, 5, 6)
    lead = tuple(x.shape[:-1])
    if m == 0:
        return np.empty(lead + (n,), x.dtype)
    a16 = x.dtype == np.float16
    wcp = warpcols_plan(m, k, a16, bs)
    if wcp and not force_generic and (pair, early, nib, h2, wide) == (None,) * 5 and cols == COLS and prefetch \
            and not pingpong:      # the default at this shape: the warp-column kernel
        return nf4warp_cuda.run_arrays(x, q1, am1, q3, am3, quant_type, block_size, k, n, b1, b3,
                                       warps=2 * wcp[1] if SIM else wcp[0], sms=sms, blocks=2 if SIM else None,
                                       split=wcp[1])
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
        pair, early, nib, h2, wide = table_choice(mt, pair, early, nib, h2, a16, wide, k)
        if pingpong is None:    # as sessions
            pingpong = pingpong_for(wide, prefetch)
        if groups is None:      # as sessions
            groups = pick_groups(a16, mt, h2, wide, k, pingpong) if (pair, early, nib, cols, prefetch,
                                                                      max_registers) == (False, False, False, COLS,
                                                                                         True, None) else 1
        nch = -(-m // mt)
        block = threads(k, wide) * groups
        if SIM:
            occ = DEFAULT_BLOCKS_PER_SM
        else:
            occ = blocks_per_sm(launcher(a16, mt, pair, cols, prefetch, pingpong, max_registers, early, nib, h2,
                                         wide, groups=groups), block)
        if sms is None:
            if SIM:
                sms = 2
            else:
                from .cuda_launch import current_device, sm_count
                sms = sm_count(current_device())
        parts = parts_for(n, nch, sms, occ, cols, groups)
        grid = nch * parts // groups
        args = (dx, dev(q1, np.uint64), dam1, dev(q3, np.uint64), dam3, cuda.to_device(lut_for(code, pair, h2)), db1, db3,
                ds, m, k, n, bs.bit_length() - 5, parts, int(b1 is not None), int(b3 is not None))
    if SIM:
        kern = _make_generic(a16, gw) if generic else _make_decode(mt, a16, pair, cols, prefetch, pingpong=pingpong,
                                                                   early=early, nib=nib, h2=h2, wide=wide,
                                                                   groups=groups)
        for _ in range(repeat):
            kern[grid, block, 0, 0 if generic or not (pair or h2) else TAB_BYTES](*args)
    else:
        from .cuda_launch import arg as p
        lau = launcher(a16, mt, pair, cols, prefetch, pingpong, max_registers, early, nib, h2, wide, groups=groups)
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
        self.code = cuda.to_device(code)
        self.code_arg = (self.code.device_ctypes_pointer.value, (16,))
        self.generic = launcher(self.a16, None)
        self.sms = sm_count(current_device())
        self.fast, self.parts = {}, {}
        self.tc = None      # the tensor-core decode kernel (fp16 X, M = TC_MIN_M .. 16; nf4tc_cuda)
        if self.a16 and nf4tc_cuda.ok(True, TC_MIN_M, self.k, self.n, self.bs) and tc_device():
            self.tc = nf4tc_cuda.SessionKernels(2, self.n, self.sms)
            self.tc_lut = cuda.to_device(nf4tc_cuda.lut(code))
        self.mma = None     # the balanced tensor-core kernel at M in mma_ms (nf4mma_cuda)
        self.mma_ms = {m for m in MMA_M if nf4mma_cuda.ok(True, m, self.k, self.n, self.bs)}
        if self.tc is not None and self.mma_ms and self.k * self.n >= MMA_MIN_KN:
            from .matmulawq_cuda import ScratchPool
            mm = nf4mma_cuda.mm_for(max(MMA_M))
            self.mma = nf4mma_cuda.launcher(2, mm)
            self.mma_shm = nf4mma_cuda.shared_bytes(2, mm)
            occ = max(1, self.mma.blocks_per_sm(32 * nf4mma_cuda.WARPS, self.mma_shm))
            self.mma_blocks = nf4mma_cuda.plan_blocks(self.k, self.n, self.sms, occ)
            pf, nc = nf4mma_cuda.scratch(2, mm, self.mma_blocks, self.k, self.n)
            self.mma_scratch = ScratchPool(pf, nc)
            self.mma_floats = pf
        self.block, self.align, self.luts, self.lut_args, self.groups = {}, {}, {}, {}, {}

        def lut_arg(pair, h2):
            """(pointer, shape) of the device table; one copy per table (the h2 one serves every chain length)."""
            key = (pair and not h2, bool(h2))
            if key not in self.luts:
                self.luts[key] = cuda.to_device(lut_for(code, pair, h2))
            return self.luts[key].device_ctypes_pointer.value, (self.luts[key].size,)
        self.wc = {}        # M -> (launcher, block, grid) of the warp-column kernel (nf4warp_cuda; WARPCOLS)
        for m in (1, 2):
            plan = warpcols_plan(m, self.k, self.a16, self.bs)
            if plan:
                lau = nf4warp_cuda.launcher(self.k // nf4warp_cuda.CHUNK, split=plan[1], mt=m)
                self.wc[m] = (lau, 32 * plan[0], nf4warp_cuda.grid_for(lau, plan[0], self.sms))
        if self.wc:
            self.wc_lut = lut_arg(False, True)
        if self.k % 16 == 0 and self.k // 16 <= MAX_WPR:
            for mt in MT_BUCKETS:   # compiled and planned now, never on the hot path
                pair, _, _, h2, wide = table_choice(mt, a16=self.a16, k=self.k)
                self.lut_args[mt] = lut_arg(pair, h2)
                self.groups[mt] = pick_groups(self.a16, mt, h2, wide, self.k, pingpong_for(wide))
                self.block[mt] = threads(self.k, wide) * self.groups[mt]
                self.align[mt] = 15 if wide else 7      # 16- / 8-byte weight loads
                self.fast[mt] = launcher(self.a16, mt, h2=h2, wide=wide, pingpong=pingpong_for(wide),
                                         groups=self.groups[mt])
                occ = blocks_per_sm(self.fast[mt], self.block[mt])
                for m in range(1, MAX_M_FAST + 1):
                    if bucket(m) == mt:
                        self.parts[m] = parts_for(self.n, -(-m // mt), self.sms, occ, groups=self.groups[mt])

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
        if self.mma is not None and m in self.mma_ms and not ((x.ptr | q1.ptr | q3.ptr) & 15):
            blocks = self.mma_blocks
            self.mma.launch(blocks, 32 * nf4mma_cuda.WARPS, ctx.stream, (x.ptr, (m * k // 2,)),
                            (q1.ptr, (q1.size // 4,)), (am1.ptr, (am1.size,)), (q3.ptr, (q3.size // 4,)),
                            (am3.ptr, (am3.size,)), (self.tc_lut.device_ctypes_pointer.value, (256,)), *tail,
                            self.mma_scratch.partials(ctx, self.mma_floats), self.mma_scratch.counters(ctx.stream),
                            m, k, n, self.bs.bit_length() - 1, blocks, hb1, hb3, shmem=self.mma_shm)
            return
        if self.tc is not None and TC_MIN_M <= m <= nf4tc_cuda.MAX_M and not ((x.ptr | q1.ptr | q3.ptr) & 7):
            lau, grid_, block, parts, _ = self.tc.pick(m)
            lau.launch(grid_, block, ctx.stream, (x.ptr, (m * k // 4,)),
                       (q1.ptr, (q1.size // 8,)), (am1.ptr, (am1.size,)), (q3.ptr, (q3.size // 8,)),
                       (am3.ptr, (am3.size,)), (self.tc_lut.device_ctypes_pointer.value, (256,)), *tail, m, k, n,
                       self.bs.bit_length() - 1, parts, hb1, hb3)
            return
        if m in self.wc and not ((x.ptr | q1.ptr | q3.ptr) & 15):    # 16-byte loads
            lau, block, grid = self.wc[m]
            lau.launch(grid, block, ctx.stream, *common, (q1.ptr, (q1.size // 8,)), (am1.ptr, (am1.size,)),
                       (q3.ptr, (q3.size // 8,)), (am3.ptr, (am3.size,)),
                       self.wc_lut, *tail, m, k, n, self.bs.bit_length() - 5,
                       grid, hb1, hb3)
            return
        mt = bucket(m)
        if m in self.parts and not ((q1.ptr | q3.ptr) & self.align[mt] or x.ptr & 15):   # 16-byte loads of X
            parts = self.parts[m]
            self.fast[mt].launch(-(-m // mt) * parts // self.groups[mt], self.block[mt], ctx.stream, *common,
                                 (q1.ptr, (q1.size // 8,)), (am1.ptr, (am1.size,)), (q3.ptr, (q3.size // 8,)),
                                 (am3.ptr, (am3.size,)), self.lut_args[mt], *tail, m, k, n, self.bs.bit_length() - 5,
                                 parts, hb1, hb3)
        else:
            self.generic.launch(-(-n // GEN_WARPS), 32 * GEN_WARPS, ctx.stream, *common, (q1.ptr, (q1.size,)),
                                (am1.ptr, (am1.size,)), (q3.ptr, (q3.size,)), (am3.ptr, (am3.size,)), self.code_arg,
                                *tail, m, k, n, self.bs, hb1, hb3)


KERNEL = FusedFFNNF4CudaKernel

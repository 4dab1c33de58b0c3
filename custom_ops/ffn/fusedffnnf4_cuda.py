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
K measured (BENCHMARKS.md, session 13). The same generator (matmul=True) builds MatMulNF4's M=1 kernel; it lives in
nf4/decode_cuda.py (``make_decode``).
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


import numpy as np
from numba import cuda, float32, int64

from ..device import half2, launch as cuda_launch
from ..device.inputs import check_x_biases
from ..device.launch import Launcher, arg
from ..device.memory import ld16, ld32, st16, st32
from ..device.mma import silu
from ..device.ptx import warp_sum
from ..device.splitk import ScratchPool
from ..device.target import SIM, tc_device
from ..nf4 import common as nf4_common, nf4mma_cuda, nf4tc_cuda, nf4warp_cuda
from ..nf4.common import check_weights
from ..nf4.decode_cuda import COLS, lut_for, make_decode, sig
from ..nf4.matmulnf4_cuda import TAB_BYTES, m1_block
from ..runtime.kernels import Kernel, KernelError
from .common4 import opt

MT_BUCKETS = (1, 2)       # rows per block (x kept in registers: 16 * MT floats per thread)
MAX_M_FAST = 16
MAX_WPR = 1024            # words per row the decode kernel takes (K <= 16384)
GEN_WARPS = 8
DEFAULT_BLOCKS_PER_SM = 4
NIB = {1: True, 2: False}   # per row bucket: the 16-entry table addressed by PRMT (``nib``; pair=False only).
                            # H100, M=1, weights cycled past L2 (benchmarks/nf4shapes_gpu.py, BENCHMARKS.md): 25.5 us
                            # against 27.1 at 4096 -> 2 x 11008, 14.0 against 14.5 at 2048 -> 2 x 8192
H2 = {1: 2, 2: 0}          # per row bucket, fp16 X only: the packed-fp16 decode with chains of this many products
                            # (0: off; ``h2``, see decode_cuda.make_decode). Weights cycled past L2, M=1 (benchmarks/
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


# ------------------------------------------------------------------------------------------------- host side
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
    pair, early, nib, h2, wide = table_choice(mt, pair, early, nib, h2, a16, wide)
    vec_table = half2.VEC_TABLE if vec_table is None else vec_table
    key = (a16, mt) + ((pair, cols, prefetch, pingpong, max_registers, early, nib, h2, wide, am16, vec_table, groups)
                       if mt else ())
    if key not in _launchers:
        fn = _make_generic(a16) if mt is None else make_decode(mt, a16, pair, cols, prefetch, max_registers,
                                                                 pingpong=pingpong, early=early, nib=nib, h2=h2,
                                                                 wide=wide, am16=am16, vec_table=vec_table,
                                                                 groups=groups)
        lau = Launcher(fn, sig(a16, mt is None, pair, am16), dynamic_shared=TAB_BYTES if mt and (pair or h2) else 0)
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
                sms = cuda_launch.sm_count(cuda_launch.current_device())
        parts = parts_for(n, nch, sms, occ, cols, groups)
        grid = nch * parts // groups
        args = (dx, dev(q1, np.uint64), dam1, dev(q3, np.uint64), dam3, cuda.to_device(lut_for(code, pair, h2)), db1, db3,
                ds, m, k, n, bs.bit_length() - 5, parts, int(b1 is not None), int(b3 is not None))
    if SIM:
        kern = _make_generic(a16, gw) if generic else make_decode(mt, a16, pair, cols, prefetch, pingpong=pingpong,
                                                                   early=early, nib=nib, h2=h2, wide=wide,
                                                                   groups=groups)
        for _ in range(repeat):
            kern[grid, block, 0, 0 if generic or not (pair or h2) else TAB_BYTES](*args)
    else:
        lau = launcher(a16, mt, pair, cols, prefetch, pingpong, max_registers, early, nib, h2, wide, groups=groups)
        for _ in range(repeat):
            lau.launch(grid, block, 0, *[arg(a) for a in args])
        cuda.synchronize()
    return ds.copy_to_host().view(x.dtype).reshape(lead + (n,))


class FusedFFNNF4CudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes and pointer alignment (see plans.py)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.a16 = self.in_types[0] == 10
        self.code = cuda.to_device(code)
        self.code_arg = (self.code.device_ctypes_pointer.value, (16,))
        self.generic = launcher(self.a16, None)
        self.sms = cuda_launch.sm_count(cuda_launch.current_device())
        self.fast, self.parts = {}, {}
        self.tc = None      # the tensor-core decode kernel (fp16 X, M = TC_MIN_M .. 16; nf4tc_cuda)
        if self.a16 and nf4tc_cuda.ok(True, TC_MIN_M, self.k, self.n, self.bs) and tc_device():
            self.tc = nf4tc_cuda.SessionKernels(2, self.n, self.sms)
            self.tc_lut = cuda.to_device(nf4tc_cuda.lut(code))
        self.mma = None     # the balanced tensor-core kernel at M in mma_ms (nf4mma_cuda)
        self.mma_ms = {m for m in MMA_M if nf4mma_cuda.ok(True, m, self.k, self.n, self.bs)}
        if self.tc is not None and self.mma_ms and self.k * self.n >= MMA_MIN_KN:
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

"""FusedFFNAWQ, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 each stored as MatMulAWQ's weight
(AutoAWQ GEMM layout; onnx_lowbit.awq). One launch; the fp16 weights are never written; SiLU * mul in the
epilogue.

Decode kernel (M <= 16): MatMulAWQ's decode kernel with two weights (matmulawq_cuda.make_gemv, nw=2), reading both
in the same pass: lane = column group c (one int32 = 8 columns of a qweight row; a warp reads 128
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
Generic kernel (any M; matmulawq_cuda.make_generic, nw=2): thread = (row, column group), walks all of K for both
weights; correct, not tuned.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..awq import matmulawq1_cuda
from ..awq.dequantawq_cpu import check_both, parse_attrs
from ..awq.matmulawq_cuda import (MAX_M_FAST, RMAX, TC_MIN_M, TC_WARPS, blocks_per_sm as bps, bucket as awq_bucket,
                                  chunks, make_gemv as awq_gemv, make_generic as awq_generic, plan as awq_plan, tc_ok,
                                  tc_run, tc_setup)
from ..device import launch as cuda_launch
from ..device.inputs import check_x_biases
from ..device.launch import Array, Launcher, arg
from ..device.splitk import ScratchPool, partial_floats
from ..device.target import SIM
from ..runtime.kernels import Kernel, KernelError
from .common4 import opt

CT = 32
WARPS = 8
BLOCK = CT * WARPS
UNROLL = {1: 8, 2: 4, 4: 4}   # per row bucket: qweight words in flight per thread and weight (2 x UNROLL loads,
                              # pipelined); MT=1 measured 28.7 us with 8 against 29.9 with 4 (H100, LLaMA-7B)
MAX_REGISTERS = {1: 96, 2: 80, 4: 128}   # per row bucket: no local-memory spills (ptxas); MT=1 (77 registers):
                                          # 3 blocks of 256 per SM, so LLaMA-7B gate+up (344 blocks) is one wave
MT_BUCKETS = (1, 2, 4)
DEFAULT_BLOCKS_PER_SM = 4


def _make_gemv(mt, a16, ct=CT, warps=WARPS, unroll=None, max_registers=None):
    """The decode kernel for row bucket ``mt``: MatMulAWQ's (matmulawq_cuda.make_gemv) with both weights."""
    return awq_gemv(mt, a16, ct, warps, unroll or UNROLL[mt], max_registers=max_registers or MAX_REGISTERS[mt],
                    nw=2)


def _make_generic(a16, ct=CT, warps=WARPS):
    """The generic kernel (any M): MatMulAWQ's (matmulawq_cuda.make_generic) with both weights."""
    return awq_generic(a16, ct, warps, nw=2)


# ------------------------------------------------------------------------------------------------- host side
def bucket(m):
    """Rows per block for M rows (None: the generic kernel)."""
    return awq_bucket(m, MT_BUCKETS)


def decode_plan(m, K, N, group_size, sms, occupancy=DEFAULT_BLOCKS_PER_SM, ct=CT, warps=WARPS):  # noqa: N803
    """(grid, rows R, splits): MatMulAWQ's plan (matmulawq_cuda.plan) for this kernel's occupancy."""
    mt = bucket(m)
    nch = chunks(m, mt)
    tiles, r, splits = awq_plan(K, N, group_size, sms, ct, warps, occupancy, nch)
    return tiles * splits * nch, r, splits


def _sig(a16, fused):
    t = Array(np.uint16) if a16 else Array(np.float32)
    w = [Array(np.uint32), Array(np.uint32), Array(np.uint16)]
    arrays = [t] + w + w + [t, t, t]
    if fused:
        return arrays + [Array(np.float32), Array(np.uint32)] + ["int64"] * 8
    return arrays + ["int64"] * 6


_launchers = {}


def launcher(a16, mt):
    key = (a16, mt)
    if key not in _launchers:
        fn = _make_generic(a16) if mt is None else _make_gemv(mt, a16)
        lau = Launcher(fn, _sig(a16, mt is not None))
        lau.dispatcher = fn   # register / local memory queries (benchmark)
        _launchers[key] = lau
    return _launchers[key]


def blocks_per_sm(launcher_):
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
        sms = sms or cuda_launch.sm_count(cuda_launch.current_device())
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
        for _ in range(repeat):
            launcher(a16, mt).launch(grid, BLOCK, 0, *[arg(a) for a in args])
        cuda.synchronize()
    return ds.copy_to_host().view(x.dtype).reshape(lead + (N,))


def scratch_size(plans, n):
    """fp32 elements of the partials for ``plans`` {M: (grid, rows, splits)}: splits x 2 x M x N at most."""
    return max(partial_floats(splits, 2, m, n) for m, (_, _, splits) in plans.items())


class FusedFFNAWQCudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; partials per call, per-stream counters live as long as it

    def __init__(self, **kw):
        super().__init__(**kw)
        sh = self.sh = parse_attrs(self.attrs)
        self.a16 = self.in_types[0] == 10
        self.sms = cuda_launch.sm_count(cuda_launch.current_device())
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
        self.m1, acc_size, cnt_size = matmulawq1_cuda.session_setup(self.a16, sh, self.sms, 2, acc_size, cnt_size)
        self.m8, acc_size, cnt_size = matmulawq1_cuda.session_setup(self.a16, sh, self.sms, 2, acc_size, cnt_size, mr=8)
        self.scratch = ScratchPool(acc_size, cnt_size)

    def compute(self, ctx, inputs):
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
        sp = self.m1 if m == 1 else self.m8 if m <= matmulawq1_cuda.SESSION_MAX_M else None
        if sp is not None and matmulawq1_cuda.session_launch(sp, ctx, self.scratch, x, w1, w3, b1, b3, s, sh.N, m):
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

"""DequantAWQ, CUDA face: W[K, N] float16 from AutoAWQ GEMM-layout 4-bit weights (format: dequantawq_cpu).

One kernel (``make``; ROUTES has one row). A block is 32 lanes x 8 warps: lane = column group c (one int32 of a
qweight row = 8 output columns, so a warp reads 128 contiguous bytes of qweight and writes 512 contiguous bytes of
W per row), warp = a contiguous run of rows. Each thread keeps UNROLL independent 4-byte qweight loads in flight,
decodes the 8 nibbles with the float magic-number trick (no int->float conversions: as_float(0x4B000000 | q) =
2^23 + q, so q - z = as_float(0x4B000000|q) - as_float(0x4B000000|z) exactly; the zero points decoded once per
group), multiplies by the fp32 scale (exact), rounds pairs of halves once to fp16 (RNE, one cvt.rn.f16x2.f32:
bit-exact with the reference) and stores a row's 8 halves as one 128-bit streaming store (``st.global.cs.v4.u32``:
the output must be 16-byte aligned). The zero point and 8 scales are reloaded only when a row crosses into the
next group. Grid: ~BLOCKS_PER_SM blocks per SM. H100, 4096 x 11008 -> fp16: 43.6 us, 86.9% of the copy
bandwidth of the same run (BENCHMARKS.md, "Dequant"); the variants it was chosen from are gone (docs/lab-log.md,
"Removed kernel variants (AWQ)").

Also the device helper shared with gemv_cuda (``col_of``: AutoAWQ's column order).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.fp16 import as_f32, h2f, pack_h2
from ..device.launch import Array
from ..device.memory import make_st
from ..device.target import device
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route
from .dequantawq_cpu import check_weights, parse_attrs
from ..device.host import sm_count
from .common_cuda import launcher_for

CT = 32            # column groups per block (lanes)
WARPS = 8          # row runs per block
BLOCK = CT * WARPS
UNROLL = 8         # qweight words in flight per thread
BLOCKS_PER_SM = 12   # the plan's target (H100, benchmarks/dequant_gpu.py, 2026-11-24: 12 of 0, 2 .. 16)
OUT_ALIGN = 16     # bytes: the output is written by 128-bit stores

U0, U1, U2, U3, U4, U15, U16 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 15, 16))
MAGIC = np.uint64(0x4B000000)

ROUTES = (
    Route("dequant", "every call", always,
          "BENCHMARKS.md 'Dequant (DequantNF4, DequantAWQ)' (2026-11-24 night, 86.9% of copy)"),
)


@device
def col_of(j):
    """Column within the group of 8 held by nibble j: AutoAWQ's order [0, 2, 4, 6, 1, 3, 5, 7]."""
    return ((j & 3) << 1) | (j >> 2)


def make(ct=CT, warps=WARPS, unroll=UNROLL):
    """The kernel: ``ct`` lanes (column groups) x ``warps`` row runs per block, ``unroll`` qweight loads in flight
    per thread."""
    st4 = make_st(4, True)

    @cuda.jit
    def dequant(qw, qz, sc, out, k_dim, n_dim, g_size, rows):
        """qw uint32 [Kp*NG], qz uint32 [groups*NG], sc uint16 [groups*N] (fp16 bits), out uint64 [K*N/4];
        ``rows``: rows per warp. Block b: column tile b % tiles, row block b // tiles."""
        tid = uint64(cuda.threadIdx.x)
        lane = tid % uint64(ct)
        warp = tid // uint64(ct)
        n64 = uint64(n_dim)
        ng = n64 >> U3
        tiles = (ng + uint64(ct - 1)) // uint64(ct)
        bid = uint64(cuda.blockIdx.x)
        c = (bid % tiles) * uint64(ct) + lane
        k = ((bid // tiles) * uint64(warps) + warp) * uint64(rows)
        kend = min(k + uint64(rows), uint64(k_dim))
        if c >= ng or k >= kend:
            return
        g64 = uint64(g_size)
        g = k // g64
        gend = (g + U1) * g64
        z = uint64(qz[g * ng + c])
        s = cuda.local.array(8, float32)
        zf = cuda.local.array(8, float32)
        for j in range(8):
            s[j] = h2f(sc[g * n64 + c * uint64(8) + uint64(col_of(j))])
            zf[j] = as_f32(((z >> uint64(4 * j)) & U15) | MAGIC)
        wv = cuda.local.array(unroll, uint32)
        v = cuda.local.array(8, float32)
        hw = cuda.local.array(4, uint32)
        while k < kend:
            for u in range(unroll):
                kk = k + uint64(u)
                wv[u] = qw[kk * ng + c] if kk < kend else uint32(0)
            for u in range(unroll):
                kk = k + uint64(u)
                if kk < kend:
                    if kk >= gend:
                        g += U1
                        gend += g64
                        z = uint64(qz[g * ng + c])
                        for j in range(8):
                            s[j] = h2f(sc[g * n64 + c * uint64(8) + uint64(col_of(j))])
                            zf[j] = as_f32(((z >> uint64(4 * j)) & U15) | MAGIC)
                    w = uint64(wv[u])
                    for j in range(8):
                        sh = uint64(4 * j)
                        qf = as_f32(((w >> sh) & U15) | MAGIC)
                        v[j] = (qf - zf[j]) * s[j]
                    for m in range(4):  # word m: columns 2m (nibble m) and 2m + 1 (nibble m + 4)
                        hw[m] = pack_h2(v[m], v[m + 4])
                    o = (kk * n64 + c * uint64(8)) >> U2
                    st4(out, o, hw[0], hw[1], hw[2], hw[3])
            k += uint64(unroll)

    return dequant


SIG = [Array(np.uint32), Array(np.uint32), Array(np.uint16), Array(np.uint64), "int64", "int64", "int64", "int64"]


def plan(k_dim, n_dim, sms):
    """(grid, rows per warp): ~BLOCKS_PER_SM blocks per SM, every warp a contiguous run of rows."""
    tiles = -(-(n_dim // 8) // CT)
    rblocks = max(1, min(-(-k_dim // WARPS), -(-(sms * BLOCKS_PER_SM) // tiles)))
    rows = -(-k_dim // (rblocks * WARPS))
    rblocks = -(-k_dim // (rows * WARPS))
    return tiles * rblocks, rows


def launch(lau, grid, rows, stream, qw, qz, sc, out, sh):
    """One launch of the kernel ``lau`` (``launcher()``) with ``plan``'s grid and rows: the weight (qweight, qzeros,
    scales: bridge Tensors) of shape ``sh`` into ``out`` (a device pointer to fp16 [K, N], 16-byte aligned).
    DequantAWQ's compute and FusedFFNAWQ's prefill route (ffn/fusedffn4_prefill_cuda) launch through it."""
    lau.launch(grid, BLOCK, stream, (qw.ptr, (qw.size,)), (qz.ptr, (qz.size,)), (sc.ptr, (sc.size,)),
               (out, (sh.K * sh.N // 4,)), sh.K, sh.N, sh.group_size, rows)


_launcher = []


def launcher():
    """The compiled kernel, once per process (at the first session creation)."""
    if not _launcher:
        _launcher.append(launcher_for(make(), SIG))
    return _launcher[0]


class DequantAWQCudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sh = parse_attrs(self.attrs)
        self.launchers = {"dequant": launcher()}
        self.grid, self.rows = plan(self.sh.K, self.sh.N, sm_count())

    def case(self):
        """The routing case of a call (the op has one kernel: its shape alone)."""
        return Case("float16", self.sh.K, self.sh.K, self.sh.N, bs=self.sh.group_size)

    def compute(self, ctx, inputs):
        qw, qz, sc = (inputs[i] if i < len(inputs) else None for i in range(3))
        sh = self.sh
        check_weights(qw, qz, sc, sh)
        out = ctx.output(0, (sh.K, sh.N))
        if out % OUT_ALIGN or qw.ptr & 3 or qz.ptr & 3 or sc.ptr & 1:
            raise KernelError(f"inputs and the output must be aligned device buffers (output to {OUT_ALIGN} "
                              "bytes)")
        launch(self.launchers[route(ROUTES, self.case()).kernel], self.grid, self.rows, ctx.stream, qw, qz, sc, out,
               sh)


KERNEL = DequantAWQCudaKernel

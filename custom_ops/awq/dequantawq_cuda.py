"""DequantAWQ, CUDA face: W[K, N] float16 from AutoAWQ GEMM-layout 4-bit weights (format: dequantawq_cpu).

A block is 32 lanes x 8 warps: lane = column group c (one int32 of a qweight row = 8 output columns, so a
warp reads 128 contiguous bytes of qweight and writes 512 contiguous bytes of W per row), warp = a contiguous
run of rows. Each thread keeps UNROLL independent 4-byte qweight loads in flight, decodes the 8 nibbles with
the float magic-number trick (no int->float conversions: as_float(0x4B000000 | q) = 2^23 + q, so
q - z = as_float(0x4B000000|q) - as_float(0x4B000000|z) exactly), multiplies by the fp32 scale (exact), rounds
once to fp16 (RNE, bit-exact with the reference) and stores the 8 halves as two 8-byte words. The zero point
and 8 scales are reloaded only when a row crosses into the next group. Grid: ~8 blocks per SM.

Variants (``Variant``; benchmarks/dequant_gpu.py times them all against a device copy in one run, each checked
bit-exact against the CPU face): the store (two 8-byte stores as above, or one 128-bit ``st.global.v4.u32``,
optionally ``.cs`` streaming), zero points decoded once per group instead of per row (``zpre``), pairs of halves
rounded and packed by one ``cvt.rn.f16x2.f32`` (``h2``), unroll, block shape and blocks per SM of the plan (0:
one wave, as many as are resident). Every variant rounds the same fp32 product (q - z) * s once to fp16 (RNE), so
all are bit-exact with the reference. Sessions use ``DEFAULT`` (one line below); ``LEGACY`` is the kernel above, the
one measured in BENCHMARKS.md (48.4 us, 79% of copy).

Also the device helpers shared with matmulawq_cuda (fp16 <-> fp32 bits, bit casts) in their GPU and
CUDA-simulator versions, and the inline-PTX vector store / f16x2 pack intrinsics (``make_st``, ``pack_h2``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numba import config, cuda, float32, uint32, uint64

from ..device import launch as cuda_launch
from ..device.fp16 import as_f32, f2h, h2f, pack_h2
from ..device.launch import Array, Launcher, arg
from ..device.memory import make_st
from ..device.target import device
from ..runtime.kernels import Kernel, KernelError
from .dequantawq_cpu import check_weights, parse_attrs

CT = 32            # column groups per block (lanes)
WARPS = 8          # row runs per block
BLOCK = CT * WARPS
UNROLL = 8         # qweight words in flight per thread
BLOCKS_PER_SM = 8

U0, U1, U2, U3, U4, U15, U16 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 15, 16))
MAGIC = np.uint64(0x4B000000)
F_MAGIC = np.float32(8388608.0)

@device
def col_of(j):
    """Column within the group of 8 held by nibble j: AutoAWQ's order [0, 2, 4, 6, 1, 3, 5, 7]."""
    return ((j & 3) << 1) | (j >> 2)


def _make(ct=CT, warps=WARPS, unroll=UNROLL):

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
        for j in range(8):
            s[j] = h2f(sc[g * n64 + c * uint64(8) + uint64(col_of(j))])
        wv = cuda.local.array(unroll, uint32)
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
                    w = uint64(wv[u])
                    lo = U0
                    hi = U0
                    for j in range(8):
                        sh = uint64(4 * j)
                        qf = as_f32(((w >> sh) & U15) | MAGIC)
                        zf = as_f32(((z >> sh) & U15) | MAGIC)
                        h = f2h((qf - zf) * s[j])
                        col = uint64(col_of(j))
                        if col < U4:
                            lo |= h << (col * U16)
                        else:
                            hi |= h << ((col - U4) * U16)
                    o = (kk * n64 + c * uint64(8)) >> U2
                    out[o] = lo
                    out[o + U1] = hi
            k += uint64(unroll)

    return dequant


KERNEL_FN = _make()


@dataclass(frozen=True)
class Variant:
    """A DequantAWQ kernel configuration (module docstring). ``ct`` lanes (column groups) x ``warps`` row runs per
    block, ``unroll`` qweight loads in flight per thread, ``bps`` blocks per SM the plan aims at (0: one wave, as
    many as are resident), ``store`` 'u64x2' (two 8-byte stores) / 'v4' (one st.global.v4.u32) / 'v4cs' (the
    same, .cs), ``zpre`` zero points decoded once per group, ``h2`` halves rounded in pairs by cvt.rn.f16x2.f32."""
    ct: int = CT
    warps: int = WARPS
    unroll: int = UNROLL
    bps: int = BLOCKS_PER_SM
    store: str = "u64x2"
    zpre: bool = False
    h2: bool = False

    @property
    def block(self):
        return self.ct * self.warps

    def kernel_key(self):
        """What the compiled kernel depends on (``bps`` is a launch setting)."""
        return (self.ct, self.warps, self.unroll, self.store, self.zpre, self.h2)


LEGACY = Variant()   # the kernel measured in BENCHMARKS.md
DEFAULT = Variant(ct=32, warps=8, unroll=8, bps=12, store='v4cs', zpre=True, h2=True)
# ^ chosen on the H100 (benchmarks/dequant_gpu.py, 2026-11-24, 4096 x 11008 -> fp16): 43.6 us = 86.9% of the copy
#   bandwidth measured in the same run (LEGACY 48.5 us, 78.1%)


def _make_v(ct=CT, warps=WARPS, unroll=UNROLL, store="u64x2", zpre=False, h2=False):
    """The kernel of ``_make`` with Variant's options (same parameters, same arithmetic: bit-exact)."""
    if store not in ("u64x2", "v4", "v4cs"):
        raise ValueError(f"store must be 'u64x2', 'v4' or 'v4cs', got {store!r}")
    if (store, zpre, h2) == ("u64x2", False, False):
        return _make(ct, warps, unroll)
    st4 = make_st(4, store == "v4cs")
    v4 = store != "u64x2"
    U32 = np.uint64(32)  # noqa: N806

    @cuda.jit
    def dequant(qw, qz, sc, out, k_dim, n_dim, g_size, rows):
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
                        zz = zf[j] if zpre else as_f32(((z >> sh) & U15) | MAGIC)
                        v[j] = (qf - zz) * s[j]
                    for m in range(4):  # word m: columns 2m (nibble m) and 2m + 1 (nibble m + 4)
                        if h2:
                            hw[m] = pack_h2(v[m], v[m + 4])
                        else:
                            hw[m] = uint32(f2h(v[m]) | (f2h(v[m + 4]) << U16))
                    o = (kk * n64 + c * uint64(8)) >> U2
                    if v4:
                        st4(out, o, hw[0], hw[1], hw[2], hw[3])
                    else:
                        out[o] = uint64(hw[0]) | (uint64(hw[1]) << U32)
                        out[o + U1] = uint64(hw[2]) | (uint64(hw[3]) << U32)
            k += uint64(unroll)

    return dequant


def plan(k_dim, n_dim, sms, ct=CT, warps=WARPS, bps=BLOCKS_PER_SM, fit=False):
    """(grid, rows per warp): ~``bps`` blocks per SM (``fit``: at most, e.g. one wave of resident blocks), every
    warp a contiguous run of rows."""
    tiles = -(-(n_dim // 8) // ct)
    want = (sms * bps) // tiles if fit else -(-(sms * bps) // tiles)
    rblocks = max(1, min(-(-k_dim // warps), want))
    rows = -(-k_dim // (rblocks * warps))
    rblocks = -(-k_dim // (rows * warps))
    return tiles * rblocks, rows


def geometry(variant, k_dim, n_dim, sms, lau=None):
    """(grid, block, rows per warp) of ``variant`` for K x N on ``sms`` SMs; bps 0: one wave, as many blocks as
    ``lau`` (its Launcher) says are resident per SM."""
    bps = variant.bps or (lau.blocks_per_sm(variant.block) if lau is not None else BLOCKS_PER_SM)
    grid, rows = plan(k_dim, n_dim, sms, variant.ct, variant.warps, max(1, bps), fit=variant.bps == 0)
    return grid, variant.block, rows


_launchers = {}


def launcher(variant=None):
    """The compiled kernel of ``variant`` (default LEGACY, which benchmarks/awq_gpu.py times with BLOCK and
    ``plan``), one per kernel configuration per process."""
    key = (variant or LEGACY).kernel_key()
    if key not in _launchers:
        fn = KERNEL_FN if key == LEGACY.kernel_key() else _make_v(*key)
        _launchers[key] = Launcher(fn, [Array(np.uint32), Array(np.uint32), Array(np.uint16), Array(np.uint64),
                                        "int64", "int64", "int64", "int64"])
    return _launchers[key]


def out_align(variant):
    """Byte alignment the output needs."""
    return 8 if variant.store == "u64x2" else 16


def run_arrays(qweight, qzeros, scales, group_size, K, N, *, sms=None, ct=CT, warps=WARPS,  # noqa: N803
               variant=None):
    """Runs the kernel on host arrays (tests): through the Numba dispatcher under the CUDA simulator (``ct`` and
    ``warps`` may be shrunk there to keep it fast: they replace the variant's), through the direct launch path on
    a real GPU (the variant's own geometry). ``variant``: default LEGACY."""
    v = variant or LEGACY
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_weights(qweight, qzeros, scales, sh)
    dqw = cuda.to_device(np.ascontiguousarray(qweight).view(np.uint32).reshape(-1))
    dqz = cuda.to_device(np.ascontiguousarray(qzeros).view(np.uint32).reshape(-1))
    dsc = cuda.to_device(np.ascontiguousarray(scales).view(np.uint16).reshape(-1))
    dout = cuda.device_array(K * N // 4, np.uint64)
    if config.ENABLE_CUDASIM:
        if (ct, warps) != (CT, WARPS):
            v = dataclasses.replace(v, ct=ct, warps=warps)
        grid, block, rows = geometry(v, K, N, sms or 2)
        kern = KERNEL_FN if v.kernel_key() == LEGACY.kernel_key() else _make_v(*v.kernel_key())
        kern[grid, block](dqw, dqz, dsc, dout, K, N, group_size, rows)
    else:
        lau = launcher(v)
        grid, block, rows = geometry(v, K, N, sms or cuda_launch.sm_count(cuda_launch.current_device()), lau)
        lau.launch(grid, block, 0, arg(dqw), arg(dqz), arg(dsc), arg(dout), K, N, group_size, rows)
        cuda.synchronize()
    return dout.copy_to_host().view(np.float16).reshape(K, N)


class DequantAWQCudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sh = parse_attrs(self.attrs)
        self.variant = DEFAULT
        self.launcher = launcher(DEFAULT)  # compiled once per process, at the first session creation
        self.grid, self.block, self.rows = geometry(DEFAULT, self.sh.K, self.sh.N,
                                                    cuda_launch.sm_count(cuda_launch.current_device()), self.launcher)
        self.align = out_align(DEFAULT)

    def compute(self, ctx, inputs):
        qw, qz, sc = (inputs[i] if i < len(inputs) else None for i in range(3))
        sh = self.sh
        check_weights(qw, qz, sc, sh)
        out = ctx.output(0, (sh.K, sh.N))
        if out % self.align or qw.ptr & 3 or qz.ptr & 3 or sc.ptr & 1:
            raise KernelError(f"inputs and the output must be aligned device buffers (output to {self.align} "
                              "bytes)")
        self.launcher.launch(self.grid, self.block, ctx.stream, (qw.ptr, (qw.size,)), (qz.ptr, (qz.size,)),
                             (sc.ptr, (sc.size,)), (out, (sh.K * sh.N // 4,)), sh.K, sh.N, sh.group_size,
                             self.rows)


KERNEL = DequantAWQCudaKernel

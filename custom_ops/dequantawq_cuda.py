"""DequantAWQ, CUDA face: W[K, N] float16 from AutoAWQ GEMM-layout 4-bit weights (format: dequantawq_cpu).

A block is 32 lanes x 8 warps: lane = column group c (one int32 of a qweight row = 8 output columns, so a
warp reads 128 contiguous bytes of qweight and writes 512 contiguous bytes of W per row), warp = a contiguous
run of rows. Each thread keeps UNROLL independent 4-byte qweight loads in flight, decodes the 8 nibbles with
the float magic-number trick (no int->float conversions: as_float(0x4B000000 | q) = 2^23 + q, so
q - z = as_float(0x4B000000|q) - as_float(0x4B000000|z) exactly), multiplies by the fp32 scale (exact), rounds
once to fp16 (RNE, bit-exact with the reference) and stores the 8 halves as two 8-byte words. The zero point
and 8 scales are reloaded only when a row crosses into the next group. Grid: ~8 blocks per SM.

Also the device helpers shared with matmulawq_cuda (fp16 <-> fp32 bits, bit casts) in their GPU and
CUDA-simulator versions.
"""
from __future__ import annotations

import numpy as np
from numba import config, cuda, float32, int32, uint16, uint32, uint64
from numba.cuda import libdevice

from .dequantawq_cpu import check_weights, parse_attrs
from .kernels import Kernel

CT = 32            # column groups per block (lanes)
WARPS = 8          # row runs per block
BLOCK = CT * WARPS
UNROLL = 8         # qweight words in flight per thread
BLOCKS_PER_SM = 8

U0, U1, U2, U3, U4, U15, U16 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 15, 16))
MAGIC = np.uint64(0x4B000000)
F_MAGIC = np.float32(8388608.0)

SIM = bool(config.ENABLE_CUDASIM)

if SIM:
    # The simulator runs kernels as Python, has no libdevice, and calling a cuda.jit device function there
    # costs a module swap per call: the helpers are plain Python functions on numpy scalars instead.
    def device(fn):
        return fn

    _F32 = {}

    def as_f32(u):
        """float32 with the bit pattern of the low 32 bits of ``u``."""
        u = int(u) & 0xFFFFFFFF
        v = _F32.get(u)
        if v is None:
            v = _F32[u] = np.uint32(u).view(np.float32)
        return v

    def h2f(h):
        """float16 bits -> float32 value."""
        return np.float32(np.uint16(int(h) & 0xFFFF).view(np.float16))

    def f2h(v):
        """float32 value -> float16 bits as uint64 (RNE)."""
        return np.uint64(np.float32(v).astype(np.float16).view(np.uint16))
else:
    device = cuda.jit(device=True, inline=True)

    @device
    def as_f32(u):
        return libdevice.int_as_float(int32(u))

    @device
    def h2f(h):
        return libdevice.half2float(uint16(h))

    @device
    def f2h(v):
        return uint64(libdevice.float2half_rn(v)) & np.uint64(0xFFFF)


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


def plan(k_dim, n_dim, sms, ct=CT, warps=WARPS):
    """(grid, rows per warp): ~BLOCKS_PER_SM blocks per SM, every warp a contiguous run of rows."""
    tiles = -(-(n_dim // 8) // ct)
    rblocks = max(1, min(-(-k_dim // warps), -(-(sms * BLOCKS_PER_SM) // tiles)))
    rows = -(-k_dim // (rblocks * warps))
    rblocks = -(-k_dim // (rows * warps))
    return tiles * rblocks, rows


_launchers = {}


def launcher():
    from .cuda_launch import Array, Launcher
    if "dq" not in _launchers:
        _launchers["dq"] = Launcher(KERNEL_FN, [Array(np.uint32), Array(np.uint32), Array(np.uint16),
                                                Array(np.uint64), "int64", "int64", "int64", "int64"])
    return _launchers["dq"]


def run_arrays(qweight, qzeros, scales, group_size, K, N, *, sms=None, ct=CT, warps=WARPS):  # noqa: N803
    """Runs the kernel on host arrays (tests): through the Numba dispatcher under the CUDA simulator (``ct`` and
    ``warps`` may be shrunk there to keep it fast), through the direct launch path on a real GPU."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_weights(qweight, qzeros, scales, sh)
    dqw = cuda.to_device(np.ascontiguousarray(qweight).view(np.uint32).reshape(-1))
    dqz = cuda.to_device(np.ascontiguousarray(qzeros).view(np.uint32).reshape(-1))
    dsc = cuda.to_device(np.ascontiguousarray(scales).view(np.uint16).reshape(-1))
    dout = cuda.device_array(K * N // 4, np.uint64)
    if config.ENABLE_CUDASIM:
        grid, rows = plan(K, N, sms or 2, ct, warps)
        kern = KERNEL_FN if (ct, warps) == (CT, WARPS) else _make(ct, warps)
        kern[grid, ct * warps](dqw, dqz, dsc, dout, K, N, group_size, rows)
    else:
        from .cuda_launch import current_device, sm_count
        grid, rows = plan(K, N, sms or sm_count(current_device()))
        p = lambda a: (a.device_ctypes_pointer.value, (a.size,))  # noqa: E731
        launcher().launch(grid, BLOCK, 0, p(dqw), p(dqz), p(dsc), p(dout), K, N, group_size, rows)
        cuda.synchronize()
    return dout.copy_to_host().view(np.float16).reshape(K, N)


class DequantAWQCudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        from .cuda_launch import current_device, sm_count
        self.sh = parse_attrs(self.attrs)
        self.launcher = launcher()  # compiled once per process, at the first session creation
        self.grid, self.rows = plan(self.sh.K, self.sh.N, sm_count(current_device()))

    def compute(self, ctx, inputs):
        from .bridge import KernelError
        qw, qz, sc = (inputs[i] if i < len(inputs) else None for i in range(3))
        sh = self.sh
        check_weights(qw, qz, sc, sh)
        out = ctx.output(0, (sh.K, sh.N))
        if out & 7 or qw.ptr & 3 or qz.ptr & 3 or sc.ptr & 1:
            raise KernelError("inputs and the output must be aligned device buffers (output to 8 bytes)")
        self.launcher.launch(self.grid, BLOCK, ctx.stream, (qw.ptr, (qw.size,)), (qz.ptr, (qz.size,)),
                             (sc.ptr, (sc.size,)), (out, (sh.K * sh.N // 4,)), sh.K, sh.N, sh.group_size,
                             self.rows)


KERNEL = DequantAWQCudaKernel

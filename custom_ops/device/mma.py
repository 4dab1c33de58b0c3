"""Device helpers the tensor-core kernels share (AWQ, NF4, fp16 FFN): the mma.sync m16n8k16 instruction, fp32
SiLU, and the store of one output element (bias, then SiLU * mul for the fused two-weight ops).

Under the CUDA simulator ``mma`` runs the same product through shared memory in float64 (every thread of the block
must call it together; ``scr`` is a block scratch of 6 uint32 per thread), so the kernels' fragment layouts are
tested in CI."""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32

from .fp16 import f2h, h2f
from .target import SIM, device

if SIM:
    def silu(g):
        with np.errstate(over="ignore", invalid="ignore"):
            g = np.float32(g)
            return g / (np.float32(1.0) + np.exp(-g))
else:
    @device
    def silu(g):
        return g / (float32(1.0) + math.exp(-g))


if SIM:
    def _frag_index():
        """Half-word index (in the warp's 32 x 6 uint32 fragments, lane-major) of A[row][k] and B[k][j]."""
        r, k = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
        a = 2 * (((r & 7) * 4 + ((k & 7) >> 1)) * 6 + (r >> 3) + 2 * (k >> 3)) + (k & 1)
        k2, j = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
        b = 2 * ((j * 4 + ((k2 & 7) >> 1)) * 6 + 4 + (k2 >> 3)) + (k2 & 1)
        return a, b

    _A_IDX, _B_IDX = _frag_index()

    @cuda.jit(device=True)
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, tid):
        """Simulator: mma.sync.m16n8k16.row.col f32.f16.f16.f32 through shared memory (every thread of the block
        calls it together)."""
        tid = int(tid)
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            scr[tid * 6 + i] = v
        cuda.syncthreads()
        lane = tid & 31
        h = np.array(scr[(tid - lane) * 6:(tid - lane + 32) * 6], np.uint32).view(np.float16).astype(np.float64)
        d = h[_A_IDX] @ h[_B_IDX]
        cuda.syncthreads()
        g, t = lane >> 2, lane & 3
        return (np.float32(d[g, 2 * t] + c0), np.float32(d[g, 2 * t + 1] + c1), np.float32(d[g + 8, 2 * t] + c2),
                np.float32(d[g + 8, 2 * t + 1] + c3))
else:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.extending import intrinsic as _intrinsic

    @_intrinsic
    def _mma_asm(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = _types.UniTuple(_types.float32, 4)(*([_types.uint32] * 6 + [_types.float32] * 4))

        def codegen(context, builder, sig, args):
            i32, f32 = _ir.IntType(32), _ir.FloatType()
            asm = _ir.InlineAsm(_ir.FunctionType(_ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4),
                                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, "
                                "{$8,$9}, {$10,$11,$12,$13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            r = builder.call(asm, args)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, i) for i in range(4)])
        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, tid):
        return _mma_asm(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@device
def tc_store(nw, out, b1, b3, has_b1, has_b3, oi, col, gv, uv):
    """out[oi] = gv + b1[col] (nw = 1), or SiLU(gv + b1[col]) * (uv + b3[col]) (nw = 2), as fp16 bits."""
    if has_b1:
        gv += h2f(b1[col])
    if nw == 1:
        out[oi] = f2h(gv)
    else:
        if has_b3:
            uv += h2f(b3[col])
        out[oi] = f2h(silu(gv) * uv)


def make_to_warp0(kw, nacc):
    """to_warp0(acc, red, warp, lane): warps 1 .. kw-1 put their ``nacc`` per-lane sums in shared memory ``red``
    ((kw - 1) x nacc x 32 fp32), warp 0 adds them to its own in warp order (deterministic); every thread of the block
    must call it (one barrier). The tensor-core FFN kernels' reduction over their K warps."""
    @(cuda.jit(device=True) if SIM else device)     # the simulator's syncthreads exists inside cuda.jit functions
    def to_warp0(acc, red, warp, lane):
        if kw > 1:
            if warp > 0:
                base = (warp - uint32(1)) * uint32(nacc * 32) + lane
                for i in range(nacc):
                    red[base + uint32(i * 32)] = acc[i]
            cuda.syncthreads()
        if warp == 0:
            for w in range(1, kw):
                base = uint32((w - 1) * nacc * 32) + lane
                for i in range(nacc):
                    acc[i] += red[base + uint32(i * 32)]
    return to_warp0

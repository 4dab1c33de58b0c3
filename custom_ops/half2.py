"""Packed fp16 (half2, held as uint32 bits) device helpers for the decode kernels, GPU (inline PTX) and CUDA-simulator
versions: ``hsum2`` (two half2 values' four halves summed in fp32), ``warp_max`` (the largest value of a warp, in
lane 0), ``fp32_decode`` (the opt-out of packed-fp16 arithmetic); under the simulator also ``hfma2`` (on the GPU matmulnf4_cuda builds it like its other 32-bit PTX
ops: one fma.rn.f16x2)."""
from __future__ import annotations

import os

import numpy as np
from numba import config, cuda, float32

FULL = np.uint32(0xFFFFFFFF)


def fp32_decode():
    """``ONNX_LOWBIT_FP32_DECODE=1``: the NF4 decode kernels' defaults keep fp32 arithmetic (no packed-fp16 decode)
    for users who want the smallest rounding error over the last few microseconds."""
    return os.environ.get("ONNX_LOWBIT_FP32_DECODE", "0").lower() not in ("0", "", "false", "no", "off")

if config.ENABLE_CUDASIM:
    def _halves(u):
        return np.array([int(u) & 0xFFFF, (int(u) >> 16) & 0xFFFF], np.uint16).view(np.float16).astype(np.float64)

    def hfma2(a, b, c):
        """a * b + c on both halves, one rounding to fp16 (fma.rn.f16x2)."""
        with np.errstate(all="ignore"):
            r = (_halves(a) * _halves(b) + _halves(c)).astype(np.float16).view(np.uint16)
        return np.uint32(int(r[0]) | int(r[1]) << 16)

    def hsum2(a, b):
        """float32(a.lo) + float32(a.hi) + float32(b.lo) + float32(b.hi), summed as (a.lo + a.hi) + (b.lo + b.hi)."""
        ha, hb = _halves(a).astype(np.float32), _halves(b).astype(np.float32)
        with np.errstate(all="ignore"):
            return np.float32(np.float32(ha[0] + ha[1]) + np.float32(hb[0] + hb[1]))

    @cuda.jit(device=True)
    def warp_max(v, red, tid):
        """Largest of the warp's ``v`` (NaN ignored), in lane 0 (the simulator has no shuffles: shared memory)."""
        red[tid] = v
        cuda.syncthreads()
        s = float32(0.0)
        if (tid & 31) == 0:
            for i in range(32):
                if red[tid + i] > s:
                    s = red[tid + i]
        cuda.syncthreads()
        return s
else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def hsum2(typingctx, a, b):
        """The four halves of two half2 values (uint32 bits) converted to fp32 and summed: (a.lo + a.hi) + (b.lo +
        b.hi)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            text = ("{ .reg .b16 al, ah, bl, bh; .reg .f32 t0, t1, t2, t3; "
                    "mov.b32 {al, ah}, $1; mov.b32 {bl, bh}, $2; "
                    "cvt.f32.f16 t0, al; cvt.f32.f16 t1, ah; cvt.f32.f16 t2, bl; cvt.f32.f16 t3, bh; "
                    "add.f32 t0, t0, t1; add.f32 t2, t2, t3; add.f32 $0, t0, t2; }")
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [i32, i32]), text, "=f,r,r")
            return builder.call(asm, args)
        return types.float32(types.uint32, types.uint32), codegen

    @cuda.jit(device=True, inline=True)
    def warp_max(v, red, tid):
        """Largest of the warp's ``v`` (NaN ignored), in lane 0."""
        for off in (16, 8, 4, 2, 1):
            o = cuda.shfl_down_sync(FULL, v, off)
            if o > v:
                v = o
        return v

"""Inline-PTX wrappers of the decode kernels (32-bit integer ops Numba would widen to 64 bits, byte permutes, shared
loads at a byte offset, packed-fp16 FMA) and the warp sum, GPU and CUDA-simulator versions: ``prmt``, ``add32``,
``mad32``, ``shr32``, ``min32``, ``andor32`` ((a & b) | c in one LOP3), ``f2u``, ``lds32``, ``lds64``, ``hfma2``,
``warp_sum``."""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32
from numba.cuda import libdevice

from . import half2
from .target import SIM

FULL = np.uint32(0xFFFFFFFF)


if SIM:
    # The simulator has no warp shuffles: reduce through shared memory (every thread of the block calls this).
    @cuda.jit(device=True)
    def warp_sum(v, red, tid):
        red[tid] = v
        cuda.syncthreads()
        s = float32(0.0)
        if (tid & 31) == 0:
            for i in range(32):
                s += red[tid + i]
        cuda.syncthreads()
        return s
else:
    @cuda.jit(device=True, inline=True)
    def warp_sum(v, red, tid):
        v += cuda.shfl_down_sync(FULL, v, 16)
        v += cuda.shfl_down_sync(FULL, v, 8)
        v += cuda.shfl_down_sync(FULL, v, 4)
        v += cuda.shfl_down_sync(FULL, v, 2)
        v += cuda.shfl_down_sync(FULL, v, 1)
        return v


# 32-bit decode helpers of the M=1 kernels: PRMT builds a table offset from a weight byte in one instruction
# (byte b of the word into bits 8..15, the lane's copy offset into bits 0..7), and the table is read at a byte
# offset (one LDS with the table base folded into the address: [R + UR]).
if SIM:
    def prmt(a, b, s):
        """PTX prmt.b32 (default mode): output byte i = byte (s >> 4i) & 7 of b:a."""
        v = (int(b) << 32) | int(a)
        s = int(s)
        return np.uint32(sum(((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4)))

    def lds64(tab, off):
        return tab[int(off) >> 3]

    def add32(a, b):
        return np.uint32((int(a) + int(b)) & 0xFFFFFFFF)

    def mad32(a, b, c):
        return np.uint32((int(a) * int(b) + int(c)) & 0xFFFFFFFF)

    def shr32(a, b):
        return np.uint32(int(a) >> int(b))

    def min32(a, b):
        return np.uint32(min(int(a), int(b)))

    def andor32(a, b, c):
        return np.uint32((int(a) & int(b)) | int(c))

    def f2u(v):
        return np.float32(v).view(np.uint32)

    def lds32(tab, off):
        return tab[int(off) >> 2]

    hfma2 = half2.hfma2
else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def prmt(typingctx, a, b, s):
        """PTX prmt.b32 d, a, b, s (uint32 operands)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, args)
        return types.uint32(types.uint32, types.uint32, types.uint32), codegen

    def _asm32(name, text, nargs):
        """uint32 PTX instruction ``text`` on ``nargs`` uint32 operands: Numba types uint32 (op) uint32 as 64-bit,
        and LLVM widens 32-bit loop counters; inline PTX keeps the index math in 32-bit registers."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            cons = ",".join(["=r"] + ["r"] * nargs)
            return builder.call(ir.InlineAsm(ir.FunctionType(i32, [i32] * nargs), text, cons), args)
        sig = types.uint32(*[types.uint32] * nargs)
        if nargs == 2:
            def op(typingctx, a, b):
                return sig, codegen
        else:
            def op(typingctx, a, b, c):
                return sig, codegen
        op.__name__ = name
        return intrinsic(op)

    @cuda.jit(device=True, inline=True)
    def f2u(v):
        return uint32(libdevice.float_as_int(v))

    add32 = _asm32("add32", "add.u32 $0, $1, $2;", 2)
    mad32 = _asm32("mad32", "mad.lo.u32 $0, $1, $2, $3;", 3)
    shr32 = _asm32("shr32", "shr.b32 $0, $1, $2;", 2)
    min32 = _asm32("min32", "min.u32 $0, $1, $2;", 2)
    andor32 = _asm32("andor32", "lop3.b32 $0, $1, $2, $3, 0xEA;", 3)   # (a & b) | c: 0xF0 & 0xCC | 0xAA
    hfma2 = _asm32("hfma2", "fma.rn.f16x2 $0, $1, $2, $3;", 3)    # half2 values held as uint32 bits

    def _lds(bits):
        def lds(typingctx, tab, off):
            """Element of the (shared) array ``tab`` at byte offset ``off`` (uint32)."""
            def codegen(context, builder, sig, args):
                data = context.make_array(sig.args[0])(context, builder, args[0]).data
                p = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()),
                                [builder.zext(args[1], ir.IntType(64))], inbounds=True)
                return builder.load(builder.bitcast(p, ir.IntType(bits).as_pointer()))
            return getattr(types, f"uint{bits}")(tab, types.uint32), codegen
        lds.__name__ = f"lds{bits}"
        return intrinsic(lds)

    lds64 = _lds(64)
    lds32 = _lds(32)

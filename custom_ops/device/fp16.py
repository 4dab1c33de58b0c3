"""fp16 <-> fp32 device helpers of the CUDA kernels (values in fp32 registers, fp16 held as uint16 bits), GPU
(libdevice, inline PTX) and CUDA-simulator versions: ``as_f32`` (a bit cast), ``h2f`` / ``f2h`` (widen / round to
nearest even), ``r16`` (round an fp32 value to fp16 precision), ``same`` (its fp32 twin: the identity), ``pack_h2``
(two values rounded and packed into one uint32, one cvt.rn.f16x2.f32)."""
from __future__ import annotations

import numpy as np
from numba import int32, uint16, uint64
from numba.cuda import libdevice

from .target import SIM, device

if SIM:
    # plain Python functions on numpy scalars under the simulator (target.device)
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
def r16(v):
    return h2f(f2h(v))


@device
def same(v):
    return v


if SIM:
    def pack_h2(lo, hi):
        """Two float32 values -> float16 bits (RNE) packed into a uint32, ``lo`` in the low half."""
        return np.uint32(int(f2h(lo)) | int(f2h(hi)) << 16)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _make_pack_h2():
        @intrinsic
        def pack_h2(typingctx, lo, hi):
            """Two float32 values -> float16 bits (RNE) packed into a uint32, ``lo`` in the low half (one
            cvt.rn.f16x2.f32, sm_80+; it puts its first source in the upper half)."""
            def codegen(context, builder, sig, args):
                a = context.cast(builder, args[0], sig.args[0], types.float32)
                b = context.cast(builder, args[1], sig.args[1], types.float32)
                f = ir.FloatType()
                fnty = ir.FunctionType(ir.IntType(32), [f, f])
                return builder.call(ir.InlineAsm(fnty, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"), [b, a])
            return types.uint32(lo, hi), codegen
        return pack_h2

    pack_h2 = _make_pack_h2()

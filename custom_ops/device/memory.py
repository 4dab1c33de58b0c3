"""Vector and element loads / stores of the CUDA kernels, GPU (inline PTX) and CUDA-simulator versions: ``ld16`` /
``st16`` (an element of a float16 array held as uint16 bits, widened to / rounded from fp32), ``ld32`` / ``st32``
(their float32 twins), ``w16`` / ``w32`` (element e of 8 values packed in words), ``make_st`` (one 2- or 4-word
vector store), ``make_ld4`` (one 16-byte load as 4 uint32 words; ``LOAD``: the non-caching load the decode kernels
pass it), ``addr`` (an array argument's device address)."""
from __future__ import annotations

import numpy as np
from numba import uint32

from .fp16 import as_f32, f2h, h2f
from .target import SIM, device

LOAD = "ld.global.nc.L1::no_allocate.v4.u32"
M16 = np.uint32(0xFFFF)


# Element access for kernels over float32 arrays or float16 arrays held as uint16 bits (values in fp32 registers):
# ld16 / st16 widen / round (RNE) (fp16.r16 rounds an fp32 value to fp16 precision); the 32-bit twins are plain.
@device
def ld16(a, i):
    return h2f(a[i])


@device
def st16(a, i, v):
    a[i] = f2h(v)


@device
def ld32(a, i):
    return a[i]


@device
def st32(a, i, v):
    a[i] = v


if SIM:
    def make_st(n, cs=False):
        """Simulator twin of the vector store: st(arr, i, v0, ..., v{n-1}) writes n 32-bit values from element i of
        a 32-bit array, n/2 64-bit words (pairs, low half first) of a 64-bit one, or 2n elements of a 16-bit one."""
        def st(arr, i, *vals):
            i = int(i)
            if arr.dtype.itemsize == 2:     # fp16 bits: each word two elements, low first
                for j in range(n):
                    arr[i + 2 * j] = int(vals[j]) & 0xFFFF
                    arr[i + 2 * j + 1] = (int(vals[j]) >> 16) & 0xFFFF
            elif arr.dtype.itemsize == 8:
                for j in range(0, n, 2):
                    arr[i + j // 2] = np.uint64((int(vals[j]) & 0xFFFFFFFF) | (int(vals[j + 1]) & 0xFFFFFFFF) << 32)
            else:
                for j in range(n):
                    arr[i + j] = vals[j]
        return st
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def make_st(n, cs=False):
        """st(arr, i, v0, ..., v{n-1}): one n x 32-bit vector store (n = 2 or 4: ``st.global[.cs].v{n}``) of
        float32 (or integer, truncated to 32 bits) values at element i of ``arr`` (the address must be aligned to
        4 n bytes; of a 16-bit array: 2 n elements, the low half of each word first). ``cs``: the streaming
        (evict-first) cache hint."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            i = context.cast(builder, args[1], sig.args[1], types.uint64)
            ptr = builder.gep(ary.data, [i])
            fl = sig.args[2] == types.float32
            to = types.float32 if fl else types.uint32
            vals = [context.cast(builder, args[2 + j], sig.args[2 + j], to) for j in range(n)]
            ty = ir.FloatType() if fl else ir.IntType(32)
            regs = ", ".join(f"${j + 1}" for j in range(n))
            asm = f"st.global{'.cs' if cs else ''}.v{n}.{'f32' if fl else 'u32'} [$0], {{{regs}}};"
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type] + [ty] * n)
            cons = "l" + (",f" if fl else ",r") * n + ",~{memory}"
            builder.call(ir.InlineAsm(fnty, asm, cons, side_effect=True), [ptr] + vals)
            return context.get_dummy_value()

        if n == 4:
            @intrinsic
            def st(typingctx, arr, idx, a, b, c, d):
                return types.void(arr, idx, a, b, c, d), codegen
        elif n == 2:
            @intrinsic
            def st(typingctx, arr, idx, a, b):
                return types.void(arr, idx, a, b), codegen
        else:
            raise ValueError(f"vector stores of 2 or 4 values, not {n}")
        return st


def make_ld4(asm):
    """ld4(arr, i) -> bytes [16i, 16i + 16) of an array (its 16-byte chunk i: 8 uint16, 4 uint32 / float32 or 2
    uint64 elements) as 4 uint32 words, low first, in one 128-bit load (``asm``: the PTX load instruction without
    operands). The address must be 16-byte aligned."""
    if SIM:
        def ld4(a, i):
            if a.dtype.itemsize == 8:
                j = 2 * int(i)
                u, v = int(a[j]), int(a[j + 1])
                return (np.uint32(u & 0xFFFFFFFF), np.uint32(u >> 32), np.uint32(v & 0xFFFFFFFF), np.uint32(v >> 32))
            if a.dtype.itemsize == 2:       # fp16 bits: 8 elements, two per word
                j = 8 * int(i)
                return tuple(np.uint32(int(a[j + 2 * k]) | int(a[j + 2 * k + 1]) << 16) for k in range(4))
            j = 4 * int(i)
            if a.dtype == np.float32:
                return tuple(np.float32(a[j + k]).view(np.uint32) for k in range(4))
            return a[j], a[j + 1], a[j + 2], a[j + 3]
        return ld4

    @intrinsic
    def ld4(typingctx, arr, idx):
        rt = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            i = context.cast(builder, args[1], sig.args[1], types.uint64)
            per = 16 // context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))   # elements per chunk
            ptr = builder.gep(ary.data, [builder.shl(i, ir.Constant(ir.IntType(64), per.bit_length() - 1))])
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ptr.type])
            res = builder.call(ir.InlineAsm(fnty, asm + " {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l"), [ptr])
            return context.make_tuple(builder, rt, [builder.extract_value(res, k) for k in range(4)])
        return rt(arr, idx), codegen
    return ld4


@device
def w16(words, i, e):
    """Element e (0..7) of the 8 fp16 values held by words[i .. i+4) (little-endian) as float32."""
    return h2f((uint32(words[i + (e >> 1)]) >> uint32(16 * (e & 1))) & M16)


@device
def w32(words, i, e):
    """Element e (0..3) of the 4 fp32 values held by words[i .. i+4) (their bits)."""
    return as_f32(words[i + e])


if SIM:
    def addr(a):
        """The address of a (simulator) device array's data."""
        return int(a._ary.ctypes.data) if hasattr(a, "_ary") else int(a.ctypes.data)
else:
    @intrinsic
    def addr(typingctx, a):
        """The device address of an array argument's data (uint64)."""
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            return builder.ptrtoint(data, ir.IntType(64))
        return types.uint64(a), codegen

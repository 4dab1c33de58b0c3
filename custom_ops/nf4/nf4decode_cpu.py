"""NF4 / FP4 decode on the CPU with a vector permute: 16 code values in one register, each nibble picks its value
with ``vpermps`` (AVX-512 ``llvm.x86.avx512.permvar.sf.512``), scaled by the block's absmax and interleaved back
into element order, 32 elements per 16 bytes. LLVM does not vectorise a 16-entry table lookup written in Python
(it would need gathers, which it does not emit for AMD targets), so ``decode_blocks`` is a Numba intrinsic that
writes the vector code itself. The products are bit-identical with ``code[nib] * absmax`` in fp32 (the reference).

``FAST``: whether this CPU has AVX-512F (else the kernels take their scalar path). ``absmax32``: one absmax per
32-element piece (the kernels' form of weights whose blocks straddle the rows of W^T). Used by matmulnf4_cpu and
matmulnf4_int8_cpu."""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llb, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


def _has_avx512():
    try:
        return bool(llb.get_host_cpu_features().get("avx512f", False))
    except Exception:  # noqa: BLE001 - unknown host: the scalar path
        return False


FAST = _has_avx512()


@intrinsic
def decode_blocks(typingctx, q, code, absmax, out, bpb, nblocks):
    """out[32 i + e] (float32) = code[nibble e of bytes 16 i ..] * absmax[block], for ``nblocks`` blocks of ``bpb``
    bytes (a multiple of 16) from the starts of the 1-D C arrays q (uint8), absmax (float32) and out (float32);
    code: float32[16]. Element 2j of a block is byte j's high nibble, 2j + 1 its low one (bitsandbytes' order).
    No bounds checks: the caller passes views of the right lengths."""
    sig = types.void(q, code, absmax, out, bpb, nblocks)

    def codegen(context, builder, signature, args):
        qa, ca, ama, oa, bpb_v, nb_v = args
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:4], (qa, ca, ama, oa))]
        qp, cp, ap, op = (x.data for x in arrs)
        f32, i32, i8, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(8), ir.IntType(64)
        v16f, v16i, v16b = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f, v16i]),
                                              "llvm.x86.avx512.permvar.sf.512")
        tbl = builder.load(builder.bitcast(cp, v16f.as_pointer()), align=4)
        four, fifteen = ir.Constant(v16i, [4] * 16), ir.Constant(v16i, [15] * 16)
        first = ir.Constant(v16i, [x for i in range(8) for x in (i, 16 + i)])       # hi0 lo0 hi1 lo1 ...
        second = ir.Constant(v16i, [x for i in range(8, 16) for x in (i, 16 + i)])
        bpb64 = builder.sext(bpb_v, i64) if bpb_v.type != i64 else bpb_v
        nb64 = builder.sext(nb_v, i64) if nb_v.type != i64 else nb_v
        chunks = builder.udiv(bpb64, ir.Constant(i64, 16))
        with cgutils.for_range(builder, nb64) as lb:
            b = lb.index
            s = builder.load(builder.gep(ap, [b]))
            sv = builder.insert_element(ir.Constant(v16f, ir.Undefined), s, ir.Constant(i32, 0))
            sv = builder.shuffle_vector(sv, ir.Constant(v16f, ir.Undefined), ir.Constant(v16i, [0] * 16))
            with cgutils.for_range(builder, chunks) as lc:
                byte0 = builder.add(builder.mul(b, bpb64), builder.mul(lc.index, ir.Constant(i64, 16)))
                bv = builder.load(builder.bitcast(builder.gep(qp, [byte0]), v16b.as_pointer()), align=1)
                iv = builder.zext(bv, v16i)
                whi = builder.fmul(builder.call(perm, [tbl, builder.lshr(iv, four)]), sv)
                wlo = builder.fmul(builder.call(perm, [tbl, builder.and_(iv, fifteen)]), sv)
                e0 = builder.mul(byte0, ir.Constant(i64, 2))
                o0 = builder.bitcast(builder.gep(op, [e0]), v16f.as_pointer())
                o1 = builder.bitcast(builder.gep(op, [builder.add(e0, ir.Constant(i64, 16))]), v16f.as_pointer())
                builder.store(builder.shuffle_vector(whi, wlo, first), o0, align=4)
                builder.store(builder.shuffle_vector(whi, wlo, second), o1, align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def dot_blocks(typingctx, q, code, absmax, ae, ao, bpb, nblocks):
    """float32 sum over ``nblocks`` blocks of ``bpb`` bytes (a multiple of 16) of absmax[b] * sum_j (code[hi(byte
    j)] * ae[j] + code[lo(byte j)] * ao[j]): one row of W^T against one row of A split into its even (``ae``) and
    odd (``ao``) elements, so that the decoded nibbles need no interleaving and nothing is stored. Per block the
    16 lanes are summed with FMAs, scaled by absmax with one FMA into the row's sum, reduced in lane order at the
    end. No bounds checks."""
    sig = types.float32(q, code, absmax, ae, ao, bpb, nblocks)

    def codegen(context, builder, signature, args):
        qa, ca, ama, aea, aoa, bpb_v, nb_v = args
        arrs = [context.make_array(t)(context, builder, v)
                for t, v in zip(signature.args[:5], (qa, ca, ama, aea, aoa))]
        qp, cp, ap, ep, op = (x.data for x in arrs)
        f32, i32, i8, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(8), ir.IntType(64)
        v16f, v16i, v16b = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f, v16i]),
                                              "llvm.x86.avx512.permvar.sf.512")
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f, v16f, v16f]),
                                             "llvm.fma.v16f32")
        tbl = builder.load(builder.bitcast(cp, v16f.as_pointer()), align=4)
        four, fifteen = ir.Constant(v16i, [4] * 16), ir.Constant(v16i, [15] * 16)
        zero = ir.Constant(v16f, [0.0] * 16)
        bpb64 = builder.sext(bpb_v, i64) if bpb_v.type != i64 else bpb_v
        nb64 = builder.sext(nb_v, i64) if nb_v.type != i64 else nb_v
        chunks = builder.udiv(bpb64, ir.Constant(i64, 16))
        total = cgutils.alloca_once_value(builder, zero)
        part = cgutils.alloca_once_value(builder, zero)
        with cgutils.for_range(builder, nb64) as lb:
            b = lb.index
            builder.store(zero, part)
            with cgutils.for_range(builder, chunks) as lc:
                byte0 = builder.add(builder.mul(b, bpb64), builder.mul(lc.index, ir.Constant(i64, 16)))
                bv = builder.load(builder.bitcast(builder.gep(qp, [byte0]), v16b.as_pointer()), align=1)
                iv = builder.zext(bv, v16i)
                whi = builder.call(perm, [tbl, builder.lshr(iv, four)])
                wlo = builder.call(perm, [tbl, builder.and_(iv, fifteen)])
                xe = builder.load(builder.bitcast(builder.gep(ep, [byte0]), v16f.as_pointer()), align=4)
                xo = builder.load(builder.bitcast(builder.gep(op, [byte0]), v16f.as_pointer()), align=4)
                acc = builder.call(fma, [whi, xe, builder.load(part)])
                builder.store(builder.call(fma, [wlo, xo, acc]), part)
            s = builder.load(builder.gep(ap, [b]))
            sv = builder.insert_element(ir.Constant(v16f, ir.Undefined), s, ir.Constant(i32, 0))
            sv = builder.shuffle_vector(sv, ir.Constant(v16f, ir.Undefined), ir.Constant(v16i, [0] * 16))
            builder.store(builder.call(fma, [builder.load(part), sv, builder.load(total)]), total)
        vec = builder.load(total)
        out = ir.Constant(f32, 0.0)
        for i in range(16):
            out = builder.fadd(out, builder.extract_element(vec, ir.Constant(i32, i)))
        return out
    return sig, codegen


@njit(cache=True, nogil=True, boundscheck=False)
def absmax32(absmax, start, count, bs):
    """out[i] = absmax[(start + 32 i) // bs] for i < count: the block scale of each 32-element piece of W^T from
    element ``start`` (a multiple of 32), the absmax of the fast kernels run with a block size of 32."""
    out = np.empty(count, np.float32)
    lg = 0
    while (1 << lg) < bs:       # bs is a power of two: a shift, not a division per piece
        lg += 1
    for i in range(count):
        out[i] = absmax[(start + 32 * i) >> lg]
    return out

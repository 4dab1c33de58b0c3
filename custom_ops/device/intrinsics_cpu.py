"""What the CPU families' Numba intrinsics share (gru/quantgru_vnni.py, nf4/nf4vnni_cpu.py, nf4/nf4col_cpu.py): the
host's instruction sets (``host_has``, ``VNNI``, ``VBMI``), the LLVM IR types of 512-bit vectors, and small IR
builders (constants, an array argument's data pointer, an LLVM function or intrinsic by name, a scalar broadcast to
every lane)."""
from __future__ import annotations

from llvmlite import binding as llb, ir
from numba.core import cgutils


def host_has(*features) -> bool:
    """Whether this CPU has every one of ``features`` (llvmlite's names, e.g. "avx512vnni"); False on a host
    llvmlite cannot describe (the callers then take their portable paths)."""
    try:
        f = llb.get_host_cpu_features()
        return all(bool(f.get(k, False)) for k in features)
    except Exception:  # noqa: BLE001 - unknown host: the portable paths
        return False


VNNI = host_has("avx512f", "avx512bw", "avx512vnni")   # vpdpbusd / vpdpwssd on 512-bit registers
VBMI = VNNI and host_has("avx512vbmi")                 # vpermb

I1, I8, I16, I32, I64, F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                              ir.FloatType())
V64B, V32W, V16I, V16F = ir.VectorType(I8, 64), ir.VectorType(I16, 32), ir.VectorType(I32, 16), ir.VectorType(F32, 16)


def const(t, v):
    """An IR constant of type t (a vector type takes a list)."""
    return ir.Constant(t, v)


def array_ptr(context, builder, ty, val, elem=I8):
    """The data pointer of the array argument ``val`` (Numba type ``ty``) as a pointer to ``elem``."""
    return builder.bitcast(context.make_array(ty)(context, builder, val).data, elem.as_pointer())


def as_i64(builder, v):
    """v widened to int64 (sign-extended) unless it is one."""
    return builder.sext(v, I64) if v.type != I64 else v


def function(builder, name, ret, args):
    """The LLVM function or intrinsic ``name`` of that signature, declared in the module on first use."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def splat(builder, s, vt):
    """The scalar s in every lane of a vector of type vt."""
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), s, const(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), const(ir.VectorType(I32, vt.count), [0] * vt.count))

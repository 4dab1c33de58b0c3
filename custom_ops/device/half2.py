"""Packed fp16 (half2, held as uint32 bits) device helpers for the decode kernels, GPU (inline PTX) and CUDA-simulator
versions: ``hsum2`` (two half2 values' four halves summed in fp32), ``warp_max`` (the largest value of a warp, in
lane 0 at least), ``fmax``, ``hscale2`` (a half2 times an fp32 scale), ``ldx8`` (8 consecutive elements of X as
fp32, in one or two 16-byte loads), ``sts4`` (one 16-byte shared-memory store of four copies of a word),
``fp32_decode`` (the opt-out of packed-fp16 arithmetic), host side ``h2_scale`` /
``code_with_scale`` (the scaled fp16 levels) and ``h2_table_src`` (the generated kernels' table build); under the
simulator also ``hfma2`` (on the GPU ptx.py builds it like its other 32-bit PTX
ops: one fma.rn.f16x2)."""
from __future__ import annotations

import os

import numpy as np
from numba import config, cuda, float32, int32, uint32

FULL = np.uint32(0xFFFFFFFF)


_SCALES = {}


def h2_scale(code):
    """The factor a (float32, in [1, 2)) by which the packed-fp16 decode's table holds the 16 code values, fp16(a *
    c), its results being multiplied by 1 / a: chosen to minimise the mean |fp16(a c) / a - c| over the non-zero
    levels. Rounding the levels to fp16 is the decode's one systematic error (every weight of a level carries the
    same one, so it does not average out when X has a mean); for NF4, a = 1.3662 halves it (mean 5.8e-5 -> 2.5e-5,
    largest relative 3.3e-4 -> 1.8e-4)."""
    c = np.ascontiguousarray(code, np.float32)
    key = c.tobytes()
    if key not in _SCALES:
        nz = c[c != 0].astype(np.float64)
        al = (1 + np.arange(1 << 14, dtype=np.float64) / (1 << 14)).astype(np.float32)
        r = (al[:, None] * nz[None, :].astype(np.float32)).astype(np.float16).astype(np.float64) / al[:, None] - nz
        _SCALES[key] = al[int(np.argmin(np.abs(r).mean(axis=1)))] if nz.size else np.float32(1)
    return _SCALES[key]


def code_with_scale(code):
    """float32 [18]: the 16 code values, then h2_scale(code) and its inverse (the M=1 matmul kernel's table build
    and epilogue read entries 16 and 17; the other kernels only 0..15)."""
    c = np.ascontiguousarray(code, np.float32).reshape(-1)[:16]
    a = h2_scale(c)
    return np.concatenate([c, np.array([a, np.float32(1) / a], np.float32)])


VEC_TABLE = True     # the table build's stores: 16 bytes (4 lane copies) each, a quarter of the store instructions
                     # (SASS of the build loop: 247 against 557 instructions). H100, weights past L2
                     # (benchmarks/nf4shapes_gpu.py, BENCHMARKS.md session 22), us, against 4-byte stores: warp
                     # columns FusedFFNNF4 M=1 1024 -> 2 x 4096 4.72 / 4.90, 2048 -> 2 x 8192 9.96 / 10.21, M=2
                     # 2048 12.68 / 12.65; MatMulNF4 2048x2048 4.62 / 4.86, 2048x6144 6.28 / 6.53; LLaMA-7B block
                     # kernel 21.40 / 21.52 and 22.28 / 22.25 (within the run-to-run spread)


def h2_table_src(from_codes, vec=None):
    """Source lines (4-space indent, for a generated kernel body) that build the packed-fp16 decode's byte-pair table
    in dynamic shared memory ``tab``: entry i's 32 lane copies at words i * 64 + l; four entries' loads issued before
    their stores (one load's latency, not one per entry). ``vec`` (default VEC_TABLE): 8 stores of 16 bytes per entry
    (``sts4``: copies 4c .. 4c + 3, c = (i & 7) ^ j at store j, so the 8 lanes of a quarter-warp hit 8 distinct
    bank quads), else 32 stores of 4 bytes (copy (i + j) & 31 at store j). The entries come from ``lut``: ``from_codes``
    builds them from the 16 code values and their scale (lut[16]; code_with_scale), else lut holds them
    (decode_cuda.lut_for(..., h2=True)). Names used: tid, nthreads, uint32, pack_h2, sts4, the constants U0, U1,
    U4, U15, U31, U256; names set: i, i0..i3, e0..e3, tb0..tb3, j (al with from_codes)."""
    vec = VEC_TABLE if vec is None else vec
    lines = ["    al = lut[16]"] if from_codes else []
    lines += ["    i = tid", "    while i < U256:"]
    for u in range(4):
        iu = f"i{u}"
        ent = f"pack_h2(lut[{iu} >> U4] * al, lut[{iu} & U15] * al)" if from_codes else f"lut[{iu}]"
        lines += [f"        {iu} = i + nthreads * uint32({u})", f"        e{u} = {ent} if {iu} < U256 else U0"]
    for u in range(4):
        if vec:
            lines += [f"        if i{u} < U256:",
                      f"            tb{u} = (i{u} << uint32(6)) | ((i{u} & uint32(7)) << uint32(2))",
                      "            j = uint32(0)", "            while j < uint32(32):",
                      f"                sts4(tab, tb{u} ^ j, e{u})", "                j = uint32(j + uint32(4))"]
        else:
            lines += [f"        if i{u} < U256:", "            j = uint32(0)", "            while j < uint32(32):",
                      f"                tab[(i{u} << uint32(6)) | ((i{u} + j) & U31)] = e{u}",
                      "                j = uint32(j + U1)"]
    return lines + ["        i = uint32(i + nthreads * U4)"]


# Uniform int4 (quant_type "int4": code[q] = (q - 8) / 8, onnxruntime's MatMulNBits grid) decoded with no table: a
# 32-bit word of 8 nibbles (byte b: element 2b in the high nibble, 2b + 1 in the low one) gives four half2 of code
# values, each by one LOP3 and one fma.rn.f16x2: the nibbles at bits 0..3 and 16..19 or'd into fp16 1024.0
# (0x6400, whose last mantissa bit is worth 1) read 1024 + q, times 1/8 minus 129 gives (q - 8) / 8; the nibbles at
# bits 4..7 and 20..23 read 1024 + 16 q, times 1/128 minus 9 gives the same; the word shifted by 8 gives bytes 1 and
# 3 the same way. Every step is exact (fp16 holds q / 8 and the fma rounds once). Decoded half2 r holds the word's
# elements U4_PAIRS[r] (low half, high half): the kernels pack X's pairs in that order.
U4_PAIRS = ((1, 5), (0, 4), (3, 7), (2, 6))
U4_CONSTS = {"U4_LO": np.uint32(0x000F000F), "U4_HI": np.uint32(0x00F000F0), "U4_MAGIC": np.uint32(0x64006400),
             "U4_SLO": np.uint32(0x30003000), "U4_BLO": np.uint32(0xD808D808),      # 1/8, -129
             "U4_SHI": np.uint32(0x20002000), "U4_BHI": np.uint32(0xC880C880),      # 1/128, -9
             "U4_SH8": np.uint32(8)}


def u4_src(word, out, ind):
    """Source lines (indent ``ind``) setting names out[0..4) to the four half2 of code values of uint32 ``word``
    (a name), elements U4_PAIRS[r]. Names used: shr32, andor32, hfma2 and U4_CONSTS; sets ``word``_8."""
    return [f"{ind}{word}_8 = shr32({word}, U4_SH8)",
            f"{ind}{out[0]} = hfma2(andor32({word}, U4_LO, U4_MAGIC), U4_SLO, U4_BLO)",
            f"{ind}{out[1]} = hfma2(andor32({word}, U4_HI, U4_MAGIC), U4_SHI, U4_BHI)",
            f"{ind}{out[2]} = hfma2(andor32({word}_8, U4_LO, U4_MAGIC), U4_SLO, U4_BLO)",
            f"{ind}{out[3]} = hfma2(andor32({word}_8, U4_HI, U4_MAGIC), U4_SHI, U4_BHI)"]


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

    def hscale2(u, p):
        """Both halves of half2 ``u`` times the fp32 ``p``, each rounded once to fp16 (RNE)."""
        h = _halves(u).astype(np.float32)
        with np.errstate(all="ignore"):
            r = (h * np.float32(p)).astype(np.float16).view(np.uint16)
        return np.uint32(int(r[0]) | int(r[1]) << 16)

    def fmax(a, b):
        """IEEE maxNum (fmaxf: a NaN operand is ignored)."""
        return np.fmax(np.float32(a), np.float32(b))

    @cuda.jit(device=True)
    def warp_max(v, red, tid):
        """Largest of the warp's ``v`` (>= 0; NaN ignored), in lane 0 (the simulator has no shuffles: shared
        memory)."""
        red[tid] = v
        cuda.syncthreads()
        s = float32(0.0)
        if (tid & 31) == 0:
            for i in range(32):
                if red[tid + i] > s:
                    s = red[tid + i]
        cuda.syncthreads()
        return s

    def sts4(tab, w, v):
        """tab[w .. w + 3] = v (uint32 words; w % 4 == 0)."""
        for j in range(4):
            tab[int(w) + j] = v

    def ldx8(a, i):
        """Elements 8 i .. 8 i + 7 of ``a`` (fp16, fp16 bits as uint16, or fp32) as fp32 values."""
        v = np.asarray([a[8 * int(i) + j] for j in range(8)])
        if v.dtype == np.uint16:
            v = v.view(np.float16)
        return tuple(np.float32(t) for t in v)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
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

    @intrinsic
    def hscale2(typingctx, u, p):
        """Both halves of half2 ``u`` (uint32 bits) converted to fp32, times ``p``, packed back to fp16 (RNE): the
        same value as pack_h2 of the fp32 products."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            text = ("{ .reg .b16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; "
                    "mul.f32 a, a, $2; mul.f32 b, b, $2; cvt.rn.f16x2.f32 $0, b, a; }")
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, ir.FloatType()]), text, "=r,r,f")
            return builder.call(asm, args)
        return types.uint32(types.uint32, types.float32), codegen

    fmax = cuda.jit(device=True, inline=True)(lambda a, b: libdevice.fmaxf(a, b))

    @intrinsic
    def _redux_umax(typingctx, u):
        """redux.sync.max.u32 over the full warp (sm_80+)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r")
            return builder.call(asm, args)
        return types.uint32(types.uint32), codegen

    @cuda.jit(device=True, inline=True)
    def warp_max(v, red, tid):
        """Largest of the warp's ``v`` (>= 0: their bit patterns order as their values; a NaN counts as the
        largest), in every lane: one redux.sync on the bits."""
        return libdevice.int_as_float(int32(_redux_umax(uint32(libdevice.float_as_int(v)))))

    @intrinsic
    def sts4(typingctx, tab, w, v):
        """tab[w .. w + 3] = v: one 16-byte store of four copies of the uint32 ``v`` (w % 4 == 0; shared memory:
        STS.128)."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            p = builder.gep(data, [builder.zext(args[1], ir.IntType(64))], inbounds=True)
            vt = ir.VectorType(i32, 4)
            val = ir.Constant(vt, ir.Undefined)
            for j in range(4):
                val = builder.insert_element(val, args[2], ir.Constant(i32, j))
            builder.store(val, builder.bitcast(p, vt.as_pointer()), align=16)
            return context.get_dummy_value()
        if tab.dtype != types.uint32:
            return None
        return types.void(tab, types.uint32, types.uint32), codegen

    @intrinsic
    def ldx8(typingctx, arr, idx):
        """Elements 8 i .. 8 i + 7 of ``arr`` (fp16, fp16 bits as uint16, or fp32) as fp32 values: one 16-byte load
        (fp32: two). Every thread of a decode kernel reads its own 16 or 32 consecutive elements of X: element-wise
        loads ask a warp for 32 sectors each (ncu: the M=1 kernel's warps waited on them ~13% of their time)."""
        rt = types.UniTuple(types.float32, 8)
        half = arr.dtype.bitwidth == 16

        def codegen(context, builder, sig, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            i = context.cast(builder, args[1], sig.args[1], types.uint64)
            ptr = builder.gep(ary.data, [builder.shl(i, ir.Constant(ir.IntType(64), 3))])
            if half:
                v = builder.load(builder.bitcast(ptr, ir.VectorType(ir.HalfType(), 8).as_pointer()), align=16)
                vals = [builder.fpext(builder.extract_element(v, ir.Constant(i32, j)), f32) for j in range(8)]
            else:
                p4 = builder.bitcast(ptr, ir.VectorType(f32, 4).as_pointer())
                vs = [builder.load(builder.gep(p4, [ir.Constant(i32, h)]), align=16) for h in range(2)]
                vals = [builder.extract_element(vs[j >> 2], ir.Constant(i32, j & 3)) for j in range(8)]
            return context.make_tuple(builder, rt, vals)
        if not (half or arr.dtype == types.float32):
            return None
        return rt(arr, idx), codegen

"""MatMulNF4 at accuracy_level 4 on AVX-512 VNNI CPUs: int8 activations x the NF4 / FP4 codes as int8 levels, 64
products per ``vpdpbusd`` (reference: onnx_lowbit.nf4_int8). LLVM writes neither the 16-entry table lookup nor
vpdpbusd from Python loops, so the two hot loops are Numba intrinsics:

* ``quantize_row``: one row of A -> int8 per group of g elements (the reference's fp32 operations: amax, 127 / amax,
  the product rounded half to even), arranged per span of 128 elements as the packed weight is: its 64 even
  elements, then its 64 odd ones (byte j of a weight span holds element 2j in the high nibble, 2j + 1 in the low
  one); per 8-element lane ``corr`` = -128 x the lane's sum (psadbw) and ``sal`` = amax x fp32(1 / 127^2) (s_a / 127
  up to an ulp or two: a scale, not a rounding decision; NaN for a group holding NaN / inf, 0 past K, where the
  activations are 0 too). ``quantize_row_nat``: the same, aq left in natural order (nf4col_cpu's column-lane
  kernels, a constant weight's).
* ``tile_R_C`` (``tile_1_Cp``: one row, absmax x sal formed once per call, ``prescaled``): R rows x C columns over
  all of K. Per span and column: one 64-byte load of the packed weight, the high nibbles shifted down, both
  looked up in the 16 levels + 128 (unsigned: vpdpbusd multiplies u8 x s8; ``vpermb`` on VBMI CPUs, which reads 6
  index bits of a table holding the levels 4 times, else ``and`` + ``vpshufb``), two vpdpbusd per row into int32
  lanes started at ``corr`` (which takes the +128 back out: exact), the lanes to fp32 and one FMA with absmax x sal
  per lane (lane l of span z: elements 128 z + 8 l .. + 7, one weight block and one activation group each), the
  lanes summed once per column at the end (a pairwise tree: the same order in every tile shape).

The weight block size (``lbs``: its log2; 32 when the caller passes one absmax per 32-element piece) takes
1 (>= 128), 2 (64) or 4 (32) absmax values per span. K must be a multiple of 32; a last span of 32, 64 or 96
elements reads only its bytes (masked loads). ``VNNI``: whether this CPU has AVX-512 F / BW / VNNI (else nothing
here is emitted and the callers take the scalar path of matmulnf4_int8_cpu)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..device.intrinsics_cpu import F32, I8, I16, I32, I64, V16F, V16I, V32W, V64B, VBMI, VNNI  # noqa: F401
from ..device.intrinsics_cpu import array_ptr as _ptr, as_i64 as _i64, const as _c, function as _fn, splat as _splat

SPAN = 128    # elements per 64-byte vector of one column's packed weight
SAL = float(np.float32(1.0 / 16129.0))   # sal = amax x fp32(1 / 127^2): s_a / 127 within an ulp or two (a scale only)


TABLE_BYTES = 72   # the kernels' level table: 64 bytes of levels, the level divisor L, padding
L_AT = 64


def table(levels, divisor=127) -> np.ndarray:
    """uint8[TABLE_BYTES]: the 16 int8 levels + 128, four times (vpshufb looks up within each 128-bit lane, vpermb
    reads 6 index bits: the tiles load these 64 bytes), then at L_AT the level divisor L (onnx_lowbit.nf4_int8:
    127, or 128 for int4), whose factor 127 / L ``rescale`` applies to the products (sal carries 1 / 127^2)."""
    t = np.zeros(TABLE_BYTES, np.uint8)
    t[:64] = np.tile((np.asarray(levels, np.int16) + 128).astype(np.uint8), 4)
    t[L_AT] = divisor
    return t


@njit(cache=True, nogil=True, boundscheck=False)
def rescale(tbl, out, n_cols):
    """out[m, :n_cols] *= fp32(127 / L) (exact: 1 for L = 127, 0.9921875 for 128), L at tbl[L_AT]; rows any view."""
    div = tbl[L_AT]
    if div == 127:
        return
    f = np.float32(127.0) / np.float32(div)
    for m in range(out.shape[0]):
        for j in range(n_cols):
            out[m, j] *= f


def _make_quantize(natural):
    """quantize_row (``natural`` False: aq per span in the packed weight's even / odd order) or quantize_row_nat
    (True: aq in natural order, for nf4col_cpu's column-lane kernels)."""
    def quantize(typingctx, x, k_dim, lg, aq, corr, sal):
        return _quantize(natural, x, k_dim, lg, aq, corr, sal)
    quantize.__name__ = quantize.__qualname__ = "quantize_row_nat" if natural else "quantize_row"
    return intrinsic(quantize)


def _quantize(natural, x, k_dim, lg, aq, corr, sal):
    """One row of A (float32 1-D ``x``, K = ``k_dim`` elements, groups of 2^lg >= 16 dividing K) -> ``aq`` (int8
    1-D, K rounded up to 128, per span its even elements then its odd ones (natural order with ``natural``), 0 past
    K), ``corr`` (int32, one per 8 elements: -128 x their sum) and ``sal`` (float32, one per 8 elements: amax x
    fp32(1 / 127^2), NaN for a group with a NaN or inf, 0 past K). No bounds checks."""
    sig = types.void(x, k_dim, lg, aq, corr, sal)

    def codegen(context, builder, signature, args):
        if not VNNI:
            return context.get_dummy_value()
        xa, kv, lgv, qa, ca, sa = args
        xp = _ptr(context, builder, signature.args[0], xa, F32)
        qp = _ptr(context, builder, signature.args[3], qa, I8)
        cp = _ptr(context, builder, signature.args[4], ca, I32)
        sp = _ptr(context, builder, signature.args[5], sa, F32)
        k, lgs = _i64(builder, kv), _i64(builder, lgv)
        kp = builder.and_(builder.add(k, _c(I64, SPAN - 1)), _c(I64, -SPAN))
        v16b = ir.VectorType(I8, 16)
        umax = _fn(builder, "llvm.vector.reduce.umax.v16i32", I32, [V16I])
        cvt = _fn(builder, "llvm.x86.avx512.mask.cvtps2dq.512", V16I, [V16F, V16I, I16, I32])
        psad = _fn(builder, "llvm.x86.avx512.psad.bw.512", ir.VectorType(I64, 8), [V64B, V64B])
        nvec = builder.shl(_c(I64, 1), builder.sub(lgs, _c(I64, 4)))          # 16-float vectors per group
        with cgutils.for_range(builder, builder.lshr(k, lgs)) as lg_:
            k0 = builder.shl(lg_.index, lgs)
            mx = cgutils.alloca_once_value(builder, _c(V16I, [0] * 16))
            with cgutils.for_range(builder, nvec) as lv:
                p = builder.gep(xp, [builder.add(k0, builder.shl(lv.index, _c(I64, 4)))])
                bits = builder.and_(builder.load(builder.bitcast(p, V16I.as_pointer()), align=4),
                                    _c(V16I, [0x7FFFFFFF] * 16))
                m0 = builder.load(mx)
                builder.store(builder.select(builder.icmp_unsigned(">", bits, m0), bits, m0), mx)
            top = builder.call(umax, [builder.load(mx)])
            finite = builder.icmp_unsigned("<", top, _c(I32, 0x7F800000))
            amax = builder.bitcast(top, F32)
            pos = builder.fcmp_ordered(">", amax, _c(F32, 0.0))
            inv = builder.select(pos, builder.fdiv(_c(F32, 127.0), amax), _c(F32, 0.0))
            inv = builder.select(finite, inv, _c(F32, 0.0))
            sal_v = builder.select(finite, builder.fmul(amax, _c(F32, SAL)), _c(F32, float("nan")))
            invv = _splat(builder, inv, V16F)
            with cgutils.for_range(builder, nvec) as lv:
                e = builder.add(k0, builder.shl(lv.index, _c(I64, 4)))
                xv = builder.load(builder.bitcast(builder.gep(xp, [e]), V16F.as_pointer()), align=4)
                # round half to even (MXCSR's default) to int32: |x inv| <= 127 (1 + 2^-24)^2 < 127.5, no clipping
                r = builder.call(cvt, [builder.fmul(xv, invv), ir.Constant(V16I, ir.Undefined), _c(I16, -1),
                                       _c(I32, 4)])
                qv = builder.trunc(r, v16b)
                qv = builder.select(finite, qv, _c(v16b, [0] * 16))
                builder.store(qv, builder.bitcast(builder.gep(qp, [e]), v16b.as_pointer()), align=1)
            with cgutils.for_range(builder, builder.shl(nvec, _c(I64, 1))) as ll:        # g / 8 lanes
                builder.store(sal_v, builder.gep(sp, [builder.add(builder.lshr(k0, _c(I64, 3)), ll.index)]))
        with cgutils.for_range_slice(builder, k, kp, _c(I64, 16), inc=True) as (e, _):   # zero padding
            builder.store(_c(v16b, [0] * 16), builder.bitcast(builder.gep(qp, [e]), v16b.as_pointer()), align=1)
        with cgutils.for_range_slice(builder, builder.lshr(k, _c(I64, 3)), builder.lshr(kp, _c(I64, 3)),
                                     _c(I64, 1), inc=True) as (ln, _):
            builder.store(_c(F32, 0.0), builder.gep(sp, [ln]))
        evens = list(range(0, 128, 2))
        odds = list(range(1, 128, 2))
        with cgutils.for_range(builder, builder.lshr(kp, _c(I64, 7))) as lz:
            z = lz.index
            p0 = builder.bitcast(builder.gep(qp, [builder.shl(z, _c(I64, 7))]), V64B.as_pointer())
            p1 = builder.bitcast(builder.gep(qp, [builder.add(builder.shl(z, _c(I64, 7)), _c(I64, 64))]),
                                 V64B.as_pointer())
            v0, v1 = builder.load(p0, align=1), builder.load(p1, align=1)
            flip, zero = _c(V64B, [0x80] * 64), _c(V64B, [0] * 64)
            s0 = builder.call(psad, [builder.xor(v0, flip), zero])   # per 8 bytes: sum(q) + 1024
            s1 = builder.call(psad, [builder.xor(v1, flip), zero])
            sums = builder.trunc(builder.shuffle_vector(s0, s1, _c(V16I, list(range(16)))), V16I)
            cv = builder.mul(builder.sub(sums, _c(V16I, [1024] * 16)), _c(V16I, [-128] * 16))
            builder.store(cv, builder.bitcast(builder.gep(cp, [builder.shl(z, _c(I64, 4))]), V16I.as_pointer()),
                          align=4)
            if not natural:
                builder.store(builder.shuffle_vector(v0, v1, _c(ir.VectorType(I32, 64), evens)), p0, align=1)
                builder.store(builder.shuffle_vector(v0, v1, _c(ir.VectorType(I32, 64), odds)), p1, align=1)
        return context.get_dummy_value()
    return sig, codegen


quantize_row = _make_quantize(False)
quantize_row_nat = _make_quantize(True)


def _masked_load(builder, ptr, vt, count, align):
    """``vt`` from ``ptr`` reading only the first ``count`` (i64) elements (llvm.masked.load), the others 0."""
    n = vt.count
    i1v, i64v = ir.VectorType(ir.IntType(1), n), ir.VectorType(I64, n)
    fn = _fn(builder, f"llvm.masked.load.v{n}{'f32' if vt.element == F32 else 'i8'}.p0", vt,
             [vt.as_pointer(), I32, i1v, vt])
    mask = builder.icmp_unsigned("<", _c(i64v, list(range(n))), _splat(builder, count, i64v))
    zero = _c(vt, [0.0 if vt.element == F32 else 0] * n)
    return builder.call(fn, [builder.bitcast(ptr, vt.as_pointer()), _c(I32, align), mask, zero])


def _absmax_vec(builder, ap, b0, nb, valid=None):
    """16 lanes of absmax: ``nb`` (1, 2 or 4) consecutive values from block b0, each on 16 / nb lanes; with
    ``valid`` (the tail span) only blocks below it are read, the others are 0."""
    if nb == 1:
        return _splat(builder, builder.load(builder.gep(ap, [b0])), V16F)
    vt = ir.VectorType(F32, nb)
    p = builder.gep(ap, [b0])
    if valid is None:
        v = builder.load(builder.bitcast(p, vt.as_pointer()), align=4)
    else:
        v = _masked_load(builder, p, vt, valid, 4)
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), _c(V16I, [i * nb // 16 for i in range(16)]))


def _lookup(builder, tbl, idx):
    """The levels (+ 128) of the low nibbles of ``idx``'s bytes (the bits above are ignored), as 16 x int32: one
    vpermb on VBMI CPUs (it reads 6 index bits: the table holds the 16 levels 4 times), else and + vpshufb."""
    if VBMI:
        v = builder.call(_fn(builder, "llvm.x86.avx512.permvar.qi.512", V64B, [V64B, V64B]), [tbl, idx])
    else:
        v = builder.call(_fn(builder, "llvm.x86.avx512.pshuf.b.512", V64B, [V64B, V64B]),
                         [tbl, builder.and_(idx, _c(V64B, [15] * 64))])
    return builder.bitcast(v, V16I)


def _lane_sums(builder, vecs):
    """The lane sums of the 16-lane vectors ``vecs`` (a power of two of them), as one vector with one sum per input
    in order: a pairwise tree per input (lane i + lane i + 8, then + 4, + 2, + 1), the inputs packed together as
    they narrow (a transposing reduction: about 3 operations per input instead of 8). Every input gets the same
    additions in the same order however many are reduced together, so a column's bytes do not depend on the tile."""
    width, per = 16, 1          # lanes per input, inputs per vector
    while width > 1:
        h = width // 2
        lo = [k * width + i for k in range(per) for i in range(h)]
        hi = [k * width + h + i for k in range(per) for i in range(h)]
        n = vecs[0].type.count
        if len(vecs) > 1:       # two vectors into one: [v's inputs, u's inputs], each on h lanes
            mask = ir.VectorType(I32, 2 * len(lo))
            vecs = [builder.fadd(builder.shuffle_vector(v, u, _c(mask, lo + [n + x for x in lo])),
                                 builder.shuffle_vector(v, u, _c(mask, hi + [n + x for x in hi])))
                    for v, u in zip(vecs[0::2], vecs[1::2])]
            per *= 2
        else:                   # one vector: narrowed in place
            mask = ir.VectorType(I32, len(lo))
            v = vecs[0]
            vecs = [builder.fadd(builder.shuffle_vector(v, v, _c(mask, lo)), builder.shuffle_vector(v, v, _c(mask, hi)))]
        width = h
    return vecs[0]


def _make_tile(R, C, prescaled=False):  # noqa: N803
    """The intrinsic tile(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, col0, row0, out, ld): for r < R, c < C,
    out[(row0 + r) ld + col0 + c] (float32 flat) = row row0 + r of the quantised A (aq / corr / sal: quantize_row's
    arrays, rows kp bytes / kp / 8 lanes apart) times column col0 + c of the packed weight (q: its bytes from the
    first column's, am: its absmax of blocks of 2^lbs elements, numbered from the first column's; tbl: ``table``).
    ``prescaled`` (one row): ``am`` holds absmax x the block's sal already (``prescale``; the same fp32 products
    the other tiles form per span), ``sal`` is not read: one vector multiply less per column and span."""

    @intrinsic
    def tile(typingctx, q, am, tbl, aq, corr, sal, kp, k_dim, lbs, col0, row0, out, ld):
        sig = types.void(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, col0, row0, out, ld)

        def codegen(context, builder, signature, args):
            if not VNNI:
                return context.get_dummy_value()
            ta = signature.args
            qp, ap, tp = (_ptr(context, builder, ta[i], args[i], e) for i, e in ((0, I8), (1, F32), (2, I8)))
            aqp, cp, sp = (_ptr(context, builder, ta[i], args[i], e) for i, e in ((3, I8), (4, I32), (5, F32)))
            op = _ptr(context, builder, ta[11], args[11], F32)
            kp, k, lbs, col0, row0, ld = (_i64(builder, args[i]) for i in (6, 7, 8, 9, 10, 12))
            dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I, [V16I, V16I, V16I])
            fma = _fn(builder, "llvm.fma.v16f32", V16F, [V16F, V16F, V16F])
            tblv = builder.load(builder.bitcast(tp, V64B.as_pointer()), align=1)
            zero = _c(V16F, [0.0] * 16)
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(C)] for _ in range(R)]
            cols = [builder.mul(builder.add(col0, _c(I64, c)), k) for c in range(C)]       # first elements
            rows = [builder.add(row0, _c(I64, r)) for r in range(R)]
            tail = builder.and_(k, _c(I64, SPAN - 1))
            bs = builder.shl(_c(I64, 1), lbs)

            qcol = [builder.lshr(cols[c], _c(I64, 1)) for c in range(C)]                  # first bytes
            acol = [builder.lshr(cols[c], lbs) for c in range(C)]                          # first blocks

            def span(z, nb, is_tail):
                e = builder.shl(z, _c(I64, 7))
                zb = builder.mul(z, _c(I64, nb)) if nb > 1 else builder.lshr(z, builder.sub(lbs, _c(I64, 7)))
                xs = []
                for r in range(R):
                    a0 = builder.add(builder.mul(rows[r], kp), e)
                    ae = builder.load(builder.bitcast(builder.gep(aqp, [a0]), V16I.as_pointer()), align=1)
                    ao = builder.load(builder.bitcast(builder.gep(aqp, [builder.add(a0, _c(I64, 64))]),
                                                      V16I.as_pointer()), align=1)
                    l0 = builder.add(builder.mul(rows[r], builder.lshr(kp, _c(I64, 3))), builder.lshr(e, _c(I64, 3)))
                    cr = builder.load(builder.bitcast(builder.gep(cp, [l0]), V16I.as_pointer()), align=4)
                    sl = None if prescaled else builder.load(builder.bitcast(builder.gep(sp, [l0]),
                                                                             V16F.as_pointer()), align=4)
                    xs.append((ae, ao, cr, sl))
                for c in range(C):
                    qa = builder.gep(qp, [builder.add(qcol[c], builder.shl(z, _c(I64, 6)))])
                    if is_tail:
                        qv = _masked_load(builder, qa, V64B, builder.lshr(tail, _c(I64, 1)), 1)
                        valid = builder.lshr(builder.add(tail, builder.sub(bs, _c(I64, 1))), lbs)
                    else:
                        qv = builder.load(builder.bitcast(qa, V64B.as_pointer()), align=1)
                        valid = None
                    hi = builder.bitcast(builder.lshr(builder.bitcast(qv, V32W), _c(V32W, [4] * 32)), V64B)
                    wh, wl = _lookup(builder, tblv, hi), _lookup(builder, tblv, qv)
                    amv = _absmax_vec(builder, ap, builder.add(acol[c], zb), nb, valid)
                    for r in range(R):
                        ae, ao, cr, sl = xs[r]
                        s = builder.call(dp, [builder.call(dp, [cr, wh, ae]), wl, ao])
                        f = builder.sitofp(s, V16F)
                        sc = amv if prescaled else builder.fmul(amv, sl)
                        builder.store(builder.call(fma, [f, sc, builder.load(acc[r][c])]), acc[r][c])

            def spans(nb):
                with cgutils.for_range(builder, builder.lshr(k, _c(I64, 7))) as lz:
                    span(lz.index, nb, False)
                with builder.if_then(builder.icmp_unsigned("!=", tail, _c(I64, 0))):
                    span(builder.lshr(k, _c(I64, 7)), nb, True)

            with builder.if_else(builder.icmp_unsigned("<=", lbs, _c(I64, 5))) as (b32, wider):
                with b32:
                    spans(4)
                with wider:
                    with builder.if_else(builder.icmp_unsigned("==", lbs, _c(I64, 6))) as (b64, b128):
                        with b64:
                            spans(2)
                        with b128:
                            spans(1)
            sums = _lane_sums(builder, [builder.load(acc[r][c]) for r in range(R) for c in range(C)])
            for r in range(R):
                o = builder.gep(op, [builder.add(builder.mul(rows[r], ld), col0)])
                if C == 1:
                    builder.store(builder.extract_element(sums, _c(I32, r)), o)
                else:
                    vt = ir.VectorType(F32, C)
                    row = builder.shuffle_vector(sums, sums, _c(ir.VectorType(I32, C), [r * C + c for c in range(C)]))
                    builder.store(row, builder.bitcast(o, vt.as_pointer()), align=4)
            return context.get_dummy_value()
        return sig, codegen
    tile.__name__ = f"tile_{R}_{C}" + ("p" if prescaled else "")
    return tile


tile_1_1 = _make_tile(1, 1)
tile_1_4 = _make_tile(1, 4)
tile_2_1 = _make_tile(2, 1)
tile_2_4 = _make_tile(2, 4)
tile_4_1 = _make_tile(4, 1)
tile_4_4 = _make_tile(4, 4)
tile_1_1p = _make_tile(1, 1, prescaled=True)
tile_1_4p = _make_tile(1, 4, prescaled=True)

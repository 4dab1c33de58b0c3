"""QuantGRU's AVX-512 intrinsics (custom_ops/gru/quantgru_cpu.py uses them on hosts with ``VNNI``): Numba intrinsics
that write vpdpbusd / vpdpwssd on 512-bit registers themselves (LLVM's own loops give 256-bit pmaddwd with
horizontal sums), and vector gathers for the cell's table lookups (LLVM emits none for AMD targets by itself).

Two forms of the integer products (see "The CPU kernel" in docs/gru.md):

* ``_make_mm``: on weights **packed** in the order those instructions read them (quantgru_cpu.pack_weights):
  blocks of 16 output rows, k in groups of G (4 bytes, or 2 int16 values), one 64-byte vector per (block, group)
  holding the 16 rows' G values: lane i of the accumulator is row i's sum, the activations' G values broadcast to
  all lanes (no horizontal sums); ``_tr16`` is the packing's 16 x 16 transpose.
* ``_make_rowdot``: on the weights **as stored** (row-major, nothing packed or cached): each row's dot product
  with the activation vector in 64-byte pieces along k (lanes hold partial sums), four rows at a time, summed
  across lanes at the end of the row. For calls too short to repay packing (a streaming frame).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..device.intrinsics_cpu import VNNI, array_ptr, function, splat

KIND_U8S8, KIND_S16 = 0, 1   # vpdpbusd (unsigned byte activations, signed byte weights), vpdpwssd (int16 both)


def _make_mm(kind, dual, nb, mr, listed=False):
    """An intrinsic mm(wp, a0, a1, a_stride, m_groups, nb_groups, kg0, kg1, kg_total, o0, o1, o_stride):
    for row groups mg < m_groups (rows m = mg mr + r) and block groups bg < nb_groups (blocks b = bg nb + j),
    o0[m o_stride + 16 b + i] = sum over k-groups g in [kg0, kg1) of the products of packed weights
    wp[b, g, i, :] and activations a0[m a_stride + G g + :] (int32, wrapping: callers keep sums exact); with
    ``dual`` likewise o1 from a1 (the same weight vector feeds both). wp 1-D (int8 / int16) holding
    [blocks, kg_total, 16, G]; a0, a1 1-D (uint8 / int16); o0, o1 1-D int32; strides in elements. No bounds
    checks: the callers size the buffers (rows padded to mr, blocks to nb, k to G).

    ``listed``: mm(wp, blk, a0, ...) with blk int64 [nb_groups nb]: list position b reads the weights of block
    blk[b] (any blocks, in any order) and writes o0[m o_stride + 16 b + i]: a half of the hidden units' rows in
    whole groups of nb blocks although each gate's share of them is not a multiple of nb."""
    name = "llvm.x86.avx512.vpdpbusd.512" if kind == KIND_U8S8 else "llvm.x86.avx512.vpdpwssd.512"
    esz = 1 if kind == KIND_U8S8 else 2

    def codegen(context, builder, signature, args):
        if not VNNI:      # never called on such hosts (run_direction's pack_min); LLVM could not select it
            return context.get_dummy_value()
        if listed:
            blka, args = args[1], (args[0],) + tuple(args[2:])
            blkt, sargs = signature.args[1], (signature.args[0],) + tuple(signature.args[2:])
            blkp = context.make_array(blkt)(context, builder, blka).data
        else:
            sargs = signature.args
        wpa, a0a, a1a, a_st, mg_n, bg_n, k0, k1, kgt, o0a, o1a, o_st = args
        ptrs = [array_ptr(context, builder, t, v)
                for t, v in zip((sargs[0], sargs[1], sargs[2], sargs[9], sargs[10]), (wpa, a0a, a1a, o0a, o1a))]
        wptr, ap0, ap1, op0, op1 = ptrs
        i32, i64 = ir.IntType(32), ir.IntType(64)
        v16 = ir.VectorType(i32, 16)
        fn = function(builder, name, v16, [v16, v16, v16])
        c = lambda v: ir.Constant(i64, v)  # noqa: E731
        a_st_b = builder.mul(a_st, c(esz))          # bytes per activation row
        o_st_b = builder.mul(o_st, c(4))
        blk_b = builder.mul(kgt, c(64))             # bytes per packed block
        zero = ir.Constant(v16, [0] * 16)
        accs = [[[cgutils.alloca_once_value(builder, zero) for _ in range(mr)] for _ in range(nb)]
                for _ in range(2 if dual else 1)]
        with cgutils.for_range(builder, bg_n) as lb:
            bg = lb.index
            with cgutils.for_range(builder, mg_n) as lm:
                mg = lm.index
                for s in accs:
                    for row in s:
                        for a in row:
                            builder.store(zero, a)
                rows = [builder.mul(builder.add(builder.mul(mg, c(mr)), c(r)), a_st_b) for r in range(mr)]
                pos = [builder.add(builder.mul(bg, c(nb)), c(j)) for j in range(nb)]
                if listed:
                    pos = [builder.load(builder.gep(blkp, [q])) for q in pos]
                blks = [builder.mul(q, blk_b) for q in pos]
                with cgutils.for_range_slice(builder, k0, k1, c(1), inc=True) as (g, _):
                    g64 = builder.mul(g, c(64))
                    g4 = builder.mul(g, c(4))
                    ws = []
                    for j in range(nb):
                        p = builder.gep(wptr, [builder.add(blks[j], g64)])
                        ws.append(builder.load(builder.bitcast(p, v16.as_pointer()), align=1))
                    for s, base in enumerate((ap0, ap1) if dual else (ap0,)):
                        for r in range(mr):
                            p = builder.gep(base, [builder.add(rows[r], g4)])
                            x = builder.load(builder.bitcast(p, i32.as_pointer()), align=1)
                            xv = splat(builder, x, v16)
                            for j in range(nb):
                                acc = accs[s][j][r]
                                builder.store(builder.call(fn, [builder.load(acc), xv, ws[j]]), acc)
                for s, base in enumerate((op0, op1) if dual else (op0,)):
                    for r in range(mr):
                        m_off = builder.mul(builder.add(builder.mul(mg, c(mr)), c(r)), o_st_b)
                        for j in range(nb):
                            b_off = builder.mul(builder.add(builder.mul(bg, c(nb)), c(j)), c(64))
                            p = builder.gep(base, [builder.add(m_off, b_off)])
                            builder.store(builder.load(accs[s][j][r]), builder.bitcast(p, v16.as_pointer()),
                                          align=4)
        return context.get_dummy_value()

    if listed:
        @intrinsic
        def mm(typingctx, wp, blk, a0, a1, a_stride, m_groups, nb_groups, kg0, kg1, kg_total, o0, o1, o_stride):
            return types.void(wp, blk, a0, a1, a_stride, m_groups, nb_groups, kg0, kg1, kg_total, o0, o1,
                              o_stride), codegen
    else:
        @intrinsic
        def mm(typingctx, wp, a0, a1, a_stride, m_groups, nb_groups, kg0, kg1, kg_total, o0, o1, o_stride):
            return types.void(wp, a0, a1, a_stride, m_groups, nb_groups, kg0, kg1, kg_total, o0, o1,
                              o_stride), codegen
    return mm


@intrinsic
def _tr16(typingctx, src, src_off, stride, dst, dst_off):
    """Transposes a 16 x 16 matrix of 4-byte units: the 64 bytes at byte src_off + i stride of ``src`` (row i) go to
    ``dst`` as unit i of each of 16 consecutive 64-byte vectors from byte dst_off (vector g = the rows' unit g).
    The weight packing's inner step (any dtypes; byte offsets; no bounds checks)."""
    sig = types.void(src, src_off, stride, dst, dst_off)

    def codegen(context, builder, signature, args):
        sa, so, st, da, do = args
        sp = array_ptr(context, builder, signature.args[0], sa)
        dp = array_ptr(context, builder, signature.args[3], da)
        i32 = ir.IntType(32)
        v16 = ir.VectorType(i32, 16)
        v = [builder.load(builder.bitcast(builder.gep(sp, [builder.add(so, builder.mul(st, ir.Constant(st.type, i)))]),
                                          v16.as_pointer()), align=1) for i in range(16)]
        bs = 8
        while bs:
            lo = ir.Constant(v16, [c if not c & bs else 16 + c - bs for c in range(16)])
            hi = ir.Constant(v16, [c + bs if not c & bs else 16 + c for c in range(16)])
            for r in range(16):
                if not r & bs:
                    v[r], v[r + bs] = builder.shuffle_vector(v[r], v[r + bs], lo), builder.shuffle_vector(v[r], v[r + bs], hi)
            bs >>= 1
        for g in range(16):
            p = builder.gep(dp, [builder.add(do, ir.Constant(do.type, 64 * g))])
            builder.store(v[g], builder.bitcast(p, v16.as_pointer()), align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _lut_gather(typingctx, tab, q, out, n, lo, sh):
    """out[j] = gru_int.lut(q[j], tab) for j < n rounded down to 8 (the caller does the rest): q, out int64 arrays
    (may be the same), tab int32; u = q - lo, i = u >> sh, y = tab[i] + (((tab[i + 1] - tab[i]) * (u & (2^sh - 1))
    + 2^sh / 2) >> sh), eight at a time with vector gathers (LLVM emits none for AMD targets by itself)."""
    sig = types.void(tab, q, out, n, lo, sh)

    def codegen(context, builder, signature, args):
        ta, qa, oa, n_v, lo_v, sh_v = args
        tp = context.make_array(signature.args[0])(context, builder, ta).data
        qp = context.make_array(signature.args[1])(context, builder, qa).data
        op = context.make_array(signature.args[2])(context, builder, oa).data
        i1, i32, i64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)
        v8, v8i32, v8b = ir.VectorType(i64, 8), ir.VectorType(i32, 8), ir.VectorType(i1, 8)
        v8p = ir.VectorType(i32.as_pointer(), 8)
        gather = function(builder, "llvm.masked.gather.v8i32.v8p0", v8i32, [v8p, i32, v8b, v8i32])
        splat8 = lambda x: splat(builder, x, v8)  # noqa: E731
        one = ir.Constant(i64, 1)
        shv = splat8(sh_v)
        mask = splat8(builder.sub(builder.shl(one, sh_v), one))
        rnd = splat8(builder.ashr(builder.shl(one, sh_v), one))
        lov = splat8(lo_v)
        allm = ir.Constant(v8b, [1] * 8)
        und = ir.Constant(v8i32, ir.Undefined)
        base = splat8(builder.ptrtoint(tp, i64))
        four = splat8(ir.Constant(i64, 4))
        nb8 = builder.sdiv(n_v, ir.Constant(i64, 8))

        def loop(interp):
            with cgutils.for_range(builder, nb8) as lp:
                j = builder.mul(lp.index, ir.Constant(i64, 8))
                qv = builder.load(builder.bitcast(builder.gep(qp, [j]), v8.as_pointer()), align=8)
                u = builder.sub(qv, lov)
                idx = builder.ashr(u, shv)
                pa = builder.inttoptr(builder.add(base, builder.mul(idx, four)), v8p)
                y = builder.sext(builder.call(gather, [pa, ir.Constant(i32, 4), allm, und]), v8)
                if interp:
                    pb = builder.inttoptr(builder.add(base, builder.mul(builder.add(idx, splat8(one)), four)), v8p)
                    b = builder.sext(builder.call(gather, [pb, ir.Constant(i32, 4), allm, und]), v8)
                    d = builder.add(builder.mul(builder.sub(b, y), builder.and_(u, mask)), rnd)
                    y = builder.add(y, builder.ashr(d, shv))
                builder.store(y, builder.bitcast(builder.gep(op, [j]), v8.as_pointer()), align=8)
        with builder.if_else(builder.icmp_signed("==", sh_v, ir.Constant(i64, 0))) as (plain, interp):
            with plain:      # sh = 0 (int8): the interpolation term is 0
                loop(False)
            with interp:
                loop(True)
        return context.get_dummy_value()
    return sig, codegen


ROWDOT_MR = 4        # rows per pass of a row-dot product (the activation vector loaded once for them)
ROWDOT_MAX_K = 2048  # longest row the row-dot products take: int32 lanes exact (int16: a lane sums k / 16 products
#                      of |w d| <= 2^23, below 2^31 up to k = 4080; int8: |w (u - c)| <= 128 * 255)


def _make_rowdot(kind):
    """An intrinsic rowdot(w, a0, a1, c, out): out[r] = sum_k w[r, k] d[k] (int64) for every row of w [rows, K]
    (C-contiguous, K <= ROWDOT_MAX_K), exact:

    * KIND_U8S8 (w int8): d = a0 - c with a0 uint8 [>= K] and c in 0..255 (vpdpbusd of a0 and of c's bytes
      broadcast on the same weight vector, subtracted lane-wise; a1 unused);
    * KIND_S16 (w int16): d = 256 a0 + a1 with a0, a1 int16 [>= K] (two vpdpwssd on one weight vector; lanes
      combined in int64; c unused).

    k runs in 64-byte vectors, the last one masked (no reads past a row or an activation vector), ROWDOT_MR rows
    at a time sharing each activation load (1, 2 and 8 measured slower); a row's lanes are summed at its end
    (int8: int32, int16: int64). int16 prefetches the next ROWDOT_MR rows' vectors (its weights, twice the bytes,
    come from L3 at H = 400: 7-16% faster; int8's from L2: slower). Both run at ~60 GB/s from L2 or L3 (H = 400,
    thread time), the reads bound them: int8 computing d with one vpdpbusd (weights as the unsigned operand, where
    d fits a byte) measured no faster than two, nor did summing 16 rows' lanes together by shuffles."""
    name = "llvm.x86.avx512.vpdpbusd.512" if kind == KIND_U8S8 else "llvm.x86.avx512.vpdpwssd.512"
    esz = 1 if kind == KIND_U8S8 else 2
    lanes = 64 // esz                       # elements per 64-byte vector
    mr = ROWDOT_MR

    @intrinsic
    def rowdot(typingctx, w, a0, a1, c, out):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and w.dtype.bitwidth == 8 * esz):
            return None
        sig = types.void(w, a0, a1, c, out)

        def codegen(context, builder, signature, args):
            if not VNNI:      # never called on such hosts; LLVM could not select it
                return context.get_dummy_value()
            wa, a0a, a1a, c_v, oa = args
            warr = context.make_array(signature.args[0])(context, builder, wa)
            i1, i8, i32, i64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
            p8 = i8.as_pointer()
            wptr = builder.bitcast(warr.data, p8)
            ap0 = array_ptr(context, builder, signature.args[1], a0a)
            ap1 = array_ptr(context, builder, signature.args[2], a1a)
            optr = context.make_array(signature.args[4])(context, builder, oa).data
            rows, kdim = cgutils.unpack_tuple(builder, warr.shape, 2)
            const = lambda v: ir.Constant(i64, v)  # noqa: E731
            v16, v16l = ir.VectorType(i32, 16), ir.VectorType(i64, 16)
            vel = ir.VectorType(ir.IntType(8 * esz), lanes)
            vmask = ir.VectorType(i1, lanes)
            fn = function(builder, name, v16, [v16, v16, v16])
            mload = function(builder, f"llvm.masked.load.v{lanes}i{8 * esz}.p0", vel,
                             [vel.as_pointer(), i32, vmask, vel])
            red32 = function(builder, "llvm.vector.reduce.add.v16i32", i32, [v16])
            red64 = function(builder, "llvm.vector.reduce.add.v16i64", i64, [v16l])
            zero = ir.Constant(v16, [0] * 16)
            nfull = builder.sdiv(kdim, const(lanes))
            rem = builder.sub(kdim, builder.mul(nfull, const(lanes)))
            tail = builder.icmp_signed("<", ir.Constant(vel, list(range(lanes))),
                                       splat(builder, builder.trunc(rem, vel.element), vel))   # lanes < rem
            row_b = builder.mul(kdim, const(esz))
            if kind == KIND_U8S8:   # c's byte in all four bytes of every lane
                cvec = splat(builder, builder.mul(builder.and_(builder.trunc(c_v, i32), ir.Constant(i32, 255)),
                                                  ir.Constant(i32, 0x01010101)), v16)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(mr)]
            last = builder.sub(rows, const(1))

            def load(base, off, masked):
                p = builder.bitcast(builder.gep(base, [off]), vel.as_pointer())
                if masked:
                    v = builder.call(mload, [p, ir.Constant(i32, 1), tail, ir.Constant(vel, [0] * lanes)])
                else:
                    v = builder.load(p, align=1)
                return builder.bitcast(v, v16)

            prefetch = function(builder, "llvm.prefetch.p0", ir.VoidType(), [p8, i32, i32, i32])
            ahead = builder.mul(row_b, const(mr))

            def piece(rbase, j, masked):
                off = builder.mul(j, const(64))
                if kind == KIND_S16 and not masked:   # the next rows' vector (never faults, even past the end)
                    for i in range(mr):
                        builder.call(prefetch, [builder.gep(wptr, [builder.add(builder.add(rbase[i], off), ahead)]),
                                                ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                x0 = load(ap0, off, masked)
                x1 = cvec if kind == KIND_U8S8 else load(ap1, off, masked)
                for i in range(mr):
                    wv = load(wptr, builder.add(rbase[i], off), masked)
                    for s, x in enumerate((x0, x1)):
                        acc = accs[i][s]
                        builder.store(builder.call(fn, [builder.load(acc), x, wv]), acc)

            n_groups = builder.sdiv(builder.add(rows, const(mr - 1)), const(mr))
            with cgutils.for_range(builder, n_groups) as lg:
                rr = [builder.add(builder.mul(lg.index, const(mr)), const(i)) for i in range(mr)]
                rbase = []
                for r in rr:     # rows past the end read the last row (results not stored)
                    rc = builder.select(builder.icmp_signed("<", r, rows), r, last)
                    rbase.append(builder.mul(rc, row_b))
                for pair in accs:
                    for a in pair:
                        builder.store(zero, a)
                with cgutils.for_range(builder, nfull) as lk:
                    piece(rbase, lk.index, False)
                with builder.if_then(builder.icmp_signed(">", rem, const(0))):
                    piece(rbase, nfull, True)
                for i in range(mr):
                    s0, s1 = builder.load(accs[i][0]), builder.load(accs[i][1])
                    if kind == KIND_U8S8:     # sum w (a0 - c): exact in int32 (|.| < 2^31 for K <= MAX_K)
                        tot = builder.sext(builder.call(red32, [builder.sub(s0, s1)]), i64)
                    else:                     # sum w (256 a0 + a1) in int64
                        v = builder.add(builder.shl(builder.sext(s0, v16l), ir.Constant(v16l, [8] * 16)),
                                        builder.sext(s1, v16l))
                        tot = builder.call(red64, [v])
                    with builder.if_then(builder.icmp_signed("<", rr[i], rows)):
                        builder.store(tot, builder.gep(optr, [rr[i]]))
            return context.get_dummy_value()
        return sig, codegen
    return rowdot


rowdot_u8s8 = _make_rowdot(KIND_U8S8)
rowdot_s16 = _make_rowdot(KIND_S16)


def rowdot(w, a0, a1, c, out):
    """rowdot_u8s8 or rowdot_s16 by the width of w (Numba only: the overload below picks it at compile time)."""
    raise NotImplementedError("rowdot is called from Numba-compiled code")


@overload(rowdot, inline="always")
def _rowdot_nb(w, a0, a1, c, out):
    if w.dtype.bitwidth == 16:
        return lambda w, a0, a1, c, out: rowdot_s16(w, a0, a1, c, out)
    return lambda w, a0, a1, c, out: rowdot_u8s8(w, a0, a1, c, out)

"""MatMulNF4 at accuracy_level 4 on AVX-512 VNNI CPUs for a CONSTANT weight, repacked once per node into column
lanes (reference: onnx_lowbit.nf4_int8; the kernels of a non-constant weight are nf4vnni_cpu's).

``pack`` (once per node; the copy costs N x K / 2 bytes of codes plus 4 x N x K / g bytes of absmax, next to
onnxruntime's own initializer): column tiles of 16 columns (the last one padded with code 0 and absmax 0, the tiles
to a multiple of 4 with code 0); per tile and per 8-element step s of K one 64-byte vector whose 4 bytes of lane c
(column 16 t + c) hold elements 8 s .. 8 s + 3 in their low nibbles and 8 s + 4 .. 8 s + 7 in their high nibbles,
the vectors of 4 consecutive tiles side by side per step (``qk``: [tiles / 4][K / 8][4][64] bytes: the one-row
kernel reads one 256-byte stream per step, about 25 % faster than four streams once the weight is not in cache);
the absmax per tile, group and column (``sk``: [tiles][K / g][16] float32, the group's weight block).

``tile_R_T`` (R rows x T tiles of 16 columns, every int32 lane one column): per step one 64-byte load, one shift of
the high nibbles, two lookups of the 16 levels + 128 (``vpermb``, 6 index bits, the levels 4 times: no mask) and
two ``vpdpbusd`` per row with the row's 4 activation bytes broadcast (u8 weights x s8 activations; the int32 lanes
start each group at the row's -128 x sum(a_q over the group), which takes the +128 back out: exact). Per group:
the lanes to fp32, times the row's scale sal (amax x fp32(1 / 127^2)), one FMA with the absmax of the 16 columns
into the fp32 lanes; no horizontal sums. Every column gets the same operations (groups in order) whatever R, T,
the tile range or the task, so every row count and thread split gives the same bytes; they differ from
nf4vnni_cpu's (other fp32 summation order), within the level-4 tolerances of the reference.

Activations: nf4vnni_cpu.quantize_row_nat (natural order), then ``group_scales`` (corr / sal per group)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..device.intrinsics_cpu import F32, I8, I32, I64, V16F, V16I, V32W, V64B, VNNI
from ..device.intrinsics_cpu import array_ptr as _ptr, as_i64 as _i64, const as _c, function as _fn, splat as _splat
from . import nf4vnni_cpu as vnni
from .nf4vnni_cpu import _lookup

TILE = 16     # columns per tile (int32 lanes of a vector)


class ColPack:
    """A constant weight in column lanes (``pack``): ``qk`` uint8 [ceil(tiles / 4) * 4 * K / 8 * 64], ``sk``
    float32 [tiles * K / g * 16], K, N, the group g and its log2 ``lg``."""
    __slots__ = ("qk", "sk", "k", "n", "g", "lg", "tiles")

    def __init__(self, qk, sk, k, n, g):
        self.qk, self.sk, self.k, self.n, self.g = qk, sk, k, n, g
        self.lg = int(g).bit_length() - 1
        self.tiles = -(-n // TILE)

    @property
    def nbytes(self):
        return self.qk.nbytes + self.sk.nbytes


@njit(cache=True, inline="always")
def sizes(k_dim, n_dim, g):
    """(elements of qk, of sk) of a ColPack of a K x N weight with groups of g (the module doc's layout)."""
    tiles = (n_dim + TILE - 1) // TILE
    return (tiles + 3) // 4 * 4 * (k_dim // 8) * 64, tiles * (k_dim // g) * TILE


@njit(cache=True, inline="always")
def task_tiles(begin, end, n_dim):
    """(t0, t1, n0, n1): a native task's column tiles [begin, end) clipped to the weight's N columns, and the
    columns [n0, n1) they cover."""
    t0, t1 = begin, min(end, (n_dim + TILE - 1) // TILE)
    return t0, t1, t0 * TILE, min(t1 * TILE, n_dim)


@njit(cache=True, nogil=True, boundscheck=False)
def pack_arrays(q, absmax, k_dim, n_dim, bs, g):
    """(qk, sk) of the bitsandbytes weight (q: packed bytes, W^T element i in byte i >> 1, high nibble for even i;
    absmax: one per bs elements; K a multiple of 32) in the layout of the module doc."""
    steps = k_dim // 8
    ngr = k_dim // g
    nq, ns = sizes(k_dim, n_dim, g)
    qk = np.zeros(nq, np.uint8)
    sk = np.zeros(ns, np.float32)
    for n in range(n_dim):
        t, c = n // TILE, n % TILE
        base = n * k_dim
        for s in range(steps):
            o = (((t >> 2) * steps + s) * 4 + (t & 3)) * 64 + 4 * c
            i = (base >> 1) + 4 * s      # K % 32 == 0: bytes b0..b3 hold elements 8 s .. 8 s + 7 (even ones high)
            b0, b1, b2, b3 = np.int64(q[i]), np.int64(q[i + 1]), np.int64(q[i + 2]), np.int64(q[i + 3])
            qk[o] = np.uint8((b0 >> 4) | (b2 & 0xF0))               # elements 8 s, 8 s + 4
            qk[o + 1] = np.uint8((b0 & 15) | ((b2 << 4) & 0xF0))    # 8 s + 1, 8 s + 5
            qk[o + 2] = np.uint8((b1 >> 4) | (b3 & 0xF0))           # 8 s + 2, 8 s + 6
            qk[o + 3] = np.uint8((b1 & 15) | ((b3 << 4) & 0xF0))    # 8 s + 3, 8 s + 7
        for b in range(ngr):
            sk[(t * ngr + b) * TILE + c] = absmax[(base + b * g) // bs]
    return qk, sk


def pack(q, absmax, k, n, bs, g) -> ColPack:
    """The ColPack of a weight (host arrays; g: the level-4 group, matmulnf4_int8_cpu.group)."""
    q1 = np.ascontiguousarray(q).reshape(-1)
    am = np.ascontiguousarray(absmax, dtype=np.float32).reshape(-1)
    qk, sk = pack_arrays(q1, am, k, n, bs, g)
    return ColPack(_aligned(qk), _aligned(sk), k, n, g)


def _aligned(x, align=64):
    """A copy of 1-D ``x`` starting on an ``align``-byte boundary (a tile's 64-byte vectors: no line splits)."""
    buf = np.empty(x.nbytes + align, np.uint8)
    off = (-buf.ctypes.data) % align
    out = buf[off:off + x.nbytes].view(x.dtype)
    out[:] = x
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def group_scales(corr, sal, g):
    """Per group of g elements (corr, sal: quantize_row_nat's, one per 8 elements, rows [M, Kp / 8]): (int32
    -128 x the group's sum of a_q, float32 the group's sal), both [M, Kp / g] (the groups past K: 0, never read)."""
    m, lanes = corr.shape
    per = g // 8
    ng = lanes // per
    cg = np.empty((m, ng), np.int32)
    sg = np.empty((m, ng), np.float32)
    for r in range(m):
        for j in range(ng):
            s = np.int32(0)
            for i in range(j * per, (j + 1) * per):
                s += corr[r, i]
            cg[r, j] = s
            sg[r, j] = sal[r, j * per]
    return cg, sg


def _masked_store(builder, val, ptr, count):
    """Stores the first ``count`` (i64, <= 16) lanes of the V16F ``val`` at ``ptr``."""
    i1v, i64v = ir.VectorType(ir.IntType(1), 16), ir.VectorType(I64, 16)
    fn = _fn(builder, "llvm.masked.store.v16f32.p0", ir.VoidType(), [V16F, V16F.as_pointer(), I32, i1v])
    mask = builder.icmp_unsigned("<", _c(i64v, list(range(16))), _splat(builder, count, i64v))
    builder.call(fn, [val, builder.bitcast(ptr, V16F.as_pointer()), _c(I32, 4), mask])


def _make_tile(R, T):  # noqa: N803
    """The intrinsic tile(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t0, row0, nvalid, out, ld, oc): for r < R
    and the tiles t = t0 .. t0 + T - 1 (qk, sk: the whole ColPack's arrays), out[(row0 + r) ld + 16 t + c - oc]
    (float32 flat) for 16 t + c < nvalid = row row0 + r of the quantised A (aq: natural order, rows lda bytes apart;
    cg, sg: group_scales', rows ldg apart) times column 16 t + c."""

    def tile(typingctx, qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t0, row0, nvalid, out, ld, oc):
        sig = types.void(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t0, row0, nvalid, out, ld, oc)

        def codegen(context, builder, signature, args):
            if not VNNI:
                return context.get_dummy_value()
            ta = signature.args
            qp, sp, tp = (_ptr(context, builder, ta[i], args[i], e) for i, e in ((0, I8), (1, F32), (2, I8)))
            aqp, cp, gp = (_ptr(context, builder, ta[i], args[i], e) for i, e in ((3, I8), (4, I32), (5, F32)))
            op = _ptr(context, builder, ta[13], args[13], F32)
            lda, ldg, k, lg, t0, row0, nvalid, ld, oc = (_i64(builder, args[i])
                                                         for i in (6, 7, 8, 9, 10, 11, 12, 14, 15))
            dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I, [V16I, V16I, V16I])
            fma = _fn(builder, "llvm.fma.v16f32", V16F, [V16F, V16F, V16F])
            tblv = builder.load(builder.bitcast(tp, V64B.as_pointer()), align=1)
            steps = builder.lshr(k, _c(I64, 3))
            ngr = builder.lshr(k, lg)
            spg = builder.shl(_c(I64, 1), builder.sub(lg, _c(I64, 3)))
            tiles = [builder.add(t0, _c(I64, t)) for t in range(T)]
            rows = [builder.add(row0, _c(I64, r)) for r in range(R)]
            qt = [builder.add(builder.mul(builder.lshr(tiles[t], _c(I64, 2)), builder.shl(steps, _c(I64, 8))),
                              builder.shl(builder.and_(tiles[t], _c(I64, 3)), _c(I64, 6))) for t in range(T)]
            st = [builder.mul(tiles[t], builder.shl(ngr, _c(I64, 4))) for t in range(T)]     # first scales
            ar = [builder.mul(rows[r], lda) for r in range(R)]
            gr = [builder.mul(rows[r], ldg) for r in range(R)]
            facc = [[cgutils.alloca_once_value(builder, _c(V16F, [0.0] * 16)) for _ in range(T)] for _ in range(R)]
            iacc = [[cgutils.alloca_once_value(builder, _c(V16I, [0] * 16)) for _ in range(T)] for _ in range(R)]
            with cgutils.for_range(builder, ngr) as lb:
                b = lb.index
                for r in range(R):
                    cv = _splat(builder, builder.load(builder.gep(cp, [builder.add(gr[r], b)])), V16I)
                    for t in range(T):
                        builder.store(cv, iacc[r][t])
                s0 = builder.shl(b, builder.sub(lg, _c(I64, 3)))
                with cgutils.for_range(builder, spg) as ls:
                    s = builder.add(s0, ls.index)
                    ws = []
                    for t in range(T):
                        qa = builder.gep(qp, [builder.add(qt[t], builder.shl(s, _c(I64, 8)))])
                        qv = builder.load(builder.bitcast(qa, V64B.as_pointer()), align=1)
                        hi = builder.bitcast(builder.lshr(builder.bitcast(qv, V32W), _c(V32W, [4] * 32)), V64B)
                        ws.append((_lookup(builder, tblv, qv), _lookup(builder, tblv, hi)))
                    for r in range(R):
                        a0 = builder.add(ar[r], builder.shl(s, _c(I64, 3)))
                        alo = builder.load(builder.bitcast(builder.gep(aqp, [a0]), I32.as_pointer()), align=1)
                        ahi = builder.load(builder.bitcast(builder.gep(aqp, [builder.add(a0, _c(I64, 4))]),
                                                           I32.as_pointer()), align=1)
                        alo, ahi = _splat(builder, alo, V16I), _splat(builder, ahi, V16I)
                        for t in range(T):
                            wl, wh = ws[t]
                            acc = builder.call(dp, [builder.load(iacc[r][t]), wl, alo])
                            builder.store(builder.call(dp, [acc, wh, ahi]), iacc[r][t])
                for r in range(R):
                    sv = _splat(builder, builder.load(builder.gep(gp, [builder.add(gr[r], b)])), V16F)
                    for t in range(T):
                        am = builder.load(builder.bitcast(builder.gep(sp, [builder.add(st[t], builder.shl(
                            b, _c(I64, 4)))]), V16F.as_pointer()), align=1)
                        f = builder.fmul(builder.sitofp(builder.load(iacc[r][t]), V16F), sv)
                        builder.store(builder.call(fma, [f, am, builder.load(facc[r][t])]), facc[r][t])
            for r in range(R):
                for t in range(T):
                    c0 = builder.shl(_c(I64, t), _c(I64, 4))
                    o = builder.gep(op, [builder.add(builder.mul(rows[r], ld), builder.sub(builder.add(
                        builder.shl(t0, _c(I64, 4)), c0), oc))])
                    left = builder.sub(builder.sub(nvalid, builder.shl(t0, _c(I64, 4))), c0)
                    v = builder.load(facc[r][t])
                    with builder.if_else(builder.icmp_signed(">=", left, _c(I64, 16))) as (full, part):
                        with full:
                            builder.store(v, builder.bitcast(o, V16F.as_pointer()), align=4)
                        with part:
                            with builder.if_then(builder.icmp_signed(">", left, _c(I64, 0))):
                                _masked_store(builder, v, o, left)
            return context.get_dummy_value()
        return sig, codegen
    tile.__name__ = tile.__qualname__ = f"coltile_{R}_{T}"
    return intrinsic(tile)


tile_1_4 = _make_tile(1, 4)
tile_1_1 = _make_tile(1, 1)
tile_2_2 = _make_tile(2, 2)
tile_2_1 = _make_tile(2, 1)
tile_4_2 = _make_tile(4, 2)
tile_4_1 = _make_tile(4, 1)


@njit(cache=True, nogil=True, boundscheck=False)
def quantize_arrays(a, g):
    """(aq int8 [M, Kp] natural order, cg int32 [M, Kp / g], sg float32 [M, Kp / g]) of float32 a [M, K] for the
    tiles (Kp: K rounded up to 128; groups past K: 0)."""
    m, k = a.shape
    kp = (k + 127) // 128 * 128
    aq = np.empty((m, kp), np.int8)
    corr = np.empty((m, kp // 8), np.int32)
    sal = np.empty((m, kp // 8), np.float32)
    lg = 0
    while (1 << lg) < g:
        lg += 1
    for r in range(m):
        vnni.quantize_row_nat(a[r], k, lg, aq[r], corr[r], sal[r])
    cg, sg = group_scales(corr, sal, g)
    return aq, cg, sg


@njit(cache=True, nogil=True, boundscheck=False)
def cols(aq, cg, sg, qk, sk, tbl, k_dim, lg, t0, t1, n_dim, out):
    """out[m, j] (float32 [M, >= j], rows any stride) = column 16 t0 + j for the columns below n_dim of tiles
    t0 .. t1 - 1 (qk, sk: the whole ColPack's arrays). One row: the 4-tile kernel on groups of 4 tiles (one
    256-byte stream per step), single tiles before and after; more rows: 4 / 2 / 1 rows x 2 or 1 tiles; then the
    level divisor's factor (nf4vnni_cpu.rescale)."""
    _cols(aq, cg, sg, qk, sk, tbl, k_dim, lg, t0, t1, n_dim, out)
    vnni.rescale(tbl, out, min(t1 * TILE, n_dim) - t0 * TILE)


@njit(cache=True, nogil=True, boundscheck=False)
def _cols(aq, cg, sg, qk, sk, tbl, k_dim, lg, t0, t1, n_dim, out):
    """``cols`` before the level divisor's factor."""
    m_dim = aq.shape[0]
    lda = aq.shape[1]
    ldg = cg.shape[1]
    ld = out.strides[0] // 4
    oc = t0 * TILE
    if m_dim == 1:
        t = t0
        while t < t1 and (t & 3) != 0:
            tile_1_1(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, 0, n_dim, out, ld, oc)
            t += 1
        while t + 4 <= t1:
            tile_1_4(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, 0, n_dim, out, ld, oc)
            t += 4
        while t < t1:
            tile_1_1(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, 0, n_dim, out, ld, oc)
            t += 1
        return
    t = t0
    while t < t1:
        wide = t + 2 <= t1
        m = 0
        while m + 4 <= m_dim:
            if wide:
                tile_4_2(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, m, n_dim, out, ld, oc)
            else:
                tile_4_1(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, m, n_dim, out, ld, oc)
            m += 4
        while m + 2 <= m_dim:
            if wide:
                tile_2_2(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, m, n_dim, out, ld, oc)
            else:
                tile_2_1(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, m, n_dim, out, ld, oc)
            m += 2
        while m < m_dim:
            tile_1_1(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t, m, n_dim, out, ld, oc)
            if wide:
                tile_1_1(qk, sk, tbl, aq, cg, sg, lda, ldg, k_dim, lg, t + 1, m, n_dim, out, ld, oc)
            m += 1
        t += 2 if wide else 1


def product(pk: ColPack, a2, tbl):
    """float32 [M, K] @ the packed weight -> float32 [M, N] on one thread (tests, benchmarks)."""
    aq, cg, sg = quantize_arrays(np.ascontiguousarray(a2, dtype=np.float32), pk.g)
    out = np.empty((a2.shape[0], pk.n), np.float32)
    cols(aq, cg, sg, pk.qk, pk.sk, tbl, pk.k, pk.lg, 0, pk.tiles, pk.n, out)
    return out

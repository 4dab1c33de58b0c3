"""QuantGRU's compiled paths on the CPU (Numba): the fixed-point GRU of onnx_lowbit.gru_int, bit-exact (spec:
docs/gru.md). The op's CPU face is quantgru_cpu (the kernel class, its native entries); quantgru_tasks runs this
module's packed path on onnxruntime's thread pool.

All integer; no BLAS, no float GEMM. Per direction one Numba entry, ``run_direction`` (arrays and ints only):

1. ``quantize_split``: X -> d = quantize(x) - zp_x, the zero point removed so the GEMM needs no row sums. int8:
   d in [-255, 255] is one int16 operand. int16: d in [-65535, 65535] is split into int16 bytes, d = 256 hi + lo
   (hi in [-256, 255], lo in [0, 255]): each product w * hi, w * lo is below 2^23 in magnitude, so CHUNK (< 256)
   of them sum exactly in int32; chunks are added in int64.
2. ``input_proj``: qWx for all steps as one integer GEMM ([T N, C] x W^T), rows in blocks of MB, each output a
   dot product of two contiguous rows in int32 (LLVM vectorises the loop to pmaddwd), rescaled per channel.
   Parallel (Numba prange over row blocks) when it pays (PARALLEL_MACS).
3. ``recurrence``: per batch row (rows in parallel when N > 1), per step the recurrent product R (qh - zp_h) as
   the same dot products (R's rows contiguous: no transposed copy), then the elementwise cell (``_cell``) in
   branch-free int64 with the per-channel bias terms folded into one constant per channel and gate
   (``bias_terms``: integer sums, so the order does not change the result), the scalar rescales as
   (left shift, rounding add, right shift) triples (``shift_triples``).

On CPUs with AVX-512 VNNI (``VNNI``) the products are quantgru_vnni's intrinsics instead, in one of two forms:

**Packed path** (``_run_packed``): W and R packed (``pack_pair`` / ``pack_weights``: 16-row blocks, k in 4-byte
groups, the order vpdpbusd / vpdpwssd read them; ~0.1 ms at H = 400) for ``_make_mm``'s products: 16 rows per
accumulator, the activations' 4-byte group broadcast, no horizontal sums; the recurrence 4 blocks (64 rows) per
pass, the input GEMM 2 blocks x 4 rows (each weight vector used 4 times) in tiles of MT rows, or row by row up to
ROW_PROJ_MAX rows. A session kernel whose W and R are constant initializers packs them once, when it is created
(``QuantGRUKernel``, ``pack_direction``, ``run_direction_packed``): all its calls, a streaming frame included, take
this path with nothing packed per call. Otherwise ``run_direction_path`` packs per call, from PACK_MIN_STEPS steps.
The activations carry an offset instead of the zero point (corrected by offset x rowsum(W) per channel, exact):

* int8: u = q + 128 in [0, 255] (unsigned bytes) x int8 weights (vpdpbusd, 64 products per instruction);
* int16 weights all in [-128, 127] (int8 weights widened to int16; ``narrow_copy`` checks it while making the
  int8 copy, on every call when packing per call): u = q + 32768 split into two unsigned bytes, u = 256 a0 + a1,
  x int8 weights: two vpdpbusd on one weight load (half the bytes of the int16 form);
* other int16: q = 256 (q >> 8) + (q & 255) x int16 weights (vpdpwssd, 32 products), exact int32 sums of 256
  products (KCH_S16 groups), added in int64.

**Direct path** (``_run_direct``; calls below PACK_MIN_STEPS that have no packed weights, C and H up to
ROWDOT_MAX_K): W and R as stored, each row's dot product with the activations in 64-byte pieces (``rowdot``),
nothing packed; int8: u = q + 128 with the offset removed in the products, int16: d = q - zp split as in 1.

Input values are checked by ``check_values`` (Numba) on every call; only when it fails does gru_int.check_inputs
run to name the problem.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from numba.extending import overload

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import Q

from ..device.jit import njit_variant
from .quantgru_vnni import KIND_S16, KIND_U8S8, ROWDOT_MAX_K, VNNI, _lut_gather, _make_mm, _tr16, rowdot

# scalar quantity indices (numba sees plain ints)
IX, IH, IWX, IRH, IZP, IRP, IGP, IZO, IRO, IGO, IRB, IRRH, IOLD, INEW = (Q[n] for n in gru_int.QUANTITIES)
CHUNK = 192            # int16: products per exact int32 partial sum (at most 255; 192: measured fastest of 64..240)
MB = 4                 # input GEMM: rows per block (one W row read from L1 for MB dot products)
PARALLEL_MACS = 1 << 22  # input GEMM: multiply-adds from which the parallel variant is used (2 threads ~2x)
PIPE_BLOCK, PIPE_BLOCKS = 16, 16  # batch 1: steps per block of ``pipelined`` (>= 16; about 16 blocks)
# (the packed path does not pipeline batch 1 over two threads as ``pipelined`` does: in an onnxruntime session its
# 16 parallel regions per call met onnxruntime's spinning intra-op pool: H = 400, T = 500, int8, 2 threads, session
# median 25 ms with it, 5.7 ms without (onnxruntime's float GRU 9.0-11.7 ms); the kernel alone gained < 1 ms)
# scalar rescales of the cell (rows of shift_triples), gru_int.scalar_shifts' order
S_WZ, S_RZ, S_WR, S_RR, S_RB, S_RRH, S_WG, S_RG, S_OLD, S_NEW, S_OH, S_NH = range(12)
# per-channel constants of the cell (rows of bias_terms): the bias terms of z_pre, r_pre, Rh_add_br, g_pre with
# their zero points
B_Z, B_R, B_RB, B_G = range(4)
_JIT = dict(cache=True, nogil=True, boundscheck=False)


@njit(cache=True, inline="always")
def _rs(v, s):
    """gru_int.rshift of one int64 by a shift s (any sign)."""
    if s <= 0:
        return v << (-s)
    if s >= 63:
        return np.int64(0)
    return (v + (np.int64(1) << (s - 1))) >> s


@njit(cache=True, inline="always")
def _triple(s):
    """(left, round, right) of gru_int.rshift by s without branches: ((v << left) + round) >> right (by 63: 0)."""
    r = min(max(s, 0), 63)
    return max(-s, 0), (np.int64(1) << r) >> 1, r


@njit(cache=True, inline="always")
def _rs_flat(v, s):
    """_rs without branches (loops of it vectorise), for |v| < 2^62: a left shift by max(-s, 0), then a rounding
    right shift by min(max(s, 0), 63) (by 63: 0)."""
    lft, rnd, r = _triple(s)
    return ((v << lft) + rnd) >> r


@njit(cache=True, inline="always")
def _sat(v, lo, hi):
    return min(max(v, lo), hi)


@njit(cache=True, inline="always")
def _quantize(x, scale, zp, lo, hi):
    """gru_int.quantize of one float32 (scale = 2^e, exact)."""
    if math.isnan(x):
        return zp
    v = np.rint(np.float64(x) * scale)
    if v < lo - zp:
        v = np.float64(lo - zp)
    elif v > hi - zp:
        v = np.float64(hi - zp)
    return np.int64(v) + zp


def _wide(w):
    """True for int16 weights (the operand is split into bytes), False for int8: a compile-time constant in
    Numba (the overload below), so each width compiles without the other's branches (a runtime flag slowed the
    recurrent product 1.8x)."""
    return w.dtype.itemsize == 2


@overload(_wide, inline="always")
def _wide_nb(w):
    wide = w.dtype.bitwidth == 16
    return lambda w: wide


@njit(cache=True, inline="always")
def _dot(a, b):
    """sum a[k] b[k] of two int8/int16 rows, in int32 (wrapping; callers keep it exact)."""
    acc = np.int32(0)
    for i in range(a.shape[0]):
        acc = np.int32(acc + np.int32(a[i]) * np.int32(b[i]))
    return acc


@njit(cache=True, inline="always")
def _dot_exact(w, dh, dl):
    """sum_k w[k] d[k] exactly (int64): d = dh (int8 weights, |w d| < 2^15: int32 holds any row of <= 2^15), or
    d = 256 dh + dl (int16 weights: CHUNK products per int32 partial sum)."""
    if not _wide(w):
        return np.int64(_dot(w, dh))
    acc = np.int64(0)
    for k0 in range(0, w.shape[0], CHUNK):
        ww = w[k0:k0 + CHUNK]
        acc += (np.int64(_dot(ww, dh[k0:k0 + CHUNK])) << 8) + np.int64(_dot(ww, dl[k0:k0 + CHUNK]))
    return acc


@njit(**_JIT)
def quantize_rows(x, e, zp, lo, hi, out):
    """out[m, k] = gru_int.quantize(x[m, k], e, zp) for x [M, K] float32 (out int64)."""
    scale = 2.0 ** e
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            out[m, k] = _quantize(x[m, k], scale, zp, lo, hi)


@njit(**_JIT)
def quantize_split(x, e, zp, lo, hi, split, dh, dl):
    """d = gru_int.quantize(x, e, zp) - zp for x [M, K] float32 -> dh (and dl when split: d = 256 dh + dl) [M, K]
    int16."""
    scale = 2.0 ** e
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            d = _quantize(x[m, k], scale, zp, lo, hi) - zp
            if split:
                dh[m, k] = d >> 8
                dl[m, k] = d & 255
            else:
                dh[m, k] = d


def _input_proj(dh, dl, W, shift, zp, lo, hi, out):
    """out[m, c] = sat(rshift(W[c] . d[m], shift[c]) + zp) for d [M, C] (quantize_split's), W [3H, C] int8/int16,
    out [M, 3H] int32: gru_int.input_gemm (W qx - zp_x rowsum(W) = W d)."""
    m_dim, nc = dh.shape[0], W.shape[0]
    for mb in prange((m_dim + MB - 1) // MB):
        m0 = mb * MB
        m1 = min(m0 + MB, m_dim)
        for c in range(nc):
            w = W[c]
            s = shift[c]
            for m in range(m0, m1):
                out[m, c] = _sat(_rs(_dot_exact(w, dh[m], dl[m]), s) + zp, lo, hi)


input_proj, input_proj_parallel = (njit_variant(_input_proj, par, **_JIT) for par in (False, True))


@njit(**_JIT)
def shift_triples(e):
    """[12, 3] int64: (left, round, right) of each scalar rescale of the cell (rows S_*), so that
    ((v << left) + round) >> right == gru_int.rshift(v, s) for |v| < 2^54 (s >= 63: right = 63 gives 0)."""
    s = np.empty(12, np.int64)
    s[S_WZ], s[S_RZ] = e[IWX] - e[IZP], e[IRH] - e[IZP]
    s[S_WR], s[S_RR] = e[IWX] - e[IRP], e[IRH] - e[IRP]
    s[S_RB], s[S_RRH] = e[IRH] - e[IRB], e[IRO] + e[IRB] - e[IRRH]
    s[S_WG], s[S_RG] = e[IWX] - e[IGP], e[IRRH] - e[IGP]
    s[S_OLD], s[S_NEW] = e[IZO] + e[IH] - e[IOLD], e[IZO] + e[IGO] - e[INEW]
    s[S_OH], s[S_NH] = e[IOLD] - e[IH], e[INEW] - e[IH]
    t = np.zeros((12, 3), np.int64)
    for i in range(12):
        if s[i] <= 0:
            t[i, 0] = -s[i]
        else:
            r = min(s[i], 63)
            t[i, 1], t[i, 2] = np.int64(1) << (r - 1), r
    return t


@njit(**_JIT)
def bias_terms(b, ch, e, z, h):
    """[4, H] int64 per-channel constants of the cell: B_Z: rshift(bx_z) + rshift(br_z) + zp(z_pre), B_R likewise
    for r, B_RB: rshift(br_g) + zp(Rh_add_br), B_G: rshift(bx_g) + zp(g_pre) (b int32 [6H] = bx, br; ch the
    direction's channel_exp)."""
    h3 = 3 * h
    t = np.empty((4, h), np.int64)
    for j in range(h):
        cz, cr, cg = j, h + j, 2 * h + j
        t[B_Z, j] = (_rs_flat(np.int64(b[cz]), np.int64(ch[2, cz]) - e[IZP])
                     + _rs_flat(np.int64(b[h3 + cz]), np.int64(ch[3, cz]) - e[IZP]) + z[IZP])
        t[B_R, j] = (_rs_flat(np.int64(b[cr]), np.int64(ch[2, cr]) - e[IRP])
                     + _rs_flat(np.int64(b[h3 + cr]), np.int64(ch[3, cr]) - e[IRP]) + z[IRP])
        t[B_RB, j] = _rs_flat(np.int64(b[h3 + cg]), np.int64(ch[3, cg]) - e[IRB]) + z[IRB]
        t[B_G, j] = _rs_flat(np.int64(b[cg]), np.int64(ch[2, cg]) - e[IGP]) + z[IGP]
    return t


@njit(cache=True, inline="always")
def _lut(q, tab, lo, sh, rnd):
    """gru_int.lut of a saturated q, branch-free: sh = 0 (int8) reads tab[q - lo] (the difference term is 0)."""
    u = q - lo
    i = u >> sh
    a = np.int64(tab[i])
    return a + (((np.int64(tab[i + 1]) - a) * (u & ((np.int64(1) << sh) - 1)) + rnd) >> sh)


@njit(cache=True, inline="always")
def _luts(tab, q, out, lo, sh, rnd):
    """out[j] = _lut(q[j], tab) for all j (q, out int64 [n], may be one array): on AVX-512 hosts (``VNNI``) eight at a
    time with vector gathers (_lut_gather; measured 166 / 348 ns per 400 lookups against 608 for the scalar
    loop, int8 / int16), the rest one by one."""
    n = q.shape[0]
    j0 = 0
    if VNNI:
        _lut_gather(tab, q, out, n, lo, sh)
        j0 = (n // 8) * 8
    for j in range(j0, n):
        out[j] = _lut(q[j], tab, lo, sh, rnd)

@njit(cache=True, inline="always")
def _rs3(v, left, rnd, right):
    return ((v << left) + rnd) >> right


@njit(cache=True, inline="always")
def _cell(qwx, qrh, qh, bt, t, luts, e, z, lo, hi, sh, pz, pr, pb, pg, qg):
    """One step's elementwise part of one batch row (gru_int.step after its R h GEMM): qwx [3H] int32, qrh [3H]
    int64 (rescaled GEMM outputs), qh [H] int64 updated in place; bt = bias_terms, t = shift_triples; pz, pr,
    pb, pg, qg [H] int64 scratch. In phases (the table lookups apart) so that LLVM vectorises the arithmetic."""
    h = qh.shape[0]
    rnd = (np.int64(1) << sh) >> 1
    one_z = np.int64(1) << e[IZO]
    zwx, zrh, zh, zzo, zro, zrb, zrrh, zold, znew, zgo = (z[IWX], z[IRH], z[IH], z[IZO], z[IRO], z[IRB], z[IRRH],
                                                          z[IOLD], z[INEW], z[IGO])
    wz0, wz1, wz2 = t[S_WZ, 0], t[S_WZ, 1], t[S_WZ, 2]
    rz0, rz1, rz2 = t[S_RZ, 0], t[S_RZ, 1], t[S_RZ, 2]
    wr0, wr1, wr2 = t[S_WR, 0], t[S_WR, 1], t[S_WR, 2]
    rr0, rr1, rr2 = t[S_RR, 0], t[S_RR, 1], t[S_RR, 2]
    rb0, rb1, rb2 = t[S_RB, 0], t[S_RB, 1], t[S_RB, 2]
    rh0, rh1, rh2 = t[S_RRH, 0], t[S_RRH, 1], t[S_RRH, 2]
    wg0, wg1, wg2 = t[S_WG, 0], t[S_WG, 1], t[S_WG, 2]
    rg0, rg1, rg2 = t[S_RG, 0], t[S_RG, 1], t[S_RG, 2]
    ol0, ol1, ol2 = t[S_OLD, 0], t[S_OLD, 1], t[S_OLD, 2]
    nw0, nw1, nw2 = t[S_NEW, 0], t[S_NEW, 1], t[S_NEW, 2]
    oh0, oh1, oh2 = t[S_OH, 0], t[S_OH, 1], t[S_OH, 2]
    nh0, nh1, nh2 = t[S_NH, 0], t[S_NH, 1], t[S_NH, 2]
    bz, br, brb, bg = bt[B_Z], bt[B_R], bt[B_RB], bt[B_G]
    tz, tr, tg = luts[0], luts[1], luts[2]
    for j in range(h):   # pre-activations of z and r, Rh_g + br_g
        pz[j] = _sat(_rs3(np.int64(qwx[j]) - zwx, wz0, wz1, wz2) + _rs3(qrh[j] - zrh, rz0, rz1, rz2) + bz[j], lo, hi)
        pr[j] = _sat(_rs3(np.int64(qwx[h + j]) - zwx, wr0, wr1, wr2) + _rs3(qrh[h + j] - zrh, rr0, rr1, rr2)
                     + br[j], lo, hi)
        pb[j] = _sat(_rs3(qrh[2 * h + j] - zrh, rb0, rb1, rb2) + brb[j], lo, hi)
    _luts(tz, pz, pz, lo, sh, rnd)   # sigmoid tables: z into pz, r into pr
    _luts(tr, pr, pr, lo, sh, rnd)
    for j in range(h):   # r (Rh_g + br_g), g's pre-activation
        qrrh = _sat(_rs3((pr[j] - zro) * (pb[j] - zrb), rh0, rh1, rh2) + zrrh, lo, hi)
        pg[j] = _sat(_rs3(np.int64(qwx[2 * h + j]) - zwx, wg0, wg1, wg2) + _rs3(qrrh - zrrh, rg0, rg1, rg2) + bg[j],
                     lo, hi)
    _luts(tg, pg, qg, lo, sh, rnd)   # tanh table
    for j in range(h):   # z h + (1 - z) g
        dz = pz[j] - zzo
        qold = _sat(_rs3(dz * (qh[j] - zh), ol0, ol1, ol2) + zold, lo, hi)
        qnew = _sat(_rs3((one_z - dz) * (qg[j] - zgo), nw0, nw1, nw2) + znew, lo, hi)
        qh[j] = _sat(_rs3(qold - zold, oh0, oh1, oh2) + _rs3(qnew - znew, nh0, nh1, nh2) + zh, lo, hi)


@njit(cache=True, inline="always")
def _steps(qwx, n, R, r_shift, qh, s0, s1, ln, reverse, bt, t, luts, e, z, lo, hi, sh, y, dh, dl, qrh, sc):
    """Steps s0..s1-1 of batch row n (of ln; reverse: time index ln - 1 - s), state qh [H] int64 in place, y's
    rows written; dh, dl [H] int16, qrh [3H] int64, sc [5, H] int64 scratch."""
    h = qh.shape[0]
    scale = 2.0 ** (-e[IH])
    zh, zrh = z[IH], z[IRH]
    for s in range(s0, s1):
        ti = ln - 1 - s if reverse else s
        for k in range(h):
            d = qh[k] - zh
            if _wide(R):
                dh[k] = d >> 8
                dl[k] = d & 255
            else:
                dh[k] = d
        for c in range(3 * h):
            qrh[c] = _sat(_rs(_dot_exact(R[c], dh, dl), r_shift[c]) + zrh, lo, hi)
        _cell(qwx[ti, n], qrh, qh, bt, t, luts, e, z, lo, hi, sh, sc[0], sc[1], sc[2], sc[3], sc[4])
        for j in range(h):
            y[ti, n, j] = np.float32((qh[j] - zh) * scale)


@njit(cache=True, inline="always")
def _finish(qh, n, ln, e, z, y, yh):
    """Row n's padded steps (>= ln) of y to 0, its Y_h from the state qh (0 when ln = 0)."""
    scale = 2.0 ** (-e[IH])
    for ti in range(ln, y.shape[0]):
        for j in range(qh.shape[0]):
            y[ti, n, j] = np.float32(0.0)
    for j in range(qh.shape[0]):
        yh[n, j] = np.float32((qh[j] - z[IH]) * scale) if ln > 0 else np.float32(0.0)


def _recurrence(qwx, R, r_shift, qh0, lens, reverse, bt, t, luts, e, z, lo, hi, sh, y, yh):
    """All steps of one direction, batch rows in parallel with the parallel variant (a row's steps are
    sequential). qwx [T, N, 3H] int32, R [3H, H] int8/int16, r_shift [3H] int64 (eR + e_h - e_Rh), qh0 [N, H]
    int64; writes y [T, N, H] float32 (0 at a row's steps >= lens[n]) and yh [N, H]."""
    n_dim, h = qh0.shape
    for n in prange(n_dim):
        qh = qh0[n].copy()
        dh, dl = np.empty(h, np.int16), np.empty(h, np.int16)
        qrh, sc = np.empty(3 * h, np.int64), np.empty((5, h), np.int64)
        _steps(qwx, n, R, r_shift, qh, 0, lens[n], lens[n], reverse, bt, t, luts, e, z, lo, hi, sh, y, dh, dl,
               qrh, sc)
        _finish(qh, n, lens[n], e, z, y, yh)


recurrence, recurrence_parallel = (njit_variant(_recurrence, par, **_JIT) for par in (False, True))


@njit(parallel=True, **_JIT)
def pipelined(dh, dl, W, shift, zwx, qwx, R, r_shift, qh, ln, block, reverse, bt, t, luts, e, z, lo, hi, sh, y,
              yh):
    """One batch row (N = 1) on two threads without synchronisation: the steps in blocks of ``block``; while one
    thread runs block b's steps, the other projects the input rows of block b + 1 (disjoint rows of qwx
    [T, 1, 3H]; dh, dl [T, C]); only block 0's rows are projected before (both threads). With one thread the two
    tasks run one after the other: same result."""
    nb = (ln + block - 1) // block
    h = qh.shape[1]
    r0, r1 = (0, min(block, ln)) if not reverse else (ln - min(block, ln), ln)
    input_proj_parallel(dh[r0:r1], dl[r0:r1], W, shift, zwx, lo, hi, qwx[r0:r1, 0])
    q = qh[0]
    dh1, dl1 = np.empty(h, np.int16), np.empty(h, np.int16)
    qrh, sc = np.empty(3 * h, np.int64), np.empty((5, h), np.int64)
    for b in range(nb):
        for task in prange(2):
            if task == 0:
                _steps(qwx, 0, R, r_shift, q, b * block, min((b + 1) * block, ln), ln, reverse, bt, t, luts, e, z,
                       lo, hi, sh, y, dh1, dl1, qrh, sc)
            elif b + 1 < nb:
                s0, s1 = (b + 1) * block, min((b + 2) * block, ln)
                p0, p1 = (s0, s1) if not reverse else (ln - s1, ln - s0)
                input_proj(dh[p0:p1], dl[p0:p1], W, shift, zwx, lo, hi, qwx[p0:p1, 0])
    _finish(q, 0, ln, e, z, y, yh)



# ---------------------------------------------------------------------------------------------------- VNNI paths
# AVX-512 VNNI hosts (``VNNI``): the products are quantgru_vnni's intrinsics. The packed path (long calls) packs W
# and R per call (pack_weights) for _make_mm's products; the direct path (short calls) multiplies them as stored
# (rowdot). See "The CPU kernel" in docs/gru.md.
NB_REC, NB_GEMM, MR_GEMM = 4, 2, 4   # recurrence: 4 blocks (64 rows) per pass; input GEMM: 2 blocks x 4 rows
MT = 32                              # input GEMM: rows per tile (a tile's activations stay in L1)
KCH_U8, KCH_S16 = 16384, 128         # k-groups per exact int32 sum: |w u| <= 128 * 255 (65536 products < 2^31);
#                                      int16: |w lo| <= 2^15 * 255 (256 products < 2^31)
PACK_MIN_STEPS = 16                  # per-call packing from this many steps of a batch row (below: the direct
#                                      path): the crossover measured 11..32 steps (H = 256..600, int8 / int16)
_mm_rec1 = _make_mm(KIND_U8S8, False, NB_REC, 1)
_mm_rec2 = _make_mm(KIND_U8S8, True, NB_REC, 1)
_mm_rec16 = _make_mm(KIND_S16, True, NB_REC, 1)
_mm_gemm1 = _make_mm(KIND_U8S8, False, NB_GEMM, MR_GEMM)
_mm_gemm2 = _make_mm(KIND_U8S8, True, NB_GEMM, MR_GEMM)
_mm_gemm16 = _make_mm(KIND_S16, True, NB_GEMM, MR_GEMM)
_mm_list1 = _make_mm(KIND_U8S8, False, NB_REC, 1, listed=True)
_mm_list2 = _make_mm(KIND_U8S8, True, NB_REC, 1, listed=True)
_mm_list16 = _make_mm(KIND_S16, True, NB_REC, 1, listed=True)


@njit(**_JIT)
def narrow_copy(w, out):
    """out (int8, w's shape) = w (int16) when every value of w lies in [-128, 127] (int8 weights widened to
    int16): returns True; False as soon as a row holds a value outside (out then partly written). One pass that
    LLVM vectorises (the range test is an OR of (w + 128) >> 8)."""
    rows, k_dim = w.shape
    for r in range(rows):
        bad = np.int64(0)
        for k in range(k_dim):
            v = np.int64(w[r, k])
            out[r, k] = v
            bad |= (v + 128) >> 8
        if bad != 0:
            return False
    return True


@njit(**_JIT)
def narrow_range(w):
    """True when every value of the int16 matrix w lies in [-128, 127] (narrow_copy's test)."""
    return narrow_copy(w, np.empty(w.shape, np.int8))


@njit(**_JIT)
def pack_weights(w, nbp, out, rowsum):
    """Packs w [rows, K] (int8 / int16) into out (1-D int8: groups of G = 4 bytes; int16: G = 2 values)
    [nbp, KG, 16, G] (zero padded, KG = ceil(K / G)) for the VNNI products, and rowsum[r] = sum_k w[r, k]
    (int64); w and out of one dtype. Whole 16 x 16 tiles of 4-byte units go through _tr16, the edges element by
    element."""
    rows, K = w.shape
    g_ = 4 // out.itemsize
    kg = (K + g_ - 1) // g_
    esz = w.itemsize
    s = 16 * g_
    for r in range(rows):
        acc = np.int64(0)
        for k in range(K):
            acc += w[r, k]        # int64 lanes: 8x faster than an int32 sum that Numba widens every step
        rowsum[r] = acc
    kv = (K // (16 * g_)) * 16          # groups covered by whole 16 x 16 tiles
    for b in range(nbp):
        full = b * 16 + 16 <= rows
        if full:
            for g0 in range(0, kv, 16):
                _tr16(w, np.int64((b * 16 * K + g0 * g_) * esz), np.int64(K * esz), out, np.int64((b * kg + g0) * 64))
        for lane in range(16):
            r = b * 16 + lane
            base = b * kg * s + lane * g_
            for g in range(kv if full else 0, kg):
                for j in range(g_):
                    k = g * g_ + j
                    out[base + g * s + j] = w[r, k] if (r < rows and k < K) else 0


@njit(cache=True, inline="always")
def _comb(o0, o1, i, split):
    """The sum of one output from the int32 partial sums: 256 (high part) + low part when split, else o0."""
    if split:
        return (np.int64(o0[i]) << 8) + np.int64(o1[i])
    return np.int64(o0[i])


@njit(cache=True, inline="always")
def _mm_call(rec, wp, a0, a1, a_stride, m_groups, nb_groups, k0, k1, kg, o0, o1, o_stride, split):
    """The VNNI product of the packed weights' dtype and the activations' split (rec: the recurrence's shape)."""
    if wp.itemsize == 2:
        if rec:
            _mm_rec16(wp, a0, a1, a_stride, m_groups, nb_groups, k0, k1, kg, o0, o1, o_stride)
        else:
            _mm_gemm16(wp, a0, a1, a_stride, m_groups, nb_groups, k0, k1, kg, o0, o1, o_stride)
    elif split:
        if rec:
            _mm_rec2(wp, a0, a1, a_stride, m_groups, nb_groups, k0, k1, kg, o0, o1, o_stride)
        else:
            _mm_gemm2(wp, a0, a1, a_stride, m_groups, nb_groups, k0, k1, kg, o0, o1, o_stride)
    elif rec:
        _mm_rec1(wp, a0, a1, a_stride, m_groups, nb_groups, k0, k1, kg, o0, o1, o_stride)
    else:
        _mm_gemm1(wp, a0, a1, a_stride, m_groups, nb_groups, k0, k1, kg, o0, o1, o_stride)


@njit(cache=True, inline="always")
def _add_chunk(o0, o1, acc, n, first, split):
    """acc[:n] = (first) or += one k chunk's exact sums (_comb of its int32 parts)."""
    if first:
        for i in range(n):
            acc[i] = _comb(o0, o1, i, split)
    else:
        for i in range(n):
            acc[i] += _comb(o0, o1, i, split)


@njit(cache=True, inline="always")
def _products(rec, wp, a0, a1, a_stride, m_groups, nbp, kg, o0, o1, acc, n_out, split):
    """acc[m n_out + c] (int64) = the exact sums of the packed products for m_groups row groups (all blocks):
    in k chunks whose int32 sums are exact (KCH_*), each chunk's parts combined (_comb) and added."""
    kch = KCH_S16 if wp.itemsize == 2 else KCH_U8
    nbg = nbp // (NB_REC if rec else NB_GEMM)
    rows = m_groups * (1 if rec else MR_GEMM)
    for k0 in range(0, kg, kch):
        _mm_call(rec, wp, a0, a1, a_stride, m_groups, nbg, np.int64(k0), np.int64(min(kg, k0 + kch)), kg, o0, o1,
                 n_out, split)
        _add_chunk(o0, o1, acc, rows * n_out, k0 == 0, split)


@njit(cache=True, inline="always")
def listed_products(wp, blk, a0, a1, kg, o0, o1, acc, split):
    """acc[16 i + lane] (int64) = the exact sums of one activation vector (a0, a1) with the rows of block blk[i]
    of the packed weights (i < len(blk), a multiple of NB_REC; half_blocks lists them), as _products."""
    kch = KCH_S16 if wp.itemsize == 2 else KCH_U8
    ng = blk.shape[0] // NB_REC
    z = np.int64(0)
    for k0 in range(0, kg, kch):
        k1 = np.int64(min(kg, k0 + kch))
        if wp.itemsize == 2:
            _mm_list16(wp, blk, a0, a1, z, np.int64(1), ng, np.int64(k0), k1, kg, o0, o1, z)
        elif split:
            _mm_list2(wp, blk, a0, a1, z, np.int64(1), ng, np.int64(k0), k1, kg, o0, o1, z)
        else:
            _mm_list1(wp, blk, a0, a1, z, np.int64(1), ng, np.int64(k0), k1, kg, o0, o1, z)
        _add_chunk(o0, o1, acc, blk.shape[0] * 16, k0 == 0, split)


@njit(cache=True, inline="always")
def list_capacity(h):
    """The most list positions half_blocks writes for hidden size h (any half)."""
    return 3 * ((h + 15) // 16 + 2) + NB_REC


@njit(cache=True, inline="always")
def half_blocks(h, u0, u1, blk, base):
    """Lists into blk the 16-row blocks of packed W or R that hold rows g H + u0 .. g H + u1 - 1 of each gate g,
    gate after gate, and pads the list to a multiple of NB_REC by repeating its first block (those sums are
    unused); returns the list's length. base[g] is set so that listed_products' sum of row r of gate g is
    acc[base[g] + r]. Each half of the hidden units is then computed in whole groups of NB_REC blocks over all
    three gates (H = 400: 40 blocks for the half of 208 units, where whole groups per gate took 48). Where H is
    not a multiple of 16 a block holding rows of two gates is listed for both."""
    n = 0
    for g in range(3):
        b0, b1 = (g * h + u0) // 16, (g * h + u1 + 15) // 16
        base[g] = 16 * (n - b0)
        for b in range(b0, b1):
            blk[n] = b
            n += 1
    while n % NB_REC:
        blk[n] = blk[0]
        n += 1
    return n


@njit(cache=True, inline="always")
def _act(q, bias, split, a0, a1, i):
    """Activation operands of one quantised value q: u = q - bias (bias = qmin for the unsigned-byte products, 0
    for int16 ones); a0 = u (int8 path) or u >> 8 with a1 = u & 255 (int16: u = 256 a0 + a1)."""
    u = q - bias
    if split:
        a0[i] = u >> 8
        a1[i] = u & 255
    else:
        a0[i] = u


@njit(**_JIT)
def quantize_acts(x, e, zp, lo, hi, bias, split, kp, a0, a1):
    """The input projection's activations: x [M, C] float32 quantised (gru_int.quantize), as _act operands in rows
    of kp (zero padded; a0, a1 [M', kp] with M' >= M rows, the extra rows zero; a1 is a0 when not split)."""
    scale = 2.0 ** e
    m_dim, c_dim = x.shape
    a0[:] = 0
    if split:
        a1[:] = 0
    for m in range(m_dim):
        r0, r1 = a0[m], a1[m]
        for k in range(c_dim):
            _act(_quantize(x[m, k], scale, zp, lo, hi), bias, split, r0, r1, k)


@njit(cache=True, inline="always")
def _rescale(v, lft, rnd, rgt, zp, lo, hi):
    """sat(rshift(v, s) + zp) with s as a (left, round, right) triple (chan_triples)."""
    return _sat((((v << lft) + rnd) >> rgt) + zp, lo, hi)


@njit(cache=True, inline="always")
def rescale_rows(acc, ct, r0, zp, lo, hi, out):
    """out[j] = _rescale(acc[j] - ct[3, r0 + j], ct[0, r0 + j], ct[1, r0 + j], ct[2, r0 + j], zp, lo, hi) for
    j < len(out): rows r0 .. of chan_triples' rescale, acc the rows' sums. Every array is indexed by the loop
    counter of ``range`` alone (views taken first), so LLVM vectorises the loop: an index Numba cannot prove
    non-negative (a view's offset added inside the loop) keeps its wrap-around select and the loop scalar (H =
    400, int16: a half step's rescale took 1.0 us that way)."""
    n = out.shape[0]
    c0, c1, c2, c3 = ct[0, r0:r0 + n], ct[1, r0:r0 + n], ct[2, r0:r0 + n], ct[3, r0:r0 + n]
    for j in range(n):
        out[j] = _rescale(acc[j] - c3[j], c0[j], c1[j], c2[j], zp, lo, hi)


@njit(**_JIT)
def chan_triples(shift, corr_in, off, rowsum):
    """[4, n] int64 per output channel: (left, round, right) of its rescale by shift[c] (>= 0 after the value
    checks; any sign works), and the correction off * rowsum[c] that the activations' offset adds (corr_in rows
    beyond len(shift): zero)."""
    n = shift.shape[0]
    t = np.empty((4, corr_in), np.int64)
    for c in range(n):   # branch-free (vectorises): as _rs_flat
        t[0, c], t[1, c], t[2, c] = _triple(shift[c])
        t[3, c] = off * rowsum[c]
    t[:, n:] = 0
    return t


def _proj_packed(wp, a0, a1, kp, kg, nbp, ct, zp, lo, hi, split, m0, m1, out):
    """qwx rows [m0, m1) (out [M, 3H] int32) from the packed W (wp) and the activation rows (a0, a1 [M', kp]):
    gru_int.input_gemm, rows in tiles of MT (from m0 rounded down to MR_GEMM; rows outside [m0, m1) are computed
    in scratch and dropped). Tiles in parallel with the parallel variant."""
    n_out = nbp * 16
    nc = out.shape[1]
    r0 = (m0 // MR_GEMM) * MR_GEMM
    n_tiles = (m1 - r0 + MT - 1) // MT
    for ti in prange(n_tiles):
        t0 = r0 + ti * MT
        nr = min(MT, a0.shape[0] - t0)
        nr = (nr // MR_GEMM) * MR_GEMM
        o0 = np.empty(nr * n_out, np.int32)
        o1 = np.empty(nr * n_out if split else 0, np.int32)
        acc = np.empty(nr * n_out, np.int64)
        _products(False, wp, a0[t0:t0 + nr].reshape(nr * kp), a1[t0:t0 + nr].reshape(nr * kp), np.int64(kp),
                  nr // MR_GEMM, nbp, kg, o0, o1 if split else o0, acc, n_out, split)
        for m in range(max(t0, m0), min(t0 + nr, m1)):
            i0 = (m - t0) * n_out
            rescale_rows(acc[i0:i0 + nc], ct, 0, zp, lo, hi, out[m])


proj_packed, proj_packed_parallel = (njit_variant(_proj_packed, par, **_JIT) for par in (False, True))


@njit(cache=True, inline="always")
def _steps_packed(qwx, n, rp, kp, kg, nbp, ctr, bias, split, qh, s0, s1, ln, reverse, bt, t, luts, e, z, lo, hi,
                  sh, y, a0, a1, o0, o1, acc, qrh, sc):
    """_steps on the packed R (rp): steps s0..s1-1 of batch row n; a0, a1 [kp] (zero padded), o0, o1 [16 nbp]
    int32, acc [16 nbp] int64, qrh [3H] int64, sc [5, H] int64 scratch."""
    h = qh.shape[0]
    scale = 2.0 ** (-e[IH])
    zh, zrh = z[IH], z[IRH]
    n_out = nbp * 16
    for s in range(s0, s1):
        ti = ln - 1 - s if reverse else s
        for k in range(h):
            _act(qh[k], bias, split, a0, a1, k)
        _products(True, rp, a0, a1, np.int64(kp), 1, nbp, kg, o0, o1, acc, n_out, split)
        rescale_rows(acc, ctr, 0, zrh, lo, hi, qrh)
        _cell(qwx[ti, n], qrh, qh, bt, t, luts, e, z, lo, hi, sh, sc[0], sc[1], sc[2], sc[3], sc[4])
        for j in range(h):
            y[ti, n, j] = np.float32((qh[j] - zh) * scale)


@njit(cache=True, inline="always")
def _rec_scratch(h, kp, nbp, split, proto):
    """Scratch of one batch row's packed recurrence: a0, a1 (a0 when not split; proto's dtype), o0, o1, acc, qrh,
    sc."""
    a0 = np.zeros(kp, proto.dtype)
    a1 = np.zeros(kp if split else 0, proto.dtype)
    return (a0, a1 if split else a0, np.empty(nbp * 16, np.int32), np.empty(nbp * 16 if split else 0, np.int32),
            np.empty(nbp * 16, np.int64), np.empty(3 * h, np.int64), np.empty((5, h), np.int64))


def _recurrence_packed(qwx, rp, kp, kg, nbp, ctr, bias, split, qh0, lens, reverse, bt, t, luts, e, z, lo, hi, sh,
                       y, yh, proto):
    """_recurrence on the packed R: batch rows in parallel with the parallel variant."""
    n_dim, h = qh0.shape
    for n in prange(n_dim):
        qh = qh0[n].copy()
        a0, a1, o0, o1, acc, qrh, sc = _rec_scratch(h, kp, nbp, split, proto)
        _steps_packed(qwx, n, rp, kp, kg, nbp, ctr, bias, split, qh, 0, lens[n], lens[n], reverse, bt, t, luts, e,
                      z, lo, hi, sh, y, a0, a1, o0, o1 if split else o0, acc, qrh, sc)
        _finish(qh, n, lens[n], e, z, y, yh)


recurrence_packed, recurrence_packed_parallel = (njit_variant(_recurrence_packed, par, **_JIT) for par in (False, True))


@njit(cache=True, inline="always")
def _packed_dims(h, c, itemsize):
    """(nbp, kgw, kgr): 16-row blocks (padded to NB_REC) and k-groups of W [3H, C] and R [3H, H] packed from weights
    of itemsize bytes (pack_weights)."""
    g_ = 4 // itemsize
    return ((3 * h + 15) // 16 + NB_REC - 1) // NB_REC * NB_REC, (c + g_ - 1) // g_, (h + g_ - 1) // g_


@njit(cache=True, inline="always")
def _empty64(n, proto):
    """np.empty(n, proto.dtype) starting on a 64-byte boundary (a view into a slightly larger buffer): the products
    load the packed weights 64 bytes at a time, and a vector split over two cache lines costs more (int16 at H = C =
    400, T = 500: 4.26-4.39 ms with both packed arrays aligned, 4.90-5.25 ms with both at 32 bytes past a line)."""
    per = 64 // proto.itemsize
    buf = np.empty(n + per, proto.dtype)
    off = ((64 - buf.ctypes.data % 64) % 64) // proto.itemsize
    return buf[off:off + n]


@njit(**_JIT)
def pack_pair(w, r):
    """(wp, rp, rsw, rsr): W [3H, C] and R [3H, H] (int8 / int16) packed for the VNNI products (pack_weights; wp and
    rp 64-byte aligned) and their row sums."""
    h, c = r.shape[1], w.shape[1]
    nbp, kgw, kgr = _packed_dims(h, c, w.itemsize)
    wp = _empty64(nbp * kgw * 64 // w.itemsize, w)
    rp = _empty64(nbp * kgr * 64 // w.itemsize, w)
    rsw, rsr = np.empty(3 * h, np.int64), np.empty(3 * h, np.int64)
    pack_weights(w, nbp, wp, rsw)
    pack_weights(r, nbp, rp, rsr)
    return wp, rp, rsw, rsr


ROW_PROJ_MAX = 2   # packed input GEMM: up to this many rows one at a time with the recurrence's product (one row:
#                    3.0 us against 6.7 for a tile of MR_GEMM rows, H = 400, C = 257)


@njit(**_JIT)
def _run_packed(x, qh, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, bias, split, proto):
    """run_direction's packed (VNNI) path on packed weights (pack_pair; int8: unsigned-byte products, the
    activations offset by bias = qmin; int16: int16 products, bias 0), qh [N, H] int64 the quantised initial
    state; proto: an empty array of the activations' dtype (uint8 / int16)."""
    t_dim, n_dim, c_dim = x.shape
    h = rsr.shape[0] // 3
    bits = 16 if split else 8
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    nbp, kgw, kgr = _packed_dims(h, c_dim, wp.itemsize)
    g_ = 4 // wp.itemsize
    kpw, kpr = kgw * g_, kgr * g_
    shift = np.empty(3 * h, np.int64)
    for c in range(3 * h):
        shift[c] = np.int64(ch[0, c]) + e[IX] - e[IWX]
    ctw = chan_triples(shift, nbp * 16, z[IX] - bias, rsw)
    for c in range(3 * h):
        shift[c] = np.int64(ch[1, c]) + e[IH] - e[IRH]
    ctr = chan_triples(shift, nbp * 16, z[IH] - bias, rsr)
    m = t_dim * n_dim
    mp = (m + MR_GEMM - 1) // MR_GEMM * MR_GEMM
    xa0 = np.empty((mp, kpw), proto.dtype)
    xa1 = np.empty((mp, kpw), proto.dtype) if split else xa0
    quantize_acts(x.reshape(m, c_dim), e[IX], z[IX], lo, hi, bias, split, kpw, xa0, xa1)
    qwx = np.empty((m, 3 * h), np.int32)
    bt, tr, sh = bias_terms(b, ch, e, z, h), shift_triples(e), 6 if split else 0
    if m <= ROW_PROJ_MAX:
        n_out = nbp * 16
        o0, o1 = np.empty(n_out, np.int32), np.empty(n_out if split else 0, np.int32)
        acc = np.empty(n_out, np.int64)
        for r in range(m):
            _products(True, wp, xa0[r], xa1[r], np.int64(kpw), 1, nbp, kgw, o0, o1 if split else o0, acc, n_out,
                      split)
            rescale_rows(acc, ctw, 0, z[IWX], lo, hi, qwx[r])
    elif m * 3 * h * c_dim >= PARALLEL_MACS and m >= 2 * MT:
        proj_packed_parallel(wp, xa0, xa1, kpw, kgw, nbp, ctw, z[IWX], lo, hi, split, 0, m, qwx)
    else:
        proj_packed(wp, xa0, xa1, kpw, kgw, nbp, ctw, z[IWX], lo, hi, split, 0, m, qwx)
    args = (qwx.reshape(t_dim, n_dim, 3 * h), rp, kpr, kgr, nbp, ctr, bias, split, qh, lens, reverse, bt, tr, luts,
            e, z, lo, hi, sh, y, yh, proto)
    if n_dim > 1:
        recurrence_packed_parallel(*args)
    else:
        recurrence_packed(*args)


def _act_proto(w):
    """An empty array of the direct path's activation dtype for weights w: uint8 (int8 w: u = q - qmin) or int16
    (int16 w: d = q - zp split into d >> 8 and d & 255); a compile-time choice in Numba (the overload below)."""
    return np.empty(0, np.int16 if w.dtype.itemsize == 2 else np.uint8)


@overload(_act_proto, inline="always")
def _act_proto_nb(w):
    if w.dtype.bitwidth == 16:
        return lambda w: np.empty(0, np.int16)
    return lambda w: np.empty(0, np.uint8)


@njit(cache=True, inline="always")
def _rescale_by(v, s, zp, lo, hi):
    """sat(rshift(v, s) + zp) by _rs_flat (loops over channels vectorise)."""
    return _sat(_rs_flat(v, s) + zp, lo, hi)


@njit(cache=True, inline="always")
def _steps_direct(qwx, n, R, ch_r, s_r, bias, cc, split, qh, s0, s1, ln, reverse, bt, t, luts, e, z, lo, hi, sh, y,
                  a0, a1, acc, qrh, sc):
    """_steps on R as stored (rowdot): steps s0..s1-1 of batch row n; channel c's rescale shift ch_r[c] + s_r; a0,
    a1 [H] the activations' scratch (_act with bias; cc the offset rowdot removes), acc [3H] int64, qrh [3H]
    int64, sc [5, H] int64."""
    h = qh.shape[0]
    scale = 2.0 ** (-e[IH])
    zh, zrh = z[IH], z[IRH]
    for s in range(s0, s1):
        ti = ln - 1 - s if reverse else s
        for k in range(h):
            _act(qh[k], bias, split, a0, a1, k)
        rowdot(R, a0, a1, cc, acc)
        for c in range(3 * h):
            qrh[c] = _rescale_by(acc[c], np.int64(ch_r[c]) + s_r, zrh, lo, hi)
        _cell(qwx[ti, n], qrh, qh, bt, t, luts, e, z, lo, hi, sh, sc[0], sc[1], sc[2], sc[3], sc[4])
        for j in range(h):
            y[ti, n, j] = np.float32((qh[j] - zh) * scale)


def _recurrence_direct(qwx, R, ch_r, s_r, bias, cc, split, qh0, lens, reverse, bt, t, luts, e, z, lo, hi, sh, y,
                       yh, proto):
    """_recurrence on R as stored: batch rows in parallel with the parallel variant."""
    n_dim, h = qh0.shape
    for n in prange(n_dim):
        qh = qh0[n].copy()
        a0, a1 = np.empty(h, proto.dtype), np.empty(h if split else 0, proto.dtype)
        acc, qrh, sc = np.empty(3 * h, np.int64), np.empty(3 * h, np.int64), np.empty((5, h), np.int64)
        _steps_direct(qwx, n, R, ch_r, s_r, bias, cc, split, qh, 0, lens[n], lens[n], reverse, bt, t, luts, e, z, lo,
                      hi, sh, y, a0, a1 if split else a0, acc, qrh, sc)
        _finish(qh, n, lens[n], e, z, y, yh)


recurrence_direct, recurrence_direct_parallel = (njit_variant(_recurrence_direct, par, **_JIT) for par in (False, True))


@njit(**_JIT)
def _run_direct(x, qh, W, R, b, ch, luts, e, z, lens, reverse, y, yh, lo, hi):
    """run_direction's direct (VNNI) path: W [3H, C] and R [3H, H] as stored (C, H <= ROWDOT_MAX_K), multiplied
    row by row (rowdot; nothing packed); qh [N, H] int64 the quantised initial state. int8: activations
    u = q - qmin (unsigned bytes), the offset zp - qmin removed in the products; int16: d = q - zp split into two
    int16 operands."""
    t_dim, n_dim, c_dim = x.shape
    h = R.shape[1]
    split = _wide(W)
    proto = _act_proto(W)
    m = t_dim * n_dim
    xa0 = np.empty((m, c_dim), proto.dtype)
    xa1 = np.empty((m if split else 0, c_dim), proto.dtype)
    bias_x, bias_h = (z[IX], z[IH]) if split else (lo, lo)
    quantize_acts(x.reshape(m, c_dim), e[IX], z[IX], lo, hi, bias_x, split, c_dim, xa0, xa1 if split else xa0)
    qwx = np.empty((m, 3 * h), np.int32)
    acc = np.empty(3 * h, np.int64)
    zwx, s_w = z[IWX], e[IX] - e[IWX]
    for r in range(m):
        rowdot(W, xa0[r], xa1[r] if split else xa0[r], z[IX] - bias_x, acc)
        for c in range(3 * h):
            qwx[r, c] = _rescale_by(acc[c], np.int64(ch[0, c]) + s_w, zwx, lo, hi)
    bt, tr, sh = bias_terms(b, ch, e, z, h), shift_triples(e), 6 if split else 0
    args = (qwx.reshape(t_dim, n_dim, 3 * h), R, ch[1], e[IH] - e[IRH], bias_h, z[IH] - bias_h, split, qh, lens,
            reverse, bt, tr, luts, e, z, lo, hi, sh, y, yh, proto)
    if n_dim > 1:
        recurrence_direct_parallel(*args)
    else:
        recurrence_direct(*args)

@njit(**_JIT)
def check_values(ch, e, lens, t):
    """The value checks of gru_int.check_inputs (channel_exp range, per-channel right shifts, sequence_lens in
    0..T) for all directions: ch [D, 4, 3H] int32, e [D, 14] int64. Returns True when they all pass."""
    h = ch.shape[2] // 3
    for n in range(lens.shape[0]):
        if lens[n] < 0 or lens[n] > t:
            return False
    for k in range(ch.shape[0]):
        for r in range(4):
            for g in range(3):   # each (row, gate) block: its lower bound, then min / max (vectorised)
                if r == 0:
                    target = e[k, IWX] - e[k, IX]
                elif r == 1:
                    target = e[k, IRH] - e[k, IH]
                else:
                    target = e[k, IRB] if r == 3 and g == 2 else e[k, IZP + g]
                mn, mx = np.int64(gru_int.MAX_EXP), np.int64(-gru_int.MAX_EXP)
                for c in range(g * h, (g + 1) * h):
                    v = np.int64(ch[k, r, c])
                    mn, mx = min(mn, v), max(mx, v)
                if mn < max(target, -gru_int.MAX_EXP) or mx > gru_int.MAX_EXP:
                    return False
    return True


@njit(cache=True, inline="always")
def _initial_state(h0, e, z, n_dim, h, lo, hi):
    """qh [N, H] int64: initial_h quantised (h0 [N, H]), or zp_h everywhere when h0 has no rows."""
    qh = np.empty((n_dim, h), np.int64)
    if h0.shape[0] == 0:
        qh[:] = z[IH]
    else:
        quantize_rows(h0, e[IH], z[IH], lo, hi, qh)
    return qh


@njit(**_JIT)
def _run_packed_any(x, qh, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, bits):
    """_run_packed with the operands' form given by the packed weights' dtype and the op's width: int8; int16
    weights all in [-128, 127] packed as int8 (the activations split into two unsigned bytes); int16."""
    lo = -(1 << (bits - 1))
    _run_packed(x, qh, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, lo if wp.itemsize == 1 else 0,
                bits == 16, _act_proto(wp))


@njit(**_JIT)
def run_direction_packed(x, h0, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, bits):
    """run_direction on W and R packed beforehand (pack_direction: a kernel whose W and R are constant
    initializers packs them once): the packed path for every length; bits the op's width. y and yh go on as
    layout 'A' views whatever their layout here (see run_direction_path)."""
    _run_direction_packed(x, h0, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y[::1], yh[::1], bits)


@njit(**_JIT)
def _run_direction_packed(x, h0, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, bits):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    qh = _initial_state(h0, e, z, x.shape[1], rsr.shape[0] // 3, lo, hi)
    _run_packed_any(x, qh, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, bits)


def pack_direction(W, R):  # noqa: N803
    """pack_pair of one direction's W and R (int8 / int16 [3H, C], [3H, H]) for run_direction_packed; int16 weights
    all in [-128, 127] are packed as int8 (the per-call packed path's choice)."""
    W, R = np.ascontiguousarray(W), np.ascontiguousarray(R)  # noqa: N806
    if W.dtype == np.int16:
        w8, r8 = np.empty(W.shape, np.int8), np.empty(R.shape, np.int8)
        if narrow_copy(W, w8) and narrow_copy(R, r8):
            W, R = w8, r8  # noqa: N806
    return pack_pair(W, R)

@njit(**_JIT)
def run_direction(x, h0, W, R, b, ch, luts, e, z, lens, reverse, y, yh):
    """One direction, everything after the host checks: x [T, N, C] float32 (C-contiguous), h0 [N, H] float32 (no
    rows: zero state, i.e. zp_h), W [3H, C] / R [3H, H] int8 or int16 (C-contiguous), b [6H] int32, ch [4, 3H]
    int32, luts [3, L] int32, e, z [14] int64, lens [N] int64; writes y [T, N, H] and yh [N, H] float32 (any
    strides). On VNNI hosts the packed path from PACK_MIN_STEPS steps, the direct one below; else the portable
    one."""
    run_direction_path(x, h0, W, R, b, ch, luts, e, z, lens, reverse, y, yh, PACK_MIN_STEPS if VNNI else -1)


@njit(**_JIT)
def run_direction_path(x, h0, W, R, b, ch, luts, e, z, lens, reverse, y, yh, pack_min):
    """run_direction with the path chosen by pack_min (pack_min < 0: the portable path; VNNI hosts only otherwise):
    the packed VNNI path when a batch row runs at least pack_min steps, else the direct VNNI path where C and H are
    at most ROWDOT_MAX_K, else the portable path (row dot products in LLVM's loops). int16 weights all in
    [-128, 127] (int8 weights widened; checked on every packed call) take the packed path's int8 weights with the
    activations split into two bytes. y and yh go on as layout 'A' views (``[::1]``) whatever their layout here
    (contiguous for one direction, strided for two or for layout 1): the paths below compile once per weight
    dtype instead of once per layout combination (six signatures became two; cold compiles in CI)."""
    _run_direction_path(x, h0, W, R, b, ch, luts, e, z, lens, reverse, y[::1], yh[::1], pack_min)


@njit(**_JIT)
def _run_direction_path(x, h0, W, R, b, ch, luts, e, z, lens, reverse, y, yh, pack_min):
    t_dim, n_dim, c_dim = x.shape
    h = R.shape[1]
    wide = _wide(W)
    bits = 16 if wide else 8
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if VNNI and pack_min >= 0:
        maxlen = 0
        for n in range(n_dim):
            maxlen = max(maxlen, lens[n])
        packed = maxlen >= pack_min and maxlen > 0
        if packed or (c_dim <= ROWDOT_MAX_K and h <= ROWDOT_MAX_K):
            qh = _initial_state(h0, e, z, n_dim, h, lo, hi)
            if not packed:
                _run_direct(x, qh, W, R, b, ch, luts, e, z, lens, reverse, y, yh, lo, hi)
                return
            narrow = False
            w8, r8 = np.empty((0, 0), np.int8), np.empty((0, 0), np.int8)
            if wide:
                w8, r8 = np.empty(W.shape, np.int8), np.empty(R.shape, np.int8)
                narrow = narrow_copy(W, w8) and narrow_copy(R, r8)
            if wide and narrow:
                wp8, rp8, rsw, rsr = pack_pair(w8, r8)
                _run_packed_any(x, qh, wp8, rp8, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, bits)
            else:
                wp, rp, rsw, rsr = pack_pair(W, R)
                _run_packed_any(x, qh, wp, rp, rsw, rsr, b, ch, luts, e, z, lens, reverse, y, yh, bits)
            return
    m = t_dim * n_dim
    dh = np.empty((m, c_dim), np.int16)
    dl = np.empty((m, c_dim) if wide else (0, c_dim), np.int16)
    quantize_split(x.reshape(m, c_dim), e[IX], z[IX], lo, hi, wide, dh, dl if wide else dh)
    qwx = np.empty((m, 3 * h), np.int32)
    shift = np.empty(3 * h, np.int64)
    for c in range(3 * h):
        shift[c] = np.int64(ch[0, c]) + e[IX] - e[IWX]
    big = m * 3 * h * c_dim >= PARALLEL_MACS and m >= 2 * MB
    pipe = big and n_dim == 1 and lens[0] >= 2 * PIPE_BLOCK
    if pipe:
        pass    # projected block by block below
    elif big:
        input_proj_parallel(dh, dl if wide else dh, W, shift, z[IWX], lo, hi, qwx)
    else:
        input_proj(dh, dl if wide else dh, W, shift, z[IWX], lo, hi, qwx)
    qh = _initial_state(h0, e, z, n_dim, h, lo, hi)
    r_shift = np.empty(3 * h, np.int64)
    for c in range(3 * h):
        r_shift[c] = np.int64(ch[1, c]) + e[IH] - e[IRH]
    bt, tr, sh = bias_terms(b, ch, e, z, h), shift_triples(e), 6 if wide else 0
    if pipe:
        block = max(PIPE_BLOCK, (lens[0] + PIPE_BLOCKS - 1) // PIPE_BLOCKS)
        pipelined(dh, dl if wide else dh, W, shift, z[IWX], qwx.reshape(t_dim, 1, 3 * h), R, r_shift, qh, lens[0],
                  block, reverse, bt, tr, luts, e, z, lo, hi, sh, y, yh)
        return
    args = (qwx.reshape(t_dim, n_dim, 3 * h), R, r_shift, qh, lens, reverse, bt, tr, luts, e, z, lo, hi, sh, y, yh)
    if n_dim > 1:
        recurrence_parallel(*args)
    else:
        recurrence(*args)

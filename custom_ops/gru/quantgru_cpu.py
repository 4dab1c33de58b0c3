"""QuantGRU, CPU face (Numba): the fixed-point GRU of onnx_lowbit.gru_int, bit-exact (spec: docs/gru.md).

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

Input values are checked by ``check_values`` (Numba) on every call; only when it fails does gru_int.check_inputs
run to name the problem.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from numba.extending import overload

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import NQ, Q

from ..device import native
from ..runtime import plans
from ..runtime.kernels import Kernel, KernelError

# scalar quantity indices (numba sees plain ints)
IX, IH, IWX, IRH, IZP, IRP, IGP, IZO, IRO, IGO, IRB, IRRH, IOLD, INEW = (Q[n] for n in gru_int.QUANTITIES)
CHUNK = 192            # int16: products per exact int32 partial sum (at most 255; 192: measured fastest of 64..240)
MB = 4                 # input GEMM: rows per block (one W row read from L1 for MB dot products)
PARALLEL_MACS = 1 << 22  # input GEMM: multiply-adds from which the parallel variant is used (2 threads ~2x)
PIPE_BLOCK, PIPE_BLOCKS = 16, 16  # batch 1: steps per block of ``pipelined`` (>= 16; about 16 blocks)
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


input_proj = njit(**_JIT)(_input_proj)
input_proj_parallel = njit(parallel=True, **_JIT)(_input_proj)


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
        t[B_Z, j] = (_rs(np.int64(b[cz]), np.int64(ch[2, cz]) - e[IZP])
                     + _rs(np.int64(b[h3 + cz]), np.int64(ch[3, cz]) - e[IZP]) + z[IZP])
        t[B_R, j] = (_rs(np.int64(b[cr]), np.int64(ch[2, cr]) - e[IRP])
                     + _rs(np.int64(b[h3 + cr]), np.int64(ch[3, cr]) - e[IRP]) + z[IRP])
        t[B_RB, j] = _rs(np.int64(b[h3 + cg]), np.int64(ch[3, cg]) - e[IRB]) + z[IRB]
        t[B_G, j] = _rs(np.int64(b[cg]), np.int64(ch[2, cg]) - e[IGP]) + z[IGP]
    return t


@njit(cache=True, inline="always")
def _lut(q, tab, lo, sh, rnd):
    """gru_int.lut of a saturated q, branch-free: sh = 0 (int8) reads tab[q - lo] (the difference term is 0)."""
    u = q - lo
    i = u >> sh
    a = np.int64(tab[i])
    return a + (((np.int64(tab[i + 1]) - a) * (u & ((np.int64(1) << sh) - 1)) + rnd) >> sh)


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
    for j in range(h):   # sigmoid tables: z into pz, r into pr
        pz[j] = _lut(pz[j], tz, lo, sh, rnd)
        pr[j] = _lut(pr[j], tr, lo, sh, rnd)
    for j in range(h):   # r (Rh_g + br_g), g's pre-activation
        qrrh = _sat(_rs3((pr[j] - zro) * (pb[j] - zrb), rh0, rh1, rh2) + zrrh, lo, hi)
        pg[j] = _sat(_rs3(np.int64(qwx[2 * h + j]) - zwx, wg0, wg1, wg2) + _rs3(qrrh - zrrh, rg0, rg1, rg2) + bg[j],
                     lo, hi)
    for j in range(h):   # tanh table
        qg[j] = _lut(pg[j], tg, lo, sh, rnd)
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


recurrence = njit(**_JIT)(_recurrence)
recurrence_parallel = njit(parallel=True, **_JIT)(_recurrence)


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
            for c in range(ch.shape[2]):
                v = np.int64(ch[k, r, c])
                if v < -gru_int.MAX_EXP or v > gru_int.MAX_EXP:
                    return False
                g = c // h
                if r == 0:
                    target = e[k, IWX] - e[k, IX]
                elif r == 1:
                    target = e[k, IRH] - e[k, IH]
                elif r == 2:
                    target = e[k, IZP + g]
                else:
                    target = e[k, IZP + g] if g < 2 else e[k, IRB]
                if v < target:
                    return False
    return True


@njit(**_JIT)
def run_direction(x, h0, W, R, b, ch, luts, e, z, lens, reverse, y, yh):
    """One direction, everything after the host checks: x [T, N, C] float32 (C-contiguous), h0 [N, H] float32 (no
    rows: zero state, i.e. zp_h), W [3H, C] / R [3H, H] int8 or int16, b [6H] int32, ch [4, 3H] int32, luts [3, L]
    int32, e, z [14] int64, lens [N] int64; writes y [T, N, H] and yh [N, H] float32 (any strides)."""
    t_dim, n_dim, c_dim = x.shape
    h = R.shape[1]
    wide = _wide(W)
    bits = 16 if wide else 8
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
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
    qh = np.empty((n_dim, h), np.int64)
    if h0.shape[0] == 0:
        qh[:] = z[IH]
    else:
        quantize_rows(h0, e[IH], z[IH], lo, hi, qh)
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


_NO_H0 = np.zeros((0, 1), np.float32)


def quant_gru(X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
              exponents, zero_points, direction="forward", layout=0):
    """Host-array entry with gru_int.quant_gru's signature (tests): checks the inputs, then runs."""
    a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
    X = np.asarray(X, np.float32)
    gru_int.check_inputs(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
    return _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)


def quant_gru_run(X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
                  exponents, zero_points, direction="forward", layout=0):
    """quant_gru without the input checks (the kernel alone: benchmarks/gru_cpu.py)."""
    a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
    return _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)


def _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h, y_out=None, yh_out=None):
    """Runs every direction, writing into y_out / yh_out (ONNX layout shapes; new arrays when None)."""
    d, h = a.num_directions, a.hidden_size
    x = X if a.layout == 0 else X.transpose(1, 0, 2)
    x = np.ascontiguousarray(x, np.float32)
    t, n, _ = x.shape
    lens = np.full(n, t, np.int64) if sequence_lens is None else np.asarray(sequence_lens, np.int64)
    h0 = None
    if initial_h is not None:
        h0 = initial_h if a.layout == 0 else initial_h.transpose(1, 0, 2)
    if y_out is None:
        y_out = np.empty((t, d, n, h) if a.layout == 0 else (n, t, d, h), np.float32)
    if yh_out is None:
        yh_out = np.empty((d, n, h) if a.layout == 0 else (n, d, h), np.float32)
    ys = y_out if a.layout == 0 else y_out.transpose(1, 2, 0, 3)    # [T, D, N, H] views
    yhs = yh_out if a.layout == 0 else yh_out.transpose(1, 0, 2)    # [D, N, H]
    for k in range(d):
        reverse = a.direction == "reverse" or k == 1
        # int32 copies of the small int8/int16 tables: one compiled cell for both widths
        run_direction(x, _NO_H0 if h0 is None else np.ascontiguousarray(h0[k], np.float32), W[k], R[k],
                      np.ascontiguousarray(B[k], np.int32), np.ascontiguousarray(channel_exp[k], np.int32),
                      luts[k].astype(np.int32), a.exponents[k], a.zero_points[k], lens, reverse, ys[:, k], yhs[k])
    return y_out, yh_out


class QuantGRUKernel(Kernel):
    native_plans = True  # inputs up to NATIVE_MACS: the native entry (below); longer ones: the Python path
    def __init__(self, **kw):
        super().__init__(**kw)
        at = self.attrs
        self.a = gru_int.GRUAttrs(at["hidden_size"], at["bits"], at["exponents"], at["zero_points"],
                                  at.get("direction", "forward"), at.get("layout", 0))

    def compute(self, ctx, inputs):
        ins = [inputs[i] if i < len(inputs) else None for i in range(8)]
        for i in range(6):
            self.check_input(ins, i)
        v = [t.numpy() if t is not None else None for t in ins]
        t, n = self._check(v)
        d, h = self.a.num_directions, self.a.hidden_size
        shapes = ((t, d, n, h), (d, n, h)) if self.a.layout == 0 else ((n, t, d, h), (n, d, h))
        if ctx.native and t * n * ins[0].shape[2] * 3 * h <= NATIVE_MACS and (n == 1 or native.parallel_ok()):
            outs = [ctx.output(i, shape) for i, shape in enumerate(shapes)]
            if ctx.run_native(native.compile_entry(_native_gru), 1, 1, native_values(self.a, ins, outs, (t, n)),
                              (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)):
                return
        elif ctx.native:
            plans.not_replayable()   # a long input projection (BLAS) or batches under Numba's workqueue layer
        y, yh = (ctx.output_numpy(i, shape, np.float32) for i, shape in enumerate(shapes))
        _run(self.a, *v, y_out=y, yh_out=yh)

    _signature = None  # the shapes and dtypes gru_int.check_inputs last accepted

    def _check(self, v):
        """gru_int.check_inputs, fast on repeated calls: the shapes and dtypes once per signature, the values
        (channel_exp, sequence_lens) by check_values; on a failure gru_int.check_inputs names the problem."""
        sig = tuple(None if x is None else (x.shape, x.dtype.num) for x in v)
        x = v[0]
        t, n = (x.shape[0], x.shape[1]) if self.a.layout == 0 else (x.shape[1], x.shape[0])
        lens = v[6] if v[6] is not None else _NO_LENS
        if sig == self._signature and check_values(v[4], self.a.exponents, lens, t):
            return t, n
        try:
            gru_int.check_inputs(self.a, *v)
        except ValueError as e:
            raise KernelError(str(e)) from None
        self._signature = sig
        return t, n


_NO_LENS = np.zeros(0, np.int32)
KERNEL = QuantGRUKernel


# ---- native entry (runtime/plans.py, "CPU kernels"): one task per call running run_direction per direction, the
# same compiled code as the Python path (so the same bytes), for inputs whose input GEMM stays below PARALLEL_MACS
# (run_direction then takes its serial projection and, for one batch row, the serial recurrence: a streaming GRU's
# frames); more rows use the parallel recurrence where native.parallel_ok. channel_exp's values were checked by
# Python when the call was recorded: a replay whose channel_exp differs (its fingerprint) or whose sequence_lens are
# out of range is declined and goes through Python, which checks them.
# params: X, W, R, B, channel_exp, luts, sequence_lens (0), initial_h (0), Y, Y_h, exponents, zero_points, T, N, C,
# H, D, layout, bits, reverse (1: direction "reverse"), lo, hi, LUT shift, LUT length, channel_exp fingerprint
NATIVE_MACS = PARALLEL_MACS - 1


def native_values(a, ins, outs, tn):
    lo, hi = gru_int.qrange(a.bits)
    ce = ins[4]
    return ([t.ptr if t is not None else 0 for t in ins[:8]] + list(outs)
            + [a.exponents.ctypes.data, a.zero_points.ctypes.data, tn[0], tn[1], ins[0].shape[2], a.hidden_size,
               a.num_directions, a.layout, a.bits, int(a.direction == "reverse"), lo, hi, gru_int.LUT_SHIFT[a.bits],
               gru_int.lut_len(a.bits), int(native.fingerprint(np.uint64(ce.ptr), ce.size * 4))])


def _native_gru(p, begin, end):
    if native.arg(p, 18) == 8:
        return _native_run(p, np.int8)
    return _native_run(p, np.int16)


@njit(cache=True, nogil=True)
def _native_run(p, qdt):
    t, n, c, h, d = native.arg(p, 12), native.arg(p, 13), native.arg(p, 14), native.arg(p, 15), native.arg(p, 16)
    layout, rev, ll = native.arg(p, 17), native.arg(p, 19), native.arg(p, 23)
    h3 = 3 * h
    if native.fingerprint(p[4], d * 4 * h3 * 4) != p[24]:
        return native.DECLINED
    lens = np.full(n, t, np.int64)
    if p[6]:
        given = native.vector(p[6], n, np.int32)
        for i in range(n):
            if given[i] < 0 or given[i] > t:
                return native.DECLINED
            lens[i] = given[i]
    xin = native.array(p[0], (t, n, c) if layout == 0 else (n, t, c), np.float32)
    x = np.empty((t, n, c), np.float32)
    for ti in range(t):
        for ni in range(n):
            x[ti, ni] = xin[ti, ni] if layout == 0 else xin[ni, ti]
    w_all = native.array(p[1], (d, h3, c), qdt)
    r_all = native.array(p[2], (d, h3, h), qdt)
    b_all = native.array(p[3], (d, 2 * h3), np.int32)
    ch_all = native.array(p[4], (d, 4, h3), np.int32)
    lut_all = native.array(p[5], (d, 3, ll), qdt)
    e_all = native.array(p[10], (d, NQ), np.int64)
    z_all = native.array(p[11], (d, NQ), np.int64)
    yout = native.array(p[8], (t, d, n, h) if layout == 0 else (n, t, d, h), np.float32)
    yhout = native.array(p[9], (d, n, h) if layout == 0 else (n, d, h), np.float32)
    for k in range(d):
        h0 = np.zeros((0, 1), np.float32)
        if p[7]:
            h0in = native.array(p[7], (d, n, h) if layout == 0 else (n, d, h), np.float32)
            h0 = np.empty((n, h), np.float32)
            for ni in range(n):
                h0[ni] = h0in[k, ni] if layout == 0 else h0in[ni, k]
        y = np.empty((t, n, h), np.float32)
        yh = np.empty((n, h), np.float32)
        run_direction(x, h0, w_all[k], r_all[k], b_all[k], ch_all[k], lut_all[k].astype(np.int32), e_all[k],
                      z_all[k], lens, rev == 1 or k == 1, y, yh)
        for ti in range(t):
            for ni in range(n):
                if layout == 0:
                    yout[ti, k, ni] = y[ti, ni]
                else:
                    yout[ni, ti, k] = y[ti, ni]
        for ni in range(n):
            if layout == 0:
                yhout[k, ni] = yh[ni]
            else:
                yhout[ni, k] = yh[ni]
    return 0

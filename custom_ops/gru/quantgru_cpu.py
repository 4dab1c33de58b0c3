"""QuantGRU, CPU face (Numba): the fixed-point GRU of onnx_lowbit.gru_int, bit-exact (spec: docs/gru.md).

Per direction: X is quantised (Numba) and the input GEMM for all steps is one BLAS product (float64 of the
integer operands: exact, every partial sum is an integer below 2^53); then one Numba parallel region runs the
recurrence, the batch rows in parallel (a row's steps are sequential), R h summed in float64 (exact, SIMD).
Everything else is int64.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import NQ, Q

from ..device import native
from ..runtime import plans
from ..runtime.kernels import Kernel, KernelError

# scalar quantity indices (numba sees plain ints)
IX, IH, IWX, IRH, IZP, IRP, IGP, IZO, IRO, IGO, IRB, IRRH, IOLD, INEW = (Q[n] for n in gru_int.QUANTITIES)


@njit(cache=True, inline="always")
def _rs(v, s):
    if s <= 0:
        return v << (-s)
    if s >= 63:
        return np.int64(0)
    return (v + (np.int64(1) << (s - 1))) >> s


@njit(cache=True, inline="always")
def _sat(v, lo, hi):
    return lo if v < lo else (hi if v > hi else v)


@njit(cache=True, inline="always")
def _lut(q, tab, lo, sh):
    u = q - lo
    if sh == 0:
        return np.int64(tab[u])
    i = u >> sh
    f = u & ((np.int64(1) << sh) - 1)
    a = np.int64(tab[i])
    return a + _rs((np.int64(tab[i + 1]) - a) * f, sh)


@njit(cache=True, inline="always")
def _quantize(x, e, zp, lo, hi):
    if math.isnan(x):
        return zp
    v = np.rint(np.float64(x) * 2.0 ** e)
    if v < lo - zp:
        v = np.float64(lo - zp)
    elif v > hi - zp:
        v = np.float64(hi - zp)
    return np.int64(v) + zp


@njit(cache=True, nogil=True)
def quantize_rows(x, e, zp, lo, hi, out):
    """out[m, k] = gru_int.quantize(x[m, k]) as float64 (x [M, K] float32)."""
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            out[m, k] = np.float64(_quantize(x[m, k], e, zp, lo, hi))


@njit(cache=True, nogil=True)
def rescale_gemm(acc, rowsum, zp_in, shift, zp_out, lo, hi, out):
    """out[m, c] = sat(rshift(acc[m, c] - zp_in rowsum[c], shift[c]) + zp_out); acc float64 holding exact integers."""
    for m in range(acc.shape[0]):
        for c in range(acc.shape[1]):
            out[m, c] = _sat(_rs(np.int64(acc[m, c]) - zp_in * rowsum[c], shift[c]) + zp_out, lo, hi)




@njit(cache=True, nogil=True, inline="always")
def _cell(qwx, qrh, qh, b, ch, luts, e, z, lo, hi, sh):
    """One step's elementwise part of one batch row: qwx, qrh [3H] int64 (rescaled GEMMs), qh [H] int64 updated
    in place (gru_int.step after its R h GEMM)."""
    h = qh.shape[0]
    h3 = 3 * h
    one_z = np.int64(1) << e[IZO]
    for j in range(h):
        cz, cr, cg = j, h + j, 2 * h + j
        dwz, dwr, dwg = qwx[cz] - z[IWX], qwx[cr] - z[IWX], qwx[cg] - z[IWX]
        drz, drr, drg = qrh[cz] - z[IRH], qrh[cr] - z[IRH], qrh[cg] - z[IRH]
        qzp = _sat(_rs(dwz, e[IWX] - e[IZP]) + _rs(drz, e[IRH] - e[IZP])
                   + _rs(np.int64(b[cz]), np.int64(ch[2, cz]) - e[IZP])
                   + _rs(np.int64(b[h3 + cz]), np.int64(ch[3, cz]) - e[IZP]) + z[IZP], lo, hi)
        qz = _lut(qzp, luts[0], lo, sh)
        qrp = _sat(_rs(dwr, e[IWX] - e[IRP]) + _rs(drr, e[IRH] - e[IRP])
                   + _rs(np.int64(b[cr]), np.int64(ch[2, cr]) - e[IRP])
                   + _rs(np.int64(b[h3 + cr]), np.int64(ch[3, cr]) - e[IRP]) + z[IRP], lo, hi)
        qr = _lut(qrp, luts[1], lo, sh)
        qrb = _sat(_rs(drg, e[IRH] - e[IRB]) + _rs(np.int64(b[h3 + cg]), np.int64(ch[3, cg]) - e[IRB])
                   + z[IRB], lo, hi)
        qrrh = _sat(_rs((qr - z[IRO]) * (qrb - z[IRB]), e[IRO] + e[IRB] - e[IRRH]) + z[IRRH], lo, hi)
        qgp = _sat(_rs(dwg, e[IWX] - e[IGP]) + _rs(qrrh - z[IRRH], e[IRRH] - e[IGP])
                   + _rs(np.int64(b[cg]), np.int64(ch[2, cg]) - e[IGP]) + z[IGP], lo, hi)
        qg = _lut(qgp, luts[2], lo, sh)
        qold = _sat(_rs((qz - z[IZO]) * (qh[j] - z[IH]), e[IZO] + e[IH] - e[IOLD]) + z[IOLD], lo, hi)
        omz = one_z - (qz - z[IZO])
        qnew = _sat(_rs(omz * (qg - z[IGO]), e[IZO] + e[IGO] - e[INEW]) + z[INEW], lo, hi)
        qh[j] = _sat(_rs(qold - z[IOLD], e[IOLD] - e[IH]) + _rs(qnew - z[INEW], e[INEW] - e[IH]) + z[IH], lo, hi)


# reassoc/contract: the float64 sums of R h hold exact integers, so any summation order gives the same result
@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def recurrence(qwx, r64, rsum, r_shift, qh0, lens, reverse, b, ch, luts, e, z, lo, hi, sh, y, yh):
    """All steps of one direction, the batch rows in parallel (each row's steps are sequential). qwx [T, N, 3H]
    int64, r64 [3H, H] float64 (the integer R), qh0 [N, H] int64; writes y [T, N, H] (rows' padded steps stay as
    given) and yh [N, H] float32. R h is summed in float64: exact (integers below 2^53)."""
    n_dim, h = qh0.shape
    h3 = 3 * h
    scale = 2.0 ** (-e[IH])
    for n in prange(n_dim):
        qh = qh0[n].copy()
        qhf = np.empty(h, np.float64)
        qrh = np.empty(h3, np.int64)
        for s in range(lens[n]):
            ti = lens[n] - 1 - s if reverse else s
            for k in range(h):
                qhf[k] = np.float64(qh[k])
            for c in range(h3):
                acc = 0.0
                for k in range(h):
                    acc += r64[c, k] * qhf[k]
                qrh[c] = _sat(_rs(np.int64(acc) - z[IH] * rsum[c], r_shift[c]) + z[IRH], lo, hi)
            _cell(qwx[ti, n], qrh, qh, b, ch, luts, e, z, lo, hi, sh)
            for j in range(h):
                y[ti, n, j] = np.float32((qh[j] - z[IH]) * scale)
        for j in range(h):
            yh[n, j] = np.float32((qh[j] - z[IH]) * scale) if lens[n] > 0 else np.float32(0.0)


def run_direction(x, h0, W, R, b, ch, luts, e, z, bits, lens, reverse):
    """One direction: x [T, N, C] float32, h0 [N, H] float32 or None -> (y [T, N, H], yh [N, H]) float32.

    The GEMMs run in float64 on the integer operands: every partial sum is an integer below 2^53 (|q| <= 2^15,
    C, H <= 2^15), so they are exact and equal the reference's integer sums."""
    t_dim, n_dim, c_dim = x.shape
    h3 = W.shape[0]
    h = h3 // 3
    lo, hi = gru_int.qrange(bits)
    sh = gru_int.LUT_SHIFT[bits]
    w64 = W.astype(np.float64)
    wsum, rsum = W.astype(np.int64).sum(1), R.astype(np.int64).sum(1)
    qx = np.empty((t_dim * n_dim, c_dim), np.float64)
    quantize_rows(x.reshape(t_dim * n_dim, c_dim), e[IX], z[IX], lo, hi, qx)
    qwx = np.empty((t_dim * n_dim, h3), np.int64)
    rescale_gemm(qx @ w64.T, wsum, z[IX], ch[0].astype(np.int64) + e[IX] - e[IWX], z[IWX], lo, hi, qwx)
    qwx = qwx.reshape(t_dim, n_dim, h3)
    qh = np.full((n_dim, h), z[IH], np.int64)
    if h0 is not None:
        h0q = np.empty((n_dim, h), np.float64)
        quantize_rows(np.ascontiguousarray(h0, np.float32), e[IH], z[IH], lo, hi, h0q)
        qh = h0q.astype(np.int64)
    y = np.zeros((t_dim, n_dim, h), np.float32)
    yh = np.empty((n_dim, h), np.float32)
    recurrence(qwx, R.astype(np.float64), rsum, ch[1].astype(np.int64) + e[IH] - e[IRH], qh, lens, reverse, b, ch,
               luts, e, z, lo, hi, sh, y, yh)
    return y, yh


def quant_gru(X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
              exponents, zero_points, direction="forward", layout=0):
    """Host-array entry with gru_int.quant_gru's signature (tests)."""
    a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
    X = np.asarray(X, np.float32)
    gru_int.check_inputs(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
    y, yh = _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
    return y, yh


def _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h, y_out=None, yh_out=None):
    """Runs every direction; writes into y_out / yh_out (ONNX layout shapes) when given."""
    d, h = a.num_directions, a.hidden_size
    x = X if a.layout == 0 else X.transpose(1, 0, 2)
    x = np.ascontiguousarray(x, np.float32)
    t, n, _ = x.shape
    lens = (np.full(n, t, np.int64) if sequence_lens is None else np.asarray(sequence_lens, np.int64))
    h0 = None
    if initial_h is not None:
        h0 = initial_h if a.layout == 0 else initial_h.transpose(1, 0, 2)
    Y = np.empty((t, d, n, h), np.float32)
    Yh = np.empty((d, n, h), np.float32)
    for k in range(d):
        reverse = a.direction == "reverse" or k == 1
        # int32 copies of the int8/int16 tables and biases: one compiled signature for both widths
        Y[:, k], Yh[k] = run_direction(x, None if h0 is None else h0[k], W[k], R[k],
                                       np.ascontiguousarray(B[k], np.int32),
                                       np.ascontiguousarray(channel_exp[k], np.int32),
                                       np.ascontiguousarray(luts[k], np.int32), a.exponents[k].astype(np.int64),
                                       a.zero_points[k].astype(np.int64), a.bits, lens, reverse)
    if a.layout == 1:
        Y, Yh = Y.transpose(2, 0, 1, 3), Yh.transpose(1, 0, 2)
    if y_out is not None:
        y_out[...] = Y
    if yh_out is not None:
        yh_out[...] = Yh
    return np.ascontiguousarray(Y), np.ascontiguousarray(Yh)


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
        try:
            t, n, _ = gru_int.check_inputs(self.a, *v)
        except ValueError as e:
            raise KernelError(str(e)) from None
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


KERNEL = QuantGRUKernel


# ---- native entry (runtime/plans.py, "CPU kernels"): one task per call, the steps of _run / run_direction with the
# input projection as a loop product instead of BLAS (exact either way: integer sums below 2^53), so only calls up to
# NATIVE_MACS multiply-adds take it (a streaming GRU's frames); the recurrence's body single-threaded for one
# batch row, the parallel kernel for more. channel_exp's values were checked by Python when the call was recorded:
# a replay whose channel_exp differs (its fingerprint) or whose sequence_lens are out of range is declined and goes
# through Python, which checks them.
# params: X, W, R, B, channel_exp, luts, sequence_lens (0), initial_h (0), Y, Y_h, exponents, zero_points, T, N, C,
# H, D, layout, bits, reverse (1: direction "reverse"), lo, hi, LUT shift, LUT length, channel_exp fingerprint
NATIVE_MACS = 1 << 22
recurrence_serial = njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})(recurrence.py_func)


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


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _product(qx, w64, out):
    """out = qx @ w64.T on float64 holding integers (exact in any order)."""
    for m in range(qx.shape[0]):
        for j in range(w64.shape[0]):
            acc = 0.0
            for k in range(qx.shape[1]):
                acc += qx[m, k] * w64[j, k]
            out[m, j] = acc


@njit(cache=True, nogil=True)
def _native_run(p, qdt):
    t, n, c, h, d = native.arg(p, 12), native.arg(p, 13), native.arg(p, 14), native.arg(p, 15), native.arg(p, 16)
    layout, rev, lo, hi = native.arg(p, 17), native.arg(p, 19), native.arg(p, 20), native.arg(p, 21)
    sh, ll = native.arg(p, 22), native.arg(p, 23)
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
        w, r, ch, e, z = w_all[k], r_all[k], ch_all[k], e_all[k], z_all[k]
        w64 = w.astype(np.float64)
        wsum = np.zeros(h3, np.int64)
        rsum = np.zeros(h3, np.int64)
        for j in range(h3):
            for i in range(c):
                wsum[j] += np.int64(w[j, i])
            for i in range(h):
                rsum[j] += np.int64(r[j, i])
        qx = np.empty((t * n, c), np.float64)
        quantize_rows(x.reshape(t * n, c), e[IX], z[IX], lo, hi, qx)
        acc = np.empty((t * n, h3), np.float64)
        _product(qx, w64, acc)
        qwx = np.empty((t * n, h3), np.int64)
        rescale_gemm(acc, wsum, z[IX], ch[0].astype(np.int64) + e[IX] - e[IWX], z[IWX], lo, hi, qwx)
        qh = np.full((n, h), z[IH], np.int64)
        if p[7]:
            h0in = native.array(p[7], (d, n, h) if layout == 0 else (n, d, h), np.float32)
            h0 = np.empty((n, h), np.float32)
            for ni in range(n):
                h0[ni] = h0in[k, ni] if layout == 0 else h0in[ni, k]
            h0q = np.empty((n, h), np.float64)
            quantize_rows(h0, e[IH], z[IH], lo, hi, h0q)
            qh = h0q.astype(np.int64)
        y = np.zeros((t, n, h), np.float32)
        yh = np.empty((n, h), np.float32)
        args = (qwx.reshape(t, n, h3), r.astype(np.float64), rsum, ch[1].astype(np.int64) + e[IH] - e[IRH], qh, lens,
                rev == 1 or k == 1, b_all[k], ch, lut_all[k].astype(np.int32), e, z, lo, hi, sh, y, yh)
        if n == 1:
            recurrence_serial(*args)
        else:
            recurrence(*args)
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

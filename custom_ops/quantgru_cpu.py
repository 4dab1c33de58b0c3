"""QuantGRU, CPU face (Numba): the fixed-point GRU of onnx_lowbit.gru_int, bit-exact (spec: docs/gru.md).

Per direction: X is quantised and the input GEMM (int64 accumulation) computed for all steps in parallel over
(t, n); then the batch entries run their recurrences in parallel (each entry's steps are sequential, entries are
independent). All integer arithmetic is int64 (exact for both widths).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import Q

from .kernels import Kernel

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


@njit(parallel=True, cache=True, nogil=True)
def run_direction(x, h0, has_h0, W, R, b, ch, luts, e, z, lo, hi, sh, lens, reverse, y, yh):
    """x [T, N, C] f32, h0 [N, H] f32; W [3H, C], R [3H, H] (int8/int16), b [6H] int32, ch [4, 3H] int32,
    luts [3, L]; e, z int64 [14]. Writes y [T, N, H] (0 where t >= lens[n]) and yh [N, H] (float32)."""
    t_dim, n_dim, c_dim = x.shape
    h3 = W.shape[0]
    h = h3 // 3
    qwx = np.empty((t_dim, n_dim, h3), np.int64)
    wsum = np.zeros(h3, np.int64)
    rsum = np.zeros(h3, np.int64)
    for c in range(h3):
        for k in range(c_dim):
            wsum[c] += W[c, k]
        for k in range(h):
            rsum[c] += R[c, k]
    for tn in prange(t_dim * n_dim):
        t = tn // n_dim
        n = tn % n_dim
        qx = np.empty(c_dim, np.int64)
        for k in range(c_dim):
            qx[k] = _quantize(x[t, n, k], e[IX], z[IX], lo, hi)
        for c in range(h3):
            acc = np.int64(0)
            for k in range(c_dim):
                acc += np.int64(W[c, k]) * qx[k]
            qwx[t, n, c] = _sat(_rs(acc - z[IX] * wsum[c], np.int64(ch[0, c]) + e[IX] - e[IWX]) + z[IWX], lo, hi)
    scale_h = 2.0 ** (-e[IH])
    one_z = np.int64(1) << e[IZO]
    for n in prange(n_dim):
        qh = np.empty(h, np.int64)
        qrh = np.empty(h3, np.int64)
        for j in range(h):
            qh[j] = _quantize(h0[n, j], e[IH], z[IH], lo, hi) if has_h0 else z[IH]
        for t in range(t_dim):
            y[t, n, :] = 0.0
        for s in range(lens[n]):
            ti = lens[n] - 1 - s if reverse else s
            for c in range(h3):
                acc = np.int64(0)
                for k in range(h):
                    acc += np.int64(R[c, k]) * qh[k]
                qrh[c] = _sat(_rs(acc - z[IH] * rsum[c], np.int64(ch[1, c]) + e[IH] - e[IRH]) + z[IRH], lo, hi)
            for j in range(h):
                cz, cr, cg = j, h + j, 2 * h + j
                dwz = qwx[ti, n, cz] - z[IWX]
                dwr = qwx[ti, n, cr] - z[IWX]
                dwg = qwx[ti, n, cg] - z[IWX]
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
                qh[j] = _sat(_rs(qold - z[IOLD], e[IOLD] - e[IH]) + _rs(qnew - z[INEW], e[INEW] - e[IH]) + z[IH],
                             lo, hi)
            for j in range(h):
                y[ti, n, j] = np.float32((qh[j] - z[IH]) * scale_h)
        for j in range(h):
            yh[n, j] = np.float32((qh[j] - z[IH]) * scale_h) if lens[n] > 0 else np.float32(0.0)


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
    lo, hi = gru_int.qrange(a.bits)
    sh = gru_int.LUT_SHIFT[a.bits]
    Y = np.empty((t, d, n, h), np.float32)
    Yh = np.empty((d, n, h), np.float32)
    for k in range(d):
        reverse = a.direction == "reverse" or k == 1
        hk = (np.ascontiguousarray(h0[k], np.float32) if h0 is not None else np.zeros((n, h), np.float32))
        yk = np.empty((t, n, h), np.float32)
        yhk = np.empty((n, h), np.float32)
        # int32 copies of the int8/int16 arrays: one compiled signature for both widths
        run_direction(x, hk, h0 is not None, np.ascontiguousarray(W[k], np.int32),
                      np.ascontiguousarray(R[k], np.int32), np.ascontiguousarray(B[k], np.int32),
                      np.ascontiguousarray(channel_exp[k], np.int32), np.ascontiguousarray(luts[k], np.int32),
                      a.exponents[k].astype(np.int64),
                      a.zero_points[k].astype(np.int64), lo, hi, sh, lens, reverse, yk, yhk)
        Y[:, k] = yk
        Yh[k] = yhk
    if a.layout == 1:
        Y, Yh = Y.transpose(2, 0, 1, 3), Yh.transpose(1, 0, 2)
    if y_out is not None:
        y_out[...] = Y
    if yh_out is not None:
        yh_out[...] = Yh
    return np.ascontiguousarray(Y), np.ascontiguousarray(Yh)


class QuantGRUKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        at = self.attrs
        self.a = gru_int.GRUAttrs(at["hidden_size"], at["bits"], at["exponents"], at["zero_points"],
                                  at.get("direction", "forward"), at.get("layout", 0))

    def compute(self, ctx, inputs):
        from .bridge import KernelError
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
        y, yh = (ctx.output_numpy(i, shape, np.float32) for i, shape in enumerate(shapes))
        _run(self.a, *v, y_out=y, yh_out=yh)


KERNEL = QuantGRUKernel

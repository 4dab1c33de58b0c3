"""Interval errors of FPLUT tables for the cut-point search (fplut_search.py): for a batch of intervals of the
fp16 grid, each with its segment count and fp16 samples, the (max relative error, max absolute error, number of
outputs that are not the correctly rounded fp16 of f) over the fp16 inputs inside it, computed with exactly the
float32 / fp16 rounding steps of ``fplut.evaluate_fp16``. ``errors`` is the Numba kernel (``make_numba_errors``),
or the pure numpy ``errors_numpy`` where Numba is missing; both give identical figures (tests/test_fplut_tables.py).
"""
from __future__ import annotations

import numpy as np

from . import halfbits

FP16_MAX = halfbits.FP16_MAX


def errors_numpy(x32, ref, den, ref16, ia, ib, t, s, nseg, closed):
    """Batch of intervals [x[ia[m]], x[ib[m]]) (closed: ..]) with nseg segments, fp16 samples t[m] (float32) and
    scales s[m]: their (max rel, max abs, number of outputs != fp16(f)), by the numpy steps of
    ``fplut.evaluate_fp16``."""
    out = np.zeros((len(ia), 3))
    for m in range(len(ia)):
        hi = ib[m] + 1 if closed else ib[m]
        xs, tm = x32[ia[m]:hi], t[m]
        p = (xs - x32[ia[m]]) * s[m]
        j = np.minimum(np.maximum(np.floor(p), 0), nseg).astype(np.int64)
        jp = np.minimum(j + 1, nseg)
        fr = np.clip(p - j.astype(np.float32), np.float32(0), np.float32(1))
        y1 = tm[j]
        y = (tm[jp] - y1) * fr + y1
        if closed:
            y = np.where(xs >= x32[ib[m]], tm[nseg], y)
        y = np.clip(y, np.float32(-FP16_MAX), np.float32(FP16_MAX)).astype(np.float16).astype(np.float64)
        err = np.abs(y - ref[ia[m]:hi])
        out[m] = (err / den[ia[m]:hi]).max(), err.max(), np.count_nonzero(y != ref16[ia[m]:hi])
    return out


def make_numba_errors():
    """``errors_numpy`` compiled with Numba: float32 arithmetic (Numba contracts nothing into FMAs without
    fastmath) and round-to-nearest-even to fp16 on the float32 bits (halfbits), so the figures are identical."""
    from numba import njit  # here: without Numba the module still imports (errors = errors_numpy, below)

    to_f16 = njit(inline="always")(halfbits.f32bits_to_f16bits)
    f16_value = halfbits.all_fp16().astype(np.float64)          # fp16 bit pattern -> value

    @njit(cache=True, nogil=True, boundscheck=False)
    def kernel(x32, ref, den, ref16, ia, ib, t, s, nseg, closed, f16v):
        zero, one = np.float32(0.0), np.float32(1.0)
        lim = np.float32(65504.0)
        fn = np.float32(nseg)
        buf = np.empty(1, np.float32)
        bits = buf.view(np.uint32)
        out = np.zeros((ia.size, 3))
        for m in range(ia.size):
            a32, b32, s32 = x32[ia[m]], x32[ib[m]], s[m]
            hi = ib[m] + 1 if closed else ib[m]
            mr, ma, cnt = 0.0, 0.0, 0
            for i in range(ia[m], hi):
                x = x32[i]
                p = (x - a32) * s32
                fl = np.floor(p)
                if fl < zero:
                    fl = zero
                if fl > fn:
                    fl = fn
                j = int(fl)
                jp = min(j + 1, nseg)
                fr = p - np.float32(j)
                if fr < zero:
                    fr = zero
                if fr > one:
                    fr = one
                y1 = t[m, j]
                y = (t[m, jp] - y1) * fr + y1
                if closed and x >= b32:
                    y = t[m, nseg]
                if y > lim:
                    y = lim
                if y < -lim:
                    y = -lim
                buf[0] = y
                y16 = f16v[to_f16(bits[0])]
                if y16 != ref16[i]:
                    cnt += 1
                err = abs(y16 - ref[i])
                rel = err / den[i]
                if err > ma:
                    ma = err
                if rel > mr:
                    mr = rel
            out[m, 0] = mr
            out[m, 1] = ma
            out[m, 2] = cnt
        return out

    def errors(x32, ref, den, ref16, ia, ib, t, s, nseg, closed):
        return kernel(x32, ref, den, ref16, ia, ib, t, s, nseg, closed, f16_value)
    return errors


try:
    errors = make_numba_errors()
except Exception:  # pragma: no cover - Numba missing: the numpy version gives the same figures, slower
    errors = errors_numpy

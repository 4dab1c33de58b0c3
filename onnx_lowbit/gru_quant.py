"""QuantGRU parameters: calibration ranges (per-time-step EMA) -> power-of-two exponents and zero points,
per-channel weight/bias quantisation, integer sigmoid/tanh tables (the inputs and attributes of a QuantGRU node).

    ranges = calibrate(X, W, R, B, ..., direction=..., layout=..., clip=...)   # list (per direction) of Ranges
    p = quant_params(W, R, B, ranges, bits=16, clip=None)                     # dict: W, R, B, channel_exp, luts,
                                                                               #       exponents, zero_points
    Y, Y_h = gru_int.quant_gru(X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], ...,
                               exponents=p["exponents"], zero_points=p["zero_points"], bits=16, ...)

Rules (docs/gru.md): asymmetric quantities take the range widened to include 0, e = floor(log2((2^bits - 1) /
(hi - lo))), zp = -rint(2^e (lo + hi) / 2); symmetric ones (W, R rows, g_out) e = floor(log2(qmax / max|v|)); biases
int32 at e = e_W[c] + e_x (bx) / e_R[c] + e_h (br), lowered to fit int32. Exponents are then lowered where
needed so every scalar rescale is at most a left shift by gru_int.MAX_LEFT_SHIFT and every per-channel GEMM
rescale is a right shift (gru_int.GRUAttrs / check_inputs check this).
"""
from __future__ import annotations

import math

import numpy as np

from . import gru_float, gru_int
from .gru_int import CH_BR, CH_BX, CH_R, CH_W, NQ, QUANTITIES, Q, qrange, quantize

EMA_OLD, EMA_NEW = 0.9, 0.1
SYMMETRIC = ("g_out",)
# Bits of headroom above the EMA range of every scalar quantity (the EMA of per-step ranges underestimates the
# extremes; int16 has resolution to spare, int8 does not). Measured in docs/gru.md.
HEADROOM = {8: 0, 16: 2}


class Ranges:
    """min/max of each quantity of one direction, updated per time step: v = 0.9 v_old + 0.1 v_step (the first
    step sets it; steps where the quantity is identically 0 are not counted)."""

    def __init__(self):
        self.lo, self.hi = {}, {}

    def update(self, values: dict) -> None:
        for name, v in values.items():
            v = np.asarray(v)
            if v.size == 0:
                continue
            lo, hi = float(v.min()), float(v.max())
            if lo == hi == 0.0:  # identically 0 (h, Rh, z*h at the first step from a zero state): no range information
                continue
            if name in self.lo:
                lo, hi = EMA_OLD * self.lo[name] + EMA_NEW * lo, EMA_OLD * self.hi[name] + EMA_NEW * hi
            self.lo[name], self.hi[name] = lo, hi

    def get(self, name):
        return self.lo.get(name, 0.0), self.hi.get(name, 0.0)


def calibrate(X, W, R, B=None, sequence_lens=None, initial_h=None, *, hidden_size=None, direction="forward",
              layout=0, clip=None, ranges=None):
    """Runs the float GRU (linear_before_reset=1) on X and returns the per-direction Ranges (updating ``ranges``
    if given, e.g. for several calibration batches)."""
    d = np.asarray(W).shape[0]
    ranges = ranges if ranges is not None else [Ranges() for _ in range(d)]
    gru_float.gru(X, W, R, B, sequence_lens, initial_h, hidden_size=hidden_size, direction=direction,
                  layout=layout, linear_before_reset=1, clip=clip, trace=lambda k, vals: ranges[k].update(vals))
    return ranges


def exp_limits(bits: int):
    return -2 * bits, 2 * bits


def sym_exp(maxabs, bits: int, hi_cap: int):
    """Largest e (<= hi_cap) with maxabs * 2^e <= qmax (array-friendly)."""
    qmax = qrange(bits)[1]
    m = np.asarray(maxabs, np.float64)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(qmax / np.where(m > 0, m, 1.0)))
    e = np.where(m > 0, e, hi_cap)
    return np.clip(e, -hi_cap, hi_cap).astype(np.int64)


def asym_exp(lo, hi, bits: int, hi_cap: int) -> int:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    width = hi - lo
    if not width > 0 or not math.isfinite(width):
        return hi_cap if width == 0 else -hi_cap
    return int(min(max(math.floor(math.log2(((1 << bits) - 1) / width)), -hi_cap), hi_cap))


def zero_point(lo, hi, e: int, bits: int) -> int:
    """The centre of [min(lo, 0), max(hi, 0)] maps to 0: zp = -rint(centre 2^e) (headroom splits evenly)."""
    qmin, qmax = qrange(bits)
    centre = 0.5 * (min(lo, 0.0) + max(hi, 0.0))
    return int(min(max(-int(np.rint(np.ldexp(centre, e))), qmin), qmax))


def build_lut(fn, e_pre, zp_pre, e_out, zp_out, bits, clip=None):
    """Table of gru_int.lut: entry i holds the quantised fn at q_pre = qmin + i 2^S (S = LUT_SHIFT[bits])."""
    qmin = qrange(bits)[0]
    q = qmin + np.arange(gru_int.lut_len(bits), dtype=np.int64) * (1 << gru_int.LUT_SHIFT[bits])
    x = np.ldexp((q - zp_pre).astype(np.float64), -int(e_pre))
    if clip is not None:
        x = np.clip(x, -clip, clip)
    return quantize(fn(x), e_out, zp_out, bits).astype(gru_int.QTYPES[bits])


def _sigmoid(v):
    return 0.5 * (np.tanh(0.5 * v) + 1.0)


def row_exp(rows, bits: int, hi_cap: int, mse: bool = False):
    """Per-row exponent of symmetric weights: the largest e with max|row| 2^e <= qmax, or with ``mse`` the one of
    e, e + 1 (one bit finer, the largest weights clipped to qmax) with the smaller squared quantisation error."""
    e = sym_exp(np.abs(rows).max(axis=1), bits, hi_cap)
    if not mse:
        return e
    errs = []
    for ee in (e, np.minimum(e + 1, hi_cap)):
        q = quantize(np.ldexp(rows, ee[:, None].astype(np.int32)), 0, 0, bits)
        errs.append(np.sum((np.ldexp(q.astype(np.float64), -ee[:, None].astype(np.int32)) - rows) ** 2, axis=1))
    return np.where(errs[1] < errs[0], np.minimum(e + 1, hi_cap), e)


def _direction_params(W, R, bx, br, rg: Ranges, bits, clip, headroom, weight_mse=False, weight_bits=None):
    emin, emax = exp_limits(bits)
    e = {}
    for name in QUANTITIES:
        lo, hi = rg.get(name)
        if name in SYMMETRIC:
            e[name] = int(sym_exp(max(abs(lo), abs(hi)), bits, emax))
        else:
            e[name] = asym_exp(lo, hi, bits, emax)
        e[name] -= headroom if isinstance(headroom, int) else int(headroom.get(name, 0))
    for name in ("z_out", "r_out", "g_out"):              # table outputs: at most 2^-bits resolution, e >= 0
        e[name] = min(max(e[name], 0), bits)
    wb = bits if weight_bits is None else weight_bits     # W, R on a weight_bits grid, stored in the bits type
    eW = row_exp(W, wb, emax + 8, weight_mse)
    eR = row_exp(R, wb, emax + 8, weight_mse)
    # lower targets until every scalar rescale is a left shift of at most MAX_LEFT_SHIFT and the GEMM rescales
    # are right shifts (lowering e coarsens a quantity's scale; its range still fits)
    lim = gru_int.MAX_LEFT_SHIFT
    for _ in range(64):
        before = dict(e)
        e["Wx"] = min(e["Wx"], int(eW.min()) + e["x"])
        e["Rh"] = min(e["Rh"], int(eR.min()) + e["h"])
        for src, dst, s in gru_int.scalar_shifts(e):
            if s < -lim:
                e[dst] += s + lim
        if e == before:
            break
    # biases: int32 at the GEMM accumulator's scale (lowered to fit), at least the exponents they are added at
    h = R.shape[1]
    tz = np.repeat([e["z_pre"], e["r_pre"], e["g_pre"]], h)
    tr = np.repeat([e["z_pre"], e["r_pre"], e["Rh_add_br"]], h)
    ebx = np.maximum(np.minimum(eW + e["x"], sym_exp(np.abs(bx), 32, 62)), tz)
    ebr = np.maximum(np.minimum(eR + e["h"], sym_exp(np.abs(br), 32, 62)), tr)
    ebx, ebr = np.clip(ebx, -62, 62), np.clip(ebr, -62, 62)
    zp = {name: (0 if name in SYMMETRIC else zero_point(*rg.get(name), e[name], bits)) for name in QUANTITIES}
    qt = gru_int.QTYPES[bits]
    qW = np.stack([quantize(W[i], eW[i], 0, wb) for i in range(W.shape[0])]).astype(qt)
    qR = np.stack([quantize(R[i], eR[i], 0, wb) for i in range(R.shape[0])]).astype(qt)
    i32 = lambda v, ee: np.clip(np.rint(np.ldexp(v, ee.astype(np.int32))), -2 ** 31, 2 ** 31 - 1)  # noqa: E731
    b = np.concatenate([i32(bx, ebx), i32(br, ebr)]).astype(np.int32)
    ch = np.stack([eW, eR, ebx, ebr]).astype(np.int32)
    luts = np.stack([build_lut(_sigmoid, e["z_pre"], zp["z_pre"], e["z_out"], zp["z_out"], bits, clip),
                     build_lut(_sigmoid, e["r_pre"], zp["r_pre"], e["r_out"], zp["r_out"], bits, clip),
                     build_lut(np.tanh, e["g_pre"], zp["g_pre"], e["g_out"], zp["g_out"], bits, clip)])
    return qW, qR, b, ch, luts, [e[n] for n in QUANTITIES], [zp[n] for n in QUANTITIES]


def quant_params(W, R, B, ranges, *, bits=16, clip=None, headroom=None, weight_mse=False, weight_bits=None) -> dict:
    """QuantGRU inputs and attributes from float weights W [D, 3H, C], R [D, 3H, H], B [D, 6H] (or None) and
    the per-direction calibration ranges. ``headroom``: bits (int), {quantity: bits}, or a list of either per
    direction; ``weight_mse``: per-row weight exponents by squared error (row_exp) instead of max|row|;
    ``weight_bits`` (default ``bits``): 8 with bits 16 puts W and R on the int8 grid (values in -128..127, still
    int16 arrays: the pass stores them int8 and widens them with a Cast), everything else int16."""
    if bits not in gru_int.LUT_SHIFT:
        raise ValueError(f"bits must be 8 or 16, got {bits}")
    if weight_bits not in (None, 8, bits):
        raise ValueError(f"weight_bits must be 8 or bits ({bits}), got {weight_bits}")
    W, R = np.asarray(W, np.float64), np.asarray(R, np.float64)
    d, h3 = W.shape[0], W.shape[1]
    B = np.zeros((d, 2 * h3)) if B is None else np.asarray(B, np.float64)
    if len(ranges) != d:
        raise ValueError(f"expected {d} direction ranges, got {len(ranges)}")
    hd = headroom if isinstance(headroom, (list, tuple)) else [headroom] * d
    if len(hd) != d:
        raise ValueError(f"expected {d} per-direction headrooms, got {len(hd)}")
    hd = [HEADROOM[bits] if v is None else (v if isinstance(v, dict) else int(v)) for v in hd]
    out = [_direction_params(W[k], R[k], B[k, :h3], B[k, h3:], ranges[k], bits, clip, hd[k], weight_mse,
                             weight_bits)
           for k in range(d)]
    assert all(len(o[5]) == NQ for o in out)
    return {"W": np.stack([o[0] for o in out]), "R": np.stack([o[1] for o in out]),
            "B": np.stack([o[2] for o in out]), "channel_exp": np.stack([o[3] for o in out]),
            "luts": np.stack([o[4] for o in out]),
            "exponents": [int(v) for o in out for v in o[5]], "zero_points": [int(v) for o in out for v in o[6]]}


def describe(p: dict, direction: int = 0) -> str:
    """One line per scalar quantity: exponent, zero point (for reports and docs)."""
    lines = []
    for i, name in enumerate(QUANTITIES):
        lines.append(f"{name:10s} e={p['exponents'][direction * NQ + i]:4d} zp={p['zero_points'][direction * NQ + i]}")
    return "\n".join(lines)


__all__ = ["Ranges", "calibrate", "quant_params", "build_lut", "describe", "CH_W", "CH_R", "CH_BX", "CH_BR", "Q"]


def refine_headroom(W, R, B, ranges, X, sequence_lens=None, initial_h=None, *, bits, clip=None, hidden_size=None,
                    direction="forward", layout=0, headroom=None, max_rows=4, max_steps=64, rounds=2,
                    on_trial=None):
    """Per-quantity headroom (a dict for quant_params) from a greedy search: each quantity in turn takes one bit
    more or less headroom when that lowers Y's relative L2 error (integer reference vs float GRU) on a subsample of
    the calibration data (the first max_rows sequences, the first max_steps steps). Finer scales trade clipping
    for resolution; int8 gains most (docs/gru.md). ``on_trial(done, total, best error)``, when given, is called
    before each trial (progress display). Returns (headroom dict, error before, error after)."""
    from . import gru_int
    X = np.asarray(X, np.float32)
    x = X[:max_steps, :max_rows] if layout == 0 else X[:max_rows, :max_steps]
    t = x.shape[0] if layout == 0 else x.shape[1]
    lens = None if sequence_lens is None else np.minimum(np.asarray(sequence_lens)[:max_rows], t).astype(np.int32)
    h0 = None
    if initial_h is not None:
        h0 = np.asarray(initial_h, np.float32)
        h0 = h0[:, :max_rows] if layout == 0 else h0[:max_rows]
    kw = dict(direction=direction, layout=layout)
    ref = gru_float.gru(x, W, R, B, lens, h0, hidden_size=hidden_size, linear_before_reset=1, clip=clip, **kw)[0]
    den = float(np.linalg.norm(ref)) or 1.0
    h = np.asarray(R).shape[-1]

    def err(hd):
        p = quant_params(W, R, B, ranges, bits=bits, clip=clip, headroom=hd)
        try:
            y = gru_int.quant_gru(x, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], lens, h0, hidden_size=h,
                                  bits=bits, exponents=p["exponents"], zero_points=p["zero_points"], **kw)[0]
        except ValueError:
            return math.inf
        return float(np.linalg.norm(y - ref)) / den

    base_hr = HEADROOM[bits] if headroom is None else int(headroom)
    hd = {n: base_hr for n in QUANTITIES}
    before = best = err(hd)
    total, done = rounds * len(QUANTITIES) * 2, 0
    for _ in range(rounds):
        for name in QUANTITIES:
            for d in (-1, 1):
                if on_trial is not None:
                    on_trial(done, total, best)
                done += 1
                trial = dict(hd)
                trial[name] += d
                v = err(trial)
                if v < best * (1 - 1e-3):
                    hd, best = trial, v
    return hd, before, best

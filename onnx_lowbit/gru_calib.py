"""QuantGRU calibration that minimises the integer GRU's output error (docs/gru.md, "Calibration").

    seqs = [Sequence(x, lens, h0), ...]            # calibration sequences, layout 0 ([T, N, C], [D, N, H])
    res = search(W, R, B, seqs, bits=16, direction="forward", hidden_size=H, clip=None)
    p = res.params                                  # the dict of gru_quant.quant_params

1. Statistics: the float GRU (gru_float, linear_before_reset=1) runs over every sequence; for each direction and
   each of the 14 quantities the exact min / max over all steps and sequences and a sample of values (at most
   ``SAMPLE_PER_STEP`` per step) for quantiles.
2. Candidates per quantity: the range [min, max] or, for the GEMM outputs and pre-activations (CLIPPABLE), a
   quantile range (LEVELS: 1e-5 .. 5e-2 clipped at each end), each with ``headroom`` (int8: -1 .. +2 bits,
   exponent one finer .. two coarser; int16: 1 .. 3 bits: START_HEADROOM, HEADROOMS); deduplicated by the (exponent,
   zero point) pairs they give after gru_quant's shift rules; plus the per-row weight exponent rule (max|row| or
   squared error, gru_quant.row_exp).
3. Greedy coordinate descent (a first pass over direction x quantity with every candidate, ``rounds`` - 1 more
   with the current range and headroom +-1; the weight rule after each pass): a candidate is
   kept when it lowers Y's relative L2 error of the integer reference (gru_int.quant_gru) against the float GRU on
   an evaluation set drawn from all sequences: forward GRUs: chunks of ``chunk`` steps started from the float
   state at the chunk's start (many sequences, long streams); others: the sequences' first ``chunk`` steps. At
   most ``max_chunks`` chunks, spread evenly over all sequences.
Start: [min, max] with START_HEADROOM bits (int8 0, int16 1): every quantity's full range fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import gru_float, gru_int, gru_quant
from .gru_int import NQ, QUANTITIES

LEVELS = {8: (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 5e-2), 16: (0.0, 1e-4, 1e-3, 1e-2, 5e-2)}   # fraction clipped at each end
                                                    # of a range (0: min / max)
HEADROOMS = {8: (0, -1, 1, 2), 16: (0, 1, 2)}       # bits of headroom tried with each range, from the start's
START_HEADROOM = {8: 0, 16: 1}
# Quantities whose ranges may be clipped at quantiles: the GEMM outputs and pre-activations, whose extremes feed
# saturating sigmoid / tanh (clipping the state h or the products overfits small calibration sets: measured on
# tests/test_pass_gru.py's 21-step data, h clipped at 1e-2 gave 1.3e-4 there and 7.8e-2 on new data).
CLIPPABLE = ("Wx", "Rh", "z_pre", "r_pre", "g_pre", "Rh_add_br", "rRh")
# int16 neither clips nor goes finer than [min, max] + 1 bit: its resolution is ample and data beyond the
# calibration's extremes would saturate (measured: on 21 calibration steps 0 bits gave 7e-2 on new data).
SAMPLE_PER_STEP = 512


@dataclass
class Sequence:
    """One calibration run of a GRU: x [T, N, C] (layout 0), lens [N] or None, h0 [D, N, H] or None."""
    x: np.ndarray
    lens: np.ndarray | None = None
    h0: np.ndarray | None = None


class Stats:
    """Exact min / max and a sample of the values of each quantity, per direction."""

    def __init__(self, d, seed=0):
        self.lo = [dict() for _ in range(d)]
        self.hi = [dict() for _ in range(d)]
        self.samples = [{n: [] for n in QUANTITIES} for _ in range(d)]
        self.rng = np.random.default_rng(seed)
        self._q = {}

    def update(self, k, values: dict) -> None:
        for name, v in values.items():
            v = np.asarray(v, np.float64).ravel()
            if v.size == 0:
                continue
            lo, hi = float(v.min()), float(v.max())
            self.lo[k][name] = min(lo, self.lo[k].get(name, lo))
            self.hi[k][name] = max(hi, self.hi[k].get(name, hi))
            if v.size > SAMPLE_PER_STEP:
                v = self.rng.choice(v, SAMPLE_PER_STEP, replace=False)
            self.samples[k][name].append(v)

    def ranges(self, k, levels: dict) -> gru_quant.Ranges:
        """Ranges of direction k with the quantile level of each quantity (0: exact min / max)."""
        r = gru_quant.Ranges()
        for name in QUANTITIES:
            if name not in self.lo[k]:
                continue
            lv = levels.get(name, 0.0)
            if lv <= 0:
                r.lo[name], r.hi[name] = self.lo[k][name], self.hi[k][name]
            else:
                if (k, name, lv) not in self._q:
                    v = np.concatenate(self.samples[k][name])
                    self._q[k, name, lv] = tuple(float(q) for q in np.quantile(v, [lv, 1 - lv]))
                r.lo[name], r.hi[name] = self._q[k, name, lv]
        return r


def gather(seqs, d, h):
    """All sequences as one padded batch: x [T, M, C], lens [M], h0 [D, M, H]."""
    t = max(s.x.shape[0] for s in seqs)
    xs, ls, hs = [], [], []
    for s in seqs:
        tt, n, c = s.x.shape
        x = np.zeros((t, n, c), np.float32)
        x[:tt] = s.x
        xs.append(x)
        ls.append(np.full(n, tt, np.int64) if s.lens is None else np.minimum(np.asarray(s.lens, np.int64), tt))
        hs.append(np.zeros((d, n, h), np.float32) if s.h0 is None else np.asarray(s.h0, np.float32))
    return np.concatenate(xs, 1), np.concatenate(ls), np.concatenate(hs, 1)


def eval_set(x, lens, h0, y_ref, direction, chunk, max_chunks):
    """(x [L, M, C], lens [M], h0 [D, M, H]) of the evaluation chunks (module docstring)."""
    t, n, c = x.shape
    if direction == "forward":
        starts = [(i, t0) for i in range(n) for t0 in range(0, int(lens[i]), chunk)]
    else:
        starts = [(i, 0) for i in range(n) if lens[i] > 0]
    if len(starts) > max_chunks:
        starts = [starts[j] for j in np.linspace(0, len(starts) - 1, max_chunks).round().astype(int)]
    m = len(starts)
    ex = np.zeros((chunk, m, c), np.float32)
    el = np.zeros(m, np.int32)
    eh = np.zeros((h0.shape[0], m, h0.shape[2]), np.float32)
    for j, (i, t0) in enumerate(starts):
        ln = int(min(lens[i] - t0, chunk, t - t0))
        ex[:ln, j] = x[t0:t0 + ln, i]
        el[j] = ln
        eh[:, j] = h0[:, i] if t0 == 0 else y_ref[t0 - 1, :, i]
    return ex, el, eh


@dataclass
class Result:
    params: dict
    levels: list
    headroom: list
    weight_mse: bool
    error_start: float
    error: float
    trials: int
    headroom0: int = 0


def search(W, R, B, seqs, *, bits, hidden_size=None, direction="forward", clip=None, rounds=2, headroom=None,
           chunk=96, max_chunks=48, on_trial=None, weight_bits=None) -> Result:
    """Quantisation parameters minimising the integer GRU's Y error on the calibration sequences (docstring).
    ``rounds`` 0: no search, the start ([min, max] with ``headroom`` bits, default 0, for every quantity).
    ``weight_bits``: gru_quant.quant_params' (8 with bits 16: int8 weights, int16 arithmetic)."""
    W, R = np.asarray(W, np.float64), np.asarray(R, np.float64)
    d, h = W.shape[0], R.shape[-1]
    if not seqs:
        raise ValueError("calibration: no sequences")
    stats = Stats(d)
    x, lens, h0 = gather(seqs, d, h)
    kw = dict(hidden_size=hidden_size, direction=direction, linear_before_reset=1, clip=clip)
    y_ref = gru_float.gru(x, W, R, B, lens, h0, trace=stats.update, **kw)[0]
    ex, el, eh = eval_set(x, lens, h0, y_ref, direction, chunk, max_chunks)
    ref = gru_float.gru(ex, W, R, B, el, eh, **kw)[0]
    den = float(np.linalg.norm(ref)) or 1.0

    def params(levels, headroom, wmse):
        rg = [stats.ranges(k, levels[k]) for k in range(d)]
        return gru_quant.quant_params(W, R, B, rg, bits=bits, clip=clip, headroom=headroom, weight_mse=wmse,
                                        weight_bits=weight_bits)

    def err(p):
        try:
            y = gru_int.quant_gru(ex, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], el, eh, hidden_size=h,
                                  bits=bits, exponents=p["exponents"], zero_points=p["zero_points"],
                                  direction=direction)[0]
        except ValueError:
            return math.inf
        return float(np.linalg.norm(y - ref)) / den

    levels = [{n: 0.0 for n in QUANTITIES} for _ in range(d)]
    hr0 = START_HEADROOM[bits] if headroom is None else int(headroom)
    headroom = [{n: hr0 for n in QUANTITIES} for _ in range(d)]
    wmse = False
    best_p = params(levels, headroom, wmse)
    start = best = err(best_p)
    tried = {_key(best_p, wmse)}
    done = trials = 0

    def cands(k, name, rnd):
        if rnd == 0:
            lvs = LEVELS[bits] if name in CLIPPABLE else (0.0,)
            return [(lv, hr0 + hr) for lv in lvs for hr in HEADROOMS[bits]]
        lv, hr = levels[k][name], headroom[k][name]
        return [(lv, v) for v in (hr - 1, hr + 1) if v - hr0 >= min(HEADROOMS[bits])]

    total = (d * NQ * len(LEVELS[bits]) * len(HEADROOMS[bits]) + (rounds - 1) * d * NQ * 2 + rounds) if rounds else 0
    for rnd in range(rounds):
        for k in range(d):
            for name in QUANTITIES:
                for lv, hr in cands(k, name, rnd):
                    done += 1
                    tl = [dict(v) for v in levels]
                    th = [dict(v) for v in headroom]
                    tl[k][name], th[k][name] = lv, hr
                    p = params(tl, th, wmse)
                    key = _key(p, wmse)
                    if key in tried:
                        continue
                    tried.add(key)
                    if on_trial is not None:
                        on_trial(done, total, best)
                    trials += 1
                    v = err(p)
                    if v < best * (1 - 1e-3):
                        levels, headroom, best, best_p = tl, th, v, p
        done += 1
        p = params(levels, headroom, not wmse)
        if _key(p, not wmse) not in tried:
            tried.add(_key(p, not wmse))
            trials += 1
            v = err(p)
            if v < best * (1 - 1e-3):
                wmse, best, best_p = not wmse, v, p
    return Result(best_p, levels, headroom, wmse, start, best, trials, hr0)


def _key(p, wmse):
    return tuple(p["exponents"]), tuple(p["zero_points"]), wmse


def describe(res: Result) -> str:
    """The choices that differ from the start ([min, max], 0 bits headroom), e.g. 'z_pre q1e-04 +1'."""
    parts = []
    for k, (lv, hd) in enumerate(zip(res.levels, res.headroom)):
        for n in QUANTITIES:
            if lv[n] or hd[n] != res.headroom0:
                tag = (f" q{lv[n]:.0e}" if lv[n] else "") + (f" {hd[n] - res.headroom0:+d}" if hd[n] != res.headroom0 else "")
                parts.append(f"{n}{'' if len(res.levels) == 1 else f'[{k}]'}{tag}")
    if res.weight_mse:
        parts.append("weights mse")
    return ", ".join(parts)

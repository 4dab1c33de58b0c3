"""Cut-point search for FPLUT tables (offline; the resulting tables ship in ``fplut_tables.json``).

Problem
-------
An FPLUT table (see :mod:`onnx_lowbit.fplut`) is fixed by its 11 fp16 cut points c0 < ... < c10: the 259 values
are f sampled at fixed positions inside the intervals.  We choose the cut points that minimise the maximum
relative error over all finite fp16 inputs, measured exactly as :func:`onnx_lowbit.fplut.error_stats` does
(``|y - f(x)| / max(|f(x)|, 2^-14)``, y from the bit-exact ``evaluate_fp16`` semantics, f in float64), ties
broken on the maximum absolute error, then on the number of correctly rounded outputs.  The one deliberate difference: the search compares against f clipped to
the fp16 range (+-65504), because inputs whose f(x) overflows fp16 (only ``exp``, x > ~11.09) have an error that
no table can avoid; for every other function the two measures are identical.

Decomposition
-------------
Because evaluation first rounds x to fp16 and every fp16 input lands in exactly one piece, the maximum error is
the maximum over 12 independent pieces, and each piece depends on at most two cut points:

* the left tail  x < c0           -> y = T[0] = f(c0): depends on c0 only;
* interval 0      [c0, c1)        -> one linear segment f(c0)..f(c1);
* intervals 1..8  [ci, ci+1)      -> 32 uniform segments, samples f(ci + k (ci+1 - ci)/32);
* interval 9      [c9, c10]       -> one linear segment f(c9)..f(c10);
* the right tail  x > c10         -> y = T[258] = f(c10): depends on c10 only.

So ``E(a, b, n)`` -- the (max rel, max abs, inexact count) of an ``n``-segment interval from a to b over the fp16 inputs
inside it, computed with exactly the float32 / fp16 rounding steps of ``evaluate_fp16`` -- is evaluated once per
(a, b, n) and cached.  Cut points are handled as indices into the sorted array of the 63,487 distinct finite
fp16 values, so every candidate is fp16-representable by construction.

Method
------
Stage 1 -- least max_rel:

1. *Bisection on the error bound with a greedy feasibility check* (global structure).  For a bound eps the
   greedy takes c0 = the largest fp16 value whose left tail stays within eps (binary search), then for the
   interval types 1, 32 x 8 in turn the furthest right end b with E(c_i, b) <= eps (galloping + binary search
   over the fp16 grid), and finally c10 = the smallest value whose right tail is within eps, which must be
   reachable from c9 with one linear segment.  The mirror greedy (right to left, c10 first) runs too and the
   better cut set is kept.  If piece errors were monotone in the interval length this "furthest reach" greedy
   would be exact (the classic minimax-partition argument); on the fp16 grid they are only nearly monotone
   (sample rounding makes them jitter), so it yields a near-optimum for the next step.  The bound is bracketed
   by doubling from 1e-4 and bisected geometrically to a relative 1e-4 (~20 greedy runs, ~10 x 17 interval
   evaluations each).  This step is what picks c0 / c10: e.g. c0 where f (silu, exp, sigmoid) has decayed so
   far that the constant T[0] is within the bound, c10 = 65504 for the functions that grow like x, c10 where
   exp reaches the fp16 maximum, c10 where sigmoid / tanh / erf round to 1.
2. *Window DP* (large-neighbourhood search).  For a lattice of candidates idx_k + d * step, |d| <= half, around
   every current cut point, a bottleneck dynamic programme over the 11 layers finds the jointly best choice of
   all cut points in the lattice exactly (cost = componentwise max of the pieces' (rel, abs), compared
   lexicographically).  The lattices run coarse to fine (steps 256, 64, 16, 4, 1 fp16 steps) and then odd
   steps (3, 7, 5) interleaved with step 1, each repeated while it improves; the whole schedule is cycled until
   a cycle brings nothing (at most 4 cycles).  This exploits the rounding jitter that the greedy cannot: it
   typically lowers max_rel a further 10-20 %.
3. *Coordinate descent* on the exact fp16 grid: each cut point alone is moved by +-1, 2, 3, 4, 5, 8, ... fp16
   steps while the key (max rel, max abs, piece rel errors sorted descending) decreases; the last component lets
   slack flow towards the bottleneck piece.

Stage 2 -- tie-break on max_abs: with the relative bound fixed at stage 1's optimum (or at a user's
``rel_budget``), the same machinery minimises max_abs (greedy bisection on the absolute bound, window DP and
coordinate descent on the key (rel-budget violation, max abs, max rel, ...)), starting from stage 1's cut points.

Stage 3 -- last tie-break: with both bounds fixed, window DP and coordinate descent maximise the number of
correctly rounded outputs (a per-piece count, so the DP adds it up instead of taking the maximum).

Finally the cut points are checked against the reference: :func:`fplut.error_stats` must report the same
max_rel as the piece decomposition (for every function whose f stays within the fp16 range).

Interval errors are evaluated in batches by a Numba kernel (the numpy steps of ``evaluate_fp16`` transcribed,
float32 arithmetic, round-to-nearest-even to fp16 on the bits; pure numpy fallback ``errors_numpy`` gives
identical figures; both in fplut_interval_errors.py).  The full search of the 12 functions takes about 75 s of CPU, ~40 s wall with the default
``--jobs 2``.

Usage::

    python -m onnx_lowbit.fplut_search [--write] [--jobs N] [--rel-budget B] [FN ...]

prints the figures of the searched tables (and of the seed SiLU table, for comparison); ``--write`` rewrites
``onnx_lowbit/fplut_tables.json`` (functions not named keep their shipped entry).  ``--rel-budget B`` switches
the objective to "least max_abs with max_rel <= B" (a trade-off the shipped tables do not make).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from . import fplut, halfbits
from . import fplut_interval_errors as interval_errors
from .unary import FUNCTIONS, evaluate

FUNCTION_NAMES = ["silu", "sigmoid", "tanh", "gelu", "gelu_tanh", "exp", "softplus", "elu", "hardswish", "mish",
                  "erf", "quick_gelu"]
SEED_TABLES = {
    "silu_seed": ("silu", [-20.359375, -17.109375, -8.3671875, -1.9755859375, -0.255615234375,
                           -0.007244110107421875, 0.0072174072265625, 0.228515625, 1.58203125, 10.46875, 65504.0]),
}
TABLES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fplut_tables.json")

_TINY = 2.0 ** -14          # relative-error floor of error_stats
_MAX = halfbits.FP16_MAX
_INNER = 32                  # segments of intervals 1..8
_TYPES = [1] + [_INNER] * 8 + [1]
# window-DP lattices (step in fp16 steps, half width in lattice points) of one refine cycle
_SCHEDULE = ((256, 12), (64, 12), (16, 12), (4, 12), (1, 24), (3, 12), (1, 24), (7, 12), (2, 12), (1, 24),
             (5, 12), (1, 24))
_CYCLES = 4
_MOVES = sorted({int(round(1.5 ** k)) for k in range(0, 21)} | {1, 2, 3, 4})   # 1 .. ~3300 fp16 steps


class _Problem:
    """One function on the grid of distinct finite fp16 values, with cached piece errors."""

    def __init__(self, function: str):
        if function not in FUNCTIONS:
            raise KeyError(f"unknown FPLUT function {function!r}; known: {', '.join(sorted(FUNCTIONS))}")
        self.function = function
        self.mode = ("rel",)          # objective, see key()
        x = np.unique(halfbits.finite_fp16().astype(np.float64)) + 0.0  # ascending; -0 merged into +0
        self.x64 = x
        self.x32 = x.astype(np.float32)
        self.n = x.size
        ref = evaluate(function, x)
        ref = np.where(np.isnan(ref), 0.0, ref)
        self.ref = np.clip(ref, -_MAX, _MAX)                            # best representable target
        self.den = np.maximum(np.abs(self.ref), _TINY)
        self.ref16 = self.ref.astype(np.float16).astype(np.float64)    # correctly rounded output
        self._cache: dict = {}
        self.errors = interval_errors.errors

    # ---- pieces --------------------------------------------------------------------------------------------
    def _t16(self, pts: np.ndarray) -> np.ndarray:
        return np.clip(evaluate(self.function, pts), -_MAX, _MAX).astype(np.float16).astype(np.float32)

    def intervals(self, pairs, nseg: int, closed: bool = False) -> None:
        """Evaluate (and cache) the errors of many (ia, ib) intervals at once."""
        todo = [(a, b) for a, b in dict.fromkeys(pairs) if (a, b, nseg, closed) not in self._cache]
        if not todo:
            return
        ia = np.array([a for a, _ in todo], dtype=np.int64)
        ib = np.array([b for _, b in todo], dtype=np.int64)
        a, b = self.x64[ia][:, None], self.x64[ib][:, None]
        pts = a + np.arange(nseg + 1, dtype=np.float64)[None, :] * (b - a) / float(nseg)   # = fplut.sample_points
        t = self._t16(pts)
        s = (float(nseg) / (b[:, 0] - a[:, 0])).astype(np.float32)                         # = fplut.scales
        out = self.errors(self.x32, self.ref, self.den, self.ref16, ia, ib, t, s, nseg, closed)
        for (pa, pb), (r, e, c) in zip(todo, out.tolist()):
            self._cache[(pa, pb, nseg, closed)] = (r, e, int(c))

    def interval(self, ia: int, ib: int, nseg: int, closed: bool = False):
        """(max rel, max abs, inexact count) over fp16 x in [x[ia], x[ib]) ([.., x[ib]] if closed), nseg segments."""
        key = (ia, ib, nseg, closed)
        r = self._cache.get(key)
        if r is None:
            self.intervals([(ia, ib)], nseg, closed)
            r = self._cache[key]
        return r

    def tail(self, i: int, left: bool):
        """(max rel, max abs, inexact count) of the constant T = f(x[i]) over x < x[i] (left) or x > x[i] (right)."""
        key = ("L" if left else "R", i)
        r = self._cache.get(key)
        if r is not None:
            return r
        sl = slice(0, i) if left else slice(i + 1, self.n)
        if (i == 0 and left) or (i == self.n - 1 and not left):
            r = (0.0, 0.0, 0)
        else:
            t = float(self._t16(self.x64[i:i + 1])[0])
            err = np.abs(t - self.ref[sl])
            r = (float((err / self.den[sl]).max()), float(err.max()), int(np.count_nonzero(t != self.ref16[sl])))
        self._cache[key] = r
        return r

    def pieces(self, idx) -> list:
        """The 12 piece errors of a cut-point index list (left tail, intervals 0..9, right tail)."""
        out = [self.tail(idx[0], True)]
        for k in range(10):
            out.append(self.interval(idx[k], idx[k + 1], _TYPES[k], closed=(k == 9)))
        out.append(self.tail(idx[10], False))
        return out

    # ---- greedy feasibility --------------------------------------------------------------------------------
    @staticmethod
    def _last_true(pred, lo: int, hi: int) -> int:
        """Largest i in [lo, hi] with pred(i), assuming pred(lo) and pred true on a prefix; galloping."""
        step, good = 1, lo
        while good + step <= hi and pred(good + step):
            good += step
            step *= 2
        bad = min(good + step, hi + 1)
        while bad - good > 1:
            mid = (good + bad) // 2
            if pred(mid):
                good = mid
            else:
                bad = mid
        return good

    @staticmethod
    def _first_true(pred, lo: int, hi: int) -> int:
        """Smallest i in [lo, hi] with pred(i), assuming pred(hi) and pred true on a suffix; galloping."""
        step, good = 1, hi
        while good - step >= lo and pred(good - step):
            good -= step
            step *= 2
        bad = max(good - step, lo - 1)
        while good - bad > 1:
            mid = (good + bad) // 2
            if pred(mid):
                good = mid
            else:
                bad = mid
        return good

    def _greedy_lr(self, ok):
        n = self.n
        # c0: largest value whose left tail is within eps (binary search; pred is true at index 0)
        lo, hi = 0, n - 11
        while hi - lo > 0:
            mid = (lo + hi + 1) // 2
            if ok(self.tail(mid, True)):
                lo = mid
            else:
                hi = mid - 1
        idx = [lo]
        for k in range(9):
            a, nseg = idx[-1], _TYPES[k]
            room = n - 1 - (9 - k)                       # leave room for the remaining cut points
            if a + 1 > room or not ok(self.interval(a, a + 1, nseg)):
                return None
            idx.append(self._last_true(lambda b: ok(self.interval(a, b, nseg)), a + 1, room))
        c9 = idx[-1]
        c10 = self._first_true(lambda i: ok(self.tail(i, False)), c9 + 1, n - 1)
        if not ok(self.tail(c10, False)) or not ok(self.interval(c9, c10, 1, closed=True)):
            return None
        return idx + [c10]

    def _greedy_rl(self, ok):
        n = self.n
        lo, hi = 10, n - 1
        while hi - lo > 0:                               # c10: smallest value whose right tail is within eps
            mid = (lo + hi) // 2
            if ok(self.tail(mid, False)):
                hi = mid
            else:
                lo = mid + 1
        idx = [lo]
        for k in range(9, 0, -1):
            b, nseg, closed = idx[-1], _TYPES[k], k == 9
            floor_ = k                                   # leave room for c0..c_{k-1}
            if b - 1 < floor_ or not ok(self.interval(b - 1, b, nseg, closed)):
                return None
            idx.append(self._first_true(lambda a: ok(self.interval(a, b, nseg, closed)), floor_, b - 1))
        c1 = idx[-1]
        c0 = self._last_true(lambda i: ok(self.tail(i, True)), 0, c1 - 1)
        if not ok(self.tail(c0, True)) or not ok(self.interval(c0, c1, 1)):
            return None
        return (idx + [c0])[::-1]

    def feasible(self, bound):
        """A cut-point index list whose every piece meets ``bound`` = (max rel, max abs), or None."""
        er, ea = bound

        def ok(r):
            return r[0] <= er and r[1] <= ea
        best = None
        for g in (self._greedy_lr, self._greedy_rl):
            idx = g(ok)
            if idx is not None and (best is None or self.key(idx) < self.key(best)):
                best = idx
        return best

    # ---- objective and polish ------------------------------------------------------------------------------
    def key(self, idx):
        """The lexicographic objective of a cut-point index list under ``self.mode``:

        ("rel",)                  (max rel, max abs, piece rel errors sorted descending)
        ("abs", R)                (max(max rel - R, 0), max abs, max rel, sorted piece rel errors)
        ("exact", R, A)           (max(max rel - R, 0), max(max abs - A, 0), inexact outputs, max rel, max abs)
        """
        p = self.pieces(idx)
        rel = sorted((q[0] for q in p), reverse=True)
        ab = max(q[1] for q in p)
        if self.mode[0] == "rel":
            return (rel[0], ab, rel)
        if self.mode[0] == "abs":
            return (max(rel[0] - self.mode[1], 0.0), ab, rel[0], rel)
        return (max(rel[0] - self.mode[1], 0.0), max(ab - self.mode[2], 0.0), sum(q[2] for q in p), rel[0], ab)

    def _cost(self, r):
        """A piece's cost tuple for the window DP; costs combine with _combine and compare lexicographically."""
        if self.mode[0] == "rel":
            return (r[0], r[1])
        if self.mode[0] == "abs":
            return (max(r[0] - self.mode[1], 0.0), r[1], r[0])
        return (max(r[0] - self.mode[1], 0.0), max(r[1] - self.mode[2], 0.0), r[2])

    def _combine(self, u, v):
        """Componentwise max (bottleneck terms); the inexact-output count of the "exact" mode adds up."""
        if self.mode[0] == "exact":
            return (max(u[0], v[0]), max(u[1], v[1]), u[2] + v[2])
        return tuple(max(p, q) for p, q in zip(u, v))

    def window_dp(self, idx, step: int, half: int):
        """Exact bottleneck DP over the lattice idx[k] + d * step, |d| <= half, for all 11 cut points jointly."""
        n = self.n
        cands = [sorted({min(max(c + d * step, 0), n - 1) for d in range(-half, half + 1)}) for c in idx]
        mx = self._combine
        layer = {c: (self._cost(self.tail(c, True)), None) for c in cands[0]}
        back = []
        for k in range(10):
            nxt = {}
            self.intervals([(a, b) for a in layer for b in cands[k + 1] if a < b], _TYPES[k], k == 9)
            for b in cands[k + 1]:
                best = None
                for a, (ca, _) in layer.items():
                    if a >= b:
                        continue
                    cb = mx(ca, self._cost(self.interval(a, b, _TYPES[k], closed=(k == 9))))
                    if k == 9:
                        cb = mx(cb, self._cost(self.tail(b, False)))
                    if best is None or cb < best[0]:
                        best = (cb, a)
                if best is not None:
                    nxt[b] = best
            back.append(nxt)
            layer = nxt
        end = min(layer, key=lambda c: layer[c][0])
        out = [end]
        for k in range(9, -1, -1):
            out.append(back[k][out[-1]][1])
        return out[::-1]

    def refine(self, idx, schedule=_SCHEDULE, cycles: int = _CYCLES):
        """Large-neighbourhood search: window DPs over the (step, half) lattices of ``schedule``, each repeated
        while it improves the key; the schedule is cycled until a whole cycle brings nothing (at most
        ``cycles`` times).  Odd steps (3, 5, 7) reach fp16 neighbours that the power-of-two lattices miss."""
        idx = list(idx)
        for _ in range(cycles):
            start = self.key(idx)
            for step, half in schedule:
                for _ in range(20):
                    new = self.window_dp(idx, step, half)
                    if self.key(new) < self.key(idx):
                        idx = new
                    else:
                        break
            if not self.key(idx) < start:
                break
        return idx

    def polish(self, idx, max_passes: int = 60):
        idx = list(idx)
        best = self.key(idx)
        for _ in range(max_passes):
            improved = False
            for k in range(11):
                lo = idx[k - 1] + 1 if k > 0 else 0
                hi = idx[k + 1] - 1 if k < 10 else self.n - 1
                for d in _MOVES:
                    for cand in (idx[k] - d, idx[k] + d):
                        if lo <= cand <= hi:
                            trial = idx[:k] + [cand] + idx[k + 1:]
                            kt = self.key(trial)
                            if kt < best:
                                idx, best, improved = trial, kt, True
            if not improved:
                break
        return idx

    def cut_points(self, idx) -> list:
        return [float(self.x64[i]) for i in idx]


def _bisect(feasible, measure, start: float):
    """Smallest bound b (to a relative 1e-4) with feasible(b) not None; returns the solution found there.

    ``measure(solution)`` is the bound a solution actually achieves (the bisection jumps down to it)."""
    hi, lo = start, 0.0
    best = feasible(hi)
    while best is None:
        lo, hi = hi, hi * 2
        if hi > 1e300:
            return None
        best = feasible(hi)
    hi = measure(best)
    while lo == 0.0 and hi > 1e-12:                          # bracket from below
        r = feasible(hi / 2)
        if r is None:
            lo = hi / 2
        else:
            hi, best = measure(r), r
    while lo > 0 and hi / lo > 1 + 1e-4:
        mid = (lo * hi) ** 0.5
        r = feasible(mid)
        if r is None:
            lo = mid
        else:
            hi, best = measure(r), r                      # jump to the bound actually achieved
    return best


def _search_indices(prob: _Problem, rel_budget: float | None = None, exact_stage: bool = True):
    """Stage 1: least max_rel (bisection + greedy, window-DP refinement, polish).  Stage 2: least max_abs among
    the tables whose max_rel stays within stage 1's optimum (the tie-break) or within ``rel_budget``.  Stage 3:
    most correctly rounded outputs among the tables within both stage-2 figures."""
    inf = float("inf")
    prob.mode = ("rel",)
    start = _bisect(lambda e: prob.feasible((e, inf)), lambda idx: prob.key(idx)[0], 1e-4)
    if start is None:
        raise RuntimeError(f"{prob.function}: no feasible cut points found")
    idx = prob.polish(prob.refine(start))
    best_rel = prob.key(idx)[0]
    if rel_budget is not None and best_rel > rel_budget:
        raise RuntimeError(f"{prob.function}: max_rel <= {rel_budget} is out of reach (best found {best_rel:.4g})")
    rb = best_rel if rel_budget is None else rel_budget
    prob.mode = ("abs", rb)
    starts = [idx]
    greedy = _bisect(lambda e: prob.feasible((rb, e)), lambda i: prob.key(i)[1], 1e-6)
    if greedy is not None:
        starts.append(greedy)
    idx = prob.polish(prob.refine(min(starts, key=prob.key)))
    if exact_stage:
        prob.mode = ("exact", rb, max(q[1] for q in prob.pieces(idx)))
        idx = prob.polish(prob.refine(idx))
    prob.mode = ("rel",)
    return idx


def search(function: str, rel_budget: float | None = None) -> list:
    """The 11 fp16 cut points (as floats) that the search finds for ``function``.

    By default they minimise max_rel (ties: max_abs).  With ``rel_budget`` they instead minimise max_abs among
    the tables whose max_rel stays within the budget (ties: max_rel)."""
    prob = _Problem(function)
    idx = _search_indices(prob, rel_budget)
    cuts = prob.cut_points(idx)
    fplut.validate(cuts)
    if function != "exp":  # exp: error_stats also counts inputs whose exp overflows fp16, which no table can fix
        got = fplut.error_stats(function, cuts)["max_rel"]
        want = max(q[0] for q in prob.pieces(idx))
        if not np.isclose(got, want, rtol=1e-12, atol=0):
            raise AssertionError(f"{function}: piece decomposition {want!r} != error_stats {got!r}")
    return cuts


def representable_max_rel(function: str, cut_points) -> float:
    """max_rel against f clipped to +-65504 (the search objective; equals error_stats' max_rel unless f overflows)."""
    prob = _Problem(function)
    idx = [int(np.searchsorted(prob.x64, c)) for c in cut_points]
    return prob.key(idx)[0]


def table_entry(function: str, cut_points, objective: str = "") -> dict:
    """The shipped JSON entry of a table: cut points, fp16 values, exhaustive figures."""
    values = fplut.build_values(function, cut_points)
    st = fplut.error_stats(function, cut_points, values)
    return {
        "function": function,
        "objective": objective,
        "cut_points": [float(c) for c in cut_points],
        "values": [float(v) for v in values.astype(np.float64)],
        "stats": {k: st[k] for k in ("max_abs", "max_rel", "exact_pct", "within_1ulp_pct")},
        "argmax_rel": st["argmax_rel"],
        "max_rel_representable": representable_max_rel(function, cut_points),
    }


def _row(name, e, secs=None):
    s, c = e["stats"], e["cut_points"]
    t = "" if secs is None else f"{secs:7.2f}"
    return (f"{name:<11} {s['max_abs']:10.3e} {s['max_rel']:10.3e} {e['max_rel_representable']:10.3e} "
            f"{s['exact_pct']:7.2f} {s['within_1ulp_pct']:7.2f}  [{c[0]:g}, {c[-1]:g}] {t}")


def _objective(rel_budget):
    if rel_budget is None:
        return "min max_rel, then min max_abs, then max exact"
    return f"min max_abs subject to max_rel <= {rel_budget:g}, then max exact"


def _timed_search(args):
    function, rel_budget = args
    t0 = time.perf_counter()
    cuts = search(function, rel_budget)
    return cuts, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onnx_lowbit.fplut_search",
                                 description="Search FPLUT cut points (see the module docstring for the method).")
    ap.add_argument("--write", action="store_true", help=f"rewrite {TABLES_PATH}")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--rel-budget", type=float, default=None,
                    help="minimise max_abs subject to max_rel <= this, instead of minimising max_rel")
    ap.add_argument("functions", nargs="*", metavar="FN", help=f"default: all ({', '.join(FUNCTION_NAMES)})")
    args = ap.parse_args(argv)
    names = args.functions or FUNCTION_NAMES
    for n in names:
        if n not in FUNCTIONS:
            ap.error(f"unknown function {n!r}; known: {', '.join(FUNCTION_NAMES)}")
    print(f"{'name':<11} {'max_abs':>10} {'max_rel':>10} {'rel(clip)':>10} {'exact%':>7} {'1ulp%':>7}  "
          f"[c0, c10]  seconds")
    t_all = time.perf_counter()
    tasks = [(n, args.rel_budget) for n in names]
    if args.jobs > 1 and len(tasks) > 1:
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
            results = list(pool.map(_timed_search, tasks))
    else:
        results = [_timed_search(t) for t in tasks]
    entries = {}
    for n, (cuts, dt) in zip(names, results):
        entries[n] = table_entry(n, cuts, _objective(args.rel_budget))
        print(_row(n, entries[n], dt), flush=True)
    wall = time.perf_counter() - t_all
    for name, (fn, cuts) in SEED_TABLES.items():
        entries[name] = table_entry(fn, cuts, "seed design (dynamic programming), for comparison")
        print(_row(name, entries[name]))
    print(f"search wall time {wall:.1f} s ({args.jobs} job(s)); per-function seconds are CPU-bound worker times")
    if args.write:
        old = {}
        if os.path.exists(TABLES_PATH):
            with open(TABLES_PATH) as f:
                old = json.load(f)
        old.update(entries)
        order = FUNCTION_NAMES + sorted(SEED_TABLES)
        order += sorted(set(old) - set(order))
        with open(TABLES_PATH, "w") as f:
            json.dump({k: old[k] for k in order if k in old}, f, indent=1)
            f.write("\n")
        print(f"wrote {TABLES_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

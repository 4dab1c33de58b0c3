"""Error plots of the shipped FPLUT tables (matplotlib, Agg backend, imported only when a plot is drawn).

    python -m onnx_lowbit.fplut_plot silu /tmp/silu.png
"""
from __future__ import annotations

import sys

import numpy as np

from . import fplut, fplut_tables, halfbits
from .unary import evaluate


def error_curves(name: str):
    """x (every finite fp16 input in [c0, c10], ascending), absolute and relative error (error_stats' metric)."""
    table = fplut_tables.get_table(name)
    c = table.cut_points
    x = np.unique(halfbits.finite_fp16().astype(np.float64))
    x = x[(x >= c[0]) & (x <= c[-1])].astype(np.float16)
    y = fplut.evaluate_fp16(x, c, table.values).astype(np.float64)
    ref = evaluate(table.function, x)
    finite = np.isfinite(ref)
    ae = np.where(finite, np.abs(y - ref), 0.0)
    re = ae / np.maximum(np.abs(np.where(finite, ref, 1.0)), 2.0 ** -14)
    return x.astype(np.float64), ae, re


def _envelope(x, e, bins: int = 1200):
    """Per-bin maximum of e over ~bins groups of consecutive inputs (the readable outline of a dense curve)."""
    if x.size <= bins:
        return x, e
    edges = np.linspace(0, x.size, bins + 1).astype(np.int64)
    mx = np.maximum.reduceat(e, edges[:-1])
    mid = x[(edges[:-1] + edges[1:]) // 2]
    return mid, mx


def x_ticks(lo: float, hi: float, linthresh: float) -> list:
    """Major ticks of the symlog x axis over [lo, hi]: 0 and the powers of ten from 2 * linthresh outwards (both
    signs). matplotlib's own symlog locator also puts +-10^k inside the linear band around 0, where their labels
    ("-10^-3", "0", "10^-3") print over each other."""
    ticks = [0.0] if lo <= 0.0 <= hi else []
    k = int(np.ceil(np.log10(2 * linthresh)))
    while 10.0 ** k <= max(abs(lo), abs(hi)):
        ticks += [v for v in (-10.0 ** k, 10.0 ** k) if lo <= v <= hi]
        k += 1
    return sorted(ticks)


def plot_error(name: str, path) -> None:
    """Write a PNG of the absolute (top) and relative (bottom, log scale) error of table ``name`` vs x over all
    finite fp16 inputs in its range [c0, c10] (symlog x axis; dotted lines at the cut points)."""
    error_figure(name).savefig(path, format="png")


def error_figure(name: str):
    """The matplotlib Figure (Agg canvas) that plot_error writes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg   # Agg canvas, no pyplot: no global backend switch
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator

    table = fplut_tables.get_table(name)
    st = fplut_tables.stats(name)
    x, ae, re = error_curves(name)
    c = np.asarray(table.cut_points)
    # symlog: linear within +-linthresh, log outside; choose it so the interesting middle of the range is readable
    inner = np.abs(c[(c != 0)])
    linthresh = float(max(min(inner.min(), 1e-2), 2.0 ** -14)) if inner.size else 1e-2

    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_a, ax_r = fig.subplots(2, 1, sharex=True)
    xe, ae_env = _envelope(x, ae)
    _, re_env = _envelope(x, re)
    ax_a.plot(x, np.where(ae > 0, ae, np.nan), lw=0.3, color="tab:blue", alpha=0.35)
    ax_a.plot(xe, np.where(ae_env > 0, ae_env, np.nan), lw=0.9, color="tab:blue", label="max over neighbouring inputs")
    ax_a.set_yscale("log")
    ax_a.set_ylabel("absolute error |y - f(x)|")
    a_in = float(ae.max()) if ae.size else 0.0
    r_in = float(re.max()) if re.size else 0.0
    if st["max_abs"] <= 10 * a_in:
        ax_a.axhline(st["max_abs"], color="k", lw=0.6, ls="--", label=f"max_abs {st['max_abs']:.3g} (all inputs)")
    ax_r.plot(x, np.where(re > 0, re, np.nan), lw=0.3, color="tab:red", alpha=0.35)
    ax_r.plot(xe, np.where(re_env > 0, re_env, np.nan), lw=0.9, color="tab:red", label="max over neighbouring inputs")
    ax_r.set_yscale("log")
    ax_r.set_ylabel("relative error |y - f| / max(|f|, 2^-14)")
    if st["max_rel"] <= 10 * r_in:
        ax_r.axhline(st["max_rel"], color="k", lw=0.6, ls="--", label=f"max_rel {st['max_rel']:.3g} (all inputs)")
    ax_r.axhline(2.0 ** -11, color="gray", lw=0.8, ls="-.", label="2^-11 (fp16 half-ULP at 1.0)")
    top = max(st["max_rel"] if st["max_rel"] <= 10 * r_in else 0.0, r_in, 2.0 ** -11)
    ax_r.set_ylim(top * 1e-5, top * 2.5)
    if a_in > 0:
        atop = max(a_in, st["max_abs"] if st["max_abs"] <= 10 * a_in else 0.0)
        ax_a.set_ylim(max(float(ae[ae > 0].min()), atop * 1e-8), atop * 2.5)
    for ax in (ax_a, ax_r):
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_xlim(c[0], c[-1])
        ax.xaxis.set_major_locator(FixedLocator(x_ticks(float(c[0]), float(c[-1]), linthresh)))
        for ci in c:
            ax.axvline(ci, color="gray", lw=0.5, ls=":")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8, framealpha=0.8)
    ax_r.set_xlabel(f"x: all finite fp16 inputs in [c0, c10] (symlog axis, linear within +-{linthresh:.3g}); "
                    "dotted lines: cut points")
    fig.suptitle(f"FPLUT {name} ({table.function}), range [{c[0]:g}, {c[-1]:g}]\n"
                 f"max_abs {st['max_abs']:.3g}   max_rel {st['max_rel']:.3g}   exact {st['exact_pct']:.2f}%   "
                 f"within 1 ULP {st['within_1ulp_pct']:.2f}%  (over all 63,488 finite fp16 inputs)\n"
                 f"inside [c0, c10]: max_abs {a_in:.3g}   max_rel {r_in:.3g}", fontsize=11)
    return fig


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m onnx_lowbit.fplut_plot NAME PATH.png")
    plot_error(sys.argv[1], sys.argv[2])

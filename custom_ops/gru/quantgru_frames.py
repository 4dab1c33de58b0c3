"""QuantGRU's streaming frames on onnxruntime's intra-op pool: calls of one step (T = 1), batch 1, W and R packed
once per node (VNNI hosts), from H = MIN_H (``pays``).

A frame's work split into 2 D independent items, one per (direction, half of the hidden units): each item
quantises the frame's input and initial state itself (a few hundred values), multiplies the rows of W and R of
its half's units in every gate (quantgru_tasks' block products), rescales them, runs its units' cell and writes
their Y and Y_h. No item waits for another: the only hand-over is onnxruntime's own join at the end of its
ParallelFor. The same products, rescales and cell as the packed path (quantgru_steps._run_packed), so the same
bytes. Each item checks the call's values (check_values) and declines the call when they fail: nothing is
written then, and Python names the problem.

Measured (benchmarks/gru_cpu.py --one-task, 2 cores, C = 257, in rounds, us per frame, this entry / the
single-task entry / onnxruntime's float GRU): H = 256 int8 16 / 18 / 26, int16 19 / 24; H = 400 int8 22 / 27 / 35,
int16 29 / 38; H = 600 int8 34 / 41 / 55, int16 48 / 60; H = 128: level with the single-task entry (13 / 12 int8,
14 / 14 int16), hence MIN_H. BENCHMARKS.md, "QuantGRU on the CPU".
"""
from __future__ import annotations

import numpy as np
from numba import njit

from onnx_lowbit.gru_int import NQ

from ..device import native
from . import quantgru_steps as q
from .quantgru_steps import IH, IRH, IWX, IX


def pays(t, h):
    """Whether a call of t steps with hidden size h takes this entry: one step, from H = MIN_H."""
    return t == 1 and h >= MIN_H


MIN_H = 256  # below, a frame stays on the single-task entry: at H = 128 this entry was level with it (module doc)


def items(d):
    """The entry's work items for d directions (run_native's ``items``, one task each)."""
    return 2 * d


@njit(cache=True, inline="always")
def _rescaled(acc, base, shift, off, rs, zp, lo, hi, h, u0, u1, out):
    """out[g hh + j] = the rescaled sum of row g H + u0 + j, read at acc[base[g] + row] (quantgru_steps.half_blocks;
    the packed path's rescale on the half's rows, _rescale_by; shift per row of all 3H rows, rs their row sums, off
    the activations' offset)."""
    hh = u1 - u0
    for g in range(3):   # views first: the loop over range(hh) vectorises (quantgru_steps.rescale_rows)
        r0, a_ = g * h + u0, base[g] + g * h + u0
        sv, rv, av, ov = shift[r0:r0 + hh], rs[r0:r0 + hh], acc[a_:a_ + hh], out[g * hh:(g + 1) * hh]
        for j in range(hh):
            ov[j] = q._rescale_by(av[j] - off * rv[j], sv[j], zp, lo, hi)


def _run_frame(p, begin, end, qdt, adt, ldt):
    """Items begin..end-1 of a frame (item i: direction i // 2, half i % 2); returns 0, or native.DECLINED when the
    call's values fail the checks (nothing written)."""
    c, h, d = native.arg(p, 14), native.arg(p, 15), native.arg(p, 16)
    ll, bits, itemsize = native.arg(p, 23), native.arg(p, 18), native.arg(p, 24)
    h3 = 3 * h
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    split = bits == 16
    bias = lo if itemsize == 1 else 0
    sh = 6 if split else 0
    given = np.int64(native.vector(p[6], 1, np.int32)[0]) if p[6] else 1   # sequence_lens, batch 1
    ch_all = native.array(p[4], (d, 4, h3), np.int32)
    e_all = native.array(p[10], (d, NQ), np.int64)
    z_all = native.array(p[11], (d, NQ), np.int64)
    if not q.check_values(ch_all, e_all, np.full(1, given, np.int64), 1):
        return native.DECLINED
    nbp, kgw, kgr = q._packed_dims(h, c, itemsize)
    g_ = 4 // itemsize
    kpw, kpr = kgw * g_, kgr * g_
    x = native.array(p[0], (1, c), np.float32)          # [1, 1, C]
    y_all = native.vector(p[8], d * h, np.float32)      # [1, D, 1, H] (layout 0) / [1, 1, D, H] (layout 1)
    yh_all = native.vector(p[9], d * h, np.float32)     # [D, 1, H] / [1, D, H]
    b_all = native.array(p[3], (d, 2 * h3), np.int32)
    lut_all = native.array(p[5], (d, 3, ll), ldt)
    xa0 = np.zeros((1, kpw), adt)
    xa1 = np.zeros((1, kpw if split else 1), adt)
    ha0, ha1 = np.zeros(kpr, adt), np.zeros(kpr if split else 1, adt)
    nl = q.list_capacity(h)
    o0 = np.empty(nl * 16, np.int32)
    o1 = np.empty(nl * 16 if split else 1, np.int32)
    acc = np.empty(nl * 16, np.int64)
    blk, base = np.empty(nl, np.int64), np.empty(3, np.int64)
    shift = np.empty(h3, np.int64)
    gw, gr = np.empty(h3, np.int64), np.empty(h3, np.int64)
    gw32 = np.empty(h3, np.int32)
    pz = np.empty(5 * h, np.int64)
    luts = np.empty((3, ll), np.int32)
    for it in range(begin, end):
        k, half = it // 2, it % 2
        u0 = 0 if half == 0 else (h // 2) // 16 * 16
        u1 = (h // 2) // 16 * 16 if half == 0 else h
        hh = u1 - u0
        e, z = e_all[k], z_all[k]
        ch = ch_all[k]
        s_ = 28 + 4 * k
        wp = native.vector(p[s_], nbp * kgw * 64 // itemsize, qdt)
        rp = native.vector(p[s_ + 1], nbp * kgr * 64 // itemsize, qdt)
        rsw, rsr = native.vector(p[s_ + 2], h3, np.int64), native.vector(p[s_ + 3], h3, np.int64)
        h0 = np.zeros((0, 1), np.float32)
        if p[7]:
            h0 = native.array(p[7], (d, 1, h), np.float32)[k]
        qh = q._initial_state(h0, e, z, 1, h, lo, hi)[0]
        if given <= 0:   # no step: Y and Y_h zero for these units
            for j in range(u0, u1):
                y_all[k * h + j] = np.float32(0.0)
                yh_all[k * h + j] = np.float32(0.0)
            continue
        # the input projection of the half's rows
        nb = q.half_blocks(h, u0, u1, blk, base)
        q.quantize_acts(x, e[IX], z[IX], lo, hi, bias, split, kpw, xa0, xa1 if split else xa0)
        q.listed_products(wp, blk[:nb], xa0[0], xa1[0] if split else xa0[0], kgw, o0, o1 if split else o0, acc,
                          split)
        for cc in range(h3):
            shift[cc] = np.int64(ch[0, cc]) + e[IX] - e[IWX]
        _rescaled(acc, base, shift, z[IX] - bias, rsw, z[IWX], lo, hi, h, u0, u1, gw)
        for i in range(3 * hh):
            gw32[i] = np.int32(gw[i])
        # the recurrent product of the half's rows
        for j in range(h):
            q._act(qh[j], bias, split, ha0, ha1 if split else ha0, j)
        q.listed_products(rp, blk[:nb], ha0, ha1 if split else ha0, kgr, o0, o1 if split else o0, acc, split)
        for cc in range(h3):
            shift[cc] = np.int64(ch[1, cc]) + e[IH] - e[IRH]
        _rescaled(acc, base, shift, z[IH] - bias, rsr, z[IRH], lo, hi, h, u0, u1, gr)
        # the cell of the half's units
        bt = q.bias_terms(b_all[k], ch, e, z, h)
        tr = q.shift_triples(e)
        for g in range(3):
            for i in range(ll):
                luts[g, i] = np.int32(lut_all[k, g, i])
        qhh = qh[u0:u1].copy()
        q._cell(gw32[:3 * hh], gr[:3 * hh], qhh, bt[:, u0:u1], tr, luts, e, z, lo, hi, sh, pz[:hh],
                pz[hh:2 * hh], pz[2 * hh:3 * hh], pz[3 * hh:4 * hh], pz[4 * hh:5 * hh])
        scale = 2.0 ** (-e[IH])
        for j in range(hh):
            v = np.float32((qhh[j] - z[IH]) * scale)
            y_all[k * h + u0 + j] = v
            yh_all[k * h + u0 + j] = v
    return 0


_run_frame_nb = njit(cache=True, nogil=True)(_run_frame)


def native_gru_frame(p, begin, end):
    if p[1] != p[25] or p[2] != p[26] or native.arg(p, 13) != 1 or native.arg(p, 12) != 1:
        return native.DECLINED
    if native.arg(p, 24) == 2:
        return _run_frame_nb(p, begin, end, np.int16, np.int16, np.int16)
    if native.arg(p, 18) == 16:    # int16 weights in the int8 range, packed as int8
        return _run_frame_nb(p, begin, end, np.int8, np.uint8, np.int16)
    return _run_frame_nb(p, begin, end, np.int8, np.uint8, np.int8)

"""QuantGRU's native entry on onnxruntime's intra-op thread pool: batch 1, W and R packed once per node (VNNI hosts),
from MIN_STEPS steps, H a multiple of 16 (``pays``).

The packed path of quantgru_steps (``_run_packed``: the same products, rescales and cell, so the same bytes) cut into
**stages of numbered items**. Each task of the call (one per core: native.CLAIM_TASKS) takes item numbers from a
counter (``native.claim``) and, before working on an item, waits until every item of the stages before it has
finished (a second counter of finished items, ``native.add_release`` / ``native.wait_at_least``). Per direction:

1. set-up (one item): the per-channel constants, the initial state and activations, the workspace (the first
   direction's);
2. the activations of the input projection, QUANT_ROWS rows per item;
3. the input projection: tiles of MT rows per item;
4. per step two items, one per half of the hidden units (split at a multiple of 16): the products of that half's
   rows of R in each gate (whole 64-row block groups into the task's own scratch; only the half's rows are
   rescaled), the cell of those units, their Y and their activations for the next step (two activation buffers,
   even and odd steps: the other half still reads this step's);
5. the end (one item): Y's padded steps, Y_h.

Items are taken in order and an item waits only for items numbered below it, which tasks that are running hold:
no deadlock whatever the pool's size. With one intra-op thread the tasks run one after another and the first does
everything; with two each step is split over both cores with one hand-over per step. The task that took the set-up
item owns the workspace (one NRT array, addressed by every task through params) and returns only after the last
item finished. A failed value check (the set-up item runs check_values) marks the call failed and releases every
waiting task; the entry then returns DECLINED and Python names the problem.

The step items multiply their half's rows as one list of blocks over the three gates (quantgru_steps.half_blocks), and
index their rescales, copies and writes through views (quantgru_steps.rescale_rows: loops LLVM vectorises).

Measured (benchmarks/gru_cpu.py, timing in rounds, 2 cores, C = H = 400, T = 500, ms, this entry / onnxruntime's
two-thread float GRU, 2026-11-30): int8 2.74-2.82, int16 4.93-5.04, int16n 3.24-3.29 / 8.64-9.04 (the single-task
entry, 2026-11-29: int8 3.73, int16 9.13, int16n 7.68 against 6.04). Streaming frames take quantgru_frames' entry
instead: through this one a frame took 2x as long (its set-up, the 4-row projection tile and the hand-overs
against a ~20 us frame).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from onnx_lowbit.gru_int import NQ

from ..device import native
from . import quantgru_steps as q
from .quantgru_steps import IH, IRH, IWX, IX, MR_GEMM, MT

QUANT_ROWS = 64          # input rows quantised per item
MIN_STEPS = 16           # calls of at least this many steps take this entry (quantgru_cpu.QuantGRUKernel); shorter
# ones (a streaming frame) the single-task entry (module doc)
# param slots after quantgru_cpu.native_values' 36: the item counter, the finished counter, the workspace address,
# the failed flag (recorded as 0: each call starts from the recorded block's copy)
S_CLAIM, S_DONE, S_WS, S_FAIL = 36, 37, 38, 39
FAILED = np.int64(1) << 40   # added to the finished counter by a failed call: every wait returns


@njit(cache=True, inline="always")
def _align(n):
    return (n + 63) // 64 * 64


@njit(cache=True, nogil=True)
def layout(t, h, c, ll, itemsize, split):
    """Byte offsets of the workspace's arrays (the order of ``_views``) and, last, its size."""
    nbp, kgw, kgr = q._packed_dims(h, c, itemsize)
    g_ = 4 // itemsize
    kpw, kpr, n_out = kgw * g_, kgr * g_, nbp * 16
    asz = 2 if itemsize == 2 else 1
    mp = (t + MR_GEMM - 1) // MR_GEMM * MR_GEMM
    sizes = np.array([4 * n_out * 8, 4 * n_out * 8, 4 * h * 8, 12 * 3 * 8, 3 * ll * 4,
                      mp * kpw * asz, (mp * kpw * asz) if split else 0, t * 3 * h * 4,
                      kpr * asz, kpr * asz if split else 0, h * 8, kpr * asz, kpr * asz if split else 0], np.int64)
    off = np.empty(sizes.shape[0] + 1, np.int64)
    at = 0
    for i in range(sizes.shape[0]):
        off[i] = at
        at += _align(sizes[i])
    off[sizes.shape[0]] = at
    return off


@njit(cache=True, inline="always")
def _views(base, off, t, h, c, ll, itemsize, split, adt):
    nbp, kgw, kgr = q._packed_dims(h, c, itemsize)
    g_ = 4 // itemsize
    kpw, kpr, n_out = kgw * g_, kgr * g_, nbp * 16
    mp = (t + MR_GEMM - 1) // MR_GEMM * MR_GEMM
    b = np.uint64(base)
    ctw = native.array(b + np.uint64(off[0]), (4, n_out), np.int64)
    ctr = native.array(b + np.uint64(off[1]), (4, n_out), np.int64)
    bt = native.array(b + np.uint64(off[2]), (4, h), np.int64)
    tr = native.array(b + np.uint64(off[3]), (12, 3), np.int64)
    luts = native.array(b + np.uint64(off[4]), (3, ll), np.int32)
    xa0 = native.array(b + np.uint64(off[5]), (mp, kpw), adt)
    xa1 = native.array(b + np.uint64(off[6 if split else 5]), (mp, kpw), adt)
    qwx = native.array(b + np.uint64(off[7]), (t, 3 * h), np.int32)
    a0 = native.vector(b + np.uint64(off[8]), kpr, adt)     # the activations of even steps' products
    a1 = native.vector(b + np.uint64(off[9 if split else 8]), kpr, adt)
    qh = native.vector(b + np.uint64(off[10]), h, np.int64)
    a0b = native.vector(b + np.uint64(off[11]), kpr, adt)   # odd steps'
    a1b = native.vector(b + np.uint64(off[12 if split else 11]), kpr, adt)
    return ctw, ctr, bt, tr, luts, xa0, xa1, qwx, a0, a1, qh, a0b, a1b


def pays(t, h):
    """Whether a call of t steps with hidden size h takes this entry: from MIN_STEPS steps, H a multiple of 16 (the
    halves of the hidden units are whole 16-row blocks of R in each gate), from H = 64."""
    return t >= MIN_STEPS and h % 16 == 0 and h >= 64


def extra_values():
    """The parameter slots this entry adds to quantgru_cpu.native_values' (S_CLAIM .. S_FAIL), all 0."""
    return [0, 0, 0, 0]


@njit(cache=True, nogil=True)
def _setup(x, h0, b, ch, lut, e, z, ws, lo, hi, bias, split, rsw, rsr):
    """Direction k's constants, initial state and first activations into the workspace views ws."""
    ctw, ctr, bt, tr, luts, xa0, xa1, qwx, a0, a1, qh, a0b, a1b = ws
    h = qh.shape[0]
    n_out = ctw.shape[1]
    shift = np.empty(3 * h, np.int64)
    for cc in range(3 * h):
        shift[cc] = np.int64(ch[0, cc]) + e[IX] - e[IWX]
    ctw[:] = q.chan_triples(shift, n_out, z[IX] - bias, rsw)
    for cc in range(3 * h):
        shift[cc] = np.int64(ch[1, cc]) + e[IH] - e[IRH]
    ctr[:] = q.chan_triples(shift, n_out, z[IH] - bias, rsr)
    bt[:] = q.bias_terms(b, ch, e, z, h)
    tr[:] = q.shift_triples(e)
    for g in range(3):
        for i in range(luts.shape[1]):
            luts[g, i] = np.int32(lut[g, i])
    qh[:] = q._initial_state(h0, e, z, 1, h, lo, hi)[0]
    a0[:] = 0
    a1[:] = 0
    a0b[:] = 0
    a1b[:] = 0
    for j in range(h):
        q._act(qh[j], bias, split, a0, a1, j)
    t = x.shape[0]
    xa0[t:] = 0   # the padding rows of the last tile
    xa1[t:] = 0


def _run_items(p, qdt, adt, ldt):
    """All items this task takes (packed weights of dtype qdt, activations adt, tables ldt); returns 0, or
    native.DECLINED from the task that found the values failing."""
    t, c, h, d = native.arg(p, 12), native.arg(p, 14), native.arg(p, 15), native.arg(p, 16)
    rev, ll, bits = native.arg(p, 19), native.arg(p, 23), native.arg(p, 18)
    itemsize = native.arg(p, 24)
    h3 = 3 * h
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    split = bits == 16
    bias = lo if itemsize == 1 else 0
    sh = 6 if split else 0
    given = np.int64(native.vector(p[6], 1, np.int32)[0]) if p[6] else t   # sequence_lens, batch 1
    ln = min(max(given, 0), t)   # out-of-range lengths fail check_values in the set-up item (nothing is run then)
    nbp, kgw, kgr = q._packed_dims(h, c, itemsize)
    g_ = 4 // itemsize
    kpw = kgw * g_
    nq = (t + QUANT_ROWS - 1) // QUANT_ROWS
    mp = (t + MR_GEMM - 1) // MR_GEMM * MR_GEMM
    npj = (mp + MT - 1) // MT
    per_dir = 1 + nq + npj + ln * 2 + 1   # per step two items (halves of the hidden units)
    total = d * per_dir
    off = layout(t, h, c, ll, itemsize, split)
    ch_all = native.array(p[4], (d, 4, h3), np.int32)
    e_all = native.array(p[10], (d, NQ), np.int64)
    z_all = native.array(p[11], (d, NQ), np.int64)
    x = native.array(p[0], (t, c), np.float32)      # batch 1: [T, 1, C] and [1, T, C] alike
    y_all = native.array(p[8], (t, d, h), np.float32)     # batch 1: Y [T, D, 1, H] and [1, T, D, H] alike
    yh_all = native.array(p[9], (d, h), np.float32)
    b_all = native.array(p[3], (d, 2 * h3), np.int32)
    lut_all = native.array(p[5], (d, 3, ll), ldt)
    owner = False
    keep = np.empty(0, np.uint8)
    rc = 0
    pz = np.empty(0, np.int64)
    po0, po1 = np.empty(0, np.int32), np.empty(0, np.int32)
    pacc = np.empty(0, np.int64)
    gw, gr = np.empty(0, np.int32), np.empty(0, np.int64)
    blk, base3 = np.empty(0, np.int64), np.empty(0, np.int64)
    it = native.claim(p, S_CLAIM)
    while it < total:
        k = it // per_dir
        r = it - k * per_dir
        if r == 0:   # start: the first item of this item's stage
            start = it
        elif r < 1 + nq:
            start = k * per_dir + 1
        elif r < 1 + nq + npj:
            start = k * per_dir + 1 + nq
        elif r < per_dir - 1:
            start = k * per_dir + 1 + nq + npj + (r - 1 - nq - npj) // 2 * 2
        else:
            start = k * per_dir + per_dir - 1
        if native.wait_at_least(p, S_DONE, start) >= FAILED:
            break
        if it == 0:   # the call's set-up: value checks, the workspace
            lens = np.full(1, given, np.int64)
            if not q.check_values(ch_all, e_all, lens, t):
                native.add_release(p, S_FAIL, 1)
                native.add_release(p, S_DONE, FAILED)
                rc = native.DECLINED
                break
            keep = np.empty(off[off.shape[0] - 1] + 64, np.uint8)
            owner = True
            base = (keep.ctypes.data + 63) // 64 * 64
            p[S_WS] = np.uint64(base)
        ws = _views(p[S_WS], off, t, h, c, ll, itemsize, split, adt)
        ctw, ctr, bt, tr, luts, xa0, xa1, qwx, a0, a1, qh, a0b, a1b = ws
        e, z = e_all[k], z_all[k]
        reverse = rev == 1 or k == 1
        s_ = 28 + 4 * k
        wp = native.vector(p[s_], nbp * kgw * 64 // itemsize, qdt)
        rp = native.vector(p[s_ + 1], nbp * kgr * 64 // itemsize, qdt)
        if r == 0:
            rsw, rsr = native.vector(p[s_ + 2], h3, np.int64), native.vector(p[s_ + 3], h3, np.int64)
            h0 = np.zeros((0, 1), np.float32)
            if p[7]:
                h0 = native.array(p[7], (d, 1, h), np.float32)[k]
            _setup(x, h0, b_all[k], ch_all[k], lut_all[k], e, z, ws, lo, hi, bias, split, rsw, rsr)
        elif r < 1 + nq:
            i = r - 1
            m0, m1 = i * QUANT_ROWS, min(t, (i + 1) * QUANT_ROWS)
            q.quantize_acts(x[m0:m1], e[IX], z[IX], lo, hi, bias, split, kpw, xa0[m0:m1], xa1[m0:m1])
        elif r < 1 + nq + npj:
            i = r - 1 - nq
            q.proj_packed(wp, xa0, xa1, kpw, kgw, nbp, ctw, z[IWX], lo, hi, split, i * MT, min(t, (i + 1) * MT), qwx)
        elif r < per_dir - 1:
            j = r - 1 - nq - npj
            s = j // 2
            half = j - 2 * s
            if pz.shape[0] == 0:
                nl = q.list_capacity(h)
                pz = np.empty(5 * h, np.int64)
                po0 = np.empty(nl * 16, np.int32)
                po1 = np.empty(nl * 16, np.int32)
                pacc = np.empty(nl * 16, np.int64)
                gw = np.empty(3 * h, np.int32)
                gr = np.empty(3 * h, np.int64)
                blk = np.empty(nl, np.int64)
                base3 = np.empty(3, np.int64)
            u0 = 0 if half == 0 else ((h // 2) // 16) * 16
            u1 = ((h // 2) // 16) * 16 if half == 0 else h
            hh = u1 - u0
            ca0, ca1 = (a0, a1) if s % 2 == 0 else (a0b, a1b)
            na0, na1 = (a0b, a1b) if s % 2 == 0 else (a0, a1)
            nl = q.half_blocks(h, u0, u1, blk, base3)
            q.listed_products(rp, blk[:nl], ca0, ca1, kgr, po0, po1, pacc, split)
            ti = ln - 1 - s if reverse else s
            for g in range(3):   # views first, loops over range(hh) alone: they vectorise (rescale_rows)
                r0, a_ = g * h + u0, base3[g] + g * h + u0
                q.rescale_rows(pacc[a_:a_ + hh], ctr, r0, z[IRH], lo, hi, gr[g * hh:(g + 1) * hh])
                src, dst = qwx[ti, r0:r0 + hh], gw[g * hh:(g + 1) * hh]
                for jj in range(hh):
                    dst[jj] = src[jj]
            qv = qh[u0:u1]
            q._cell(gw[:3 * hh], gr[:3 * hh], qv, bt[:, u0:u1], tr, luts, e, z, lo, hi, sh, pz[:hh],
                    pz[hh:2 * hh], pz[2 * hh:3 * hh], pz[3 * hh:4 * hh], pz[4 * hh:5 * hh])
            scale = 2.0 ** (-e[IH])
            zh = z[IH]
            yv, n0, n1 = y_all[ti, k, u0:u1], na0[u0:u1], na1[u0:u1]
            for jj in range(hh):
                yv[jj] = np.float32((qv[jj] - zh) * scale)
                q._act(qv[jj], bias, split, n0, n1, jj)
        else:
            scale = 2.0 ** (-e[IH])
            for ti in range(ln, t):
                for jj in range(h):
                    y_all[ti, k, jj] = np.float32(0.0)
            for jj in range(h):
                yh_all[k, jj] = np.float32((qh[jj] - z[IH]) * scale) if ln > 0 else np.float32(0.0)
        native.add_release(p, S_DONE, 1)
        it = native.claim(p, S_CLAIM)
    if owner:   # the workspace lives until every item finished
        native.wait_at_least(p, S_DONE, total)
        keep[0] = 0
    return rc


_run_items_nb = njit(cache=True, nogil=True)(_run_items)


def native_gru_tasks(p, begin, end):
    if p[1] != p[25] or p[2] != p[26] or native.arg(p, 13) != 1:
        return native.DECLINED
    if native.arg(p, 24) == 2:
        return _run_items_nb(p, np.int16, np.int16, np.int16)
    if native.arg(p, 18) == 16:    # int16 weights in the int8 range, packed as int8
        return _run_items_nb(p, np.int8, np.uint8, np.int16)
    return _run_items_nb(p, np.int8, np.uint8, np.int8)

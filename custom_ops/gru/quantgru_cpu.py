"""QuantGRU, CPU face: the kernel class and its native entries over quantgru_steps' compiled paths (spec: docs/gru.md).

``QuantGRUKernel`` checks a call's inputs and runs it: through a native entry (no Python after the first call of a
shape) or through ``_run`` (Python, per direction run_direction_path / run_direction_packed). Native entries:

* ``quantgru_tasks.native_gru_tasks`` (batch 1, W and R constant and packed once per node): the packed path as
  numbered items on onnxruntime's intra-op pool, the recurrent product of each step split over its threads;
* ``quantgru_frames.native_gru_frame`` (streaming frames: T = 1, batch 1, W and R packed, H from MIN_H): one
  independent item per direction and half of the hidden units on onnxruntime's intra-op pool;
* ``_native_gru`` (the rest up to NATIVE_MACS multiply-adds of input projection): run_direction per direction on
  one task (batches: the parallel recurrence where native.parallel_ok).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from onnx_lowbit import gru_int
from onnx_lowbit.gru_int import NQ

from ..device import native
from ..runtime import plans
from ..runtime.kernels import Kernel, KernelError
from . import quantgru_frames, quantgru_tasks
from .quantgru_steps import (PACK_MIN_STEPS, PARALLEL_MACS, VNNI, _packed_dims, check_values, pack_direction, run_direction,
                             run_direction_packed, run_direction_path)

_NO_H0 = np.zeros((0, 1), np.float32)


def quant_gru(X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
              exponents, zero_points, direction="forward", layout=0, path="auto"):
    """Host-array entry with gru_int.quant_gru's signature (tests): checks the inputs, then runs (path: _pack_min)."""
    a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
    X = np.asarray(X, np.float32)
    gru_int.check_inputs(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
    return _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h, path=path)


def quant_gru_run(X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
                  exponents, zero_points, direction="forward", layout=0, path="auto"):
    """quant_gru without the input checks (the kernel alone: benchmarks/gru_cpu.py)."""
    a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
    return _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h, path=path)


def _pack_min(path):
    """run_direction_path's pack_min for a path: "auto" (PACK_MIN_STEPS on VNNI hosts, else the portable path),
    "packed" (always), "direct" (never packed; rows up to ROWDOT_MAX_K), "portable"; "packed" and "direct" on VNNI
    hosts only."""
    if path == "portable" or not VNNI:
        if path in ("packed", "direct"):
            raise ValueError(f"the {path} path needs AVX-512 VNNI")
        return -1
    return {"auto": PACK_MIN_STEPS, "packed": 0, "direct": 1 << 62}[path]


def _run(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h, y_out=None, yh_out=None, path="auto",
         packs=None):
    """Runs every direction, writing into y_out / yh_out (ONNX layout shapes; new arrays when None); packs: W and
    R packed beforehand (pack_direction per direction: run_direction_packed), else path chooses."""
    pack_min = _pack_min(path)
    native.start_pool()   # before the compiled run_direction* call their parallel kernels (a new process crashed)
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
        hk = _NO_H0 if h0 is None else np.ascontiguousarray(h0[k], np.float32)
        # int32 copies of the small int8/int16 tables: one compiled cell for both widths
        rest = (np.ascontiguousarray(B[k], np.int32), np.ascontiguousarray(channel_exp[k], np.int32),
                luts[k].astype(np.int32), a.exponents[k], a.zero_points[k], lens, reverse, ys[:, k], yhs[k])
        if packs is not None:
            run_direction_packed(x, hk, *packs[k], *rest, a.bits)
        else:
            run_direction_path(x, hk, np.ascontiguousarray(W[k]), np.ascontiguousarray(R[k]), *rest, pack_min)
    return y_out, yh_out


class QuantGRUKernel(Kernel):
    """On VNNI hosts a node whose W and R are constant initializers has them packed once, here (pack_direction per
    direction): its calls, of any length, take the packed path with nothing packed per call (a streaming frame:
    ~1.4x faster products than the direct path's, int16 weights in the int8 range 3x). Other W and R: the paths
    of run_direction per call."""
    native_plans = True  # inputs up to NATIVE_MACS: the native entry (below); longer ones: the Python path

    def __init__(self, **kw):
        super().__init__(**kw)
        at = self.attrs
        self.a = gru_int.GRUAttrs(at["hidden_size"], at["bits"], at["exponents"], at["zero_points"],
                                  at.get("direction", "forward"), at.get("layout", 0))
        self.packs, self.packed_from = self._pack_constants()

    def _pack_constants(self):
        """(packs, (W, R addresses)) when W and R are constant initializers of the shapes and type the op takes
        (VNNI hosts), else (None, None)."""
        w, r = self.constants.get(1), self.constants.get(2)
        if not VNNI or w is None or r is None:
            return None, None
        wv, rv = w.numpy(), r.numpy()
        d, h3 = self.a.num_directions, 3 * self.a.hidden_size
        if (wv.ndim != 3 or rv.shape != (d, h3, self.a.hidden_size) or wv.shape[:2] != (d, h3)
                or wv.dtype != gru_int.QTYPES[self.a.bits] or rv.dtype != wv.dtype):
            return None, None   # compute's checks name the problem
        return [pack_direction(wv[k], rv[k]) for k in range(d)], (w.ptr, r.ptr)

    def compute(self, ctx, inputs):
        ins = [inputs[i] if i < len(inputs) else None for i in range(8)]
        for i in range(6):
            self.check_input(ins, i)
        v = [t.numpy() if t is not None else None for t in ins]
        t, n = self._check(v)
        d, h = self.a.num_directions, self.a.hidden_size
        shapes = ((t, d, n, h), (d, n, h)) if self.a.layout == 0 else ((n, t, d, h), (n, d, h))
        packs = self.packs if self.packed_from == (ins[1].ptr, ins[2].ptr) else None
        if ctx.native and packs is not None and n == 1 and TASKS and quantgru_tasks.pays(t, h):
            outs = [ctx.output(i, shape) for i, shape in enumerate(shapes)]
            values = native_values(self.a, ins, outs, (t, n), self.packs, self.packed_from)
            values += quantgru_tasks.extra_values()
            if ctx.run_native(native.compile_entry(quantgru_tasks.native_gru_tasks), native.CLAIM_TASKS, 1, values,
                              (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)):
                return
        elif ctx.native and packs is not None and n == 1 and FRAMES and quantgru_frames.pays(t, h):
            outs = [ctx.output(i, shape) for i, shape in enumerate(shapes)]
            values = native_values(self.a, ins, outs, (t, n), self.packs, self.packed_from)
            if ctx.run_native(native.compile_entry(quantgru_frames.native_gru_frame), quantgru_frames.items(d), 1,
                              values, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)):
                return
        elif ctx.native and t * n * ins[0].shape[2] * 3 * h <= NATIVE_MACS and (n == 1 or native.parallel_ok()):
            outs = [ctx.output(i, shape) for i, shape in enumerate(shapes)]
            values = native_values(self.a, ins, outs, (t, n), self.packs, self.packed_from)
            if ctx.run_native(native.compile_entry(_native_gru), 1, 1, values, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)):
                return
        elif ctx.native:
            plans.not_replayable()   # a long input projection (BLAS) or batches under Numba's workqueue layer
        y, yh = (ctx.output_numpy(i, shape, np.float32) for i, shape in enumerate(shapes))
        _run(self.a, *v, y_out=y, yh_out=yh, packs=packs)

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
# frames, on VNNI hosts the direct path: nothing packed, no Python); more rows use the parallel recurrence where
# native.parallel_ok. The entry runs check_values on every call (as the Python path does) and declines a call
# whose channel_exp or sequence_lens fail them: Python then names the problem. X (layout 0), Y and Y_h are used
# in place.
# params: X, W, R, B, channel_exp, luts, sequence_lens (0), initial_h (0), Y, Y_h, exponents, zero_points, T, N, C,
# H, D, layout, bits, reverse (1: direction "reverse"), lo, hi, LUT shift, LUT length, then the kernel's packed W
# and R (QuantGRUKernel.packs): their itemsize (0: none), the W and R addresses they were packed from (the call's
# must be those: constant initializers), 0, and per direction the addresses of wp, rp, rsw, rsr (pack_pair).
NATIVE_MACS = PARALLEL_MACS - 1
TASKS = True   # batch 1 on packed weights: quantgru_tasks' entry (False: _native_gru / Python, for comparisons)
FRAMES = True  # frames (T = 1, batch 1) on packed weights: quantgru_frames' entry (False: _native_gru)


def native_values(a, ins, outs, tn, packs, packed_from):
    lo, hi = gru_int.qrange(a.bits)
    pk = [0] * (4 + 4 * 2)
    if packs is not None:
        pk[:4] = [packs[0][0].itemsize, *packed_from, 0]
        for k, arrays in enumerate(packs):
            pk[4 + 4 * k:8 + 4 * k] = [arr.ctypes.data for arr in arrays]
    return ([t.ptr if t is not None else 0 for t in ins[:8]] + list(outs)
            + [a.exponents.ctypes.data, a.zero_points.ctypes.data, tn[0], tn[1], ins[0].shape[2], a.hidden_size,
               a.num_directions, a.layout, a.bits, int(a.direction == "reverse"), lo, hi, gru_int.LUT_SHIFT[a.bits],
               gru_int.lut_len(a.bits)] + pk)


def _native_gru(p, begin, end):
    if native.arg(p, 18) == 8:
        return _native_run(p, np.int8)
    return _native_run(p, np.int16)


@njit(cache=True, nogil=True)
def _native_run(p, qdt):
    t, n, c, h, d = native.arg(p, 12), native.arg(p, 13), native.arg(p, 14), native.arg(p, 15), native.arg(p, 16)
    layout, rev, ll = native.arg(p, 17), native.arg(p, 19), native.arg(p, 23)
    h3 = 3 * h
    lens = np.full(n, t, np.int64)
    if p[6]:
        given = native.vector(p[6], n, np.int32)
        for i in range(n):
            lens[i] = given[i]
    ch_all = native.array(p[4], (d, 4, h3), np.int32)
    e_all = native.array(p[10], (d, NQ), np.int64)
    z_all = native.array(p[11], (d, NQ), np.int64)
    if not check_values(ch_all, e_all, lens, t):
        return native.DECLINED
    packed = native.arg(p, 24) if p[1] == p[25] and p[2] == p[26] else 0    # packed W and R: their itemsize
    if layout == 0:
        x = native.array(p[0], (t, n, c), np.float32)
    else:
        xin = native.array(p[0], (n, t, c), np.float32)
        x = np.empty((t, n, c), np.float32)
        for ti in range(t):
            for ni in range(n):
                x[ti, ni] = xin[ni, ti]
    w_all = native.array(p[1], (d, h3, c), qdt)
    r_all = native.array(p[2], (d, h3, h), qdt)
    b_all = native.array(p[3], (d, 2 * h3), np.int32)
    lut_all = native.array(p[5], (d, 3, ll), qdt)
    yout = native.array(p[8], (t, d, n, h) if layout == 0 else (n, t, d, h), np.float32)
    yhout = native.array(p[9], (d, n, h) if layout == 0 else (n, d, h), np.float32)
    for k in range(d):
        h0 = np.zeros((0, 1), np.float32)
        if p[7]:
            h0in = native.array(p[7], (d, n, h) if layout == 0 else (n, d, h), np.float32)
            h0 = np.empty((n, h), np.float32)
            for ni in range(n):
                h0[ni] = h0in[k, ni] if layout == 0 else h0in[ni, k]
        if layout == 0:    # views of this direction: y [T, N, H], yh [N, H]
            y, yh = yout[:, k], yhout[k]
        else:
            y, yh = yout[:, :, k].transpose(1, 0, 2), yhout[:, k]
        rest = (b_all[k], ch_all[k], lut_all[k].astype(np.int32), e_all[k], z_all[k], lens, rev == 1 or k == 1, y, yh)
        if not packed:
            run_direction(x, h0, w_all[k], r_all[k], *rest)
        elif packed == 1:
            _native_packed(p, k, h, c, 1, np.int8, x, h0, rest)
        else:
            _native_packed(p, k, h, c, 2, np.int16, x, h0, rest)
    return 0


@njit(cache=True, nogil=True)
def _native_packed(p, k, h, c, itemsize, dt, x, h0, rest):
    """run_direction_packed on direction k's packed W and R (params 28 + 4k ...) of dtype dt (itemsize bytes)."""
    nbp, kgw, kgr = _packed_dims(h, c, itemsize)
    s = 28 + 4 * k
    wp = native.vector(p[s], nbp * kgw * 64 // itemsize, dt)
    rp = native.vector(p[s + 1], nbp * kgr * 64 // itemsize, dt)
    rsw, rsr = native.vector(p[s + 2], 3 * h, np.int64), native.vector(p[s + 3], 3 * h, np.int64)
    run_direction_packed(x, h0, wp, rp, rsw, rsr, *rest, native.arg(p, 18))

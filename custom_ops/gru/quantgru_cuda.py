"""QuantGRU, CUDA face: the pure fixed-point GRU of onnx_lowbit.gru_int, bit-exact (spec: docs/gru.md).

Three kernels per call, all on the caller's stream, with no host round trip:

* ``prep`` (quantgru_prep_cuda.py) -- the per-channel parameters from the call's B and channel_exp in device
  memory, sequence_lens clamped to 0..T, the barrier counters zeroed; all in the call's scratch.
* ``xproj`` (quantgru_xproj_cuda.py) -- qWx for all steps and directions at once: an integer GEMM of the
  quantised X by W, computed exactly on the float pipes, the tile picked per call (ROUTES), stored as int16
  [D, T, N, 3H].
* ``rec`` (quantgru_rec_cuda.py) -- the recurrence, one launch for all T steps. Block (group, b) owns the hidden units
  [b*units, +units) of one direction and batch chunk (a group); its 3*units rows of R (as int32) and the three
  lookup tables stay in shared memory for the whole launch. Per step it stages h_{t-1} (minus zp_h) of its
  batch rows from the exchange buffer, computes the R h dot products (each thread: 3 gates x TN batch rows over
  one K slice, then the K slices are summed per output), runs the integer cell for its (n, unit) pairs, writes
  h_t (int16) to the exchange buffer and the dequantised Y / Y_h, and meets the other blocks of its group at a
  barrier: a monotonically growing uint64 counter per group (threadfence + atomic add, spin on an atomic read,
  threadfence), which needs all blocks resident at once -- the launch is cooperative
  (cuLaunchCooperativeKernel). When the grid exceeds what can be resident (occupancy x SMs), or under the CUDA
  simulator (which runs blocks one after the other) where a group has more than one block, the same kernel is
  launched once per step instead (the kernel boundary is the barrier); a plain launch when no barrier is
  reached (groups of one block, or one step). ROUTES says which xproj tile and which recurrence launch serve a
  call; docs/gru-cuda.md has the figures.

Memory: per call, one scratch block (``CallPlan``: pch, lengths, counters, qWx, the h exchange) from
onnxruntime's allocator (``Context.scratch``; a per-stream buffer of the kernel's without onnxruntime's scratch
API, and for direct calls: ``Prepared``); the parameters that depend on the attributes alone (``Params``) are
uploaded once per node. The launches are a function of the shapes only, so the kernel opts in to native plans
and can be captured in a CUDA graph. (The recurrence does not leave its counters at 0 but at a multiple of the
group's block count, all its next launch needs; zeroing them in the call's scratch is free -- the parameter
launch does it -- and leaves no state between calls.)

Accumulators: int32 for bits=8 (|R (h - zp)| <= 255 * 128 * H < 2^31 for H <= 32768; likewise W (x - zp) for
C < 65793), int64 for bits=16 (and for bits=8 with C >= 65536). Every quantity after a GEMM is computed in int64
exactly as gru_int.step does.
"""
from __future__ import annotations

import ctypes

import numpy as np
from numba import cuda

from onnx_lowbit import gru_int

from ..device import launch as cuda_launch
from ..device.launch import Launcher, SimLauncher, device_ptr
from ..device.target import SIM
from ..runtime import plans
from ..runtime.abi import NP_DTYPES
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, options, route
from . import quantgru_prep_cuda as qp
from . import quantgru_xproj_cuda as qx
from .common_cuda import PC, scalar_params
from .quantgru_prep_cuda import standin_channel_exp
from .quantgru_rec_cuda import MAX_SMEM, Plan, rec_fn, sig_rec
from .quantgru_xproj_cuda import XTILES, sig_xproj, xproj_fn, xtile

TILES = [t.name for t in XTILES[8]]
assert TILES == [t.name for t in XTILES[16]]     # one tile list for both widths (their depths differ)


def _tile_row(i, name):
    def test(c):
        if c.opt("stage") != "xproj":
            return False
        if c.opt("xtile") is not None:          # forced (tests)
            return c.opt("xtile") == name
        tile = xtile(8 if c.wdtype == "int8" else 16, name)
        return i == len(TILES) - 1 or tile.blocks(c.m, c.n, c.opt("dirs")) >= c.opt("sms")
    return test


_TILE_MEASURED = {
    "128x64": "docs/gru-cuda.md, Measured (H100 2026-11-24): T=100 N=32 H=512 (600 blocks), xproj 206.3 us int8 "
              "(128x128 240.7, 64x64 249.1, 32x32 372.2)",
    "64x64": "picked between the two measured shapes; not timed where it is picked",
    "32x32": "docs/gru-cuda.md, Measured (H100 2026-11-24): T=100 N=1 H=256 (96 blocks), xproj 40.0 us int8 "
             "(45.3 with the former 64x64 tiles)",
}

# Which kernels serve a call (routing.py): every call runs the parameter kernel (quantgru_prep_cuda.prep), one
# xproj tile and the recurrence in one of three launch forms. Cases: the xproj stage has M = T N rows, K = C, N = 3H
# columns, wdtype int8 / int16, opts stage "xproj", dirs, sms, xtile (a tile forced by tests, else None); the rec
# stage has M = N, K = H, N = T, opts stage "rec", barrier (a group of several blocks and T > 1), per_step (forced
# by tests, or the simulator with a barrier: it runs blocks one after another) and resident (the grid fits on the
# GPU at once, asked only when it matters).
ROUTES = tuple(
    Route(f"xproj {name}", f"xproj stage: the first tile in XTILES order whose grid gives every SM a block"
          if i < len(TILES) - 1 else "xproj stage: else the smallest tile", _tile_row(i, name),
          _TILE_MEASURED.get(name, "the simulator's tiles (few threads)")) for i, name in enumerate(TILES)) + (
    Route("rec cooperative", "rec stage: a barrier is reached (groups of several blocks, T > 1) and the grid is "
          "resident: one cooperative launch for all steps",
          lambda c: c.opt("stage") == "rec" and c.opt("barrier") and not c.opt("per_step") and c.opt("resident"),
          "docs/gru-cuda.md, Measured (H100 2026-11-24): 534.3 / 1317.8 us int8 (N=1 H=256 / N=32 H=512) against "
          "2100.5 us one launch per step (2026-11-22, N=1)"),
    Route("rec per step", "rec stage: a barrier but the grid cannot be resident (or the simulator, or forced): "
          "one launch per step, the kernel boundary as the barrier",
          lambda c: c.opt("stage") == "rec" and (c.opt("per_step") or c.opt("barrier")),
          "correctness fallback: docs/gru-cuda.md, Earlier (2026-11-22): 2100.5 us at N=1 H=256"),
    Route("rec", "rec stage (and every other case): no barrier is reached, one plain launch", always,
          "the cooperative launch without its barrier (groups of one block, or T <= 1)"),
)


def xproj_case(cp, sms):
    """The xproj stage's Case of a CallPlan (``sms``: the SMs the grid should fill)."""
    return Case("float32", cp.t * cp.n, cp.c, 3 * cp.h, wdtype="int8" if cp.a.bits == 8 else "int16",
                opts=options(stage="xproj", dirs=cp.d, sms=sms, xtile=cp.force_xtile))


class CoopLauncher:
    """A Launcher whose launches are cooperative (cuLaunchCooperativeKernel: all blocks resident, or an error)."""

    def __init__(self, launcher):
        fn = cuda_launch.libcuda().cuLaunchCooperativeKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 2
        self.func = None

        def launch(f, gx, gy, gz, bx, by, bz, sh, st, p, extra):
            if self.func is None:
                self.func = launcher.function()
            return fn(self.func, gx, gy, gz, bx, by, bz, sh, st, p)
        launcher._launch = launch
        self.launcher = launcher

    def blocks_per_sm(self, block, shmem=None):
        return self.launcher.blocks_per_sm(block, shmem)

    def launch(self, *args, **kw):
        """Launcher.launch, then: a native plan being recorded must replay this launch cooperatively too (a plain
        cuLaunchKernel would drop the co-residency the barrier needs: with other work on the GPU a group's blocks
        could wait for each other forever). With a bridge that has cooperative steps (Recorder.mark_cooperative)
        the step is marked so; otherwise the call is not replayable and calls with its key keep going through
        Python (with no host synchronisation either way, so CUDA-graph capture is unaffected)."""
        self.launcher.launch(*args, **kw)
        rec = plans.active()
        if rec is not None:
            mark = getattr(rec, "mark_cooperative", None)
            if mark is None:
                plans.not_replayable()
            else:
                mark(self.func.value)


_launchers = {}


def _prep_launcher():
    if SIM:
        return SimLauncher(qp.prep, qp.signature())
    if "prep" not in _launchers:
        _launchers["prep"] = Launcher(qp.prep, qp.signature())
    return _launchers["prep"]


def _xproj_launcher(bits, tile, c_dim, kc=None):
    fn, wdt = xproj_fn(bits, tile, c_dim, kc), np.int8 if bits == 8 else np.int16
    if SIM:
        return SimLauncher(fn, sig_xproj(wdt))
    if fn not in _launchers:
        _launchers[fn] = Launcher(fn, sig_xproj(wdt), dynamic_shared=MAX_SMEM)
    return _launchers[fn]


def _rec_launchers(bits, tn):
    fn, wdt = rec_fn(bits == 16, tn), np.int8 if bits == 8 else np.int16
    if SIM:
        return SimLauncher(fn, sig_rec(wdt)), None
    key = (bits, tn)
    if key not in _launchers:
        rc = Launcher(fn, sig_rec(wdt), dynamic_shared=MAX_SMEM)
        rcc = CoopLauncher(Launcher(fn, sig_rec(wdt), dynamic_shared=MAX_SMEM))
        _launchers[key] = (rc, rcc)
    return _launchers[key]


def launchers(bits, tn, c_dim, tile, kc=None):
    """(prep, xproj, rec, rec cooperative) direct-launch wrappers, compiled once per process; under the simulator
    launch.SimLauncher stand-ins and no cooperative one."""
    return (_prep_launcher(), _xproj_launcher(bits, tile, c_dim, kc)) + _rec_launchers(bits, tn)


def launcher_of(name, bits, tn, c_dim, kc=None):
    """The launcher of ROUTES kernel ``name`` for a call of this bit width, recurrence batch rows per thread ``tn``
    and C (``kc``: a shorter exact float sum, tests); None for "rec cooperative" under the simulator (never routed
    there)."""
    if name.startswith("xproj "):
        return _xproj_launcher(bits, xtile(bits, name[len("xproj "):]), c_dim, kc)
    plain, coop = _rec_launchers(bits, tn)
    return coop if name == "rec cooperative" else plain


def occupancy(launcher, tpb, smem):
    """Resident blocks per SM of a Launcher's kernel with ``smem`` bytes of dynamic shared memory."""
    return launcher.blocks_per_sm(tpb, smem)


class CallPlan:
    """What one call's launches depend on: the attributes, the shapes (T, N, C) and whether initial_h and
    sequence_lens are given -- nothing else. The recurrent kernel's geometry (Plan), the xproj tile, the flags and
    the layout of the call's scratch (byte offsets, each 256-aligned): pch int64 [D*10H] and lens int32 [N]
    (written by the parameter kernel), cnt uint64 [groups] (barrier counters, zeroed by it), qwx int16
    [D*T*N*3H], hb int16 (the h exchange, 2 D N H values in whole uint64 words)."""

    def __init__(self, a, t, n, c, sms, has_h0, has_lens, *, units=None, xtile=None, kc=None, per_step=False):
        d, h = a.num_directions, a.hidden_size
        self.a, self.t, self.n, self.c, self.d, self.h = a, t, n, c, d, h
        self.plan = p = Plan(n, h, d, a.bits, sms, units=units)
        self.force_xtile = xtile                # tests: a tile by name instead of the routed one
        self.xproj = route(ROUTES, xproj_case(self, sms)).kernel
        self.xt = qx.xtile(a.bits, self.xproj[len("xproj "):])
        self.kc = kc                            # tests: a shorter exact float sum (chunk boundaries on small C)
        # the simulator runs blocks one after the other: a launch of several steps only without barriers there
        self.per_step = per_step or (SIM and p.nblk > 1)
        self.has_h0, self.has_lens = has_h0, has_lens
        self.flags = 12 | (1 if has_h0 else 0) | (2 if has_lens else 0) | (16 if h % 4 == 0 else 0)
        self.nq = max(d * t * n * 3 * h, 1)
        self.nhw = max(-(-2 * d * n * h // 4), 1)
        self.off, o = {}, 0
        for name, nbytes in (("pch", d * PC * h * 8), ("lens", max(n, 1) * 4), ("cnt", p.groups * 8),
                             ("qwx", self.nq * 2), ("hb", self.nhw * 8)):
            self.off[name] = o
            o += -(-nbytes // 256) * 256
        self.nbytes = o


class Params:
    """A node's kernel-lifetime device arrays, from its attributes alone: prm, qsc, dq (scalar_params) and the
    exponents ex int64 [D*NQ] the parameter kernel reads. Allocated on the current device, read-only afterwards
    (what native plans allow a kernel to own)."""

    def __init__(self, a):
        prm, qsc, dq = scalar_params(a)
        self.arrays = [cuda.to_device(np.ascontiguousarray(v).reshape(-1))
                       for v in (prm, qsc, dq, a.exponents.astype(np.int64))]
        self.prm, self.qsc, self.dq, self.ex = ((device_ptr(v), (v.size,)) for v in self.arrays)


REVMASK = {"forward": 0, "reverse": 1, "bidirectional": 2}


def issue(cp, params, ptrs, stream, what="all", prep=True):
    """Issues one call's launches on ``stream``: the parameter kernel (quantgru_prep_cuda.prep), xproj, then the
    recurrence -- one cooperative launch for all steps; a plain one when no group has two blocks or there is at
    most one step (no barrier is reached); one launch per step when ``cp.per_step`` or when the grid cannot be
    resident at once (the xproj tile and the recurrence's launch: ROUTES). ``ptrs``: device pointers x, w, r,
    luts, b, ce, seql, h0 (0 when absent), y, yh (outputs) and scratch (cp.nbytes bytes); ``params``: the node's
    Params. ``what``: "all", or "prep" / "xproj" / "rec"
    alone (tests, timing); ``prep``: False when an earlier launch on the same scratch left the parameters
    (timing). Every launch depends on ``cp`` alone; everything written is in the outputs or the scratch. Returns
    per_step as used."""
    a, p, t, n, c, d, h = cp.a, cp.plan, cp.t, cp.n, cp.c, cp.d, cp.h
    sb = ptrs["scratch"]
    at = lambda name, size: (sb + cp.off[name], (size,))  # noqa: E731
    pch, lens, cnt, qwx = at("pch", d * PC * h), at("lens", max(n, 1)), at("cnt", p.groups), at("qwx", cp.nq)
    if prep:
        pk = _prep_launcher()
        seql = (ptrs["seql"], (n,)) if cp.has_lens else lens
        pk.launch(qp.grid(d, h, n, p.groups), qp.TPB, stream, (ptrs["b"], (d * 6 * h,)), (ptrs["ce"], (d * 12 * h,)),
                  seql, params.ex, pch, lens, cnt, d, h, n, t, p.groups, int(cp.has_lens))
    if what == "prep":
        return cp.per_step
    lo, hi = gru_int.qrange(a.bits)
    if t * n and what != "rec":
        xp = launcher_of(cp.xproj, a.bits, p.tn, c, cp.kc)
        xp.launch(cp.xt.blocks(t * n, 3 * h, d), cp.xt.nt, stream, (ptrs["x"], (max(t * n * c, 1),)),
                  (ptrs["w"], (max(d * 3 * h * c, 1),)), qwx, params.prm, pch, params.qsc, t, n, c, h, a.layout,
                  lo, hi, shmem=cp.xt.smem)
    if what == "xproj":
        return cp.per_step
    arrays = (qwx, (ptrs["r"], (d * 3 * h * h,)), (ptrs["luts"], (d * 3 * p.llen,)),
              (ptrs["h0"], (d * n * h,)) if cp.has_h0 else (sb, (1,)), lens, at("hb", 4 * cp.nhw), at("hb", cp.nhw),
              (ptrs["y"], (max(t * d * n * h, 1),)), (ptrs["yh"], (d * n * h,)), cnt, params.prm, pch, params.qsc,
              params.dq)
    head = (t, n, h, d, p.nch, p.nbc, p.units, p.ks)
    tail = (p.nblk, REVMASK[a.direction], a.layout, lo, hi, gru_int.LUT_SHIFT[a.bits], p.llen, cp.flags, p.pc_off,
            p.rs_off, p.hs_off, p.lt_off)
    barrier = p.nblk > 1 and t > 1
    resident = False
    if barrier and not cp.per_step:             # the occupancy query only where the answer matters
        rcc = launcher_of("rec cooperative", a.bits, p.tn, c)
        key = (id(rcc), p.tpb, p.smem)
        if key not in _resident:
            _resident[key] = occupancy(rcc, p.tpb, p.smem) * sm_count_now()
        resident = p.grid <= _resident[key]
    name = route(ROUTES, Case("float32", n, h, t, wdtype="int8" if a.bits == 8 else "int16", opts=options(
        stage="rec", barrier=barrier, per_step=cp.per_step, resident=resident))).kernel
    per_step = name == "rec per step"
    steps = [(s, s + 1) for s in range(t)] if per_step and t > 0 else [(0, t)]
    lau = launcher_of(name, a.bits, p.tn, c)
    for s0, s1 in steps:
        lau.launch(p.grid, p.tpb, stream, *arrays, *head, s0, s1, *tail, shmem=p.smem)
    return per_step


_resident = {}


def sm_count_now():
    return cuda_launch.sm_count(cuda_launch.current_device())


class Prepared:
    """One QuantGRU call on host arrays copied to the device (tests, benchmarks): validated (values too), its
    CallPlan, the node's Params, device copies of the inputs, the outputs and a scratch buffer of its own;
    ``launch(stream)`` issues the call exactly as the onnxruntime kernel does on onnxruntime's buffers.

    Kept beside runtime/direct.call because it reaches what a session node cannot: one kernel alone
    (``launch(what="xproj" / "rec")``), the scratch's intermediate values (``qwx``, ``pch``, ``lens``,
    ``counters``), and overrides that put tiny test shapes on the paths large shapes take on a GPU (``units``: a
    block split, ``per_step``, ``xtile``: a tile by name, ``kc``: a shorter exact float sum, ``sms``)."""

    def __init__(self, X, W, R, B, channel_exp, luts, sequence_lens=None, initial_h=None, *, hidden_size, bits,
                 exponents, zero_points, direction="forward", layout=0, units=None, per_step=False, sms=None,
                 xtile=None, kc=None):
        a = self.a = gru_int.GRUAttrs(hidden_size, bits, exponents, zero_points, direction, layout)
        X = np.ascontiguousarray(X, np.float32)
        t, n, c = gru_int.check_inputs(a, X, W, R, B, channel_exp, luts, sequence_lens, initial_h)
        self.t, self.n, self.c, self.h, self.d = t, n, c, a.hidden_size, a.num_directions
        if not SIM:
            sms = sms or sm_count_now()
        self.cp = CallPlan(a, t, n, c, sms or 4, initial_h is not None, sequence_lens is not None, units=units,
                           xtile=xtile, kc=kc, per_step=per_step)
        self.plan, self.xt, self.per_step = self.cp.plan, self.cp.xt, self.cp.per_step
        self.params = Params(a)
        qt = np.int8 if bits == 8 else np.int16
        i32, f32 = np.int32, np.float32
        host = {"x": (X, f32), "w": (W, qt), "r": (R, qt), "luts": (luts, qt), "b": (B, i32), "ce": (channel_exp, i32),
                "seql": (sequence_lens, i32), "h0": (initial_h, f32)}
        self.bufs = {k: cuda.to_device(np.ascontiguousarray(v, dt).reshape(-1) if v is not None and np.size(v)
                                       else np.zeros(1, dt)) for k, (v, dt) in host.items()}
        d, h = self.d, self.h
        self.y = cuda.device_array(max(t * d * n * h, 1), np.float32)
        self.yh = cuda.device_array(max(d * n * h, 1), np.float32)
        self.scratch = cuda.device_array(self.cp.nbytes, np.uint8)
        self.ptrs = {k: device_ptr(v) for k, v in self.bufs.items()}
        self.ptrs.update(y=device_ptr(self.y), yh=device_ptr(self.yh), scratch=device_ptr(self.scratch))
        self._prepped = False

    def _view(self, name, count, dtype):
        o = self.cp.off[name]
        return self.scratch[o:o + count * np.dtype(dtype).itemsize].view(dtype)

    @property
    def qwx(self):
        """xproj's output (int16 [D*T*N*3H], a view of the scratch)."""
        return self._view("qwx", self.cp.nq, np.int16)

    @property
    def pch(self):
        """The parameter kernel's per-channel parameters (int64 [D*10H], a view of the scratch)."""
        return self._view("pch", self.d * PC * self.h, np.int64)

    @property
    def lens(self):
        """The sequence lengths the recurrence reads (int32 [N]: sequence_lens clamped to 0..T, or T)."""
        return self._view("lens", max(self.n, 1), np.int32)

    @property
    def counters(self):
        """The barrier counters (uint64 [groups])."""
        return self._view("cnt", self.plan.groups, np.uint64)

    def launch(self, stream=0, what="all"):
        """Issues the call's kernels on ``stream`` (``what``: "all", or "prep" / "xproj" / "rec" alone, for tests
        and timing: xproj and rec alone run the parameter kernel only on the first launch)."""
        self.per_step = issue(self.cp, self.params, self.ptrs, stream, what, prep=what == "all" or not self._prepped)
        self._prepped = True

    def result(self):
        """(Y, Y_h) as numpy arrays with the reference's shapes."""
        cuda.synchronize()
        t, n, h, d = self.t, self.n, self.h, self.d
        y = self.y.copy_to_host()[: t * d * n * h]
        yh = self.yh.copy_to_host()[: d * n * h]
        if self.a.layout == 0:
            return y.reshape(t, d, n, h), yh.reshape(d, n, h)
        return y.reshape(n, t, d, h), yh.reshape(n, d, h)


def run_arrays(*args, repeat=1, **kw):
    """QuantGRU on host arrays (the arguments of gru_int.quant_gru, plus Prepared's overrides, which direct.call
    cannot pass): returns (Y, Y_h). Under the CUDA simulator through launch.SimLauncher (one launch per step when a group has
    several blocks), on a GPU through the direct (cooperative) launch path."""
    p = Prepared(*args, **kw)
    for _ in range(repeat):
        p.launch()
    return p.result()


# ---------------------------------------------------------------------------------------------------- onnxruntime
class QuantGRUCudaKernel(Kernel):
    """Per call: the parameter kernel, xproj and the recurrence on onnxruntime's stream; every buffer is an input,
    an output, the call's scratch from onnxruntime's allocator, or the node's read-only Params. Nothing is read
    back to the host and nothing carries over between calls (the barrier counters are zeroed in the call's
    scratch by the parameter kernel), so the launches depend only on the shapes: native plans (the cooperative
    launch needs a bridge that replays it cooperatively, see CoopLauncher.launch) and CUDA-graph capture."""
    native_plans = True

    def __init__(self, **kw):
        super().__init__(**kw)
        at = self.attrs
        try:
            self.a = gru_int.GRUAttrs(at["hidden_size"], at["bits"], at["exponents"], at["zero_points"],
                                      at.get("direction", "forward"), at.get("layout", 0))
        except ValueError as e:
            raise KernelError(str(e)) from None
        if self.in_types[1] != (3 if self.a.bits == 8 else 5):
            raise KernelError(f"bits={self.a.bits} needs int{self.a.bits} W, R and luts")
        self.sms = 4 if SIM else sm_count_now()
        self.params = Params(self.a)
        self.ce_standin = standin_channel_exp(self.a)
        self.calls = {}                         # (T, N, C, has initial_h, has sequence_lens) -> CallPlan
        self._own = {}                          # stream -> scratch of calls without onnxruntime's (onnxruntime < 1.18)

    def compute(self, ctx, inputs):
        a = self.a
        ins = [inputs[i] if i < len(inputs) else None for i in range(8)]
        for i in range(6):
            self.check_input(ins, i)
        x, w, r, b, ce, lt, sl, h0 = ins
        stand = lambda v: None if v is None else np.broadcast_to(  # noqa: E731 - shape and dtype only
            np.zeros((), NP_DTYPES[v.elem_type]), v.shape)
        ce_s = self.ce_standin if tuple(ce.shape) == self.ce_standin.shape and ce.elem_type == 6 else stand(ce)
        try:
            t, n, c = gru_int.check_inputs(a, stand(x), stand(w), stand(r), stand(b), ce_s, stand(lt), stand(sl),
                                           stand(h0))
        except ValueError as e:
            raise KernelError(str(e)) from None
        d, h = a.num_directions, a.hidden_size
        shapes = ((t, d, n, h), (d, n, h)) if a.layout == 0 else ((n, t, d, h), (n, d, h))
        y, yh = (ctx.output(i, s) for i, s in enumerate(shapes))
        if n == 0:
            return
        key = (t, n, c, h0 is not None, sl is not None)
        cp = self.calls.get(key)
        if cp is None:
            cp = self.calls[key] = CallPlan(a, t, n, c, self.sms, key[3], key[4])
        if ctx.has_scratch:
            sb = ctx.scratch(cp.nbytes)
        else:
            sb = self._own_scratch(ctx.stream, cp.nbytes)
            plans.not_replayable()              # a buffer of ours that may be replaced: no plan may keep it
        ptrs = {"x": x.ptr, "w": w.ptr, "r": r.ptr, "luts": lt.ptr, "b": b.ptr, "ce": ce.ptr,
                "seql": sl.ptr if sl is not None else 0, "h0": h0.ptr if h0 is not None else 0, "y": y, "yh": yh,
                "scratch": sb}
        issue(cp, self.params, ptrs, ctx.stream)

    def _own_scratch(self, stream, nbytes):
        """Scratch kept per stream for onnxruntime without a scratch API (grown, never shrunk)."""
        buf = self._own.get(stream)
        if buf is None or buf.size < nbytes:
            buf = self._own[stream] = cuda.device_array(max(nbytes, 1), np.uint8)
        return device_ptr(buf)


KERNEL = QuantGRUCudaKernel

"""QuantGRU CUDA face beyond the kernels' arithmetic (tests/test_gru_cuda.py): the per-call parameter kernel
(quantgru_prep_cuda.prep) against the host reference on random valid inputs, and its clamps of bad values; the
onnxruntime kernel's compute with a stand-in context (simulator or GPU, no onnxruntime): bit-exact, no value checks
(bad values clamped, end to end), scratch from the context only; under the simulator its native plan is replayed as
the shim replays it, on new inputs, outputs and scratch; the cooperative launch is never recorded as a plain one.
"""
import numpy as np
import pytest
from numba import config

from gru_cuda_cases import cuda_module, random_case
from onnx_lowbit import gru_int
from onnx_lowbit.custom_ops.device.launch import device_ptr

SIM = bool(config.ENABLE_CUDASIM)


# ------------------------------------------------------------------ the parameter kernel (quantgru_prep_cuda)
def _prep_inputs(bits, direction, H, seed, valid=True):  # noqa: N803
    """Attributes and B / channel_exp: valid ones anywhere in the allowed range (every per-channel shift from 0
    up to 62 + the exponent gap, so also past 63; biases over all of int32), or bad ones (exponents below their
    targets, beyond +-62, at the int32 limits)."""
    rng = np.random.default_rng(seed)
    _, attrs = random_case(2, 2, 3, H, bits, direction, seed=seed, lens=False, h0=False)
    a = gru_int.GRUAttrs(H, bits, attrs["exponents"], attrs["zero_points"], direction)
    d = a.num_directions
    from onnx_lowbit.custom_ops.gru.quantgru_prep_cuda import standin_channel_exp
    low = standin_channel_exp(a).astype(np.int64)           # the smallest valid exponent of every entry
    if valid:
        ce = rng.integers(low, gru_int.MAX_EXP + 1)
    else:
        ce = low + rng.integers(-70, 70, low.shape)
        ce.reshape(-1)[:4] = [-(1 << 31), (1 << 31) - 1, 1000, -1000]
    B = rng.integers(-(1 << 31), 1 << 31, (d, 6 * H))
    B.reshape(-1)[:2] = [-(1 << 31), (1 << 31) - 1]
    return a, B.astype(np.int32), ce.astype(np.int32)


def _run_prep(qg, a, B, ce, sl, T, N):  # noqa: N803
    """The parameter launch alone on a scratch filled with 0xA5: (pch [D, 10H], lens [N], counters)."""
    from numba import cuda
    cp = qg.CallPlan(a, T, N, 3, 4, False, sl is not None)
    params = qg.Params(a)
    bufs = {k: cuda.to_device(np.ascontiguousarray(v).reshape(-1)) for k, v in
            (("b", B), ("ce", ce), ("seql", sl if sl is not None else np.zeros(1, np.int32)))}
    scratch = cuda.to_device(np.full(cp.nbytes, 0xA5, np.uint8))
    ptrs = {k: device_ptr(v) for k, v in bufs.items()}
    ptrs["scratch"] = device_ptr(scratch)
    qg.issue(cp, params, ptrs, 0, what="prep")
    host = scratch.copy_to_host()
    at = lambda name, n, dt: host[cp.off[name]:cp.off[name] + n * np.dtype(dt).itemsize].view(dt)  # noqa: E731
    d, h = a.num_directions, a.hidden_size
    return (at("pch", d * qg.PC * h, np.int64).reshape(d, -1), at("lens", N, np.int32),
            at("cnt", cp.plan.groups, np.uint64))


@pytest.mark.parametrize("bits,direction", [(8, "forward"), (16, "bidirectional"), (8, "reverse")])
def test_prep_kernel_equals_host_parameters(bits, direction):
    """On valid inputs the device's per-channel parameters equal the host reference (channel_params) bit for bit;
    the lengths are sequence_lens (or T), the barrier counters 0 (the scratch was filled with 0xA5 first)."""
    qg = cuda_module()
    from onnx_lowbit.custom_ops.gru.quantgru_prep_cuda import channel_params
    for seed in range(3):
        a, B, ce = _prep_inputs(bits, direction, 5 + seed, seed)
        X = np.zeros((4, 3, 2), np.float32)
        sl = np.array([4, 0, 2], np.int32)
        gru_int.check_inputs(a, X, np.zeros((a.num_directions, 3 * a.hidden_size, 2), gru_int.QTYPES[bits]),
                             np.zeros((a.num_directions, 3 * a.hidden_size, a.hidden_size), gru_int.QTYPES[bits]),
                             B, ce, np.zeros((a.num_directions, 3, gru_int.lut_len(bits)), gru_int.QTYPES[bits]), sl)
        want = channel_params(a, B, ce)
        assert want[:, :6 * a.hidden_size].max() >= 63 or seed, "no shift past 63 exercised"
        for lens in (sl, None):
            pch, got_lens, cnt = _run_prep(qg, a, B, ce, lens, 4, 3)
            assert np.array_equal(pch, want)
            assert np.array_equal(got_lens, sl if lens is not None else np.full(3, 4))
            assert not cnt.any()


def test_prep_kernel_clamps_bad_values():
    """Values the host does not check (they stay on the device): every per-channel shift clamped to >= 0 (so
    channel exponents below their target, beyond +-62 or at the int32 limits give defined parameters) and
    sequence_lens clamped to 0..T."""
    qg = cuda_module()
    for bits, direction, seed in ((16, "bidirectional", 1), (8, "forward", 2)):
        a, B, ce = _prep_inputs(bits, direction, 6, seed, valid=False)
        d, h = a.num_directions, a.hidden_size
        want = np.zeros((d, qg.PC * h), np.int64)
        c64, b64 = ce.astype(np.int64), B.astype(np.int64)
        for k in range(d):
            E = lambda n: int(a.exponents[k, gru_int.Q[n]])  # noqa: E731
            rs = lambda v, s: gru_int.rshift(v, np.maximum(s, 0))  # noqa: E731
            want[k, :3 * h] = np.maximum(c64[k, gru_int.CH_W] + E("x") - E("Wx"), 0)
            want[k, 3 * h:6 * h] = np.maximum(c64[k, gru_int.CH_R] + E("h") - E("Rh"), 0)
            bx, br, cbx, cbr = b64[k, :3 * h], b64[k, 3 * h:], c64[k, gru_int.CH_BX], c64[k, gru_int.CH_BR]
            for g, tgt in enumerate(("z_pre", "r_pre")):
                sl_ = slice(g * h, (g + 1) * h)
                want[k, (6 + g) * h:(7 + g) * h] = rs(bx[sl_], cbx[sl_] - E(tgt)) + rs(br[sl_], cbr[sl_] - E(tgt))
            want[k, 8 * h:9 * h] = rs(bx[2 * h:], cbx[2 * h:] - E("g_pre"))
            want[k, 9 * h:] = rs(br[2 * h:], cbr[2 * h:] - E("Rh_add_br"))
        sl = np.array([-5, 9, 3, -(1 << 31), (1 << 31) - 1], np.int32)
        pch, lens, cnt = _run_prep(qg, a, B, ce, sl, 4, 5)
        assert np.array_equal(pch, want)
        assert lens.tolist() == [0, 4, 3, 0, 4] and not cnt.any()


# ------------------------------------------------------------------ the onnxruntime kernel's compute (no onnxruntime)
class FakeContext:
    """bridge.Context for compute without onnxruntime: outputs (NaN) and scratch (0xA5: nothing may rely on its
    contents) are device arrays of ours; a recorder as bridge.Context. Simulator or GPU."""

    def __init__(self, has_scratch=True):
        self.stream, self.has_scratch, self.recorder = 0, has_scratch, None
        self.outs, self.scratches = {}, []

    def output(self, index, shape):
        from numba import cuda
        n = int(np.prod(shape))
        a = cuda.to_device(np.full(max(n, 1), np.nan, np.float32))
        self.outs[index] = (a, tuple(shape))
        ptr = device_ptr(a) if n else 0
        if self.recorder is not None:
            self.recorder.output(index, tuple(shape), ptr)
        return ptr

    def scratch(self, nbytes):
        from numba import cuda
        buf = cuda.to_device(np.full(max(nbytes, 1), 0xA5, np.uint8))
        self.scratches.append(buf)
        if self.recorder is not None:
            self.recorder.scratch(device_ptr(buf), nbytes)
        return device_ptr(buf)

    def result(self, index):
        from numba import cuda
        cuda.synchronize()
        a, shape = self.outs[index]
        return a.copy_to_host()[:int(np.prod(shape))].reshape(shape)


def ort_kernel(attrs):
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.gru.quantgru_cuda import QuantGRUCudaKernel
    qt = 3 if attrs["bits"] == 8 else 5
    return QuantGRUCudaKernel(spec=domain.OPS["QuantGRU"], attrs=dict(attrs), node_name="gru0",
                              in_types=[1, qt, qt, 6, 6, qt, 6, 1], out_types=[1, 1])


ELEM = {np.dtype(np.float32): 1, np.dtype(np.int8): 3, np.dtype(np.int16): 5, np.dtype(np.int32): 6}


def tensors(args):
    """bridge.Tensor views of device copies of host arrays (None for absent inputs), and the copies."""
    from numba import cuda
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    keep = [None if v is None else cuda.to_device(np.ascontiguousarray(v).reshape(-1) if v.size
                                                  else np.zeros(1, v.dtype)) for v in args]
    return [None if v is None else Tensor(device_ptr(d), ELEM[v.dtype], tuple(v.shape))
            for v, d in zip(args, keep)], keep


def ort_compute(kernel, args, ctx=None):
    ctx = ctx or FakeContext()
    ts, keep = tensors(args)
    kernel.compute(ctx, ts)
    return ctx.result(0), ctx.result(1), ctx


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(g.view(np.uint32), w.view(np.uint32))


def test_ort_compute_bit_exact():
    """QuantGRUCudaKernel.compute as onnxruntime calls it (pointers in, outputs and scratch from the context):
    bit-exact with the reference; one kernel, several shapes (batch split over two blocks per group: H = 5 with
    two directions), optional inputs present and absent, scratch poisoned."""
    cuda_module()
    args, attrs = random_case(3, 2, 3, 5, 16, "bidirectional", seed=21, layout=1)
    k = ort_kernel(attrs)
    for sub in (args, args[:6] + (None, None), args[:6] + (None, args[7])):
        assert_same(ort_compute(k, sub)[:2], gru_int.quant_gru(*sub, **attrs))
    args, attrs = random_case(4, 3, 5, 4, 8, "reverse", seed=22)
    k = ort_kernel(attrs)
    y, yh, ctx = ort_compute(k, args)
    assert_same((y, yh), gru_int.quant_gru(*args, **attrs))
    assert len(ctx.scratches) == 1 and ctx.scratches[0].size == k.calls[(4, 3, 5, True, True)].nbytes
    assert not k._own
    x2 = args[0][:, :2]
    sub = (x2,) + args[1:6] + (args[6][:2], args[7][:, :2])
    assert_same(ort_compute(k, sub)[:2], gru_int.quant_gru(*sub, **attrs))


def test_ort_compute_bad_values_are_clamped_not_raised():
    """compute checks shapes only: sequence_lens outside 0..T act as clamped to 0..T, channel exponents below
    their targets as the smallest valid ones (every per-channel shift clamped to 0) -- no error, no read past
    the inputs; the shape errors stay onnxruntime errors."""
    cuda_module()
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    from onnx_lowbit.custom_ops.gru.quantgru_prep_cuda import standin_channel_exp
    args, attrs = random_case(3, 4, 3, 4, 8, "reverse", seed=23)
    X, W, R, B, ch, luts, sl, ih = args
    k = ort_kernel(attrs)
    bad_sl = np.array([-2, 7, 3, 1 << 30], np.int32)
    a = gru_int.GRUAttrs(4, 8, attrs["exponents"], attrs["zero_points"], "reverse")
    low = standin_channel_exp(a)
    bad_ce = ch.copy()
    bad_ce[0, gru_int.CH_BX, :3] = low[0, gru_int.CH_BX, :3] - np.array([1, 5, 40])
    bad_ce[0, gru_int.CH_W, 5] = low[0, gru_int.CH_W, 5] - 3
    with pytest.raises(ValueError):
        gru_int.check_inputs(a, X, W, R, B, bad_ce, luts)
    got = ort_compute(k, (X, W, R, B, bad_ce, luts, bad_sl, ih))[:2]
    want = gru_int.quant_gru(X, W, R, B, np.maximum(bad_ce, low), luts, np.clip(bad_sl, 0, 3), ih, **attrs)
    assert_same(got, want)
    for bad, needle in ((R[:, :, :3], "R must have shape"), (ch[:, :3], "channel_exp must have shape")):
        sub = list(args)
        sub[2 if needle[0] == "R" else 4] = bad
        with pytest.raises(KernelError, match=needle):
            ort_compute(k, sub)


def _replay(plan, ins, outs, scratch, bits):
    """What the shim's replay does (ortshim.c run_plan), with the simulator's launchers: every recorded step with
    this call's input / output / scratch pointers patched in."""
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.gru import quantgru_prep_cuda as qp
    from onnx_lowbit.custom_ops.device.launch import Array, SimLauncher
    from onnx_lowbit.custom_ops.gru import quantgru_rec_cuda as qr
    from onnx_lowbit.custom_ops.gru import quantgru_xproj_cuda as qx
    wdt = np.int8 if bits == 8 else np.int16
    kernels = {id(qp.prep): SimLauncher(qp.prep, qp.signature())}
    kernels.update({id(f): SimLauncher(f, qx.sig_xproj(wdt)) for f in qx.compiled()})
    kernels.update({id(f): SimLauncher(f, qr.sig_rec(wdt)) for f in qr.compiled()})
    owned = []
    for s in range(plan.n_steps):
        st = plan.steps[s]
        assert st.kind == plans.LAUNCH
        vals = [int(st.params[i]) for i in range(st.n_params)]
        patched = set()
        for j in range(st.n_patch):
            kind, idx, off = st.patch_kind[j], st.patch_index[j], st.patch_off[j]
            base = ins[idx] if kind == plans.INPUT else outs[idx] if kind == plans.OUTPUT else scratch
            vals[st.patch_slot[j]] = base + off
            patched.add(st.patch_slot[j])
        launcher = kernels[st.func]
        args, o = [], 0
        for sig in launcher.sig:
            if isinstance(sig, Array):
                args.append((vals[o + 4], (vals[o + 2],)))
                if o + 4 not in patched:
                    owned.append(vals[o + 4])
                o += 7
            else:
                args.append(vals[o] - (1 << 64) if vals[o] >= 1 << 63 else vals[o])
                o += 1
        launcher.launch(st.grid, st.block, 0, *args, shmem=st.shmem)
    return owned


@pytest.mark.skipif(not SIM, reason="replays with the simulator's launchers (the GPU: test_native_plans_cuda.py)")
@pytest.mark.parametrize("H,direction", [(4, "forward"), (5, "bidirectional")])  # noqa: N803 - groups of 1 / 2 blocks
def test_native_plan_replays_bit_exact(H, direction):  # noqa: N803
    """compute records a valid native plan (steps, scratch size, pointer patches); replaying it as the shim does,
    on new inputs, outputs and a new scratch, gives the reference's result for the new inputs; the only pointers
    not patched are the node's read-only Params. Without onnxruntime's scratch the call is not replayable."""
    cuda_module()
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.gru import quantgru_cuda as qg
    from onnx_lowbit.custom_ops.runtime.abi import LbPlan
    assert qg.QuantGRUCudaKernel.native_plans is True
    args, attrs = random_case(3, 2, 3, H, 16, direction, seed=H)
    k = ort_kernel(attrs)
    args = [np.ascontiguousarray(v) for v in args]
    plan, ctx = LbPlan(), FakeContext()
    ts, keep = tensors(args)
    plans.compute_and_record(k, ctx, ts, plan)
    assert_same((ctx.result(0), ctx.result(1)), gru_int.quant_gru(*args, **attrs))
    cp = k.calls[(3, 2, 3, True, True)]
    assert plan.valid == 1 and plan.scratch == cp.nbytes
    assert plan.n_steps == 2 + (3 if cp.per_step else 1)          # prep, xproj, the recurrence (per step here)
    new = list(args)
    new[0] = random_case(3, 2, 3, H, 16, direction, seed=H + 50)[0][0]
    new[6] = np.array([1, 3], np.int32)
    outs = [np.full(ctx.outs[i][1], np.nan, np.float32) for i in (0, 1)]
    scratch = np.full(plan.scratch, 0x5A, np.uint8)
    owned = _replay(plan, [v.ctypes.data for v in new], [o.ctypes.data for o in outs], scratch.ctypes.data, 16)
    assert_same(outs, gru_int.quant_gru(*new, **attrs))
    assert set(owned) <= {p for p, _ in (k.params.prm, k.params.qsc, k.params.dq, k.params.ex)}
    plan2 = LbPlan()
    ctx2 = FakeContext(has_scratch=False)
    ts2, keep2 = tensors(args)
    plans.compute_and_record(k, ctx2, ts2, plan2)
    assert plan2.valid == 0 and not ctx2.scratches and k._own            # the kernel's own buffer, no plan
    assert_same((ctx2.result(0), ctx2.result(1)), gru_int.quant_gru(*args, **attrs))


def test_cooperative_launch_is_never_recorded_as_a_plain_one():
    """The recurrence's cooperative launch, when a native plan is being recorded: marked cooperative (on the
    CUfunction it was launched with) where the bridge has cooperative steps, else the call is not replayable --
    never kept as a plain cuLaunchKernel step."""
    import ctypes
    qg = cuda_module()
    from onnx_lowbit.custom_ops.runtime import plans

    class Launched:   # Launcher.launch's recording, without a GPU
        def launch(self, *args, **kw):
            plans.active().launch(0xB2, 20, 256, 0, [0x10], [0])

    coop = qg.CoopLauncher.__new__(qg.CoopLauncher)
    coop.launcher, coop.func = Launched(), ctypes.c_void_p(0xC3)
    rec = plans.Recorder([], [4])
    plans._tls.rec = rec
    try:
        coop.launch(20, 256, 0)
    finally:
        plans._tls.rec = None
    if hasattr(rec, "mark_cooperative"):
        assert rec.ok and rec.steps[-1][:2] == (plans.COOP, 0xC3)
    else:
        assert not rec.ok

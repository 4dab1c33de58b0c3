"""Native launch plans (custom_ops/runtime/plans.py): what a recorded compute call turns into. Replays inside onnxruntime
need a GPU and onnxruntime-gpu (tests/test_native_plans_cuda.py); here the recording and patching logic is checked,
and the shim's replay loop (lb_replay) runs with stand-ins for cuLaunchKernel and cublasGemmEx. The whole compute
path of the shim (kernel creation, the Python call that records, native replays with their scratch taken from and
given back to onnxruntime's allocator) runs in a subprocess against a stand-in onnxruntime C API."""
import ctypes
import json
import os
import subprocess
import sys

import pytest

from onnx_lowbit import domain
# cuLaunchKernelEx's configuration as device/launch.py's Launcher fills it (its ctypes mirror of cuda.h's structs)
from onnx_lowbit.custom_ops.device.launch import _LaunchAttr, _LaunchConfig
from onnx_lowbit.custom_ops.runtime import bridge, plans
from onnx_lowbit.custom_ops.runtime.abi import LbPlan
from onnx_lowbit.custom_ops.runtime.bridge import Tensor


def _recorder():
    a = Tensor(0x10000, 1, (4, 8))        # float32: 128 bytes
    w = Tensor(0x40000, 2, (100,))        # uint8
    rec = plans.Recorder([a, None, w], out_itemsizes=[2])
    rec.output(0, (4, 16), 0x20000)       # float16: 128 bytes
    return rec


def test_shim_and_python_agree_on_the_plan_layout():
    bridge.library_path()
    assert bridge._lib.lb_plan_size() == ctypes.sizeof(LbPlan)


def test_pointers_into_inputs_and_outputs_become_patches():
    rec = _recorder()
    values = [0, 0, 32, 4, 0x10000 + 64,   # array arg: meminfo, parent, nitems, itemsize, data (inside input 0)
              0x20000, 0x30000, 0x40000 + 99, 0x10000, 7]
    rec.launch(0xABC, 12, 256, 1024, values, pointer_slots=[4, 5, 6, 7])
    plan = LbPlan()
    assert plans.fill(plan, rec, n_out=1)
    assert plan.valid == 1 and plan.n_steps == 1 and plan.n_out == 1
    assert plan.out_ndim[0] == 2 and list(plan.out_dims[0][:2]) == [4, 16]
    st = plan.steps[0]
    assert (st.func, st.grid, st.block, st.shmem, st.n_params) == (0xABC, 12, 256, 1024, len(values))
    assert list(st.params[: len(values)]) == values
    patches = {st.patch_slot[i]: (st.patch_kind[i], st.patch_index[i], st.patch_off[i]) for i in range(st.n_patch)}
    # slot 6 is a kernel-owned buffer (kept as recorded); slot 8 equals an input pointer but is not a pointer slot
    assert patches == {4: (plans.INPUT, 0, 64), 5: (plans.OUTPUT, 0, 0), 7: (plans.INPUT, 2, 99)}


def test_a_pointer_just_past_a_tensor_is_not_patched():
    rec = _recorder()
    rec.launch(1, 1, 32, 0, [0x10000 + 128], pointer_slots=[0])
    plan = LbPlan()
    assert plans.fill(plan, rec, n_out=1)
    assert plan.steps[0].n_patch == 0


def test_outputs_left_unallocated_are_marked():
    rec = plans.Recorder([], out_itemsizes=[4, 4])
    rec.output(1, (3,), 0x5000)
    plan = LbPlan()
    assert plans.fill(plan, rec, n_out=2)
    assert plan.out_ndim[0] == -1 and plan.out_ndim[1] == 1 and plan.n_steps == 0


def test_too_many_launches_or_parameters_give_no_plan():
    rec = _recorder()
    for _ in range(bridge.MAX_PLAN_STEPS + 1):
        rec.launch(1, 1, 32, 0, [0], pointer_slots=[])
    plan = LbPlan()
    assert not plans.fill(plan, rec, n_out=1) and plan.valid == 0
    rec = _recorder()
    rec.launch(1, 1, 32, 0, [0] * (bridge.MAX_PARAMS + 1), pointer_slots=[])
    assert not plans.fill(LbPlan(), rec, n_out=1)


def test_a_call_can_refuse_a_plan():
    class K:
        native_plans = True
        out_types = (1,)

        def compute(self, ctx, inputs):
            plans.not_replayable()

    plan = LbPlan()
    plans.compute_and_record(K(), _Ctx(), [], plan)
    assert plan.valid == 0 and plan.never == 0
    assert plans.active() is None


class _Ctx:
    recorder = None


class _NoPlans:
    native_plans = False
    out_types = (1,)

    def __init__(self):
        self.calls = 0

    def compute(self, ctx, inputs):
        self.calls += 1


def test_kernels_without_the_flag_say_never():
    k, plan = _NoPlans(), LbPlan()
    plans.compute_and_record(k, _Ctx(), [], plan)
    assert k.calls == 1 and plan.never == 1 and plan.valid == 0


@pytest.mark.parametrize("op", sorted(domain.OPS))
def test_cuda_kernels_opt_in(op):
    """Every op's CUDA kernel class, as the bridge looks it up, opts in to native plans (a class that lost the flag
    would silently go through Python on every call)."""
    from onnx_lowbit.custom_ops.runtime import kernels
    assert kernels.kernel_class(op, "CUDAExecutionProvider").native_plans is True


# ---------------------------------------------------------------- cuBLAS steps, replayed by the shim (stand-ins)
_p, _i = ctypes.c_void_p, ctypes.c_int
GEMM_FN = ctypes.CFUNCTYPE(_i, _p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i, _i, _p, _p, _i, _i, _i, _i)
LAUNCH_FN = ctypes.CFUNCTYPE(_i, _p, *[ctypes.c_uint] * 7, _p, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)), _p)


class _FakeBlas:
    """cublasGemmEx stand-in: records each call's arguments (alpha/beta read through their pointers)."""

    def __init__(self, during=None):
        self.calls, self.status, self.during = [], 0, during

        def gemm(*a):
            vals = list(a)
            vals[6] = ctypes.c_float.from_address(a[6]).value
            vals[13] = ctypes.c_float.from_address(a[13]).value
            self.calls.append(vals)
            if self.during:
                self.during()
            return self.status
        self.cublasGemmEx = GEMM_FN(gemm)


def _handle(fake):
    """A cublas.Handle around the stand-in (no GPU, no cuBLAS)."""
    from onnx_lowbit.custom_ops.device import cublas
    h = cublas.Handle.__new__(cublas.Handle)
    h.lib, h.h, h.stream = fake, ctypes.c_void_p(0x7777), 0
    h._one, h._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    h._gemm_addr = ctypes.cast(fake.cublasGemmEx, ctypes.c_void_p).value
    return h


def _record(fn, inputs, out_itemsizes=(2,), outputs=((0, (8, 32), 0x300000),)):
    rec = plans.Recorder(inputs, list(out_itemsizes))
    for index, shape, ptr in outputs:
        rec.output(index, shape, ptr)
    plans._tls.rec = rec
    try:
        fn(rec)
    finally:
        plans._tls.rec = None
    return rec


def _replay(plan, in_ptrs, out_ptrs, scratch=0):
    bridge.library_path()
    ins = (bridge.LbTensor * bridge.MAX_IO)()
    for i, ptr in enumerate(in_ptrs):
        ins[i].data, ins[i].elem_type = ptr, 10
    outs = (ctypes.c_void_p * bridge.MAX_IO)(*out_ptrs)
    failed = ctypes.c_int(-1)
    fn = bridge._lib.lb_replay
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.POINTER(ctypes.c_int)]
    rc = fn(ctypes.byref(plan), ins, outs, scratch, None, ctypes.byref(failed))
    return rc, failed.value


X_IN = Tensor(0x100000, 10, (8, 64))     # fp16 X: 1024 bytes
W_IN = Tensor(0x200000, 10, (32, 64))    # fp16 W [N, K]


def test_gemm_calls_are_recorded_and_replayed_with_this_calls_pointers():
    from onnx_lowbit.custom_ops.device import cublas
    fake = _FakeBlas()
    h = _handle(fake)
    scratch = 0x900000

    def compute(rec):   # rows 4..7 of X times W^T into a kernel-owned scratch; then a launch writing the output
        h.gemm_rows(X_IN.ptr + 4 * 64 * 2, cublas.R_16F, W_IN.ptr, cublas.R_16F, scratch, 4, 32, 64, 64)
        rec.launch(0xF00, 3, 128, 0, [scratch, 0x300000 + 64, 5], pointer_slots=[0, 1])

    rec = _record(compute, [X_IN, W_IN])
    plan = LbPlan()
    assert plans.fill(plan, rec, n_out=1) and plan.n_steps == 2 and plan.scratch == 0
    g, lk = plan.steps[0], plan.steps[1]
    assert (g.kind, lk.kind) == (plans.GEMM, plans.LAUNCH) and g.func == h._gemm_addr and g.n_params == 19
    patches = {g.patch_slot[i]: (g.patch_kind[i], g.patch_index[i], g.patch_off[i]) for i in range(g.n_patch)}
    assert patches == {7: (plans.INPUT, 1, 0), 10: (plans.INPUT, 0, 512)}        # W, X; the scratch C is kept
    assert g.params[18] == 2 ** 64 - 1                                           # CUBLAS_GEMM_DEFAULT = -1
    direct = fake.calls.pop()
    assert direct == [0x7777, cublas.OP_T, cublas.OP_N, 32, 4, 64, 1.0, W_IN.ptr, cublas.R_16F, 64,
                      X_IN.ptr + 512, cublas.R_16F, 64, 0.0, scratch, cublas.R_32F, 64, cublas.COMPUTE_32F, -1]
    rc, launched = _with_launch(lambda launched: (_replay(plan, [0xA00000, 0xB00000], [0xC00000]), launched), 3)
    assert rc == (0, -1)
    want = list(direct)
    want[7], want[10] = 0xB00000, 0xA00000 + 512
    assert fake.calls == [want]                       # same call, this call's X and W
    assert launched == [(0xF00, 3, 128, 0, [scratch, 0xC00000 + 64, 5])]


def test_a_failing_gemm_stops_the_replay_and_names_the_step():
    fake = _FakeBlas()
    h = _handle(fake)

    def compute(rec):
        for _ in range(2):
            h.gemm_rows(X_IN.ptr, 2, W_IN.ptr, 2, 0x900000, 8, 32, 64, 32)

    plan = LbPlan()
    assert plans.fill(plan, _record(compute, [X_IN, W_IN]), n_out=1)
    fake.calls.clear()
    fake.status = 13
    assert _replay(plan, [X_IN.ptr, W_IN.ptr], [0x300000]) == (13, 0) and len(fake.calls) == 1


def _with_launch(fn, nparams=4):
    """Runs ``fn(launched)`` with a cuLaunchKernel stand-in installed in the shim that appends (func, grid, block,
    shmem, the first ``nparams`` parameters) per launch."""
    launched = []

    def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        launched.append((f, gx, bx, shmem, [params[i][0] for i in range(nparams)]))
        return 0

    fake_launch = LAUNCH_FN(launch)
    bridge.library_path()
    old = bridge._lib.lb_set_launch(ctypes.cast(fake_launch, ctypes.c_void_p))
    try:
        return fn(launched)
    finally:
        bridge._lib.lb_set_launch(old)


def test_pointers_into_the_scratch_become_scratch_patches_and_replays_take_this_calls_buffer():
    fake = _FakeBlas()
    h = _handle(fake)
    scratch = 0x800000                       # what this call got from onnxruntime's allocator: 4096 bytes

    def compute(rec):   # GEMM into the scratch, then a launch reading it and writing the output
        rec.scratch(scratch, 4096)
        h.gemm_rows(X_IN.ptr, 2, W_IN.ptr, 2, scratch + 512, 8, 32, 64, 32)
        rec.launch(0xF00, 3, 128, 0, [scratch + 512, scratch, 0x300000 + 64, scratch + 4096], pointer_slots=[0, 1, 2, 3])

    plan = LbPlan()
    assert plans.fill(plan, _record(compute, [X_IN, W_IN]), n_out=1) and plan.scratch == 4096
    g, lk = plan.steps[0], plan.steps[1]
    gp = {g.patch_slot[i]: (g.patch_kind[i], g.patch_index[i], g.patch_off[i]) for i in range(g.n_patch)}
    assert gp == {7: (plans.INPUT, 1, 0), 10: (plans.INPUT, 0, 0), 14: (plans.SCRATCH, 0, 512)}
    lp = {lk.patch_slot[i]: (lk.patch_kind[i], lk.patch_index[i], lk.patch_off[i]) for i in range(lk.n_patch)}
    # slot 3 points just past the scratch: not into it, kept as recorded
    assert lp == {0: (plans.SCRATCH, 0, 512), 1: (plans.SCRATCH, 0, 0), 2: (plans.OUTPUT, 0, 64)}
    fake.calls.clear()
    launched = _with_launch(lambda launched: (_replay(plan, [0xA00000, 0xB00000], [0xC00000], 0x5550000), launched))
    assert launched[0] == (0, -1)
    assert [c[14] for c in fake.calls] == [0x5550000 + 512]
    assert launched[1] == [(0xF00, 3, 128, 0, [0x5550000 + 512, 0x5550000, 0xC00000 + 64, scratch + 4096])]


COOP_FN = ctypes.CFUNCTYPE(_i, _p, *[ctypes.c_uint] * 7, _p, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)))


def _replay_with(set_launch, fn, plan):
    """``plan`` replayed (input 0xA00000, output 0xC00000) with ``fn`` (a ctypes stand-in, or None for none) installed
    through the shim's ``set_launch`` (lb_set_launch_coop / lb_set_launch_ex) and the plain launches recorded by
    _with_launch; the previous launch function restored. Returns ((rc, failed step), plain launches)."""
    old = set_launch(ctypes.cast(fn, ctypes.c_void_p) if fn is not None else None)
    try:
        return _with_launch(lambda launched: (_replay(plan, [0xA00000], [0xC00000]), launched), 2)
    finally:
        set_launch(old)


def test_cooperative_launches_are_replayed_cooperatively():
    """A launch marked cooperative (Recorder.mark_cooperative, on the CUfunction given) is replayed through
    cuLaunchCooperativeKernel with this call's pointers, the plain launches around it through cuLaunchKernel;
    without a cooperative launch installed the step fails (status 1) instead of running non-cooperatively."""
    bridge.library_path()
    coop = []

    def coop_launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params):
        coop.append((f, gx, bx, shmem, [params[i][0] for i in range(2)]))
        return 0

    def compute(rec):
        rec.launch(0xA1, 1, 32, 0, [X_IN.ptr, 7], pointer_slots=[0])
        rec.launch(0xB2, 20, 256, 4096, [X_IN.ptr + 64, 0x300000], pointer_slots=[0, 1])
        rec.mark_cooperative(0xC3)
        rec.launch(0xD4, 2, 64, 0, [0x300000, 9], pointer_slots=[0])

    plan = LbPlan()
    assert plans.fill(plan, _record(compute, [X_IN]), n_out=1)
    assert [plan.steps[s].kind for s in range(3)] == [plans.LAUNCH, plans.COOP, plans.LAUNCH]
    fn = COOP_FN(coop_launch)
    rc, launched = _replay_with(bridge._lib.lb_set_launch_coop, fn, plan)
    assert rc == (0, -1)
    assert launched == [(0xA1, 1, 32, 0, [0xA00000, 7]), (0xD4, 2, 64, 0, [0xC00000, 9])]
    assert coop == [(0xC3, 20, 256, 4096, [0xA00000 + 64, 0xC00000])]
    rc, launched = _replay_with(bridge._lib.lb_set_launch_coop, None, plan)
    assert rc == (1, 1) and len(launched) == 1
    with pytest.raises(ValueError, match="follows a kernel launch"):
        rec = plans.Recorder([], [2])
        rec.steps.append((plans.GEMM, 1, 0, 0, 0, [0] * 19, []))
        rec.mark_cooperative(2)
    with pytest.raises(ValueError, match="mark_pdl follows a kernel launch"):
        plans.Recorder([], [2]).mark_pdl()          # nothing recorded yet


EX_FN = ctypes.CFUNCTYPE(_i, ctypes.POINTER(_LaunchConfig), _p, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint64)), _p)


def test_pdl_launches_are_replayed_through_cuLaunchKernelEx():  # noqa: N802
    """A launch marked PDL (Recorder.mark_pdl, device/pdl.py) is replayed through cuLaunchKernelEx with one
    attribute, programmatic stream serialization (6) = 1, this call's pointers and the recorded grid / block /
    shared memory (cuda.h's CUlaunchConfig layout, as device/launch.py fills it); the plain launches around it
    through cuLaunchKernel. Without cuLaunchKernelEx installed the step fails (status 1) instead of running in
    order, and such a plan is not kept in the first place (plan_ok)."""
    bridge.library_path()
    ex = []

    def launch_ex(cfg, f, params, extra):
        c = cfg.contents
        ex.append((f, c.gx, c.gy, c.gz, c.bx, c.by, c.bz, c.shmem, c.n_attrs, c.attrs[0].id, c.attrs[0].value,
                   [params[i][0] for i in range(2)]))
        return 0

    def compute(rec):
        rec.launch(0xA1, 1, 32, 0, [X_IN.ptr, 7], pointer_slots=[0])
        rec.launch(0xB2, 20, 256, 4096, [X_IN.ptr + 64, 0x300000], pointer_slots=[0, 1])
        rec.mark_pdl()

    plan = LbPlan()
    assert plans.fill(plan, _record(compute, [X_IN]), n_out=1)
    assert [plan.steps[s].kind for s in range(2)] == [plans.LAUNCH, plans.PDL]
    fn = EX_FN(launch_ex)
    rc, launched = _replay_with(bridge._lib.lb_set_launch_ex, fn, plan)
    assert rc == (0, -1)
    assert launched == [(0xA1, 1, 32, 0, [0xA00000, 7])]
    assert ex == [(0xB2, 20, 1, 1, 256, 1, 1, 4096, 1, 6, 1, [0xA00000 + 64, 0xC00000])]
    rc, launched = _replay_with(bridge._lib.lb_set_launch_ex, None, plan)
    assert rc == (1, 1) and len(launched) == 1
    assert ctypes.sizeof(_LaunchAttr) == 72 and ctypes.sizeof(_LaunchConfig) == 56   # cuda.h's sizes (x86-64)


def test_calls_without_scratch_record_none():
    rec = _recorder()
    rec.launch(1, 1, 32, 0, [0x10000], pointer_slots=[0])
    plan = LbPlan()
    assert plans.fill(plan, rec, n_out=1) and plan.scratch == 0


def test_gemm_steps_take_exactly_the_gemm_arguments():
    rec = plans.Recorder([], [2])
    with pytest.raises(ValueError, match="19 arguments"):
        rec.gemm(1, [0] * 18, [])


# ---------------------------------------------------------------- the shim's compute path against a stand-in onnxruntime
# Slots of the OrtApi table the shim uses (ortshim.c); the stand-ins below log what the shim asks of them.
_V, _P, _Z, _I64 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int64
_SLOTS = {
    0: (_V, ctypes.c_int, ctypes.c_char_p), 2: (_V, _V), 93: (None, _V),
    26: (_V, ctypes.c_char_p, _P), 27: (_V, _V, _V), 28: (_V, _V, _V),
    244: (_V, _V, ctypes.c_char_p, ctypes.POINTER(_Z)), 249: (_V, _V, _Z, ctypes.POINTER(ctypes.c_int), _P),
    88: (_V, _V, ctypes.POINTER(_Z)), 90: (_V, _V, _Z, _P), 65: (_V, _V, _P), 60: (_V, _V, ctypes.POINTER(ctypes.c_int)),
    61: (_V, _V, ctypes.POINTER(_Z)), 62: (_V, _V, ctypes.POINTER(_I64), _Z), 99: (None, _V), 51: (_V, _V, _P),
    193: (_V, _V, _P), 91: (_V, _V, _Z, ctypes.POINTER(_I64), _Z, _P),
    278: (_V, _V, ctypes.c_int, _P), 277: (_V, _V, _V, _Z, _P), 253: (_V, _V, _V, _P), 132: (None, _V),
    86: (_V, _V, ctypes.c_char_p, ctypes.POINTER(_I64)),
}


class _Allocator(ctypes.Structure):   # OrtAllocator's first members
    _fields_ = [("version", ctypes.c_uint32), ("Alloc", _V), ("Free", _V), ("Info", _V)]


class _StandInOrt:
    """A stand-in onnxruntime C API (the OrtApi slots above), one FusedFFN-shaped node with two inputs on a CUDA
    op variant, a cuLaunchKernel stand-in; ``log`` gets every allocator call and launch."""

    def __init__(self, api_version, fail_alloc_after=None):
        self.api_version, self.fail_alloc_after = api_version, fail_alloc_after
        self.log, self.ops, self.statuses, self.keep, self.n_alloc = [], [], {}, [], 0
        self.inputs = {0x1000: (10, (2, 64), 0x100000), 0x1001: (10, (32, 64), 0x200000)}
        self.outputs = {}
        table = (ctypes.c_void_p * 300)()
        for slot, sig in _SLOTS.items():
            table[slot] = self._fn(sig, getattr(self, f"s{slot}"))
        self.table = table
        self.version = ctypes.create_string_buffer(b"1.99.0-stand-in")
        self.base = (ctypes.c_void_p * 2)(self._fn((_V, ctypes.c_uint32), self.get_api),
                                          self._fn((_V,), lambda: ctypes.addressof(self.version)))
        self.meminfo = 0xE0E0

    def _fn(self, sig, f):
        cb = ctypes.CFUNCTYPE(*sig)(f)
        self.keep.append(cb)
        return ctypes.cast(cb, ctypes.c_void_p).value

    def _allocator(self, name):
        a = _Allocator(0, self._fn((_V, _V, _Z), lambda this, n: 0),
                       self._fn((None, _V, _V), lambda this, p: self.log.append(["free", name, p])),
                       self._fn((_V, _V), lambda this: self.meminfo))
        self.keep.append(a)
        return ctypes.addressof(a)

    def get_api(self, version):
        self.log.append(["get_api", version])
        return ctypes.addressof(self.table) if version <= self.api_version else None

    def s0(self, code, msg):      # CreateStatus
        buf = ctypes.create_string_buffer(msg)
        self.statuses[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def s2(self, st):
        return st                 # GetErrorMessage: the status is its message buffer

    def s93(self, st):
        self.statuses.pop(st, None)

    def s26(self, name, out):
        out[0] = 0xD0
        return None

    def s27(self, domain, op):
        self.ops.append(op)

    def s28(self, options, domain):
        return None

    def s86(self, info, name, out):           # KernelInfoGetAttribute_int64: the node has no attributes
        return self.s0(2, b"attribute not found")

    def s244(self, info, out, size):          # KernelInfo_GetNodeName
        name = b"ffn0"
        if out:
            ctypes.memmove(out, name + b"\0", len(name) + 1)
        size[0] = len(name) + 1

    def s249(self, info, index, is_constant, out):   # KernelInfoGetConstantInput_tensor: no constant inputs
        self.log.append(["constant_input", index])
        is_constant[0] = 0
        return None

    def s88(self, ctx, out):
        out[0] = 2

    def s90(self, ctx, i, out):
        out[0] = 0x1000 + i

    def s65(self, value, out):
        out[0] = value

    def s60(self, info, out):
        out[0] = self.inputs[info][0]

    def s61(self, info, out):
        out[0] = len(self.inputs[info][1])

    def s62(self, info, dims, n):
        for d, v in enumerate(self.inputs[info][1]):
            dims[d] = v

    def s99(self, info):
        pass

    def s51(self, value, out):
        out[0] = self.inputs[value][2] if value in self.inputs else self.outputs[value]

    def s193(self, ctx, out):
        out[0] = 0x5150

    def s91(self, ctx, index, dims, nd, out):
        value = 0x2000 + len(self.outputs)
        self.outputs[value] = 0x300000 + 0x10000 * len(self.outputs)
        self.log.append(["output", index, [dims[d] for d in range(nd)], self.outputs[value]])
        out[0] = value

    def s278(self, info, mem_type, out):      # KernelInfoGetAllocator
        self.log.append(["kernel_allocator", mem_type])
        out[0] = self._allocator("kernel")

    def s277(self, ctx, meminfo, nbytes, out):    # KernelContext_GetScratchBuffer
        self.n_alloc += 1
        ptr = 0 if self.fail_alloc_after is not None and self.n_alloc > self.fail_alloc_after else 0xA000000 * self.n_alloc
        self.log.append(["scratch", meminfo, nbytes, ptr])
        out[0] = ptr

    def s253(self, ctx, meminfo, out):            # KernelContext_GetAllocator
        self.log.append(["call_allocator", meminfo])
        out[0] = self._allocator("call")

    def s132(self, alloc):
        self.log.append(["release_allocator"])


class _ScratchKernel:
    """A CUDA kernel that takes ``nbytes`` of scratch (``twice``: asks twice; ``boom``: raises after taking it) and
    launches once on a pointer into it, into its input and into its output."""
    native_plans = True
    out_types = (10,)

    def __init__(self, nbytes, twice=False, boom=False, **kw):
        self.nbytes, self.twice, self.boom, self.spec = nbytes, twice, boom, kw["spec"]

    def describe(self):
        return "scratch kernel"

    def compute(self, ctx, inputs):
        y = ctx.output(0, (2, 32))
        sc = ctx.scratch(self.nbytes)
        if self.twice:
            ctx.scratch(16)
        if self.boom:
            raise ValueError("boom")
        rec = plans.active()
        if rec is not None:
            rec.launch(0xF00, 4, 128, 0, [sc + 256, inputs[0].ptr + 64, y, 9], pointer_slots=[0, 1, 2])


def _stand_in_run(api_version=18, nbytes=4096, calls=3, fail_alloc_after=None, **kernel_kw):
    """Registers the shim with a stand-in onnxruntime, creates one CUDA kernel (a _ScratchKernel), runs ``calls``
    compute calls and destroys it; returns the log, the compute statuses' messages and has_scratch as seen in
    Python. Meant for a subprocess (it points the shim at the stand-in API for good)."""
    from onnx_lowbit.custom_ops.runtime import kernels
    bridge.library_path()
    lib = bridge._lib
    ort = _StandInOrt(api_version, fail_alloc_after)
    seen = {}

    def kernel_class(name, provider):
        def make(**kw):
            k = _ScratchKernel(nbytes, **kernel_kw, **kw)
            real = k.compute
            k.compute = lambda ctx, inputs: (seen.setdefault("has_scratch", ctx.has_scratch), real(ctx, inputs))
            return k
        return make

    kernels.kernel_class = kernel_class
    lib.RegisterCustomOps.restype = ctypes.c_void_p
    assert lib.RegisterCustomOps(ctypes.c_void_p(0x1), ctypes.byref(ort.base)) is None
    index = next(i for i, (spec, prov, ins, _) in enumerate(bridge._variants)
                 if spec.name == "FusedFFN" and prov == bridge.CUDA and ins[:2] == (10, 10))
    op = ort.ops[index]
    fn = lambda off, *sig: ctypes.CFUNCTYPE(*sig)(ctypes.c_void_p.from_address(op + off).value)  # noqa: E731
    create, compute = fn(136, _V, _V, _V, _V, _P), fn(144, _V, _V, _V)
    destroy = fn(72, None, _V)
    kernel = ctypes.c_void_p()
    assert create(op, ctypes.addressof(ort.table), 0x7000, ctypes.byref(kernel)) is None
    statuses = []

    def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        ort.log.append(["launch", stream, [params[i][0] for i in range(4)]])
        return 0

    fake_launch = LAUNCH_FN(launch)
    lib.lb_set_launch(ctypes.cast(fake_launch, ctypes.c_void_p))
    for _ in range(calls):
        st = compute(kernel, 0xC7C7)
        statuses.append(None if st is None else ctypes.string_at(st).decode())
    destroy(kernel)
    return {"log": ort.log, "statuses": statuses, "has_scratch": seen.get("has_scratch"),
            "plans": bridge.stats["python_computes"], "counts": bridge.scratch_counts()}


def _in_subprocess(**kw):
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_plans; "
            f"print('RESULT', json.dumps(test_plans._stand_in_run(**{kw!r})))")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, ONNX_LOWBIT_NATIVE_PLANS="1"))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT "):])


def _events(log, *kinds):
    return [e for e in log if e[0] in kinds]


def test_scratch_comes_from_onnxruntimes_allocator_per_call_and_goes_back_after_the_launches():
    r = _in_subprocess()
    assert r["statuses"] == [None, None, None] and r["has_scratch"] is True
    assert r["plans"] == 1                                   # recorded once in Python, replayed twice in C
    assert r["counts"] == {"taken": 3, "given_back": 3, "bytes": 3 * 4096}
    log = r["log"]
    assert log[:1] == [["get_api", 18]] and ["kernel_allocator", 0] in log
    meminfo = 0xE0E0                                         # the kernel allocator's OrtMemoryInfo
    scratch = _events(log, "scratch")
    assert [e[1:3] for e in scratch] == [[meminfo, 4096]] * 3         # one buffer of the recorded size per call
    ptrs = [e[3] for e in scratch]
    assert len(set(ptrs)) == 3 and all(ptrs)
    # per call: scratch taken, (replays: launched with this call's scratch and output patched in), then given back
    # to the allocator that KernelContext_GetAllocator returns for the same memory info, which is released
    calls = _events(log, "output", "scratch", "launch", "call_allocator", "free", "release_allocator")
    outs = [e[3] for e in _events(log, "output")]
    want = []
    for i, (p, y) in enumerate(zip(ptrs, outs)):
        want += [["output", 0, [2, 32], y], ["scratch", meminfo, 4096, p]]
        if i:
            want += [["launch", 0x5150, [p + 256, 0x100000 + 64, y, 9]]]
        want += [["call_allocator", meminfo], ["free", "call", p], ["release_allocator"]]
    want += [["release_allocator"]]                          # the kernel's own allocator, at destroy
    assert calls == want


def test_no_scratch_before_onnxruntime_1_18():
    r = _in_subprocess(api_version=17, calls=1)
    assert r["log"][:2] == [["get_api", 18], ["get_api", 16]] and not _events(r["log"], "kernel_allocator", "scratch")
    assert r["has_scratch"] is False
    assert "scratch memory needs onnxruntime >= 1.18" in r["statuses"][0]


def test_a_failed_or_refused_scratch_is_an_error_and_nothing_leaks():
    r = _in_subprocess(fail_alloc_after=2, calls=3)              # the replay's allocation fails
    assert r["statuses"][:2] == [None, None] and "gave no 4096 bytes of scratch" in r["statuses"][2]
    assert len(_events(r["log"], "launch")) == 1 and len(_events(r["log"], "free")) == 2
    r = _in_subprocess(twice=True, calls=1)
    assert "scratch is taken once per compute call" in r["statuses"][0]
    assert [e[2] for e in _events(r["log"], "free")] == [e[3] for e in _events(r["log"], "scratch")]
    r = _in_subprocess(boom=True, calls=2)                       # the kernel fails after taking scratch
    assert all("boom" in s for s in r["statuses"]) and len(_events(r["log"], "free")) == 2


def test_calls_without_scratch_take_none():
    r = _in_subprocess(nbytes=0, calls=2)
    assert r["statuses"] == [None, None] and not _events(r["log"], "scratch", "free", "call_allocator")
    assert len(_events(r["log"], "launch")) == 1

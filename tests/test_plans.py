"""Native launch plans (custom_ops/plans.py): what a recorded compute call turns into. Replays inside onnxruntime
need a GPU and onnxruntime-gpu (tests/test_native_plans_cuda.py); here the recording and patching logic is checked,
and the shim's replay loop (lb_replay) runs with stand-ins for cuLaunchKernel and cublasGemmEx."""
import ctypes
import threading

import pytest

from onnx_lowbit.custom_ops import bridge, plans
from onnx_lowbit.custom_ops.bridge import LbPlan, Tensor


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


@pytest.mark.parametrize("cls_path", ["fplut_cuda.FPLUTCudaKernel", "fusedffn_cuda.FusedFFNCudaKernel",
                                      "matmulnf4_cuda.MatMulNF4CudaKernel",
                                      "matmulawq_cuda.MatMulAWQCudaKernel", "dequantnf4_cuda.DequantNF4CudaKernel",
                                      "dequantawq_cuda.DequantAWQCudaKernel"])
def test_cuda_kernels_opt_in(cls_path):
    import importlib
    mod, cls = cls_path.split(".")
    assert getattr(importlib.import_module(f"onnx_lowbit.custom_ops.{mod}"), cls).native_plans is True


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
    from onnx_lowbit.custom_ops import cublas
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


def _replay(plan, in_ptrs, out_ptrs):
    bridge.library_path()
    ins = (bridge.LbTensor * bridge.MAX_IO)()
    for i, ptr in enumerate(in_ptrs):
        ins[i].data, ins[i].elem_type = ptr, 10
    outs = (ctypes.c_void_p * bridge.MAX_IO)(*out_ptrs)
    failed = ctypes.c_int(-1)
    # as onnxruntime calls the shim: without the GIL (a thread holding it must never wait for the serial lock)
    fn = bridge._nogil.lb_replay
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.POINTER(ctypes.c_int)]
    rc = fn(ctypes.byref(plan), ins, outs, None, ctypes.byref(failed))
    return rc, failed.value


X_IN = Tensor(0x100000, 10, (8, 64))     # fp16 X: 1024 bytes
W_IN = Tensor(0x200000, 10, (32, 64))    # fp16 W [N, K]


def test_gemm_calls_are_recorded_and_replayed_with_this_calls_pointers():
    from onnx_lowbit.custom_ops import cublas
    fake = _FakeBlas()
    h = _handle(fake)
    scratch = 0x900000

    def compute(rec):   # rows 4..7 of X times W^T into a kernel-owned scratch; then a launch writing the output
        h.gemm_rows(X_IN.ptr + 4 * 64 * 2, cublas.R_16F, W_IN.ptr, cublas.R_16F, scratch, 4, 32, 64, 64)
        rec.launch(0xF00, 3, 128, 0, [scratch, 0x300000 + 64, 5], pointer_slots=[0, 1])

    rec = _record(compute, [X_IN, W_IN])
    plan = LbPlan()
    assert plans.fill(plan, rec, n_out=1) and plan.n_steps == 2 and plan.serial == 0
    g, lk = plan.steps[0], plan.steps[1]
    assert (g.kind, lk.kind) == (plans.GEMM, plans.LAUNCH) and g.func == h._gemm_addr and g.n_params == 19
    patches = {g.patch_slot[i]: (g.patch_kind[i], g.patch_index[i], g.patch_off[i]) for i in range(g.n_patch)}
    assert patches == {7: (plans.INPUT, 1, 0), 10: (plans.INPUT, 0, 512)}        # W, X; the scratch C is kept
    assert g.params[18] == 2 ** 64 - 1                                           # CUBLAS_GEMM_DEFAULT = -1
    direct = fake.calls.pop()
    assert direct == [0x7777, cublas.OP_T, cublas.OP_N, 32, 4, 64, 1.0, W_IN.ptr, cublas.R_16F, 64,
                      X_IN.ptr + 512, cublas.R_16F, 64, 0.0, scratch, cublas.R_32F, 64, cublas.COMPUTE_32F, -1]
    launched = []

    def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        launched.append((f, gx, bx, shmem, [params[i][0] for i in range(3)]))
        return 0

    fake_launch = LAUNCH_FN(launch)
    bridge.library_path()
    old = bridge._lib.lb_set_launch(ctypes.cast(fake_launch, ctypes.c_void_p))
    try:
        assert _replay(plan, [0xA00000, 0xB00000], [0xC00000]) == (0, -1)
    finally:
        bridge._lib.lb_set_launch(old)
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


def _waits_for_the_serial_lock():
    acquire, release = bridge.serial_lock()

    def take():
        acquire()
        release()
    t = threading.Thread(target=take)
    t.start()
    t.join(0.3)
    return t


def test_serial_calls_and_their_replays_hold_the_shims_lock():
    bridge.library_path()
    held = []
    fake = _FakeBlas(during=lambda: held.append(_waits_for_the_serial_lock()))
    h = _handle(fake)

    def compute(rec):
        with plans.serial():
            h.gemm_rows(X_IN.ptr, 2, W_IN.ptr, 2, 0x900000, 8, 32, 64, 32)
            assert rec.serial

    plan = LbPlan()
    assert plans.fill(plan, _record(compute, [X_IN, W_IN]), n_out=1) and plan.serial == 1
    assert _replay(plan, [X_IN.ptr, W_IN.ptr], [0x300000]) == (0, -1)
    assert len(held) == 2                       # the recording call (Python) and the replay (C)
    for t in held:                              # each other thread waited while the call ran, then got the lock
        t.join(5)
        assert not t.is_alive()
    plan.serial = 0                             # an unmarked plan does not take it
    fake.calls.clear()
    assert _replay(plan, [X_IN.ptr, W_IN.ptr], [0x300000]) == (0, -1)
    held[-1].join(5)
    assert not held[-1].is_alive()


def test_gemm_steps_take_exactly_the_gemm_arguments():
    rec = plans.Recorder([], [2])
    with pytest.raises(ValueError, match="19 arguments"):
        rec.gemm(1, [0] * 18, [])

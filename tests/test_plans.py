"""Native launch plans (custom_ops/plans.py): what a recorded compute call turns into. The C replay itself needs a
GPU and onnxruntime-gpu (tests/test_native_plans_cuda.py); here the recording and patching logic is checked."""
import ctypes

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


@pytest.mark.parametrize("cls_path", ["fplut_cuda.FPLUTCudaKernel", "matmulnf4_cuda.MatMulNF4CudaKernel",
                                      "matmulawq_cuda.MatMulAWQCudaKernel", "dequantnf4_cuda.DequantNF4CudaKernel",
                                      "dequantawq_cuda.DequantAWQCudaKernel"])
def test_cuda_kernels_opt_in(cls_path):
    import importlib
    mod, cls = cls_path.split(".")
    assert getattr(importlib.import_module(f"onnx_lowbit.custom_ops.{mod}"), cls).native_plans is True

"""MatMulAWQ / FusedFFNAWQ kernel objects called as a session calls them: under the simulator, compute over host
memory (the simulator's device memory; device/host and awq/common_cuda give the kernel objects simulator launchers, SMs and tensor
cores), with a stand-in Context; on a GPU (ONNX_LOWBIT_REAL_GPU=1) one-node onnxruntime sessions. Each case names
the kernel its op's ROUTES sends it to, and checks the launch is that kernel's."""
import numpy as np
import pytest
from numba import config
from test_awq_kernels import REAL_GPU, activations, awq_model, check_matmul, weights

import onnx_lowbit
from onnx_lowbit import domain
from onnx_lowbit.custom_ops.device.launch import SimLauncher
from onnx_lowbit.custom_ops.device.splitk import partial_floats

SIM = bool(config.ENABLE_CUDASIM)


# --------------------------------------------- split-K partials from onnxruntime's allocator (MatMulAWQ, FusedFFNAWQ)
# The kernel objects' compute, as a session calls it, under the simulator: the real kernels at their GPU geometry,
# on arrays over the simulator's host memory of exactly the declared sizes, and a stand-in Context whose scratch is
# filled with NaN (no zeroing needed). On a GPU the session test below checks the same through onnxruntime.
class _ScratchCtx:
    """bridge.Context's stand-in: outputs and (with ``has_scratch``) scratch are numpy buffers (host memory is the
    simulator's device memory), scratch filled with NaN; both reported to the recorder as Context does."""

    def __init__(self, has_scratch, stream=7):
        self.has_scratch, self.stream, self.recorder = has_scratch, stream, None
        self.keep, self.asked = [], []

    def _buf(self, nbytes, fill):
        b = np.full(max(nbytes, 1), fill, np.uint8)
        self.keep.append(b)
        return b.ctypes.data

    def output(self, index, shape):
        ptr = self._buf(int(np.prod(shape)) * 4, 0)
        if self.recorder is not None:
            self.recorder.output(index, tuple(shape), ptr)
        return ptr

    def scratch(self, nbytes):
        assert self.has_scratch
        self.asked.append(nbytes)
        ptr = self._buf(nbytes, 0xFF)                       # NaN in every float
        if self.recorder is not None:
            self.recorder.scratch(ptr, nbytes)
        return ptr


@pytest.fixture
def sim_kernels():
    """The kernel modules; their objects run under the simulator only (GPU: test_gpu_session_...)."""
    if not SIM:
        pytest.skip("kernel objects over host memory: simulator only (on a GPU: test_gpu_session_...)")
    from onnx_lowbit.custom_ops.awq import matmulawq_cuda
    from onnx_lowbit.custom_ops.ffn import fusedffnawq_cuda
    return matmulawq_cuda, fusedffnawq_cuda


def _kernel(op, dtype, K, N, G):  # noqa: N803
    """The CUDA kernel object a session builds for an ``op`` node with X / A of ``dtype``."""
    from onnx_lowbit.custom_ops.runtime.kernels import kernel_class
    t = 10 if dtype == np.float16 else 1
    return kernel_class(op, "CUDAExecutionProvider")(spec=domain.OPS[op], attrs={"group_size": G, "K": K, "N": N},
                                                     node_name="t", in_types=(t,), out_types=(t,))


def _operands(arrays, nw):
    """(X, weights) of a call's host arrays as the bridge's Tensors (the kernel object's Case reads them)."""
    t = [_tensor(a) for a in arrays[:1 + 3 * nw]]
    return t[0], [tuple(t[1 + 3 * i:4 + 3 * i]) for i in range(nw)]


def _tensor(a):
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    et = {np.dtype(np.float32): 1, np.dtype(np.float16): 10, np.dtype(np.int32): 6}[a.dtype]
    return Tensor(a.ctypes.data, et, a.shape)


def _call(kernel, ctx, arrays, out_shape, dtype):
    """One recorded compute call: (output, plan, its launch's patches {slot: (kind, offset)}, the launch's
    partials and counters as (pointer, nitems, slot))."""
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.runtime.abi import LbPlan
    plan = LbPlan()
    plans.compute_and_record(kernel, ctx, [_tensor(a) if a is not None else None for a in arrays], plan)
    assert plan.valid and plan.n_steps == 1
    st = plan.steps[0]
    patches = {st.patch_slot[j]: (st.patch_kind[j], st.patch_off[j]) for j in range(st.n_patch)}
    part, cnt = SimLauncher.last_slots[-2:]      # the last two array arguments: the partials, the counters
    y = np.frombuffer(ctx.keep[0], np.dtype(dtype))[:int(np.prod(out_shape))].reshape(out_shape).copy()
    return y, plan, patches, (st.params[part], st.params[part - 2], part), (st.params[cnt], st.params[cnt - 2], cnt)


SCRATCH_CASES = [  # op, M, dtype, has_scratch: the fp32 decode kernel (fp32: M = 1, 3), the small-M tensor-core
    # GEMV (matmulawq1_cuda, fp16: M = 1, and M = 2 .. 16 in chunks of 8 rows)
    ("MatMulAWQ", 1, np.float32, True), ("MatMulAWQ", 3, np.float16, True), ("MatMulAWQ", 1, np.float16, False),
    ("MatMulAWQ", 1, np.float16, True), ("MatMulAWQ", 11, np.float16, True), ("MatMulAWQ", 3, np.float32, True),
    ("FusedFFNAWQ", 1, np.float32, True), ("FusedFFNAWQ", 5, np.float16, True), ("FusedFFNAWQ", 2, np.float16, False),
    ("FusedFFNAWQ", 1, np.float16, True), ("FusedFFNAWQ", 1, np.float16, False), ("FusedFFNAWQ", 9, np.float16, True),
    ("FusedFFNAWQ", 16, np.float16, False), ("FusedFFNAWQ", 6, np.float32, True),
]


@pytest.mark.parametrize("op,M,dtype,has_scratch", SCRATCH_CASES)
def test_session_call_takes_its_partials_from_ort_scratch(sim_kernels, op, M, dtype, has_scratch):  # noqa: N803
    """compute takes the split-K partials through ctx.scratch, exactly the launch's splits x nw x M x N floats, once
    per call, recorded as the plan's SCRATCH (patched per replay); the tile counters are the kernel's per-stream
    buffer (unpatched in the plan) and zero after every call; results meet the reference on NaN-filled scratch,
    twice in a row. Without onnxruntime's scratch (< 1.18) the partials are the pool's own per-stream buffer."""
    from onnx_lowbit.custom_ops.device import splitk
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.runtime.routing import route
    K, N, G = 256, 64, 32  # noqa: N806
    nw = 1 if op == "MatMulAWQ" else 2
    kern = _kernel(op, dtype, K, N, G)
    a = activations((M, K), dtype, seed=M + 40)
    if nw == 1:
        qw, qz, sc = weights(K, N, G, seed=8)
        bias = activations((N,), dtype, seed=41)
        arrays = [a, qw, qz, sc, bias]
    else:
        from test_ffn4_kernels import awq_weights, check_awq
        w1, w3 = awq_weights(K, N, G, seed=5)
        arrays = [a, *w1, *w3, activations((N,), dtype, seed=42), None]
    small = dtype == np.float16                # fp16: the small-M tensor-core GEMV, else the fp32 decode kernel
    name = route(type(kern).ROUTES, kern.case(M, *_operands(arrays, nw))).kernel
    assert name == ("gemv1" if M == 1 else "gemv8") if small else name == "decode"
    sp = kern.gemv[1 if M == 1 else 8] if small else None
    splits = sp.splits if small else kern.plans[M][2]
    assert splits > 1                       # the shapes need the partials
    floats = partial_floats(splits, nw, M, N)
    for _ in range(2):                      # the counters the first call left must serve the second
        ctx = _ScratchCtx(has_scratch)
        y, plan, patches, part, cnt = _call(kern, ctx, arrays, (M, N), dtype)
        if nw == 1:
            check_matmul(y, a, qw, qz, sc, G, K, N, bias)
        else:
            check_awq(y, a, w1, w3, G, K, N, arrays[7], None)
        block = sp.block if small else 256
        assert plan.steps[0].block == block     # the kernel the case is for
        assert part[1] == floats and cnt[1] == kern.scratch.tiles
        assert cnt[0] == kern.scratch.counters(ctx.stream)[0] and cnt[2] not in patches   # kernel-owned, kept
        assert np.all(kern.scratch._cnt[ctx.stream].copy_to_host() == 0)      # left zeroed for the next launch
        scratch_slots = [s for s, (kind, _) in patches.items() if kind == plans.SCRATCH]
        if has_scratch:
            assert ctx.asked == [4 * floats] and plan.scratch == 4 * floats   # one buffer per call, exact size
            assert scratch_slots == [part[2]] and patches[part[2]] == (plans.SCRATCH, 0)
            assert kern.scratch.owned_partials() == 0
        else:
            assert ctx.asked == [] and plan.scratch == 0 and scratch_slots == []   # kept: the pool's, per stream
            assert part[0] == splitk._dptr(kern.scratch._acc[ctx.stream])
            assert kern.scratch.owned_partials() == 1
    # another stream gets counters of its own
    assert kern.scratch.counters(8)[0] != kern.scratch.counters(7)[0]


@pytest.mark.parametrize("op", ["MatMulAWQ", "FusedFFNAWQ"])
def test_m1_gemv_needs_8_byte_aligned_x(sim_kernels, op):
    """M = 1, fp16: the tensor-core GEMV reads X 8 bytes at a time; an X that is only 2-byte aligned (a view one
    element into a buffer) takes the fp32 decode kernel instead, with the same result bounds."""
    K, N, G = 256, 64, 32  # noqa: N806
    nw = 1 if op == "MatMulAWQ" else 2
    kern = _kernel(op, np.float16, K, N, G)
    assert 1 in kern.gemv
    buf = activations((1, K + 4), np.float16, seed=44)
    for a, block in ((buf[:, :K], kern.gemv[1].block), (buf[:, 1:K + 1], 256)):   # 8-byte aligned / 2 bytes past
        if nw == 1:
            qw, qz, sc = weights(K, N, G, seed=8)
            arrays = [a, qw, qz, sc]
        else:
            from test_ffn4_kernels import awq_weights, check_awq
            w1, w3 = awq_weights(K, N, G, seed=5)
            arrays = [a, *w1, *w3]
        y, plan, _, _, _ = _call(kern, _ScratchCtx(True), arrays, (1, N), np.float16)
        assert plan.steps[0].block == block
        if nw == 1:
            check_matmul(y, a, qw, qz, sc, G, K, N)
        else:
            check_awq(y, a, w1, w3, G, K, N, None, None)


@pytest.mark.parametrize("M,K,G,dtype", [(1, 8, 8, np.float32), (2, 64, 64, np.float16)])
def test_single_split_takes_no_scratch(sim_kernels, M, K, G, dtype):  # noqa: N803
    """A launch with one K split (fp32 decode kernel, small-M tensor-core GEMV) writes the output directly: no
    partials, no scratch asked for."""
    N = 16  # noqa: N806
    kern = _kernel("MatMulAWQ", dtype, K, N, G)
    assert (kern.gemv[8].splits if M >= 2 else kern.plans[1][2]) == 1
    qw, qz, sc = weights(K, N, G, seed=9)
    a = activations((M, K), dtype, seed=43)
    ctx = _ScratchCtx(True)
    y, plan, _, part, _ = _call(kern, ctx, [a, qw, qz, sc], (M, N), dtype)
    check_matmul(y, a, qw, qz, sc, G, K, N)
    assert ctx.asked == [] and plan.scratch == 0 and part[:2] == (0, 0)


def test_gpu_session_takes_partials_from_onnxruntime():
    """GPU: one-node MatMulAWQ and FusedFFNAWQ sessions (fp32 decode kernel at M=1, the small-M tensor-core GEMV
    with fp16 A at M = 1 and 4) take
    their partials from onnxruntime's allocator on every call (the recording one and the native replays: the
    shim's counters) and keep none of their own; results meet the reference and repeat bit for bit."""
    if SIM or not REAL_GPU:
        pytest.skip("onnxruntime CUDA sessions: real GPU only (ONNX_LOWBIT_REAL_GPU=1)")
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here")
    from test_ffn4_kernels import awq_model as ffn_model
    from test_ffn4_kernels import awq_weights, check_awq

    from onnx_lowbit.custom_ops.awq import matmulawq_cuda
    from onnx_lowbit.custom_ops.ffn import fusedffnawq_cuda
    from onnx_lowbit.custom_ops.runtime import bridge
    K, N, G = 2048, 256, 64  # noqa: N806
    qw, qz, sc = weights(K, N, G, seed=10)
    w1, w3 = awq_weights(K, N, G, seed=11)
    for op in ("MatMulAWQ", "FusedFFNAWQ"):
        for M, dtype in ((1, np.float32), (1, np.float16), (4, np.float16)):  # noqa: N806
            a = activations((1, M, K), dtype, seed=M + 50)
            if op == "MatMulAWQ":
                model = awq_model(op, K, N, G, a_dtype=dtype, lead=("B", "T"),
                                  initializers={"qweight": qw, "qzeros": qz, "scales": sc})
                feeds = {"A": a}
            else:
                model = ffn_model((1, M), K, N, G, dtype, w1, w3, None, None)
                feeds = {"x": a}
            ids = set(bridge._kernels)
            sess = onnx_lowbit.InferenceSession(model, providers=["CUDAExecutionProvider"])
            kern = [k for i, k in bridge._kernels.items() if i not in ids][0]
            assert isinstance(kern, (matmulawq_cuda.MatMulAWQCudaKernel, fusedffnawq_cuda.FusedFFNAWQCudaKernel))
            nw = 1 if op == "MatMulAWQ" else 2
            if dtype == np.float16:                     # ROUTES: gemv1 / gemv8 (aligned onnxruntime buffers)
                splits = kern.gemv[1 if M == 1 else 8].splits
            else:
                splits = kern.plans[M][2]
            assert splits > 1, (op, M, dtype)
            counts = bridge.scratch_counts()
            ys = [sess.run(None, feeds)[0] for _ in range(4)]
            now = bridge.scratch_counts()
            nbytes = 4 * partial_floats(splits, nw, M, N)
            assert {k: now[k] - counts[k] for k in now} == {"taken": 4, "given_back": 4, "bytes": 4 * nbytes}
            assert kern.scratch.owned_partials() == 0
            if op == "MatMulAWQ":
                check_matmul(ys[0], a, qw, qz, sc, G, K, N)
            else:
                check_awq(ys[0], a, w1, w3, G, K, N, None, None)
            for y in ys[1:]:
                assert np.array_equal(y, ys[0])


if REAL_GPU and SIM:  # pragma: no cover
    raise RuntimeError("ONNX_LOWBIT_REAL_GPU=1 but the CUDA simulator is on")

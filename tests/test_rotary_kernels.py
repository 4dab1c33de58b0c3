"""Rotary: reference (onnx_lowbit.rotary), CPU face (custom_ops/attention/rotary_cpu.py) and CUDA face
(custom_ops/attention/rotary_cuda.py; under Numba's CUDA simulator in CI, on the GPU with ONNX_LOWBIT_REAL_GPU=1).

Both kernels must equal the reference bit for bit (NaN where it has NaN), and the reference must equal what the
unfused ONNX graph (Mul, Slice, Slice, Neg, Concat, Mul, Add) computes in onnxruntime, on the CPU EP and, where
a GPU and onnxruntime-gpu are present, on the CUDA EP (with and without CUDA graphs).
"""
import os

import numpy as np
import pytest
from numba import config
from onnx import TensorProto, helper, numpy_helper

from helpers import SimContext, direct_run
from onnx_lowbit import domain, rotary
from onnx_lowbit.custom_ops.attention import rotary_cpu, rotary_cuda
from onnx_lowbit.custom_ops.runtime import routing

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
F16, F32 = np.float16, np.float32
ET = {F16: TensorProto.FLOAT16, F32: TensorProto.FLOAT}

# (X shape, cos/sin shape): LLaMA q/k [B, H, S, D] with cos [B or 1, 1, S, D], a 2-D table, a per-position
# scalar, rank 1 and rank 5, a single row, an empty X
SHAPES = [((2, 3, 5, 8), (1, 1, 5, 8)), ((2, 3, 5, 8), (2, 1, 5, 8)), ((2, 3, 5, 8), (5, 8)),
          ((2, 3, 5, 8), (5, 1)), ((6,), (6,)), ((2, 2, 3, 2, 6), (2, 1, 2, 6)), ((1, 4, 1, 16), (1, 1, 1, 16)),
          ((0, 4), (4,)), ((3, 2), (1,))]


def _data(xs, cs, dt, seed=0, specials=True):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(xs) * 4).astype(dt)
    c = rng.uniform(-1, 1, cs).astype(dt)
    s = rng.uniform(-1, 1, cs).astype(dt)
    if specials and x.size >= 4:
        x.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, 6e4]
    return x, c, s


def cuda_run(x, c, s, sms=None):
    """The CUDA face as a session node runs it (direct.call); ``sms``: the kernel object's grid size."""
    setup = None if sms is None else (lambda k: setattr(k, "sms", sms))
    return direct_run("Rotary", {}, [x, c, s], [(x.shape, x.dtype)], setup=setup)[0]


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


# ------------------------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("dt", [F16, F32])
def test_reference_is_the_rotation(dt):
    """Y pairs (j, j + D/2) are the 2-D rotation of (x_j, x_{j+D/2}) by the angle whose cos / sin are given."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 16)).astype(dt)
    theta = rng.uniform(-np.pi, np.pi, (4, 16)).astype(np.float64)
    theta[:, 8:] = theta[:, :8]                       # LLaMA's table: the same angle for j and j + D/2
    y = rotary.apply(x, np.cos(theta).astype(dt), np.sin(theta).astype(dt)).astype(np.float64)
    x64, t = x.astype(np.float64), theta[:, :8]
    want = np.concatenate([x64[..., :8] * np.cos(t) - x64[..., 8:] * np.sin(t),
                           x64[..., 8:] * np.cos(t) + x64[..., :8] * np.sin(t)], axis=-1)
    tol = 4e-3 if dt == F16 else 1e-6
    assert np.allclose(y, want, rtol=tol, atol=tol * 4)
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x64, axis=-1), rtol=tol * 2)


def test_reference_rounds_each_operation():
    """fp16: the result is what the separate fp16 ops give, not the exactly rounded fp32 formula."""
    x, c, s = _data((64, 128), (64, 128), F16, specials=False)
    stepwise = rotary.apply(x, c, s)
    h = 64
    xf, cf, sf = x.astype(F32), c.astype(F32), s.astype(F32)
    rot = np.concatenate([-xf[:, h:], xf[:, :h]], axis=-1)
    once = (xf * cf + rot * sf).astype(F16)
    assert not np.array_equal(stepwise, once)     # the rounding of the products shows on 8192 values
    assert np.array_equal(stepwise, ((xf * cf).astype(F16).astype(F32) + (rot * sf).astype(F16).astype(F32))
                          .astype(F16))


def test_layout_merges_axes():
    dims, d, cst, sst = rotary.layout((2, 3, 5, 8), (1, 1, 5, 8), (1, 1, 5, 8))
    assert (dims, d, cst, sst) == ([1, 1, 6, 5], 8, [0, 0, 0, 8, 1], [0, 0, 0, 8, 1])
    dims, d, cst, _ = rotary.layout((2, 3, 5, 8), (2, 1, 5, 8), (5, 1))
    assert dims == [1, 2, 3, 5] and d == 8 and cst == [0, 40, 0, 8, 1]
    assert rotary.layout((8,), (8,), (1,))[0] == [1, 1, 1, 1]


@pytest.mark.parametrize("xs,cs,dt,cdt,match", [
    ((2, 7), (7,), F32, F32, "even length"),
    ((2, 8), (3, 8), F32, F32, "does not broadcast"),
    ((8,), (2, 8), F32, F32, "does not broadcast"),
    ((2, 8), (8,), F32, F16, "must have X's type"),
    ((2, 8), (8,), np.float64, np.float64, "float or float16"),
    ((), (), F32, F32, "at least one axis")])
def test_reference_refuses(xs, cs, dt, cdt, match):
    x, c = np.zeros(xs, dt), np.zeros(cs, cdt)
    with pytest.raises(rotary.RotaryError, match=match):
        rotary.apply(x, c, c)
    with pytest.raises(rotary.RotaryError, match=match):
        rotary_cpu.run(x, c, c)


def test_layout_refuses_too_many_broadcast_runs():
    xs = (2, 2, 2, 2, 2, 2, 4)
    with pytest.raises(rotary.RotaryError, match="separate runs"):
        rotary.layout(xs, (2, 1, 2, 1, 2, 1, 4), (4,))


# ------------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("xs,cs", SHAPES)
def test_cpu_kernel_bit_exact(xs, cs, dt):
    x, c, s = _data(xs, cs, dt, seed=len(xs))
    assert _same(rotary_cpu.run(x, c, s), rotary.apply(x, c, s))


@pytest.mark.parametrize("dt", [F16, F32])
def test_cpu_kernel_parallel_path(dt):
    x, c, s = _data((1, 16, 64, 128), (1, 1, 64, 128), dt)
    assert x.size >= rotary_cpu.PARALLEL_MIN
    assert _same(rotary_cpu.run(x, c, s), rotary.apply(x, c, s))


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("xs,cs", SHAPES)
def test_cuda_kernel_bit_exact(xs, cs, dt):
    if not SIM and not REAL_GPU:
        pytest.skip("CUDA kernels: simulator (NUMBA_ENABLE_CUDASIM=1) or ONNX_LOWBIT_REAL_GPU=1")
    x, c, s = _data(xs, cs, dt, seed=len(xs))
    assert _same(cuda_run(x, c, s), rotary.apply(x, c, s))


def test_cuda_kernel_grid_stride():
    """More pairs than the grid has threads: each thread takes several (one SM: 8 blocks of 256)."""
    if not SIM and not REAL_GPU:
        pytest.skip("CUDA kernels: simulator (NUMBA_ENABLE_CUDASIM=1) or ONNX_LOWBIT_REAL_GPU=1")
    x, c, s = _data((2, 3, 9, 80), (1, 1, 9, 80), F16)
    assert x.size // 2 > rotary_cuda.BLOCK * rotary_cuda.GRID_PER_SM
    assert _same(cuda_run(x, c, s, sms=1), rotary.apply(x, c, s))


@pytest.mark.skipif(not REAL_GPU, reason="LLaMA-size shapes on the GPU only")
@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("xs,cs", [((1, 32, 1, 128), (1, 1, 1, 128)), ((4, 32, 512, 128), (4, 1, 512, 128)),
                                   ((1, 40, 77, 64), (77, 64))])
def test_gpu_large(xs, cs, dt):
    x, c, s = _data(xs, cs, dt)
    assert _same(cuda_run(x, c, s), rotary.apply(x, c, s))



@pytest.mark.skipif(not SIM, reason="stand-in context over host memory: simulator only")
@pytest.mark.parametrize("dt", [F16, F32])
def test_cuda_kernel_object_compute(dt, monkeypatch):
    """The kernel object as a session calls it: validates shapes, allocates Y, launches once; bad shapes name
    the problem."""
    from onnx_lowbit.custom_ops.device import launch as cuda_launch
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_launch, "sm_count", lambda device: 1)
    et = int(ET[dt])
    kern = rotary_cuda.KERNEL(spec=domain.OPS["Rotary"], attrs={}, node_name="rot0", in_types=(et,) * 3,
                              out_types=(et,))
    x, c, s = _data((2, 2, 3, 8), (1, 1, 3, 8), dt)
    ctx = SimContext()
    kern.compute(ctx, [Tensor(a.ctypes.data, et, a.shape) for a in (x, c, s)])
    got = ctx.keep[0][0].view(dt)[: x.size].reshape(x.shape)
    assert _same(got, rotary.apply(x, c, s))
    bad = np.zeros((3, 3, 8), dt)
    with pytest.raises(KernelError, match="does not broadcast"):
        kern.compute(SimContext(), [Tensor(a.ctypes.data, et, a.shape) for a in (x, bad, bad)])


def test_routes():
    """The table read from the old code: one kernel per element type; every kernel it names has a launcher."""
    name = lambda dt: routing.route(rotary_cuda.ROUTES, routing.Case(dt, 64)).kernel  # noqa: E731
    assert (name("float16"), name("float32")) == ("rotary16", "rotary32")
    assert routing.kernels(rotary_cuda.ROUTES) == list(rotary_cuda.KERNELS)
    for k in routing.kernels(rotary_cuda.ROUTES):
        assert rotary_cuda.launcher(k) is rotary_cuda.launcher(k)


# ------------------------------------------------------------------------------------------------ sessions
def unfused_model(xs, cs, dt, opset=17):
    """The exporters' spelling: X * cos + concat(-X[..., h:], X[..., :h]) * sin."""
    h = xs[-1] // 2
    ints = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    inits = [ints("z", [0]), ints("h", [h]), ints("big", [2 ** 62]), ints("ax", [-1])]
    nodes = [helper.make_node("Mul", ["X", "cos"], ["a"]),
             helper.make_node("Slice", ["X", "z", "h", "ax"], ["s1"]),
             helper.make_node("Slice", ["X", "h", "big", "ax"], ["s2"]),
             helper.make_node("Neg", ["s2"], ["n"]),
             helper.make_node("Concat", ["n", "s1"], ["r"], axis=-1),
             helper.make_node("Mul", ["r", "sin"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["Y"])]
    return _model(nodes, inits, xs, cs, dt, opset)


def fused_model(xs, cs, dt, opset=17):
    node = helper.make_node("Rotary", ["X", "cos", "sin"], ["Y"], domain=domain.DOMAIN, name="rot0")
    return _model([node], [], xs, cs, dt, opset, ours=True)


def _model(nodes, inits, xs, cs, dt, opset, ours=False):
    et = ET[dt]
    g = helper.make_graph(nodes, "rotary", [helper.make_tensor_value_info("X", et, list(xs)),
                                            helper.make_tensor_value_info("cos", et, list(cs)),
                                            helper.make_tensor_value_info("sin", et, list(cs))],
                          [helper.make_tensor_value_info("Y", et, list(xs))], inits)
    ops = [helper.make_opsetid("", opset)] + ([domain.opset_import()] if ours else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def _session(model, providers):
    import onnx_lowbit
    return onnx_lowbit.InferenceSession(model.SerializeToString(), providers=providers)


@pytest.mark.parametrize("xs,cs", [((2, 3, 5, 8), (1, 1, 5, 8)), ((1, 4, 1, 16), (16,)), ((3, 8), (3, 8)),
                                   ((1, 9, 128, 64), (1, 1, 128, 64))])   # SmolLM2's q: the parallel path
def test_cpu_session_equals_the_unfused_graph(xs, cs):
    """fp32 on the CPU EP: the Rotary node gives onnxruntime's unfused result bit for bit. fp16: onnxruntime's CPU
    EP runs the unfused fp16 ops in fp32 (it inserts Casts around them), so its result is the formula rounded once;
    the op rounds each product as the fp16 ops do (as the CUDA EP computes them): apart by at most those roundings,
    3 * 2^-11 (|x cos| + |rotate_half(x) sin|) (more than an ulp of the result where the two cancel)."""
    for dt in (F32, F16):
        x, c, s = _data(xs, cs, dt)
        feeds = {"X": x, "cos": c, "sin": s}
        got = _session(fused_model(xs, cs, dt), ["CPUExecutionProvider"]).run(None, feeds)[0]
        assert _same(got, rotary.apply(x, c, s))
        want = _session(unfused_model(xs, cs, dt), ["CPUExecutionProvider"]).run(None, feeds)[0]
        if dt == F32:
            assert _same(got, want)
        else:
            fin = np.isfinite(want) & np.isfinite(got)
            assert np.array_equal(np.isnan(got), np.isnan(want))
            x64, c64, s64 = (a.astype(np.float64) for a in (x, c, s))
            with np.errstate(invalid="ignore"):
                mag = np.abs(x64 * c64) + np.abs(rotary.rotate_half(x64) * s64)
                err = np.abs(got.astype(np.float64) - want.astype(np.float64))
            assert (err[fin] <= 3 * 2.0 ** -11 * mag[fin] + 2.0 ** -24).all()


def test_cpu_session_bad_shapes_name_the_problem():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    sess = _session(fused_model(("B", 8), ("C", 8), F32), ["CPUExecutionProvider"])
    x = np.ones((2, 8), F32)
    with pytest.raises(Fail, match=r"Rotary node 'rot0'.*does not broadcast"):
        sess.run(None, {"X": x, "cos": np.ones((3, 8), F32), "sin": np.ones((3, 8), F32)})


FRESH_PROCESS = r"""
import sys
import numpy as np
import onnx_lowbit
from onnx_lowbit import rotary
from onnx_lowbit.custom_ops.attention import rotary_cpu
sys.path.insert(0, sys.argv[1])
from test_rotary_kernels import F16, F32, _data, _same, fused_model, unfused_model
xs, cs = (1, 3, 512, 64), (1, 1, 512, 64)          # SmolLM2's k at 512 tokens: the first call already parallel
assert np.prod(xs) >= rotary_cpu.PARALLEL_MIN
x, c, s = _data(xs, cs, F32)
feeds = {"X": x, "cos": c, "sin": s}
got = onnx_lowbit.InferenceSession(fused_model(xs, cs, F32).SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)[0]
import onnxruntime as ort
want = ort.InferenceSession(unfused_model(xs, cs, F32).SerializeToString(),
                            providers=["CPUExecutionProvider"]).run(None, feeds)[0]
assert _same(got, want), "fp32 session differs from the unfused graph"
x, c, s = _data(xs, cs, F16)
assert _same(rotary_cpu.run(x, c, s), rotary.apply(x, c, s)), "fp16 parallel kernel differs from the reference"
print("fresh-process rotary ok")
"""


def test_cpu_parallel_variant_compiled_first_in_a_fresh_process(tmp_path):
    """The prange variant compiled before any serial one (a fresh process, an empty Numba cache): a Rotary node whose
    every call has PARALLEL_MIN elements or more, as SmolLM2's unmerged q and k at 512 tokens. It failed to compile
    ("convert to parfors: Overwrite of parallel loop index": the inlined row-offset helper reassigned the loop index)
    unless the serial variant of that type had been compiled earlier in the process, as a short first call (tiny
    LLaMAs, this file's earlier tests) does."""
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    p = subprocess.run([sys.executable, "-c", FRESH_PROCESS, os.path.dirname(os.path.abspath(__file__))],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and "fresh-process rotary ok" in p.stdout, (p.stdout + p.stderr)[-3000:]


def _ort_cuda():
    try:
        import onnxruntime as ort
    except ImportError:
        pytest.skip("onnxruntime not installed")
    if SIM or not REAL_GPU or "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime's CUDA execution provider and a real GPU needed")
    return ort


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_session_equals_the_unfused_graph(dt, graph):
    """On the CUDA EP: the Rotary node equals onnxruntime's own unfused kernels bit for bit, also replayed in a
    CUDA graph with new input contents."""
    ort = _ort_cuda()
    xs, cs = (1, 16, 1, 128), (1, 1, 1, 128)
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    ref = ort.InferenceSession(unfused_model(xs, cs, dt).SerializeToString(), providers=cuda)
    prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"] if graph else cuda
    sess = _session(fused_model(xs, cs, dt), prov)
    bound = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in zip(("X", "cos", "sin"), _data(xs, cs, dt))}
    yv = ort.OrtValue.ortvalue_from_shape_and_type(xs, dt, "cuda", 0)
    io = sess.io_binding()
    for n, v in bound.items():
        io.bind_ortvalue_input(n, v)
    io.bind_ortvalue_output("Y", yv)
    for seed in range(4):       # with a graph: the first runs capture, the later ones replay
        x, c, s = _data(xs, cs, dt, seed=seed)
        for n, a in (("X", x), ("cos", c), ("sin", s)):
            bound[n].update_inplace(a)
        sess.run_with_iobinding(io)
        want = ref.run(None, {"X": x, "cos": c, "sin": s})[0]
        assert _same(yv.numpy(), want), seed
        assert _same(want, rotary.apply(x, c, s)), seed

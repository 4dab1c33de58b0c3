"""RMSNorm: reference (onnx_lowbit.rmsnorm), CPU face (custom_ops/attention/rmsnorm_cpu.py) and CUDA face
(custom_ops/attention/rmsnorm_cuda.py; under Numba's CUDA simulator in CI, on the GPU with ONNX_LOWBIT_REAL_GPU=1).

H must equal the reference bit for bit; Y within the reference's stated bound (fp32: a few ulps of the fp32 sum
order, checked as 2e-6 relative to max |Y|; fp16: two fp16 ulps). The reference itself is checked against a
float64 RMS normalisation, and in sessions against onnxruntime's run of the unfused graph (Add, Cast, Pow,
ReduceMean, Add, Sqrt, Div, Mul, Cast, Mul).
"""
import os

import numpy as np
import pytest
from numba import config
from onnx import TensorProto, helper, numpy_helper

from helpers import direct_run
from onnx_lowbit import domain, halfbits, rmsnorm
from onnx_lowbit.custom_ops.attention import rmsnorm_cpu, rmsnorm_cuda
from onnx_lowbit.custom_ops.runtime import routing

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")    # NaN / Inf inputs in the simulator's scalars
SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
F16, F32 = np.float16, np.float32
ET = {F16: TensorProto.FLOAT16, F32: TensorProto.FLOAT}
EPS = 1e-5
SHAPES = [(1, 1, 96), (3, 2, 64), (7,), (0, 8), (5, 40), (2, 1)]


def cuda_run(x, g, skip, eps, block=None, sms=None, misalign=(), outputs=2):
    """(Y, H) of the CUDA face run as a session node runs it (direct.call); ``block``: force the two-pass kernel with
    that many threads, ``sms``: the grid size (both set on the kernel object); ``misalign``: input indices placed
    off 16-byte alignment; ``outputs`` 1: Y only (H is None)."""
    def setup(k):
        k.block = block
        k.sms = sms or k.sms
    res = direct_run("RMSNorm", {"epsilon": eps}, [x, g, skip], [(x.shape, x.dtype)] * outputs, setup=setup,
                     misalign=misalign)
    return (res[0], res[1]) if outputs == 2 else (res[0], None)


@pytest.fixture
def launched(monkeypatch):
    """The ``ept`` of every RMSNorm launcher fetched during the test (-1 vector, EPT register, 0 two-pass): which
    kernel actually ran."""
    seen = []
    real = rmsnorm_cuda.launcher

    def spy(elem, ept, has_skip, has_h):
        seen.append(ept)
        return real(elem, ept, has_skip, has_h)
    monkeypatch.setattr(rmsnorm_cuda, "launcher", spy)
    return seen


def _data(shape, dt, seed=0, specials=False):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(dt)
    skip = rng.standard_normal(shape).astype(dt)
    g = rng.uniform(-2, 2, shape[-1:]).astype(dt)
    if specials and x.size >= 3 * shape[-1]:
        x.reshape(-1, shape[-1])[1, 0] = np.nan                  # row 1: NaN everywhere in Y
        x.reshape(-1, shape[-1])[2, 0] = np.inf
    return x, g, skip


def close(y, want):
    """Y within the reference's bound (NaN where it has NaN)."""
    assert y.shape == want.shape and y.dtype == want.dtype
    assert np.array_equal(np.isnan(y), np.isnan(want))
    fin = np.isfinite(want)
    if y.dtype == F16:
        return halfbits.ulp_distance_fp16(y[fin], want[fin]).max(initial=0) <= 2
    scale = max(float(np.abs(want[fin]).max(initial=0)), 1e-30)
    return float(np.abs(y[fin] - want[fin]).max(initial=0)) <= 2e-6 * scale


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("dt", [F16, F32])
def test_reference_is_rms_normalisation(dt):
    x, g, skip = _data((4, 256), dt)
    y, h = rmsnorm.apply(x, g, skip, EPS)
    h64 = x.astype(np.float64) + skip.astype(np.float64)
    want = g.astype(np.float64) * h64 / np.sqrt((h64 ** 2).mean(-1, keepdims=True) + EPS)
    tol = 4e-3 if dt == F16 else 1e-6
    assert np.allclose(y.astype(np.float64), want, rtol=tol, atol=tol)
    assert same(h, (x + skip).astype(dt))
    y1, h1 = rmsnorm.apply(x, g, None, EPS)
    assert h1 is x


@pytest.mark.parametrize("shape,gshape,sshape,dt,match", [
    ((2, 8), (4,), None, F32, r"gamma must have shape \[8\]"),
    ((2, 8), (8,), (8,), F32, "skip must have X's shape"),
    ((2, 8), (8,), None, np.float64, "float or float16"),
    ((), (1,), None, F32, "at least one axis")])
def test_refuses(shape, gshape, sshape, dt, match):
    x, g = np.zeros(shape, dt), np.zeros(gshape, dt)
    s = None if sshape is None else np.zeros(sshape, dt)
    with pytest.raises(rmsnorm.RMSNormError, match=match):
        rmsnorm.apply(x, g, s)
    with pytest.raises(rmsnorm.RMSNormError, match=match):
        rmsnorm_cpu.run(x, g, s)


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("shape", SHAPES + [(300, 512)])
@pytest.mark.parametrize("with_skip", [False, True])
def test_cpu_kernel(shape, dt, with_skip):
    x, g, skip = _data(shape, dt, seed=len(shape), specials=True)
    skip = skip if with_skip else None
    want_y, want_h = rmsnorm.apply(x, g, skip, EPS)
    h = np.empty_like(x)
    y, _ = rmsnorm_cpu.run(x, g, skip, EPS, h=h)
    assert close(y, want_y) and same(h, want_h)


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_skip", [False, True])
@pytest.mark.parametrize("kernel", ["routed", "register", "twopass"])
def test_cuda_kernel(shape, dt, with_skip, kernel, launched):
    """Every kernel on every shape: as routed (fp16 rows of a multiple of 8: the vector kernel), the register kernel
    (fp16 reached by placing X off 16-byte alignment, as a view into a larger buffer would be) and the two-pass one
    (32 threads, so rows of 40..96 elements take several passes per thread)."""
    if not SIM and not REAL_GPU:
        pytest.skip("CUDA kernels: simulator (NUMBA_ENABLE_CUDASIM=1) or ONNX_LOWBIT_REAL_GPU=1")
    x, g, skip = _data(shape, dt, seed=len(shape), specials=True)
    skip = skip if with_skip else None
    want_y, want_h = rmsnorm.apply(x, g, skip, EPS)
    y, h = cuda_run(x, g, skip, EPS, block=32 if kernel == "twopass" else None, sms=1,
                    misalign=(0,) if kernel == "register" else ())
    assert close(y, want_y) and same(h, want_h)
    if x.size:
        vec = dt == F16 and shape[-1] % 8 == 0 and kernel == "routed"
        assert launched == [-1 if vec else 0 if kernel == "twopass" else rmsnorm_cuda.EPT]


VEC_SHAPES = [(1, 1, 2048), (3, 2, 576), (5, 8), (2, 1, 264), (4, 40)]


@pytest.mark.parametrize("shape", VEC_SHAPES)
@pytest.mark.parametrize("with_skip,outputs", [(False, 1), (True, 1), (True, 2)])
@pytest.mark.parametrize("sms", [1, None])
def test_cuda_vector_kernel(shape, with_skip, outputs, sms, launched):
    """The vector kernel (fp16 rows of a multiple of 8 elements: a 16-byte chunk per thread): H bit-exact, Y within
    two ulps, NaN / Inf rows as the reference; idle threads (576 elements: 72 chunks in 96 threads) store nothing;
    sms=1 sends several rows through one block (the grid-stride loop); with and without the H output (genai's
    plain norms have none)."""
    if not SIM and not REAL_GPU:
        pytest.skip("CUDA kernels: simulator (NUMBA_ENABLE_CUDASIM=1) or ONNX_LOWBIT_REAL_GPU=1")
    x, g, skip = _data(shape, F16, seed=sum(shape), specials=True)
    skip = skip if with_skip else None
    want_y, want_h = rmsnorm.apply(x, g, skip, EPS)
    y, h = cuda_run(x, g, skip, EPS, sms=sms, outputs=outputs)
    assert launched == [-1]
    assert close(y, want_y) and (h is None or same(h, want_h))


def test_geometry():
    assert rmsnorm_cuda.geometry(2048, f16=True, aligned=True) == (-1, 256)
    assert rmsnorm_cuda.geometry(576, f16=True, aligned=True) == (-1, 96)
    assert rmsnorm_cuda.geometry(2048, f16=True, aligned=False) == (8, 256)     # unaligned: the register kernel
    assert rmsnorm_cuda.geometry(2044, f16=True, aligned=True) == (8, 256)      # not a multiple of 8
    assert rmsnorm_cuda.geometry(2048) == (8, 256) and rmsnorm_cuda.geometry(4096) == (8, 512)
    assert rmsnorm_cuda.geometry(100) == (8, 32) and rmsnorm_cuda.geometry(4097) == (0, rmsnorm_cuda.BLOCK)
    assert rmsnorm_cuda.geometry(8192) == (0, rmsnorm_cuda.BLOCK) and rmsnorm_cuda.geometry(64, 32) == (0, 32)


def test_routes():
    """The table: fp16 rows of a multiple of 8 elements up to VEC_MAX the vector kernel; else the register kernel up
    to 4096 elements a row unless a block size is forced, else the two-pass kernel; every kernel it names has a
    launcher (its element types, skip and H given or not)."""
    name = lambda d, block=None: routing.route(rmsnorm_cuda.ROUTES, routing.Case(  # noqa: E731
        "float16", 1, d, opts=routing.options(block=block))).kernel
    assert [name(1), name(4096), name(4097), name(64, 32)] == ["register", "vector", "twopass", "twopass"]
    assert name(8192) == "vector" and name(8200) == "twopass" and name(4100) == "twopass"
    ept = {"vector": -1, "register": rmsnorm_cuda.EPT, "twopass": 0}
    for k in routing.kernels(rmsnorm_cuda.ROUTES):
        for elem in (10,) if k == "vector" else (10, 1):      # the vector kernel is fp16 only
            for skip in (False, True):
                for h in (False, True):
                    lau = rmsnorm_cuda.launcher(elem, ept[k], skip, h)
                    assert lau is rmsnorm_cuda.launcher(elem, ept[k], skip, h)


@pytest.mark.skipif(not REAL_GPU, reason="LLaMA-size shapes on the GPU only")
@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (1, 1, 4096), (4, 128, 4096), (3, 1000), (2, 8192), (2, 10000)])
def test_gpu_large(shape, dt):
    x, g, skip = _data(shape, dt)
    want_y, want_h = rmsnorm.apply(x, g, skip, EPS)
    y, h = cuda_run(x, g, skip, EPS)
    assert close(y, want_y) and same(h, want_h)


# ------------------------------------------------------------------------------------------------ sessions
def unfused_model(shape, dt, with_skip, opset=17):
    """transformers' LlamaRMSNorm after a residual add, as the TorchScript exporter spells it."""
    et = ET[dt]
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.uniform(-2, 2, shape[-1:]).astype(dt), "gamma"),
             numpy_helper.from_array(np.asarray(2.0, F32), "two"), numpy_helper.from_array(np.asarray(EPS, F32), "eps"),
             numpy_helper.from_array(np.asarray(1.0, F32), "one")]
    nodes = [helper.make_node("Add", ["X", "skip"], ["H"])] if with_skip else []
    h = "H" if with_skip else "X"
    cast = dt == F16
    nodes += ([helper.make_node("Cast", [h], ["h32"], to=TensorProto.FLOAT)] if cast else []) + [
        helper.make_node("Pow", ["h32" if cast else h, "two"], ["p"]),
        helper.make_node("ReduceMean", ["p"], ["ms"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["v"]),
        helper.make_node("Sqrt", ["v"], ["sq"]),
        helper.make_node("Div", ["one", "sq"], ["r"]),
        helper.make_node("Mul", ["h32" if cast else h, "r"], ["n"])]
    nodes += ([helper.make_node("Cast", ["n"], ["y16"], to=et)] if cast else []) + [
        helper.make_node("Mul", ["gamma", "y16" if cast else "n"], ["Y"])]
    return _model(nodes, inits, shape, dt, with_skip, opset)


def fused_model(shape, dt, with_skip, gamma, opset=17):
    ins = ["X", "gamma"] + (["skip"] if with_skip else [])
    outs = ["Y"] + (["H"] if with_skip else [])
    node = helper.make_node("RMSNorm", ins, outs, domain=domain.DOMAIN, name="norm0", epsilon=EPS)
    return _model([node], [numpy_helper.from_array(gamma, "gamma")], shape, dt, with_skip, opset, ours=True)


def _model(nodes, inits, shape, dt, with_skip, opset, ours=False):
    et = ET[dt]
    vi = lambda n: helper.make_tensor_value_info(n, et, list(shape))  # noqa: E731
    ins = [vi("X")] + ([vi("skip")] if with_skip else [])
    outs = [vi("Y")] + ([vi("H")] if with_skip else [])
    g = helper.make_graph(nodes, "rmsnorm", ins, outs, inits)
    ops = [helper.make_opsetid("", opset)] + ([domain.opset_import()] if ours else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def _gamma(model):
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "gamma"))


def _session(model, providers):
    import onnx_lowbit
    return onnx_lowbit.InferenceSession(model.SerializeToString(), providers=providers)


@pytest.mark.parametrize("dt", [F32, F16])
@pytest.mark.parametrize("with_skip", [False, True])
def test_cpu_session(dt, with_skip):
    """One RMSNorm node in a CPU session: equal to the reference, close to onnxruntime's unfused graph."""
    shape = (2, 3, 64)
    ref = unfused_model(shape, dt, with_skip)
    gamma = _gamma(ref)
    x, _, skip = _data(shape, dt)
    feeds = {"X": x, **({"skip": skip} if with_skip else {})}
    got = _session(fused_model(shape, dt, with_skip, gamma), ["CPUExecutionProvider"]).run(None, feeds)
    want_y, want_h = rmsnorm.apply(x, gamma, skip if with_skip else None, EPS)
    assert close(got[0], want_y)
    if with_skip:
        assert same(got[1], want_h)
    unfused = _session(ref, ["CPUExecutionProvider"]).run(None, feeds)
    tol = 2e-3 if dt == F16 else 1e-5
    assert np.allclose(got[0].astype(F32), unfused[0].astype(F32), rtol=tol, atol=tol)


def test_cpu_session_without_the_h_output():
    """A node with only Y: the kernel writes no H."""
    shape, dt = (3, 64), F32
    gamma = np.linspace(-1, 1, 64).astype(dt)
    node = helper.make_node("RMSNorm", ["X", "gamma", "skip"], ["Y"], domain=domain.DOMAIN, name="norm0",
                            epsilon=EPS)
    vi = lambda n: helper.make_tensor_value_info(n, ET[dt], list(shape))  # noqa: E731
    g = helper.make_graph([node], "g", [vi("X"), vi("skip")], [vi("Y")], [numpy_helper.from_array(gamma, "gamma")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)
    x, _, skip = _data(shape, dt)
    (y,) = _session(model, ["CPUExecutionProvider"]).run(None, {"X": x, "skip": skip})
    assert close(y, rmsnorm.apply(x, gamma, skip, EPS)[0])


def test_cpu_session_bad_gamma_names_the_problem():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    shape, dt = (2, 8), F32
    node = helper.make_node("RMSNorm", ["X", "gamma"], ["Y"], domain=domain.DOMAIN, name="norm0", epsilon=EPS)
    vi = lambda n, s: helper.make_tensor_value_info(n, ET[dt], list(s))  # noqa: E731
    g = helper.make_graph([node], "g", [vi("X", ("N", 8)), vi("gamma", ("G",))], [vi("Y", ("N", 8))])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)
    with pytest.raises(Fail, match=r"RMSNorm node 'norm0'.*gamma must have shape \[8\]"):
        _session(model, ["CPUExecutionProvider"]).run(None, {"X": np.ones(shape, dt), "gamma": np.ones(4, dt)})


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_session(dt, graph):
    """On the CUDA EP: close to onnxruntime's own kernels for the unfused graph, H bit-exact, also replayed in a
    CUDA graph with new input contents."""
    try:
        import onnxruntime as ort
    except ImportError:
        pytest.skip("onnxruntime not installed")
    if SIM or not REAL_GPU or "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime's CUDA execution provider and a real GPU needed")
    shape = (1, 1, 2048)
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    ref_model = unfused_model(shape, dt, True)
    ref = ort.InferenceSession(ref_model.SerializeToString(), providers=cuda)
    prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"] if graph else cuda
    sess = _session(fused_model(shape, dt, True, _gamma(ref_model)), prov)
    x, _, skip = _data(shape, dt)
    xv, sv = (ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for a in (x, skip))
    yv, hv = (ort.OrtValue.ortvalue_from_shape_and_type(shape, dt, "cuda", 0) for _ in range(2))
    io = sess.io_binding()
    io.bind_ortvalue_input("X", xv)
    io.bind_ortvalue_input("skip", sv)
    io.bind_ortvalue_output("Y", yv)
    io.bind_ortvalue_output("H", hv)
    for seed in range(4):
        x, _, skip = _data(shape, dt, seed=seed)
        xv.update_inplace(x)
        sv.update_inplace(skip)
        sess.run_with_iobinding(io)
        want = ref.run(None, {"X": x, "skip": skip})
        assert same(hv.numpy(), want[1]), seed
        tol = 2e-3 if dt == F16 else 1e-5
        assert np.allclose(yv.numpy().astype(F32), want[0].astype(F32), rtol=tol, atol=tol), seed
        assert close(yv.numpy(), rmsnorm.apply(x, _gamma(ref_model), skip, EPS)[0]), seed

"""RotaryKV: reference (onnx_lowbit.rotarykv), CPU face (custom_ops/attention/rotarykv_cpu.py) and CUDA face
(custom_ops/attention/rotarykv_cuda.py; under Numba's CUDA simulator in CI, on the GPU with ONNX_LOWBIT_REAL_GPU=1).

Both kernels must equal the reference bit for bit (NaN where it has NaN), with and without a cache, in both copy
variants of the CUDA kernel (8-byte units, single elements). The reference must equal what the unfused ONNX graph
(Split, Reshape, Transpose, the exporters' rotary spelling, Concat) computes in onnxruntime: on the CPU EP in fp32
and, where a GPU and onnxruntime-gpu are present, on the CUDA EP in fp16 and fp32, with and without CUDA graphs.
"""
import os

import numpy as np
import pytest
from numba import config
from onnx import TensorProto, helper, numpy_helper

from helpers import SimContext, direct_run, gpu_or_sim, lowbit_session, ort_cuda_or_skip
from onnx_lowbit import domain, rotarykv
from onnx_lowbit.custom_ops.attention import rotarykv_cpu, rotarykv_cuda
from onnx_lowbit.custom_ops.runtime import routing

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
F16, F32 = np.float16, np.float32
ET = {F16: TensorProto.FLOAT16, F32: TensorProto.FLOAT}

# (B, S, P, D, Hq, Hkv, cos shape): decode (S=1), GQA, prompt without past (P=0), cos per batch / 2-D / broadcast
# over S, D not a multiple of 4 (the CUDA kernel's element copies), one head
CASES = [(2, 3, 5, 16, 4, 2, (2, 1, 3, 16)), (1, 1, 8, 8, 2, 2, (1, 1, 1, 8)), (1, 2, 0, 4, 1, 1, (2, 4)),
         (2, 2, 3, 6, 3, 1, (2, 1, 1, 6)), (1, 1, 3, 10, 2, 1, (10,)), (1, 3, 2, 8, 1, 1, (1, 3, 8))]


def _data(case, dt, seed=0, specials=True):
    b, s, p, d, hq, hkv, cs = case
    rng = np.random.default_rng(seed)
    qkv = (rng.standard_normal((b, s, (hq + 2 * hkv) * d)) * 4).astype(dt)
    c, sn = rng.uniform(-1, 1, cs).astype(dt), rng.uniform(-1, 1, cs).astype(dt)
    pk, pv = (rng.standard_normal((b, hkv, p, d)).astype(dt) for _ in range(2))
    if specials:
        qkv.reshape(-1)[:3] = [np.nan, np.inf, 6e4]          # q's first values
        qkv[0, 0, hq * d:hq * d + 2] = [-np.inf, np.nan]     # k's
        qkv.reshape(-1)[-1] = np.nan                          # v's last
        if pk.size:
            pk.reshape(-1)[0], pv.reshape(-1)[-1] = np.nan, np.inf
    return qkv, c, sn, pk, pv


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def _all_same(got, want):
    return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))


# ------------------------------------------------------------------------------------------------ reference
def test_reference_is_split_rotary_concat():
    """Q / present_key / present_value are the heads of QKV, rotated (q, k) and appended to the cache (k, v)."""
    from onnx_lowbit import rotary
    qkv, c, s, pk, pv = _data(CASES[0], F32, specials=False)
    q, kp, vp = rotarykv.apply(qkv, c, s, pk, pv, 4, 2)
    x = qkv.reshape(2, 3, 8, 16).transpose(0, 2, 1, 3)
    assert _same(q, rotary.apply(np.ascontiguousarray(x[:, :4]), c, s))
    assert _same(kp[:, :, :5], pk) and _same(kp[:, :, 5:], rotary.apply(np.ascontiguousarray(x[:, 4:6]), c, s))
    assert _same(vp[:, :, :5], pv) and _same(vp[:, :, 5:], x[:, 6:])
    q2, k2, v2 = rotarykv.apply(qkv, c, s, None, None, 4, 2)      # no cache: just the new rows
    assert _same(q2, q) and _same(k2, kp[:, :, 5:]) and _same(v2, vp[:, :, 5:])


@pytest.mark.parametrize("qs,cs,pks,pvs,hq,hkv,match", [
    ((1, 1, 40), (8,), (1, 2, 3, 8), (1, 2, 3, 8), 3, 2, "must be \\(num_heads \\+ 2 kv_num_heads\\)"),
    ((1, 1, 21), (3,), (1, 2, 3, 3), (1, 2, 3, 3), 3, 2, "even head size"),
    ((1, 40), (8,), (1, 2, 3, 8), (1, 2, 3, 8), 1, 2, "QKV must be"),
    ((1, 1, 40), (8,), (1, 1, 3, 8), (1, 1, 3, 8), 1, 2, "past_key must be"),
    ((1, 1, 40), (8,), (1, 2, 3, 8), (1, 2, 4, 8), 1, 2, "past_value must have"),
    ((1, 1, 40), (8,), (1, 2, 3, 8), None, 1, 2, "both be given"),
    ((1, 1, 40), (1, 2, 1, 8), (1, 2, 3, 8), (1, 2, 3, 8), 1, 2, "cos of shape"),
    ((1, 1, 40), (3, 8), (1, 2, 3, 8), (1, 2, 3, 8), 1, 2, "cos of shape"),
    ((1, 1, 40), (8,), (1, 2, 3, 8), (1, 2, 3, 8), 0, 2, ">= 1")])
def test_reference_and_kernels_refuse(qs, cs, pks, pvs, hq, hkv, match):
    z = lambda sh: None if sh is None else np.ones(sh, F32)  # noqa: E731
    args = (z(qs), z(cs), z(cs), z(pks), z(pvs), hq, hkv)
    with pytest.raises(rotarykv.RotaryKVError, match=match):
        rotarykv.apply(*args)
    with pytest.raises(rotarykv.RotaryKVError, match=match):
        rotarykv_cpu.run(*args)
    with pytest.raises(rotarykv.RotaryKVError, match=match):
        rotarykv_cuda.launch(1, 0, 1, (qs, cs, cs, pks, pvs), [0] * 8, hq, hkv)


def test_reference_refuses_mixed_types():
    qkv, c, s, pk, pv = _data(CASES[0], F32)
    with pytest.raises(rotarykv.RotaryKVError, match="past_value must have QKV's type"):
        rotarykv.apply(qkv, c, s, pk, pv.astype(F16), 4, 2)
    with pytest.raises(rotarykv.RotaryKVError, match="float or float16"):
        rotarykv.apply(qkv.astype(np.float64), c, s, pk, pv, 4, 2)


# ------------------------------------------------------------------------------------------------ kernels
def cuda_run(qkv, cos, sin, past_key, past_value, hq, hkv, sms=None, misalign=False):
    """The CUDA face as a session node runs it (direct.call; outputs NaN-filled first); ``sms``: the kernel object's
    grid size; ``misalign``: QKV one element (2 bytes fp16, 4 bytes fp32) off an 8-byte boundary."""
    b, s = qkv.shape[:2]
    d = qkv.shape[2] // (hq + 2 * hkv)
    p = past_key.shape[2] if past_key is not None else 0
    outs = [((b, hq, s, d), qkv.dtype), ((b, hkv, p + s, d), qkv.dtype), ((b, hkv, p + s, d), qkv.dtype)]
    setup = None if sms is None else (lambda k: setattr(k, "sms", sms))
    return tuple(direct_run("RotaryKV", {"num_heads": hq, "kv_num_heads": hkv}, [qkv, cos, sin, past_key, past_value],
                            outs, misalign=(0,) if misalign else (), setup=setup))


def _want(case, args, cache):
    hq, hkv = case[4], case[5]
    qkv, c, s, pk, pv = args
    return rotarykv.apply(qkv, c, s, pk if cache else None, pv if cache else None, hq, hkv)


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cache", [True, False])
def test_cpu_kernel_bit_exact(case, dt, cache):
    args = _data(case, dt, seed=case[1])
    qkv, c, s, pk, pv = args
    got = rotarykv_cpu.run(qkv, c, s, pk if cache else None, pv if cache else None, case[4], case[5])
    assert _all_same(got, _want(case, args, cache))


def test_cpu_kernel_parallel_path():
    case = (1, 64, 4, 128, 8, 4, (1, 1, 64, 128))
    args = _data(case, F16)
    assert args[0].size >= rotarykv_cpu.PARALLEL_MIN
    assert _all_same(rotarykv_cpu.run(*args, 8, 4), _want(case, args, True))


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cache,misalign", [(True, False), (False, False), (True, True)])
def test_cuda_kernel_bit_exact(case, dt, cache, misalign):
    """Every output element written (outputs start NaN-filled), 8-byte copy units where D and the pointers allow,
    element copies for a QKV 2 bytes off (fp16) / 4 bytes off (fp32) an 8-byte boundary."""
    gpu_or_sim()
    args = _data(case, dt, seed=case[1])
    qkv, c, s, pk, pv = args
    got = cuda_run(qkv, c, s, pk if cache else None, pv if cache else None, case[4], case[5],
                                   misalign=misalign)
    assert _all_same(got, _want(case, args, cache))


def test_cuda_kernel_grid_stride():
    """More work items than the grid has threads (one SM: 8 blocks of 256): each thread takes several, of
    different kinds."""
    gpu_or_sim()
    case = (2, 3, 40, 32, 4, 2, (2, 1, 3, 32))
    args = _data(case, F16)
    assert 2 * case[0] * case[5] * case[2] * case[3] // 4 > rotarykv_cuda.BLOCK * rotarykv_cuda.GRID_PER_SM
    assert _all_same(cuda_run(*args, 4, 2, sms=1), _want(case, args, True))


@pytest.mark.skipif(not REAL_GPU, reason="LLaMA-size shapes on the GPU only")
@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("case", [(1, 1, 128, 128, 16, 16, (1, 1, 1, 128)), (1, 1, 2047, 128, 32, 8, (1, 1, 1, 128)),
                                  (4, 512, 0, 128, 32, 32, (4, 1, 512, 128)), (2, 77, 300, 64, 12, 4, (77, 64))])
def test_gpu_large(case, dt):
    args = _data(case, dt)
    assert _all_same(cuda_run(*args, case[4], case[5]), _want(case, args, True))


@pytest.mark.skipif(not SIM, reason="stand-in context over host memory: simulator only")
@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("cache", [True, False])
def test_cuda_kernel_object_compute(dt, cache, monkeypatch):
    """The kernel object as a session calls it: validates shapes, allocates the three outputs, launches once; bad
    shapes name the problem."""
    from onnx_lowbit.custom_ops.device import launch as cuda_launch
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_launch, "sm_count", lambda device: 1)
    et = int(ET[dt])
    kern = rotarykv_cuda.KERNEL(spec=domain.OPS["RotaryKV"], attrs={"num_heads": 4, "kv_num_heads": 2},
                                node_name="rkv0", in_types=(et,) * 5, out_types=(et,) * 3)
    case = CASES[0]
    args = _data(case, dt)
    tensors = [Tensor(a.ctypes.data, et, a.shape) for a in args]
    ctx = SimContext()
    kern.compute(ctx, tensors if cache else tensors[:3] + [None, None])
    got = [b.view(dt)[: int(np.prod(sh))].reshape(sh) for b, sh in ctx.keep]
    assert _all_same(got, _want(case, args, cache))
    with pytest.raises(KernelError, match="past_key must be"):
        kern.compute(SimContext(), tensors[:3] + [Tensor(args[3].ctypes.data, et, (2, 3, 5, 16))] * 2)


def test_routes():
    """The table read from the old code (8-byte copy units when D is a multiple of 4 fp16 / 2 fp32 elements and
    every pointer is 8-byte aligned, else element copies); every kernel it names has a launcher."""
    name = lambda dt, d, al: routing.route(rotarykv_cuda.ROUTES, routing.Case(dt, 1, d, aligned=al)).kernel  # noqa
    assert [name("float16", d, al) for d, al in ((8, True), (6, True), (8, False))] == \
        ["rotarykv16.wide", "rotarykv16", "rotarykv16"]
    assert [name("float32", d, al) for d, al in ((6, True), (5, True), (6, False))] == \
        ["rotarykv32.wide", "rotarykv32", "rotarykv32"]
    for k in routing.kernels(rotarykv_cuda.ROUTES):
        assert rotarykv_cuda.launcher(k) is rotarykv_cuda.launcher(k)


# ------------------------------------------------------------------------------------------------ sessions
def _ints(name, v):
    return numpy_helper.from_array(np.asarray(v, np.int64), name)


def unfused_model(case, dt, cache=True):
    """The decode step's spelling: Split, Reshape, Transpose, the exporters' rotary (Mul, Slice, Slice, Neg, Concat,
    Mul, Add) for q and k, Concat with the cache for k and v."""
    b, s, p, d, hq, hkv, cs = case
    h = d // 2
    inits = [_ints("split", [hq * d, hkv * d, hkv * d]), _ints("z", [0]), _ints("h", [h]), _ints("big", [2 ** 62]),
             _ints("ax", [-1]), _ints("shq", [b, s, hq, d]), _ints("shkv", [b, s, hkv, d])]
    nodes = [helper.make_node("Split", ["QKV", "split"], ["q", "k", "v"], axis=-1)]
    for n, sh in (("q", "shq"), ("k", "shkv"), ("v", "shkv")):
        nodes += [helper.make_node("Reshape", [n, sh], [n + "4"]),
                  helper.make_node("Transpose", [n + "4"], [n + "t"], perm=[0, 2, 1, 3])]
    for n in ("q", "k"):
        x = n + "t"
        nodes += [helper.make_node("Mul", [x, "cos"], [n + "a"]),
                  helper.make_node("Slice", [x, "z", "h", "ax"], [n + "s1"]),
                  helper.make_node("Slice", [x, "h", "big", "ax"], [n + "s2"]),
                  helper.make_node("Neg", [n + "s2"], [n + "n"]),
                  helper.make_node("Concat", [n + "n", n + "s1"], [n + "r"], axis=-1),
                  helper.make_node("Mul", [n + "r", "sin"], [n + "b"]),
                  helper.make_node("Add", [n + "a", n + "b"], ["Q" if n == "q" else ("krot" if cache else "PK")])]
    if cache:
        nodes += [helper.make_node("Concat", ["past_key", "krot"], ["PK"], axis=2),
                  helper.make_node("Concat", ["past_value", "vt"], ["PV"], axis=2)]
    else:
        nodes += [helper.make_node("Identity", ["vt"], ["PV"])]
    return _model(nodes, inits, case, dt, cache)


def fused_model(case, dt, cache=True):
    ins = ["QKV", "cos", "sin"] + (["past_key", "past_value"] if cache else [])
    node = helper.make_node("RotaryKV", ins, ["Q", "PK", "PV"], domain=domain.DOMAIN, name="rkv0",
                            num_heads=case[4], kv_num_heads=case[5])
    return _model([node], [], case, dt, cache, ours=True)


def _model(nodes, inits, case, dt, cache, ours=False):
    b, s, p, d, hq, hkv, cs = case
    et = ET[dt]
    vi = helper.make_tensor_value_info
    ins = [vi("QKV", et, [b, s, (hq + 2 * hkv) * d]), vi("cos", et, list(cs)), vi("sin", et, list(cs))]
    if cache:
        ins += [vi("past_key", et, [b, hkv, p, d]), vi("past_value", et, [b, hkv, p, d])]
    t = p + s if cache else s
    outs = [vi("Q", et, [b, hq, s, d]), vi("PK", et, [b, hkv, t, d]), vi("PV", et, [b, hkv, t, d])]
    g = helper.make_graph(nodes, "rotarykv", ins, outs, inits)
    ops = [helper.make_opsetid("", 17)] + ([domain.opset_import()] if ours else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def _feeds(case, dt, cache=True, seed=0):
    qkv, c, s, pk, pv = _data(case, dt, seed=seed)
    f = {"QKV": qkv, "cos": c, "sin": s}
    if cache:
        f.update(past_key=pk, past_value=pv)
    return f


def _ref(case, feeds):
    return rotarykv.apply(feeds["QKV"], feeds["cos"], feeds["sin"], feeds.get("past_key"), feeds.get("past_value"),
                          case[4], case[5])


@pytest.mark.parametrize("case", CASES[:3])
@pytest.mark.parametrize("cache", [True, False])
def test_cpu_session(case, cache):
    """fp32: the RotaryKV node gives onnxruntime's unfused graph bit for bit (reference and CPU kernel too). fp16:
    the node equals the reference (onnxruntime's CPU EP runs the unfused fp16 rotary in fp32, see
    test_rotary_kernels)."""
    cpu = ["CPUExecutionProvider"]
    for dt in (F32, F16):
        feeds = _feeds(case, dt, cache)
        got = lowbit_session(fused_model(case, dt, cache), cpu).run(None, feeds)
        assert _all_same(got, _ref(case, feeds))
        if dt == F32:
            assert _all_same(got, lowbit_session(unfused_model(case, dt, cache), cpu).run(None, feeds))


def test_cpu_session_bad_shapes_name_the_problem():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    case = CASES[0]
    m = fused_model(case, F32)
    for i in (3, 4):     # past dims left free so the session accepts the wrong ones
        for dim in m.graph.input[i].type.tensor_type.shape.dim:
            dim.dim_param = "x"
    feeds = _feeds(case, F32)
    feeds["past_value"] = feeds["past_value"][:, :, :4]
    with pytest.raises(Fail, match=r"RotaryKV node 'rkv0'.*past_value must have"):
        lowbit_session(m, ["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("case", [(1, 1, 128, 128, 16, 16, (1, 1, 1, 128)), (1, 1, 33, 128, 8, 2, (1, 1, 1, 128))])
def test_cuda_session_equals_the_unfused_graph(case, dt, graph):
    """On the CUDA EP: the RotaryKV node equals onnxruntime's own unfused kernels bit for bit, also replayed in a
    CUDA graph with new input contents."""
    ort = ort_cuda_or_skip()
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    ref = ort.InferenceSession(unfused_model(case, dt).SerializeToString(), providers=cuda)
    prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"] if graph else cuda
    sess = lowbit_session(fused_model(case, dt), prov)
    feeds0 = _feeds(case, dt)
    bound = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in feeds0.items()}
    b, s, p, d, hq, hkv, _ = case
    outs = {n: ort.OrtValue.ortvalue_from_shape_and_type(sh, dt, "cuda", 0)
            for n, sh in (("Q", (b, hq, s, d)), ("PK", (b, hkv, p + s, d)), ("PV", (b, hkv, p + s, d)))}
    io = sess.io_binding()
    for n, v in bound.items():
        io.bind_ortvalue_input(n, v)
    for n, v in outs.items():
        io.bind_ortvalue_output(n, v)
    for seed in range(4):       # with a graph: the first runs capture, the later ones replay
        feeds = _feeds(case, dt, seed=seed)
        for n, a in feeds.items():
            bound[n].update_inplace(a)
        sess.run_with_iobinding(io)
        want = ref.run(None, feeds)
        got = [outs[n].numpy() for n in ("Q", "PK", "PV")]
        assert _all_same(got, want), seed
        assert _all_same(want, _ref(case, feeds)), seed

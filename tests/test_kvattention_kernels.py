"""KVAttention: reference (onnx_lowbit.kvattention), CPU face (custom_ops/attention/kvattention_cpu.py) and CUDA face
(custom_ops/attention/kvattention_cuda.py; under Numba's CUDA simulator in CI, on the GPU with ONNX_LOWBIT_REAL_GPU=1).

The sums run in fp32 in another order than the reference's float64, so the kernels agree with the reference within
those sums (fp32) or within one fp16 rounding of a score or probability (fp16), not bit for bit; the non-finite
pattern must be the same. The reference must agree with onnxruntime's unfused graph (MatMul, Mul / Div, Add,
Softmax, MatMul) on the CPU EP and, on a GPU with onnxruntime-gpu, the KVAttention node with the unfused graph on the
CUDA EP, with and without CUDA graphs.
"""
import os

import numpy as np
import pytest
from numba import config
from onnx import TensorProto, helper, numpy_helper

from helpers import SimContext, direct_run, gpu_or_sim, lowbit_session, ort_cuda_or_skip
from onnx_lowbit import domain, kvattention
from onnx_lowbit.custom_ops.attention import kvattention_cpu, kvattention_cuda
from onnx_lowbit.custom_ops.runtime import routing

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
F16, F32 = np.float16, np.float32
ET = {F16: TensorProto.FLOAT16, F32: TensorProto.FLOAT}
TOL = {F32: 2e-5, F16: 4e-3}

# (B, Hq, S, D, Hkv, T, mask shape or None, scale, divide): decode (S=1) with GQA, the causal prefill form (mask
# [B, 1, S, T]), D not a multiple of 4 (element units in the CUDA kernel), more keys than one round of the score
# step / than four steps of every key group, one head, a Div-spelled scale, no mask, T = 1
CASES = [(1, 4, 1, 16, 2, 9, (1, 1, 1, 9), 0.25, 0), (2, 1, 2, 8, 1, 7, (2, 1, 2, 7), 0.35, 0),
         (1, 2, 2, 6, 1, 5, (2, 5), 2.5, 1), (1, 1, 1, 40, 1, 70, None, 0.16, 0),
         (1, 3, 1, 12, 3, 33, (1, 3, 1, 33), 0.3, 0), (1, 2, 1, 4, 2, 1, (1,), 1.0, 0)]


def _data(case, dt, seed=0, specials=False):
    b, hq, s, d, hkv, t, ms, scale, divide = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, s, d)).astype(dt)
    k = rng.standard_normal((b, hkv, t, d)).astype(dt)
    v = rng.standard_normal((b, hkv, t, d)).astype(dt)
    mask = None
    if ms is not None:
        mask = (rng.standard_normal(ms) * 2).astype(dt)
        if ms[-1] > 2:
            mask[..., -1] = -np.inf if dt == F32 else np.finfo(F16).min    # masked keys, as exporters write them
    if specials:
        q[0, 0, 0, 0] = np.nan                        # row (0, 0, 0): all NaN
        v[0, 0, 0, d - 1] = np.inf                    # column D-1 of every row reading kv head 0: non-finite
    return q, k, v, mask


def _want(case, args):
    return kvattention.apply(*args, scale=case[7], divide=bool(case[8]))


def _close(got, want, dt):
    """Same shape and type, the same non-finite pattern (NaN / +-Inf where the reference has them), finite values
    within TOL of the reference (relative to the output's scale)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.astype(np.float64), want.astype(np.float64)
    fin = np.isfinite(w)
    assert np.array_equal(np.isnan(g), np.isnan(w)) and np.array_equal(np.isinf(g), np.isinf(w))
    assert np.array_equal(g[np.isinf(w)], w[np.isinf(w)])
    if fin.any():
        err = np.abs(g[fin] - w[fin]).max() / (np.abs(w[fin]).max() + 1e-30)
        assert err <= TOL[dt], err


# ------------------------------------------------------------------------------------------------ reference
def test_reference_is_softmax_attention():
    """fp32: the reference is softmax(Q K^T * scale + mask) V, query head h reading kv head h // 2."""
    case = CASES[0]
    q, k, v, m = _data(case, F32)
    kk, vv = np.repeat(k, 2, axis=1).astype(np.float64), np.repeat(v, 2, axis=1).astype(np.float64)
    a = q.astype(np.float64) @ kk.transpose(0, 1, 3, 2) * case[7] + m
    p = np.exp(a - a.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p @ vv
    got = kvattention.apply(q, k, v, m, scale=case[7])
    assert got.dtype == F32 and np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert np.array_equal(kvattention.apply(q, k, v, m, scale=4.0, divide=True), got)    # x / 4 = x * 0.25 exactly


def test_reference_gqa_is_repeat():
    q, k, v, m = _data(CASES[0], F16)
    assert np.array_equal(kvattention.apply(q, k, v, m, 0.25),
                          kvattention.apply(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), m, 0.25))


def test_reference_rows_without_keys_are_zero_and_masked_rows_nan():
    q, k, v, _ = _data((1, 2, 1, 8, 2, 0, None, 1.0, 0), F16)
    assert np.array_equal(kvattention.apply(q, k, v), np.zeros(q.shape, F16))
    q, k, v, _ = _data((1, 2, 1, 8, 2, 3, None, 1.0, 0), F32)
    got = kvattention.apply(q, k, v, np.full((1, 1, 1, 3), -np.inf, F32))
    assert np.isnan(got).all()


@pytest.mark.parametrize("qs,ks,vs,ms,match", [
    ((1, 2, 1), (1, 2, 3, 8), (1, 2, 3, 8), None, "rank 4"),
    ((1, 2, 1, 8), (1, 2, 3, 4), (1, 2, 3, 4), None, "K must be"),
    ((1, 3, 1, 8), (1, 2, 3, 8), (1, 2, 3, 8), None, "multiple of K's"),
    ((1, 2, 1, 8), (1, 2, 3, 8), (1, 2, 4, 8), None, "V must have"),
    ((1, 2, 1, 8), (1, 2, 3, 8), (1, 2, 3, 8), (1, 1, 1, 4), "mask of shape"),
    ((1, 2, 1, 8), (1, 2, 3, 8), (1, 2, 3, 8), (2, 1, 1, 1, 3), "mask of shape")])
def test_reference_and_kernels_refuse(qs, ks, vs, ms, match):
    z = lambda sh: None if sh is None else np.ones(sh, F32)  # noqa: E731
    args = (z(qs), z(ks), z(vs), z(ms))
    with pytest.raises(kvattention.KVAttentionError, match=match):
        kvattention.apply(*args)
    with pytest.raises(kvattention.KVAttentionError, match=match):
        kvattention_cpu.run(*args)
    with pytest.raises(kvattention.KVAttentionError, match=match):
        kvattention_cuda.launch(1, 0, (qs, ks, vs, ms), [0] * 5, 1.0, False)


def test_reference_refuses_mixed_types():
    q, k, v, m = _data(CASES[0], F32)
    with pytest.raises(kvattention.KVAttentionError, match="V must have Q's type"):
        kvattention.apply(q, k, v.astype(F16), m)
    with pytest.raises(kvattention.KVAttentionError, match="float or float16"):
        kvattention.apply(q.astype(np.float64), k, v, m)


# ------------------------------------------------------------------------------------------------ kernels
def cuda_run(q, k, v, mask=None, scale=1.0, divide=False, misalign=False):
    """The CUDA face as a session node runs it (direct.call; the output NaN-filled first); ``misalign``: K one
    element off an 8-byte boundary (element units)."""
    return direct_run("KVAttention", {"scale": scale, "divide": int(divide)}, [q, k, v, mask], [(q.shape, q.dtype)],
                      misalign=(1,) if misalign else ())[0]


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("specials", [False, True])
def test_cpu_kernel(case, dt, specials):
    args = _data(case, dt, seed=case[5], specials=specials)
    _close(kvattention_cpu.run(*args, scale=case[7], divide=bool(case[8])), _want(case, args), dt)


def test_cpu_kernel_parallel_path_and_empty():
    case = (1, 8, 16, 32, 4, 130, (1, 1, 16, 130), 0.18, 0)
    args = _data(case, F16)
    assert case[0] * case[1] * case[2] * case[5] >= kvattention_cpu.PARALLEL_MIN
    _close(kvattention_cpu.run(*args, scale=case[7]), _want(case, args), F16)
    q, k, v, _ = _data((1, 2, 1, 8, 2, 0, None, 1.0, 0), F32)
    assert np.array_equal(kvattention_cpu.run(q, k, v), np.zeros(q.shape, F32))


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("specials,misalign", [(False, False), (True, False), (False, True)])
def test_cuda_kernel(case, dt, specials, misalign):
    """Every output element written (the output starts NaN-filled); 8-byte units where D and the pointers allow,
    element units for K one element off an 8-byte boundary."""
    gpu_or_sim()
    args = _data(case, dt, seed=case[5], specials=specials)
    got = cuda_run(*args, scale=case[7], divide=bool(case[8]), misalign=misalign)
    _close(got, _want(case, args), dt)


def test_cuda_kernel_no_keys_and_long_rows():
    """T = 0 gives zeros; a head size whose score step needs several threads per key and more units than one
    thread's CU (D = 100 fp32: 50 units, 7 threads per key)."""
    gpu_or_sim()
    q, k, v, _ = _data((1, 2, 1, 8, 2, 0, None, 1.0, 0), F16)
    assert np.array_equal(cuda_run(q, k, v), np.zeros(q.shape, F16))
    case = (1, 1, 1, 100, 1, 5, (1, 1, 1, 5), 0.1, 0)
    args = _data(case, F32)
    _close(cuda_run(*args, scale=0.1), _want(case, args), F32)


@pytest.mark.parametrize("dt", [F16, F32])
def test_kernels_causal_mask_with_minus_inf(dt):
    """A causal mask (-inf above the diagonal; fp16: the exporters' finfo.min) over a cache: most threads of the
    CUDA kernel hold only masked keys (their partial sums must add 0, not NaN); the last row is fully masked in
    fp32 (NaN, as Softmax gives)."""
    b, hq, s, d, hkv, p = 1, 2, 3, 8, 1, 67
    t = p + s
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(sh).astype(dt) for sh in ((b, hq, s, d), (b, hkv, t, d), (b, hkv, t, d)))
    neg = -np.inf if dt == F32 else np.finfo(F16).min
    mask = np.where(np.arange(t)[None, :] > p + np.arange(s)[:, None], neg, 0).astype(dt)[None, None]
    if dt == F32:
        mask[..., -1, :] = -np.inf
    want = kvattention.apply(q, k, v, mask, 0.3)
    assert np.isnan(want[..., -1, :]).all() == (dt == F32) and np.isfinite(want[..., :-1, :]).all()
    _close(kvattention_cpu.run(q, k, v, mask, 0.3), want, dt)
    if SIM or REAL_GPU:
        _close(cuda_run(q, k, v, mask, 0.3), want, dt)


def test_cuda_kernel_refuses_too_many_keys():
    d = 64
    t = kvattention_cuda.max_keys(d) + 1
    with pytest.raises(kvattention.KVAttentionError, match=f"at most {t - 1} keys"):
        kvattention_cuda.launch(10, 0, ((1, 1, 1, d), (1, 1, t, d), (1, 1, t, d), None), [8] * 5, 1.0, False)


def test_cuda_kernel_key_limit_follows_the_device(monkeypatch):
    """Above 48 KiB of shared memory the launch opts in to the device's own limit (cuda_launch.shared_optin; a
    stand-in here: 99 KiB, as sm_86 / sm_89 give): the error names that device's key limit, not Hopper's."""
    from onnx_lowbit.custom_ops.device import launch as cuda_launch
    monkeypatch.setattr(kvattention_cuda, "SIM", False)
    monkeypatch.setattr(kvattention_cuda, "_limits", {})
    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_launch, "shared_optin", lambda device: 99 * 1024)
    d = 128
    small = kvattention_cuda.max_keys(d, 10, 99 * 1024)
    assert small < kvattention_cuda.max_keys(d)
    with pytest.raises(kvattention.KVAttentionError, match=f"at most {small} keys"):
        kvattention_cuda.launch(10, 0, ((1, 1, 1, d), (1, 1, small + 1, d), (1, 1, small + 1, d), None), [8] * 5,
                                1.0, False)


def test_routes():
    """The table read from the old code (8-byte units when D is a multiple of 4 fp16 / 2 fp32 elements and K, V are
    8-byte aligned, else element units); every kernel it names has a launcher."""
    name = lambda dt, d, al: routing.route(kvattention_cuda.ROUTES, routing.Case(dt, 1, d, 5, aligned=al)).kernel  # noqa
    assert [name("float16", d, al) for d, al in ((8, True), (6, True), (8, False))] == \
        ["kvattention16.wide", "kvattention16", "kvattention16"]
    assert [name("float32", d, al) for d, al in ((6, True), (5, True), (6, False))] == \
        ["kvattention32.wide", "kvattention32", "kvattention32"]
    for k in routing.kernels(kvattention_cuda.ROUTES):
        elem, wide = kvattention_cuda.variant(k)
        assert kvattention_cuda.launcher(elem, wide) is kvattention_cuda.launcher(elem, wide)


@pytest.mark.skipif(not REAL_GPU, reason="LLaMA-size shapes on the GPU only")
@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("case", [(1, 16, 1, 128, 16, 129, (1, 1, 1, 129), 0.0884, 0),
                                  (1, 32, 1, 128, 8, 2048, (1, 1, 1, 2048), 0.0884, 0),
                                  (2, 8, 64, 64, 8, 96, (2, 1, 64, 96), 0.125, 0),
                                  (1, 4, 1, 80, 2, 20000, None, 0.11, 0), (1, 2, 1, 256, 1, 300, None, 0.0625, 1)])
def test_gpu_large(case, dt):
    args = _data(case, dt, specials=True)
    _close(cuda_run(*args, scale=case[7], divide=bool(case[8])), _want(case, args), dt)


@pytest.mark.skipif(not SIM, reason="stand-in context over host memory: simulator only")
@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("with_mask", [True, False])
def test_cuda_kernel_object_compute(dt, with_mask):
    """The kernel object as a session calls it: validates shapes, allocates the output, launches once; bad shapes
    name the problem."""
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    et = int(ET[dt])
    case = CASES[0]
    kern = kvattention_cuda.KERNEL(spec=domain.OPS["KVAttention"], attrs={"scale": case[7]}, node_name="att0",
                                 in_types=(et,) * 4, out_types=(et,))
    args = _data(case, dt)
    if not with_mask:
        args = args[:3] + (None,)
    tensors = [None if a is None else Tensor(a.ctypes.data, et, a.shape) for a in args]
    ctx = SimContext()
    kern.compute(ctx, tensors)
    (buf, sh), = ctx.keep
    _close(buf.view(dt)[: int(np.prod(sh))].reshape(sh), _want(case, args), dt)
    with pytest.raises(KernelError, match="V must have K's shape"):
        kern.compute(SimContext(), tensors[:2] + [Tensor(args[2].ctypes.data, et, (1, 2, 8, 16))] + tensors[3:])


# ------------------------------------------------------------------------------------------------ sessions
def unfused_model(case, dt, repeat=True):
    """The eager-attention spelling of LLaMA exports: K / V repeated for grouped-query attention (Unsqueeze, Expand,
    Reshape), MatMul(Q, Transpose(K)), Mul (or Div) by the scale, Add of the mask, Softmax in fp32 (Casts around it
    for fp16), MatMul with V."""
    b, hq, s, d, hkv, t, ms, scale, divide = case
    rep = hq // hkv
    inits = [numpy_helper.from_array(np.asarray(scale, dt), "scale"),
             numpy_helper.from_array(np.asarray([2], np.int64), "ax2"),
             numpy_helper.from_array(np.asarray([b, hkv, rep, t, d], np.int64), "exp"),
             numpy_helper.from_array(np.asarray([b, hq, t, d], np.int64), "shp")]
    nodes = []
    for n in ("K", "V"):
        nodes += [helper.make_node("Unsqueeze", [n, "ax2"], [n + "u"]), helper.make_node("Expand", [n + "u", "exp"],
                                                                                        [n + "e"]),
                  helper.make_node("Reshape", [n + "e", "shp"], [n + "r"])]
    nodes += [helper.make_node("Transpose", ["Kr"], ["Kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["Q", "Kt"], ["A"]),
              helper.make_node("Div" if divide else "Mul", ["A", "scale"], ["As"])]
    last = "As"
    if ms is not None:
        nodes.append(helper.make_node("Add", ["As", "mask"], ["Am"]))
        last = "Am"
    if dt == F16:
        nodes += [helper.make_node("Cast", [last], ["A32"], to=TensorProto.FLOAT),
                  helper.make_node("Softmax", ["A32"], ["P32"], axis=-1),
                  helper.make_node("Cast", ["P32"], ["P"], to=TensorProto.FLOAT16)]
    else:
        nodes.append(helper.make_node("Softmax", [last], ["P"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["P", "Vr"], ["O"]))
    return _model(nodes, inits, case, dt)


def fused_model(case, dt):
    ins = ["Q", "K", "V"] + (["mask"] if case[6] is not None else [])
    node = helper.make_node("KVAttention", ins, ["O"], domain=domain.DOMAIN, name="att0", scale=float(case[7]),
                            divide=int(case[8]))
    return _model([node], [], case, dt, ours=True)


def _model(nodes, inits, case, dt, ours=False):
    b, hq, s, d, hkv, t, ms, scale, divide = case
    et = ET[dt]
    vi = helper.make_tensor_value_info
    ins = [vi("Q", et, [b, hq, s, d]), vi("K", et, [b, hkv, t, d]), vi("V", et, [b, hkv, t, d])]
    if ms is not None:
        ins.append(vi("mask", et, list(ms)))
    g = helper.make_graph(nodes, "attention", ins, [vi("O", et, [b, hq, s, d])], inits)
    ops = [helper.make_opsetid("", 17)] + ([domain.opset_import()] if ours else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def _feeds(case, dt, seed=0):
    q, k, v, m = _data(case, dt, seed=seed)
    f = {"Q": q, "K": k, "V": v}
    if m is not None:
        f["mask"] = m
    return f


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2]])
def test_cpu_session(case):
    """The KVAttention node on onnxruntime's CPU EP agrees with the reference and with onnxruntime's unfused graph
    (fp32; fp16 against the reference: the CPU EP runs fp16 MatMuls with other roundings)."""
    cpu = ["CPUExecutionProvider"]
    for dt in (F32, F16):
        feeds = _feeds(case, dt)
        got = lowbit_session(fused_model(case, dt), cpu).run(None, feeds)[0]
        _close(got, kvattention.apply(feeds["Q"], feeds["K"], feeds["V"], feeds.get("mask"), case[7], bool(case[8])),
               dt)
        if dt == F32:
            _close(got, lowbit_session(unfused_model(case, dt), cpu).run(None, feeds)[0], dt)


def test_cpu_session_bad_shapes_name_the_problem():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail
    case = CASES[0]
    m = fused_model(case, F32)
    for dim in m.graph.input[2].type.tensor_type.shape.dim:      # V's dims left free so the session accepts them
        dim.dim_param = "x"
    feeds = _feeds(case, F32)
    feeds["V"] = feeds["V"][:, :, :4]
    with pytest.raises(Fail, match=r"KVAttention node 'att0'.*V must have"):
        lowbit_session(m, ["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("dt", [F16, F32])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("case", [(1, 16, 1, 128, 16, 129, (1, 1, 1, 129), 0.0884, 0),
                                  (1, 8, 1, 128, 2, 33, (1, 1, 1, 33), 0.0884, 0)])
def test_cuda_session_agrees_with_the_unfused_graph(case, dt, graph):
    """On the CUDA EP: the KVAttention node agrees with onnxruntime's own unfused kernels and with the reference, also
    replayed in a CUDA graph with new input contents."""
    ort = ort_cuda_or_skip()
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    ref = ort.InferenceSession(unfused_model(case, dt).SerializeToString(), providers=cuda)
    prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"] if graph else cuda
    sess = lowbit_session(fused_model(case, dt), prov)
    feeds0 = _feeds(case, dt)
    bound = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in feeds0.items()}
    out = ort.OrtValue.ortvalue_from_shape_and_type(feeds0["Q"].shape, dt, "cuda", 0)
    io = sess.io_binding()
    for n, v in bound.items():
        io.bind_ortvalue_input(n, v)
    io.bind_ortvalue_output("O", out)
    for seed in range(4):       # with a graph: the first runs capture, the later ones replay
        feeds = _feeds(case, dt, seed=seed)
        for n, a in feeds.items():
            bound[n].update_inplace(a)
        sess.run_with_iobinding(io)
        got = out.numpy()
        _close(got, ref.run(None, feeds)[0], dt)
        _close(got, kvattention.apply(feeds["Q"], feeds["K"], feeds["V"], feeds.get("mask"), case[7]), dt)

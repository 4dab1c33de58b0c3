"""FusedFFN CPU kernel (custom_ops/ffn/fusedffn_cpu.py) through onnxruntime sessions, against onnx_lowbit.ffn.

Tolerances. The kernel sums K products in fp32 (SIMD-reassociated in the decode path, BLAS sgemm past M = 16),
adds the bias, computes SiLU(g) * u in fp32 and rounds once to X's type. With E1 = sum_k |x_k w1_nk| + |b1_n| and
E3 likewise (the magnitudes the fp32 sums go through) and SiLU' <= 1.1, per output:
    |s - ref| <= 2^-16 (1.1 E1 |u| + |SiLU(g)| E3) + 2^-20 |ref|      (+ 2^-11 |ref| for a float16 S: one rounding)
against the float64 reference ``ffn.swiglu_ref`` (which uses the same fp16 weight values): 2^-16 covers fp32 sums of
up to 256 terms worst case and far more in practice (observed: below 1% of it for fp32 S; for fp16 S the rounding term dominates, up to ~0.8 of the bound). fp16 S is also checked
against the issue's bar: max |s - ref| / max |ref| <= 1e-3 (normwise, per output tensor).
Non-finite inputs: the fused op must give NaN / +-Inf exactly where the unfused graph (MatMul, Sigmoid, Mul, Mul)
run by stock onnxruntime does.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_lowbit
from onnx_lowbit import domain, ffn

CPU = ["CPUExecutionProvider"]
ET = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


def ffn_model(K, N, x_dtype, w_dtype, *, lead=("M",), b1=False, b3=False, init=None, kn=None):  # noqa: N803
    """One FusedFFN node; W1, W3 (and biases) graph inputs unless given in ``init`` (name -> array); ``kn``: the
    attribute weights_kn (None: absent)."""
    init = init or {}
    xt, wt = ET[np.dtype(x_dtype)], ET[np.dtype(w_dtype)]
    specs = [("X", xt, list(lead) + [K]), ("W1", wt, [N, K]), ("W3", wt, [N, K])]
    names = ["X", "W1", "W3"]
    if b1 or b3:
        names += ["B1" if b1 else ""]
        if b1:
            specs.append(("B1", xt, [N]))
    if b3:
        names += ["B3"]
        specs.append(("B3", xt, [N]))
    node = helper.make_node("FusedFFN", names, ["S"], domain=domain.DOMAIN, name="ffn0",
                            **({} if kn is None else {"weights_kn": kn}))
    ins = [helper.make_tensor_value_info(n, t, list(lead) + [None] if n == "X" else [None] * len(s))
           for n, t, s in specs if n not in init]  # symbolic: the kernel checks the shapes
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("S", xt, list(lead) + [None])],
                          initializer=[onnx.numpy_helper.from_array(v, n) for n, v in init.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    return m


def data(K, N, x_dtype, w_dtype, lead, seed=0):  # noqa: N803
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(lead) + (K,)).astype(x_dtype)
    w1 = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(w_dtype)
    w3 = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(w_dtype)
    b1 = (rng.standard_normal(N) * 0.1).astype(x_dtype)
    b3 = (rng.standard_normal(N) * 0.1).astype(x_dtype)
    return x, w1, w3, b1, b3


def bound(x, w1, w3, b1, b3):
    """(ref, tolerance) per the module docstring."""
    ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
    k = w1.shape[1]
    ax = np.abs(x.astype(np.float64).reshape(-1, k))
    e1 = ax @ np.abs(w1.astype(np.float64)).T + (0 if b1 is None else np.abs(b1.astype(np.float64)))
    e3 = ax @ np.abs(w3.astype(np.float64)).T + (0 if b3 is None else np.abs(b3.astype(np.float64)))
    x64 = x.astype(np.float64).reshape(-1, k)
    g = x64 @ w1.astype(np.float64).T + (0 if b1 is None else b1.astype(np.float64))
    u = x64 @ w3.astype(np.float64).T + (0 if b3 is None else b3.astype(np.float64))
    tol = 2.0 ** -16 * (1.1 * e1 * np.abs(u) + np.abs(ffn.silu(g)) * e3)
    tol = tol.reshape(ref.shape) + 2.0 ** -20 * np.abs(ref)
    if x.dtype == np.float16:
        tol = tol + 2.0 ** -11 * np.abs(ref)
    return ref, tol


def check(s, x, w1, w3, b1=None, b3=None, kn=False):
    """s against the reference within ``bound``; ``kn``: w1, w3 are [K, N] (checked as their [N, K] transposes)."""
    if kn:
        w1, w3 = w1.T, w3.T
    n = w1.shape[0]
    assert s.dtype == x.dtype and s.shape == x.shape[:-1] + (n,)
    if s.size == 0:
        return 0.0
    ref, tol = bound(x, w1, w3, b1, b3)
    err = np.abs(s.astype(np.float64) - ref)
    assert np.all(err <= tol), f"max excess {np.max(err - tol):.3g} (max err {err.max():.3g})"
    rel = float(err.max() / max(np.abs(ref).max(), 1e-30))
    if x.dtype == np.float16:
        assert rel <= 1e-3, rel
    return rel


def session(model):
    return onnx_lowbit.InferenceSession(model, providers=CPU)


@pytest.mark.parametrize("x_dtype,w_dtype", [(np.float32, np.float32), (np.float16, np.float16),
                                             (np.float32, np.float16), (np.float16, np.float32)])
@pytest.mark.parametrize("K,N", [(64, 176), (33, 7), (256, 40)])
def test_cpu_vs_reference(K, N, x_dtype, w_dtype):  # noqa: N803
    """All four type variants, every bias combination, decode (M <= 16) and BLAS (M > 16) paths, empty M."""
    sessions_vs_reference(K, N, x_dtype, w_dtype, [(1, 1), (1, 3), (2, 8), (1, 17), (3, 40), (0, 4)])


def sessions_vs_reference(K, N, x_dtype, w_dtype, leads, kn=False):  # noqa: N803
    """For every bias combination: one CPU session of a FusedFFN node (weights [K, N] with ``kn``), run at each
    leading shape in ``leads`` on fresh data and checked against the reference."""
    for b1, b3 in ((False, False), (True, True), (True, False), (False, True)):
        sess = session(ffn_model(K, N, x_dtype, w_dtype, lead=("B", "T"), b1=b1, b3=b3, kn=1 if kn else None))
        for lead in leads:
            x, w1, w3, bb1, bb3 = (kn_data if kn else data)(K, N, x_dtype, w_dtype, lead, seed=sum(lead) + K)
            feeds = {"X": x, "W1": w1, "W3": w3}
            if b1:
                feeds["B1"] = bb1
            if b3:
                feeds["B3"] = bb3
            s = sess.run(None, feeds)[0]
            check(s, x, w1, w3, bb1 if b1 else None, bb3 if b3 else None, kn=kn)


def test_cpu_ranks_and_initializers():
    """X of rank 1 and 4, weights as initializers (the form the pass emits)."""
    K, N = 48, 24  # noqa: N806
    x, w1, w3, b1, b3 = data(K, N, np.float32, np.float16, (2, 3, 5))
    for lead, xx in (((), x[0, 0, 0]), (("a", "b", "c"), x), (("a", "b", "c"), x[:1, :1, :1])):
        sess = session(ffn_model(K, N, np.float32, np.float16, lead=lead, b1=True, b3=True,
                                 init={"W1": w1, "W3": w3, "B1": b1, "B3": b3}))
        check(sess.run(None, {"X": xx})[0], xx, w1, w3, b1, b3)


def test_fp16_error_figure():
    """The issue's bar on a LLaMA-like block (fp16 X and weights, K=512, N=1376): <= 1e-3 normwise, both paths."""
    K, N = 512, 1376  # noqa: N806
    sess = session(ffn_model(K, N, np.float16, np.float16))
    rels = []
    for m in (1, 64):
        x, w1, w3, _, _ = data(K, N, np.float16, np.float16, (m,), seed=m)
        rels.append(check(sess.run(None, {"X": x, "W1": w1, "W3": w3})[0], x, w1, w3))
    assert max(rels) <= 1e-3, rels


def unfused_model(K, N, dtype):  # noqa: N803
    """MatMul(x, W1^T) -> x*Sigmoid(x), MatMul(x, W3^T), Mul: what the pass replaces (weights as inputs)."""
    et = ET[np.dtype(dtype)]
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["g"]), helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["a"]), helper.make_node("MatMul", ["X", "W3"], ["u"]),
             helper.make_node("Mul", ["a", "u"], ["S"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", et, ["M", K]),
                                       helper.make_tensor_value_info("W1", et, [K, N]),
                                       helper.make_tensor_value_info("W3", et, [K, N])],
                          [helper.make_tensor_value_info("S", et, ["M", N])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m", [4, 40])
def test_nonfinite_like_unfused_graph(dtype, m):
    """NaN / +Inf / -Inf in X rows and in weight rows: same NaN and +-Inf positions as stock onnxruntime running
    the unfused graph (decode and BLAS paths); finite outputs agree within the usual tolerance."""
    K, N = 32, 24  # noqa: N806
    x, w1, w3, _, _ = data(K, N, dtype, dtype, (m,), seed=3)
    x[0, 5] = np.nan
    x[1, 7] = np.inf
    x[2, :] = 0
    x[2, 3] = -np.inf
    w1[2, 4] = np.inf       # gate column 2: +-inf, or NaN where x has -inf/inf of both signs
    w1[5, 0] = -np.inf
    w3[9, 1] = np.nan
    w1[11, :] = 0
    w1[11, 9] = -1e30 if dtype == np.float32 else -60000.0  # gate -> large negative finite: SiLU -> -0
    fused = session(ffn_model(K, N, dtype, dtype)).run(None, {"X": x, "W1": w1, "W3": w3})[0]
    ref_sess = ort.InferenceSession(unfused_model(K, N, dtype).SerializeToString(), providers=CPU)
    unfused = ref_sess.run(None, {"X": x, "W1": np.ascontiguousarray(w1.T), "W3": np.ascontiguousarray(w3.T)})[0]
    assert_like_unfused(fused, unfused, dtype)


def assert_like_unfused(fused, unfused, dtype):
    """NaN, +inf, -inf exactly where the unfused graph has them (some of each NaN / inf present), finite values
    close."""
    assert np.array_equal(np.isnan(fused), np.isnan(unfused))
    assert np.array_equal(np.isposinf(fused), np.isposinf(unfused))
    assert np.array_equal(np.isneginf(fused), np.isneginf(unfused))
    assert np.isnan(fused).any() and np.isinf(fused).any()
    fin = np.isfinite(unfused)
    np.testing.assert_allclose(fused[fin].astype(np.float64), unfused[fin].astype(np.float64),
                               rtol=2e-3 if dtype == np.float16 else 1e-5, atol=1e-3 if dtype == np.float16 else 1e-6)


def test_reference_nonfinite():
    """The reference's own convention (what the kernels are documented to do)."""
    s = ffn.silu(np.array([np.inf, -np.inf, np.nan, -1000.0, 0.0]))
    assert s[0] == np.inf and np.isnan(s[1]) and np.isnan(s[2]) and s[3] == 0.0 and s[4] == 0.0


def test_bad_inputs_name_the_problem():
    K, N = 16, 8  # noqa: N806
    x, w1, w3, _, _ = data(K, N, np.float32, np.float32, (2,))
    sess = session(ffn_model(K, N, np.float32, np.float32))
    with pytest.raises(Exception, match="same shape"):
        sess.run(None, {"X": x, "W1": w1, "W3": w3[:4]})
    with pytest.raises(Exception, match="last dimension K=16"):
        sess.run(None, {"X": x[:, :8], "W1": w1, "W3": w3})
    with pytest.raises(ValueError, match="last dimension must be K"):
        ffn.swiglu_ref(x[:, :8], w1, w3)


# ----------------------------------------------------------------------------------------------------------------
# weights_kn=1: W1, W3 [K, N] (the MatMul weights as they are)
# ----------------------------------------------------------------------------------------------------------------
def kn_data(K, N, x_dtype, w_dtype, lead, seed=0):  # noqa: N803
    x, w1, w3, b1, b3 = data(K, N, x_dtype, w_dtype, lead, seed)
    return x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3


def test_reference_kn_is_the_transpose():
    x, w1, w3, b1, b3 = kn_data(24, 10, np.float32, np.float16, (2, 3))
    assert np.array_equal(ffn.swiglu_ref(x, w1, w3, b1, b3, kn=True), ffn.swiglu_ref(x, w1.T, w3.T, b1, b3))
    assert np.array_equal(ffn.swiglu(x, w1, w3, kn=True), ffn.swiglu(x, w1.T, w3.T))
    with pytest.raises(ValueError, match=r"last dimension must be K=24 \(W1 is \[K, N\] = \[24, 10\]"):
        ffn.swiglu_ref(x[..., :8], w1, w3, kn=True)
    assert ffn.parse_kn({}) is False and ffn.parse_kn({"weights_kn": 1}) is True
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match="'weights_kn' must be 0"):
            ffn.parse_kn({"weights_kn": bad})


@pytest.mark.parametrize("x_dtype,w_dtype", [(np.float32, np.float32), (np.float16, np.float16),
                                             (np.float32, np.float16), (np.float16, np.float32)])
@pytest.mark.parametrize("K,N", [(64, 176), (33, 7), (258, 1100)])
def test_cpu_kn_vs_reference(K, N, x_dtype, w_dtype):  # noqa: N803
    """weights_kn=1: all four type variants, every bias combination, M = 1, 3, 16 (decode kernels, K not a multiple
    of 4, N not a multiple of the column block) and 17, 40 (BLAS), empty M."""
    sessions_vs_reference(K, N, x_dtype, w_dtype, [(1, 1), (1, 3), (2, 8), (1, 17), (2, 20), (0, 4)], kn=True)


def test_cpu_kn_initializers_and_zero_attribute():
    """[K, N] weights as initializers (the form the pass emits with ffn_weights="kn"); weights_kn=0 is the default
    layout."""
    K, N = 48, 24  # noqa: N806
    x, w1, w3, b1, b3 = kn_data(K, N, np.float32, np.float16, (2, 3))
    sess = session(ffn_model(K, N, np.float32, np.float16, lead=("a", "b"), b1=True, b3=True, kn=1,
                             init={"W1": w1, "W3": w3, "B1": b1, "B3": b3}))
    check(sess.run(None, {"X": x})[0], x, w1, w3, b1, b3, kn=True)
    sess = session(ffn_model(K, N, np.float32, np.float16, b1=True, kn=0))
    check(sess.run(None, {"X": x[0], "W1": w1.T.copy(), "W3": w3.T.copy(), "B1": b1})[0], x[0], w1.T, w3.T, b1)


def test_kn_shape_inference():
    """S's last dim is W1's dim 1 with weights_kn=1 (dim 0 without)."""
    K, N = 16, 40  # noqa: N806
    x, w1, w3, _, _ = kn_data(K, N, np.float32, np.float32, (2,))
    for kn, (a, b) in ((1, (w1, w3)), (None, (w1.T.copy(), w3.T.copy()))):
        m = ffn_model(K, N, np.float32, np.float32, kn=kn, init={"W1": a, "W3": b})
        inf = onnx.shape_inference.infer_shapes(m, strict_mode=True)
        dims = [d.dim_value for d in inf.graph.output[0].type.tensor_type.shape.dim]
        assert dims[-1] == N, (kn, dims)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m", [1, 4, 40])
def test_kn_nonfinite_like_unfused_graph(dtype, m):
    """weights_kn=1 with NaN / +Inf / -Inf in X rows and weight columns: NaN and +-Inf exactly where stock
    onnxruntime running the unfused graph (on the same [K, N] weights) has them."""
    K, N = 33, 24  # noqa: N806
    x, w1, w3, _, _ = kn_data(K, N, dtype, dtype, (m,), seed=3)
    x[0, 5] = np.nan if m > 1 else np.inf
    if m > 2:
        x[1, 7] = np.inf
        x[2, :] = 0
        x[2, 3] = -np.inf
    w1[4, 2] = np.inf
    w1[0, 5] = -np.inf
    w3[1, 9] = np.nan
    w1[:, 11] = 0
    w1[9, 11] = -1e30 if dtype == np.float32 else -60000.0
    fused = session(ffn_model(K, N, dtype, dtype, kn=1)).run(None, {"X": x, "W1": w1, "W3": w3})[0]
    ref_sess = ort.InferenceSession(unfused_model(K, N, dtype).SerializeToString(), providers=CPU)
    unfused = ref_sess.run(None, {"X": x, "W1": w1, "W3": w3})[0]
    assert_like_unfused(fused, unfused, dtype)


def test_kn_bad_attribute_and_shapes_name_the_problem():
    K, N = 16, 8  # noqa: N806
    with pytest.raises(Exception, match=r"FusedFFN node 'ffn0'.*attribute 'weights_kn' must be 0 .* got 2"):
        session(ffn_model(K, N, np.float32, np.float32, kn=2))
    x, w1, w3, _, _ = kn_data(K, N, np.float32, np.float32, (2,))
    sess = session(ffn_model(K, N, np.float32, np.float32, kn=1))
    with pytest.raises(Exception, match=r"last dimension K=16 \(W1 is \[K, N\] = \[16, 8\]\), got shape \[2, 8\]"):
        sess.run(None, {"X": x[:, :8], "W1": w1, "W3": w3})
    with pytest.raises(Exception, match=r"same shape \[K, N\]"):
        sess.run(None, {"X": x, "W1": w1, "W3": w3[:, :4]})


def test_fp16_widening_is_exact_for_every_pattern():
    """The CPU GEMVs' fp16 -> fp32 widening without a table (fusedffn_cpu._h2f_row) gives numpy's value for all
    65536 bit patterns (zeros of both signs, subnormals, normals, +-inf; NaN for every NaN pattern), and so does the
    table the prefill path widens with."""
    from numba import njit

    from onnx_lowbit.custom_ops.ffn import fusedffn_cpu as fcpu

    @njit
    def widen(h):
        out = np.empty(h.shape[0], np.float32)
        fcpu._h2f_row(h, np.empty(h.shape[0], np.uint32), out)
        return out

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    for got in (widen(bits), fcpu.F16_TO_F32):
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))   # signed zeros too

"""Tests of the "ortnorm" pass (passes/ortnorm.py): onnxruntime's SkipSimplifiedLayerNormalization /
SimplifiedLayerNormalization (what onnxruntime-genai's builder writes) -> RMSNorm.

Values: stock onnxruntime's CPU run of the original against onnx_lowbit's CPU session of the rewritten model on fresh
random inputs (never zeros): the residual sum bit-equal, the normalised outputs within 1e-5 relative (fp32) or
2^-9 relative (about two fp16 ulps; onnxruntime normalises the fp32 sum and rounds once, RMSNorm rounds the sum,
then the normalised value, then the product). Skipped candidates name their reason and stay onnxruntime's.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from helpers import checked_rewrite, run_cpu

from onnx_lowbit import domain

ET = {np.float32: TP.FLOAT, np.float16: TP.FLOAT16}
D = 64


def norm_model(dtype=np.float32, shape=None, bias=False, mean_out=False, gamma_input=False, axis=-1,
               skip_shape=None, seed=0, d=D):
    """X, S -> SkipSimplifiedLayerNormalization(X, S, g1) -> (Y1, H); SimplifiedLayerNormalization(H, g2) -> Y2;
    outputs Y1, Y2, H (and the mean / a bias / gamma as a graph input / another axis when asked)."""
    rng = np.random.default_rng(seed)
    shape = shape or (2, 3, d)
    et = ET[dtype]
    g1 = nh.from_array((1 + 0.3 * rng.standard_normal(d)).astype(dtype), "g1")
    g2 = nh.from_array((1 + 0.3 * rng.standard_normal(d)).astype(dtype), "g2")
    inits = [g2] + ([] if gamma_input else [g1])
    inputs = [oh.make_tensor_value_info("X", et, list(shape)),
              oh.make_tensor_value_info("S", et, list(skip_shape or shape))]
    if gamma_input:
        inputs.append(oh.make_tensor_value_info("g1", et, [d]))
    skip_ins = ["X", "S", "g1"]
    if bias:
        inits.append(nh.from_array((0.1 * rng.standard_normal(d)).astype(dtype), "bias"))
        skip_ins.append("bias")
    outs = ["Y1", "mean" if mean_out else "", "", "H"]
    nodes = [oh.make_node("SkipSimplifiedLayerNormalization", skip_ins, outs, domain="com.microsoft", epsilon=1e-5,
                          name="skipnorm"),
             oh.make_node("SimplifiedLayerNormalization", ["H", "g2"], ["Y2"], axis=axis, epsilon=1e-6,
                          stash_type=1, name="norm")]
    outputs = [oh.make_tensor_value_info(n, et, list(shape)) for n in ("Y1", "Y2", "H")]
    if mean_out:
        outputs.append(oh.make_tensor_value_info("mean", TP.FLOAT, None))
    g = oh.make_graph(nodes, "norms", inputs, outputs, inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m


def feeds(model, seed=1):
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        dt = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        out[i.name] = (3 * rng.standard_normal(shape)).astype(dt)
    return out


def counts(model):
    ops = {}
    for n in model.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return ops


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_both_norms_rewritten_and_agree(dtype):
    m = norm_model(dtype)
    out, rep = checked_rewrite(m, ["ortnorm"])
    assert counts(out) == {"RMSNorm": 2}
    assert all(n.domain == domain.DOMAIN for n in out.graph.node)
    first = next(n for n in out.graph.node if list(n.output) == ["Y1", "H"])
    assert list(first.input) == ["X", "g1", "S"]
    assert len([e for e in rep.entries if e.action == "rewritten"]) == 2
    f = feeds(m)
    want, got = run_cpu(m, f, ours=False), run_cpu(out, f)
    np.testing.assert_array_equal(got["H"], want["H"])              # the residual sum: bit-equal
    for name in ("Y1", "Y2"):
        w, o = want[name].astype(np.float64), got[name].astype(np.float64)
        assert np.all(np.isfinite(o))
        if dtype == np.float32:
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_allclose(o, w, rtol=2 * 2.0 ** -10, atol=2.0 ** -14)


@pytest.mark.parametrize("case,reason", [
    (dict(bias=True), "bias"),
    (dict(mean_out=True), "statistics output mean"),
    (dict(gamma_input=True), "not a constant"),
    (dict(axis=0), "axis 0"),
    (dict(skip_shape=(1, 3, D)), "not the input's"),
])
def test_skipped_with_reason(case, reason):
    """What RMSNorm cannot compute stays onnxruntime's op, the reason named (the other norm is still taken)."""
    m = norm_model(**case)
    out, rep = checked_rewrite(m, ["ortnorm"], check=False)
    skipped = [e for e in rep.entries if e.action == "skipped"]
    assert len(skipped) == 1 and reason in skipped[0].reason, [e.reason for e in skipped]
    f = feeds(m)
    want, got = run_cpu(m, f, ours=False), run_cpu(out, f)
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float64), want[name].astype(np.float64), rtol=1e-5, atol=1e-6)


def test_not_default():
    """Opt-in: the default passes leave onnxruntime's norms alone."""
    out, _ = checked_rewrite(norm_model(), None, check=False)
    assert counts(out).get("RMSNorm", 0) == 0


@pytest.mark.parametrize("dtype,d,taken", [(np.float16, 64, True), (np.float16, 8192, True), (np.float32, 64, False),
                                           (np.float16, 60, False), (np.float16, 8200, False)])
def test_vector_only(dtype, d, taken):
    """The option ortnorm_vector_only (onnx-lowbit genai's CUDA default) takes only the rows RMSNorm's CUDA vector
    kernel serves (fp16, D a multiple of 8 up to VECTOR_MAX) and names why it leaves the others."""
    m = norm_model(dtype, shape=(1, 1, d), d=d)
    out, rep = checked_rewrite(m, ["ortnorm"], check=False, ortnorm_vector_only=True)
    assert counts(out).get("RMSNorm", 0) == (2 if taken else 0)
    skipped = [e.reason for e in rep.entries if e.action == "skipped"]
    if not taken:
        assert len(skipped) == 2 and all("vector kernel" in r for r in skipped), skipped


def test_vector_max_matches_the_kernel():
    """The pass's VECTOR_MAX is the CUDA kernel's VEC_MAX (the pass does not import custom_ops)."""
    from onnx_lowbit.custom_ops.attention import rmsnorm_cuda
    from onnx_lowbit.passes import ortnorm
    assert ortnorm.VECTOR_MAX == rmsnorm_cuda.VEC_MAX


def test_default_epsilon_when_absent():
    """A node without an epsilon attribute gets onnxruntime's schema default (1e-12 for the skip form, 1e-5 for the
    plain one), and the rewritten model still agrees with onnxruntime on rows whose mean square is tiny (where
    epsilon decides the result)."""
    m = norm_model(np.float32)
    for n in m.graph.node:
        del n.attribute[:]
        if n.op_type == "SimplifiedLayerNormalization":
            n.attribute.append(oh.make_attribute("axis", -1))
    out, _ = checked_rewrite(m, ["ortnorm"])
    eps = {tuple(n.output): oh.get_attribute_value(n.attribute[0]) for n in out.graph.node}
    assert eps[("Y1", "H")] == pytest.approx(1e-12) and eps[("Y2",)] == pytest.approx(1e-5)
    f = {k: (v * 1e-4).astype(v.dtype) for k, v in feeds(m).items()}      # mean squares ~1e-7: epsilon matters
    want, got = run_cpu(m, f, ours=False), run_cpu(out, f)
    for name in ("Y1", "Y2", "H"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)

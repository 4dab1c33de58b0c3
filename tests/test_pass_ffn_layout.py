"""Tests of the "ffn" pass (passes/ffn.py), continued: the option ffn_weights, which layout FusedFFN's weights get
([N, K], or [K, N] with the attribute weights_kn = 1). Models, helpers and tolerances: test_pass_ffn.py."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh
from test_pass_ffn import (K, N, Builder, feeds_for, invariants, ops, rel_fro, rewrite_and_compare, run, silu, swiglu,
                           weights)

from onnx_lowbit.passes import run_passes


# ----------------------------------------------------------------------------------------------------------------
# option ffn_weights: "nk" (default) / "kn" (FusedFFN weights_kn=1, [K, N] weights)
# ----------------------------------------------------------------------------------------------------------------
def fused_node(out, op="FusedFFN"):
    (node,) = [n for n in out.graph.node if n.op_type == op]
    return node, {a.name: oh.get_attribute_value(a) for a in node.attribute}


def inits_of(out):
    return {i.name: nh.to_array(i) for i in out.graph.initializer}


def test_default_layout_is_auto_and_nk_here():
    """The default ("auto") gives nk for this fp32 model with dynamic rows, as "nk" itself does."""
    from onnx_lowbit.passes import ffn as ffn_pass
    assert ffn_pass.DEFAULT_WEIGHTS == "auto"
    for options in ({}, {"ffn_weights": None}, {"ffn_weights": "nk"}, {"ffn_weights": "auto"}):
        out, report = rewrite_and_compare(swiglu(), **options)
        node, attrs = fused_node(out)
        assert attrs == {} and inits_of(out)[node.input[1]].shape == (N, K)
        (e,) = report.rewritten("ffn")
        assert e.details["weights"] == "nk"
        assert e.reason == ("" if options.get("ffn_weights") == "nk" else "auto: nk (kn is chosen for fp16 X and "
                                                                          "weights only)")


@pytest.mark.parametrize("dtype,x_shape,layout,why", [
    (np.float16, (2, 16, K), "kn", "M = 32 static rows >= 17"),
    (np.float16, (17, K), "kn", "M = 17 static rows >= 17"),
    (np.float16, (1, 16, K), "nk", "M = 16 static rows < 17"),
    (np.float16, (1, 1, K), "nk", "M = 1 static rows < 17"),
    (np.float16, ("B", "T", K), "kn", "rows of X not static"),
    (np.float16, (2, "T", K), "kn", "rows of X not static"),
    (np.float32, (2, 16, K), "nk", "fp16 X and weights only"),
    (np.float32, ("B", "T", K), "nk", "fp16 X and weights only"),
])
def test_auto_layout(dtype, x_shape, layout, why):
    """ffn_weights="auto" for fp16 X and weights: nk below AUTO_KN_MIN_M static rows (decode: nk's kernels are the
    fastest), kn from there and for dynamic rows (the layout the H100 never ran slower than the unfused graph);
    fp32 / mixed: nk. The report says why; the model still matches the original."""
    out, report = rewrite_and_compare(swiglu(dtype, x_shape=x_shape), tol=2e-3 if dtype == np.float16 else 1e-5,
                                      ffn_weights="auto")
    node, attrs = fused_node(out)
    assert attrs == ({"weights_kn": 1} if layout == "kn" else {})
    (e,) = report.rewritten("ffn")
    assert e.details["weights"] == layout and why in e.details["weights_choice"] and why in e.reason


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("biases", [(False, False), (True, True)])
def test_kn_reuses_matmul_weights_as_stored(dtype, biases):
    """MatMul(x, W) with W [K, N]: the node reads the source initializers themselves (same names, same values, no
    new weight initializer) and runs like the original graph."""
    m = swiglu(dtype, biases=biases)
    src = inits_of(m)
    out, report = rewrite_and_compare(m, tol=1e-5 if dtype == np.float32 else 2e-3, ffn_weights="kn")
    node, attrs = fused_node(out)
    assert attrs == {"weights_kn": 1}
    assert list(node.input[1:3]) == ["gate_w", "up_w"]
    inits = inits_of(out)
    assert np.array_equal(inits["gate_w"], src["gate_w"]) and inits["gate_w"].shape == (K, N)
    assert np.array_equal(inits["up_w"], src["up_w"])
    assert not [n for n in inits if n.endswith(("_kn", "_t"))], sorted(inits)
    (e,) = report.rewritten("ffn")
    assert e.details["weights"] == "kn" and "W1 as stored, W3 as stored" in e.reason


@pytest.mark.parametrize("spelling,how", [("gemm_tb", "transposed"), ("transpose", "transposed"),
                                          ("gemm_alpha", "alpha folded")])
def test_kn_transposes_nk_sources(spelling, how):
    """Gemm transB=1 / MatMul(x, Transpose(Wt)) ([N, K] stored): one transposed [K, N] copy; Gemm alpha: a scaled
    copy."""
    x_shape = ("M", K) if spelling.startswith("gemm") else ("B", "T", K)
    w1 = weights()[0]
    out, report = rewrite_and_compare(swiglu(proj_spelling=spelling, x_shape=x_shape, biases=(True, False)),
                                      ffn_weights="kn")
    node, attrs = fused_node(out)
    assert attrs == {"weights_kn": 1}
    inits = inits_of(out)
    assert inits[node.input[1]].shape == (K, N) and node.input[1].endswith("_kn")
    np.testing.assert_allclose(inits[node.input[1]], w1, rtol=1e-6)
    assert not [n for n in out.graph.node if n.op_type == "Transpose"]
    assert f"W1 {how}, W3 {how}" in report.rewritten("ffn")[0].reason


def test_kn_constant_node_weights_kept():
    """W from a Constant node: the node's output is read as it is (the Constant stays, nothing is copied)."""
    out, _ = rewrite_and_compare(swiglu(const_node=True), ffn_weights="kn")
    node, _ = fused_node(out)
    assert list(node.input[1:3]) == ["gate_w", "up_w"]
    assert ops(out).count("Constant") == 2


def test_kn_shared_transposed_weight_one_copy():
    """Two SwiGLU blocks reading the same [N, K] weights (behind their own Transposes): one [K, N] copy each."""
    w1, w3, _, _, _ = weights()
    b = Builder()
    b.const("w1t", np.ascontiguousarray(w1.T))
    b.const("w3t", np.ascontiguousarray(w3.T))
    outs = []
    for i, x in enumerate(["x", b.node("Relu", ["x"], name="relu")]):
        g = b.node("MatMul", [x, b.node("Transpose", ["w1t"], perm=[1, 0])], name=f"gate{i}")
        u = b.node("MatMul", [x, b.node("Transpose", ["w3t"], perm=[1, 0])], name=f"up{i}")
        outs.append(b.node("Mul", [b.node("Mul", [g, b.node("Sigmoid", [g])]), u], name=f"mul{i}"))
    m = b.model(b.node("Add", outs, name="sum"))
    out, report = run_passes(m, ["ffn"], ffn_weights="kn")
    invariants(m, out)
    nodes = [n for n in out.graph.node if n.op_type == "FusedFFN"]
    assert len(nodes) == 2 and [list(n.input[1:3]) for n in nodes] == [["w1t_kn", "w3t_kn"]] * 2
    assert sorted(inits_of(out)) == ["w1t_kn", "w3t_kn"]
    feeds = feeds_for(m)
    assert rel_fro(run(out, feeds)[0], run(m, feeds, ours=False)[0]) <= 1e-5


@pytest.mark.parametrize("transposed", [False, True])
def test_kn_mixed_precision_cast_weights(transposed):
    """MatMul(x, Cast(W16)): the fp16 [K, N] constant itself (or a transposed fp16 copy of an [N, K] one)."""
    w1, w3, w2, _, _ = weights(np.float16)
    b = Builder(np.float32)
    prj = []
    for name, w in (("gate", w1), ("up", w3)):
        wsrc = b.node("Transpose", [b.const(f"{name}_wt", np.ascontiguousarray(w.T))], perm=[1, 0]) if transposed \
            else b.const(f"{name}_w", w)
        prj.append(b.node("MatMul", ["x", b.node("Cast", [wsrc], to=TP.FLOAT)], name=name))
    s = b.node("Mul", [silu(b, prj[0]), prj[1]], name="mul")
    m = b.model(b.node("MatMul", [s, b.const("down_w", w2.astype(np.float32))], name="down"))
    out, _ = rewrite_and_compare(m, ffn_weights="kn")
    node, attrs = fused_node(out)
    w = inits_of(out)[node.input[1]]
    assert attrs == {"weights_kn": 1} and w.dtype == np.float16 and np.array_equal(w, w1)
    assert node.input[1] == ("gate_wt_kn" if transposed else "gate_w")


def test_kn_leaves_four_bit_ops_alone():
    out, report = run_passes(swiglu(), ["weights4", "ffn"], weights="nf4", ffn_weights="kn")
    _, attrs = fused_node(out, "FusedFFNNF4")
    assert "weights_kn" not in attrs and "weights" not in report.rewritten("ffn")[0].details


@pytest.mark.parametrize("bad", ["KN", "mk", 1, True])
def test_bad_weights_option(bad):
    with pytest.raises(ValueError, match=r"ffn_weights must be 'nk' .*, 'kn' .* or 'auto' .*, got"):
        run_passes(swiglu(), ["ffn"], ffn_weights=bad)


def test_cli_ffn_weights(tmp_path, capsys):
    from onnx_lowbit import cli
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(swiglu(), src)
    assert cli.main(["rewrite", str(src), str(dst), "--ffn-weights", "kn", "--verify"]) == 0
    node, attrs = fused_node(onnx.load(dst))
    assert attrs == {"weights_kn": 1} and node.input[1] == "gate_w"
    assert cli.main(["rewrite", str(src), str(dst), "--ffn-weights", "nk"]) == 0
    assert fused_node(onnx.load(dst))[1] == {}
    assert cli.main(["rewrite", str(src), str(dst), "--ffn-weights", "xy"]) == 2
    assert "--ffn-weights" in capsys.readouterr().err

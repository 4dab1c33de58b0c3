"""Tests of the "ffn" pass (passes/ffn.py): hand-built SwiGLU spellings, skipped look-alikes, pass order.

Tolerances (rewritten vs original, both run in onnxruntime CPU; relative Frobenius error of the output):
* float weights, fp32 model: <= 1e-5 (the fused kernel sums in fp32 like MatMul; only rounding order differs,
  observed ~3e-7); fp16 model: <= 2e-3 (the original rounds g, Sigmoid, SiLU, u and the product to fp16, five
  roundings of 2^-11 relative; the fused op rounds once).
* with the fplut pass in the chain the original's SiLU becomes a table (~1e-3 relative per activation), unless ffn
  takes the exact SiLU first: <= 5e-3.
* 4-bit weights: the fused model is compared with the same model quantised by weights4 alone (identical packed
  bytes): <= 1e-4 fp32 (the 4-bit ops and the fused op differ only by fp32 rounding order). The quantisation error
  itself (vs the float model, ~0.1-0.2 relative for NF4/AWQ at these tiny random sizes) is the weights4 pass's
  business (tests/test_pass_weights4.py).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

import onnx_lowbit
from onnx_lowbit import domain
from onnx_lowbit.passes import PASSES, available, run_passes

CPU = ["CPUExecutionProvider"]
K, N = 64, 176
_ET = {np.float32: TP.FLOAT, np.float16: TP.FLOAT16}
FUSED = {"FusedFFN", "FusedFFNNF4", "FusedFFNAWQ"}


def rel_fro(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def weights(dtype=np.float32, seed=0, n_up=N):
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((K, N)) / 8).astype(dtype)
    w3 = (rng.standard_normal((K, n_up)) / 8).astype(dtype)
    w2 = (rng.standard_normal((N, K)) / 13).astype(dtype)
    b1 = (rng.standard_normal(N) / 10).astype(dtype)
    b3 = (rng.standard_normal(N) / 10).astype(dtype)
    return w1, w3, w2, b1, b3


class Builder:
    """A tiny graph builder: nodes, initializers, Constant nodes."""

    def __init__(self, dtype=np.float32):
        self.dtype, self.nodes, self.inits, self.extra_out, self.domains = dtype, [], [], [], {}
        self.i = 0

    def node(self, op, ins, name=None, domain="", **attrs):
        self.i += 1
        out = f"t{self.i}"
        self.nodes.append(oh.make_node(op, ins, [out], name=name or f"{op.lower()}{self.i}", domain=domain, **attrs))
        if domain:
            self.domains[domain] = 1
        return out

    def const(self, name, value, as_node=False):
        value = np.asarray(value)
        if as_node:
            self.nodes.append(oh.make_node("Constant", [], [name], name=f"{name}_const", value=nh.from_array(value)))
        else:
            self.inits.append(nh.from_array(value, name))
        return name

    def model(self, y, x_shape=("B", "T", K), y_shape=None, opset=17, inputs=()):
        et = _ET[self.dtype]
        ins = [oh.make_tensor_value_info("x", et, list(x_shape))] + list(inputs)
        rank = [None] * len(x_shape)
        outs = [oh.make_tensor_value_info(o, et, rank) for o in [y] + self.extra_out]
        g = oh.make_graph(self.nodes, "g", ins, outs, initializer=self.inits)
        ops = [oh.make_opsetid("", opset)] + [oh.make_opsetid(d, v) for d, v in self.domains.items()]
        return oh.make_model(g, opset_imports=ops, ir_version=10, producer_name="test")


def proj(b, x, w, name, spelling="matmul", bias=None, const_node=False):
    """x W (+ bias) in one of the exporter spellings; w is [K, N']."""
    if spelling == "matmul":
        y = b.node("MatMul", [x, b.const(f"{name}_w", w, const_node)], name=name)
    elif spelling == "transpose":  # MatMul(x, Transpose(Wt)) with Wt [N, K] (TorchScript/dynamo nn.Linear)
        wt = b.node("Transpose", [b.const(f"{name}_wt", np.ascontiguousarray(w.T), const_node)], perm=[1, 0])
        y = b.node("MatMul", [x, wt], name=name)
    elif spelling == "gemm_tb":  # Gemm(x, Wt, C, transB=1), 2-D x
        ins = [x, b.const(f"{name}_wt", np.ascontiguousarray(w.T), const_node)]
        if bias is not None:
            ins.append(b.const(f"{name}_c", bias))
            bias = None
        y = b.node("Gemm", ins, name=name, transB=1)
    elif spelling == "gemm_alpha":  # Gemm(x, W/2, alpha=2)
        y = b.node("Gemm", [x, b.const(f"{name}_w", (w / 2).astype(w.dtype), const_node)], name=name, alpha=2.0)
    else:
        raise ValueError(spelling)
    if bias is not None:
        y = b.node("Add", [b.const(f"{name}_b", bias), y], name=f"{name}_bias")
    return y


def silu(b, z, spelling="sigmoid_mul"):
    if spelling == "sigmoid_mul":
        return b.node("Mul", [z, b.node("Sigmoid", [z], name="sig")], name="silu")
    if spelling == "mul_sigmoid":
        return b.node("Mul", [b.node("Sigmoid", [z], name="sig"), z], name="silu")
    if spelling == "quickgelu":
        return b.node("QuickGelu", [z], name="qg", domain="com.microsoft", alpha=1.0)
    if spelling == "swish":
        return b.node("Swish", [z], name="swish")
    raise ValueError(spelling)


def swiglu(dtype=np.float32, proj_spelling="matmul", silu_spelling="sigmoid_mul", up_first=False, biases=(False, False),
           const_node=False, x_shape=("B", "T", K), down=True, opset=17, n_up=N):
    w1, w3, w2, b1, b3 = weights(dtype, n_up=n_up)
    b = Builder(dtype)
    g = proj(b, "x", w1, "gate", proj_spelling, b1 if biases[0] else None, const_node)
    u = proj(b, "x", w3, "up", proj_spelling, b3[:n_up] if biases[1] else None, const_node)
    a = silu(b, g, silu_spelling)
    s = b.node("Mul", [u, a] if up_first else [a, u], name="mul")
    y = b.node("MatMul", [s, b.const("down_w", w2)], name="down") if down else s
    return b.model(y, x_shape, opset=opset)


def feeds_for(model, seed=1, shape=None):
    vi = model.graph.input[0]
    dt = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}[vi.type.tensor_type.elem_type]
    dims = shape or [d.dim_value if d.HasField("dim_value") else 3 for d in vi.type.tensor_type.shape.dim]
    return {vi.name: np.random.default_rng(seed).standard_normal(dims).astype(dt)}


def run(model, feeds, ours=True):
    if ours:
        return onnx_lowbit.InferenceSession(model, providers=CPU).run(None, feeds)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=CPU).run(None, feeds)


def ops(model):
    return [n.op_type for n in model.graph.node]


def invariants(src, out):
    onnx.checker.check_model(out, full_check=True)
    assert [i.name for i in out.graph.input] == [i.name for i in src.graph.input]
    assert [o.name for o in out.graph.output] == [o.name for o in src.graph.output]
    assert out.producer_name == src.producer_name


def rewrite_and_compare(model, passes=("ffn",), tol=1e-5, ref_model=None, expect_op="FusedFFN", **options):
    before = model.SerializeToString()
    out, report = run_passes(model, list(passes), **options)
    assert model.SerializeToString() == before, "the input model was modified"
    invariants(model, out)
    if expect_op is not None:
        assert ops(out).count(expect_op) == 1, (ops(out), report.to_table())
        assert not {"Sigmoid", "QuickGelu", "Swish"} & set(ops(out)), ops(out)
    feeds = feeds_for(model)
    ref = run(ref_model or model, feeds, ours=ref_model is not None)[0]
    got = run(out, feeds)[0]
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert rel_fro(got, ref) <= tol, (rel_fro(got, ref), report.to_table())
    return out, report


# ----------------------------------------------------------------------------------------------------------------
# spellings
# ----------------------------------------------------------------------------------------------------------------
def test_registered_after_weights4():
    assert available().index("ffn") > available().index("weights4") > available().index("fplut")
    assert {"FusedFFN", "FusedFFNNF4", "FusedFFNAWQ"} <= set(domain.OPS)
    assert PASSES["ffn"].description


@pytest.mark.parametrize("silu_spelling", ["sigmoid_mul", "mul_sigmoid", "quickgelu"])
@pytest.mark.parametrize("up_first", [False, True])
def test_silu_spellings_and_mul_order(silu_spelling, up_first):
    out, report = rewrite_and_compare(swiglu(silu_spelling=silu_spelling, up_first=up_first))
    assert ops(out) == ["FusedFFN", "MatMul"], ops(out)
    (e,) = report.rewritten("ffn")
    assert e.details["op"] == "FusedFFN" and e.details["K"] == K and e.details["N"] == N
    node = out.graph.node[0]
    w1 = nh.to_array(next(i for i in out.graph.initializer if i.name == node.input[1]))
    assert w1.shape == (N, K)  # transposed at rewrite time


def test_swish_op_opset24_rewritten():
    """Swish (opset 24) is rewritten; onnxruntime may not run opset 24, so only the graph is checked."""
    m = swiglu(silu_spelling="swish", opset=24)
    out, report = run_passes(m, ["ffn"])
    onnx.checker.check_model(out, full_check=True)
    assert ops(out) == ["FusedFFN", "MatMul"] and report.rewritten("ffn")[0].pattern.endswith("Swish(alpha=1)")


@pytest.mark.parametrize("spelling", ["matmul", "transpose", "gemm_tb", "gemm_alpha"])
@pytest.mark.parametrize("const_node", [False, True])
def test_projection_spellings(spelling, const_node):
    x_shape = ("M", K) if spelling.startswith("gemm") else ("B", "T", K)
    out, _ = rewrite_and_compare(swiglu(proj_spelling=spelling, const_node=const_node, x_shape=x_shape))
    assert ops(out) == ["FusedFFN", "MatMul"], ops(out)
    assert not [n for n in out.graph.node if n.op_type in ("Constant", "Transpose")]


@pytest.mark.parametrize("biases", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("spelling", ["matmul", "gemm_tb"])
def test_biases_folded(biases, spelling):
    x_shape = ("M", K) if spelling == "gemm_tb" else ("B", "T", K)
    out, report = rewrite_and_compare(swiglu(proj_spelling=spelling, biases=biases, x_shape=x_shape))
    assert ops(out) == ["FusedFFN", "MatMul"], ops(out)
    node = out.graph.node[0]
    present = [len(node.input) > i and node.input[i] != "" for i in (3, 4)]
    assert present == list(biases)
    assert report.rewritten("ffn")[0].details["bias"]


@pytest.mark.parametrize("x_shape", [("M", K), ("B", "T", K), (2, "T", 3, K)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_leading_dims_and_dtypes(x_shape, dtype):
    out, _ = rewrite_and_compare(swiglu(dtype, x_shape=x_shape, biases=(True, True)),
                                 tol=1e-5 if dtype == np.float32 else 2e-3)
    assert out.graph.node[0].op_type == "FusedFFN"


def test_without_down_projection_graph_output():
    """S itself a graph output: the fused op writes it under the same name."""
    rewrite_and_compare(swiglu(down=False))


# ----------------------------------------------------------------------------------------------------------------
# skipped look-alikes
# ----------------------------------------------------------------------------------------------------------------
def skipped_reason(model, passes=("ffn",), **options):
    out, report = run_passes(model, list(passes), **options)
    onnx.checker.check_model(out, full_check=True)
    assert not FUSED & set(ops(out)), ops(out)
    (e,) = report.skipped("ffn")
    assert not report.rewritten("ffn")
    return e.reason, out


def test_skip_non_constant_weight():
    b = Builder()
    w1, w3, _, _, _ = weights()
    g = b.node("MatMul", ["x", "w1_in"], name="gate")
    u = b.node("MatMul", ["x", b.const("w3", w3)], name="up")
    s = b.node("Mul", [silu(b, g), u], name="mul")
    m = b.model(s, inputs=[oh.make_tensor_value_info("w1_in", TP.FLOAT, [K, N])])
    reason, _ = skipped_reason(m)
    assert "not a constant" in reason and "w1_in" in reason


def test_skip_different_inputs():
    b = Builder()
    w1, w3, _, _, _ = weights()
    x2 = b.node("Relu", ["x"], name="relu")
    g = b.node("MatMul", ["x", b.const("w1", w1)], name="gate")
    u = b.node("MatMul", [x2, b.const("w3", w3)], name="up")
    m = b.model(b.node("Mul", [silu(b, g), u], name="mul"))
    reason, out = skipped_reason(m)
    assert "not one input" in reason
    feeds = feeds_for(m)
    np.testing.assert_array_equal(run(m, feeds, ours=False)[0], run(out, feeds, ours=False)[0])


def test_skip_shape_mismatch():
    """up of width 1 broadcasts in the Mul: not a SwiGLU of one N."""
    reason, _ = skipped_reason(swiglu(n_up=1))
    assert "shape mismatch" in reason and "N=1" in reason


@pytest.mark.parametrize("where", ["gate", "silu", "up", "sigmoid", "gate_graph_output"])
def test_skip_shared_intermediate(where):
    w1, w3, _, _, _ = weights()
    b = Builder()
    g = b.node("MatMul", ["x", b.const("w1", w1)], name="gate")
    sg = b.node("Sigmoid", [g], name="sig")
    a = b.node("Mul", [g, sg], name="silu")
    u = b.node("MatMul", ["x", b.const("w3", w3)], name="up")
    s = b.node("Mul", [a, u], name="mul")
    tensor = {"gate": g, "silu": a, "up": u, "sigmoid": sg, "gate_graph_output": g}[where]
    if where == "gate_graph_output":
        b.extra_out.append(g)
        y = s
    else:
        y = b.node("Add", [s, b.node("Relu", [tensor], name="other")], name="add")
    m = b.model(y)
    reason, out = skipped_reason(m)
    assert "shared intermediate" in reason
    assert ("graph output" if where == "gate_graph_output" else "other") in reason
    feeds = feeds_for(m)
    for r, o in zip(run(m, feeds, ours=False), run(out, feeds)):
        np.testing.assert_array_equal(r, o)


def test_not_reported_non_matches():
    """SiLU(x) * y without projections, and plain Muls: no candidates, nothing reported."""
    b = Builder()
    s = b.node("Mul", [silu(b, "x"), b.node("Relu", ["x"])], name="mul")
    y = b.node("Mul", [s, b.const("two", np.float32(2.0))])
    out, report = run_passes(b.model(y), ["ffn"])
    assert not report.entries and sorted(ops(out)) == sorted(ops(b.model(y)))


def test_skip_mixed_formats():
    """weights4 left up in float (excluded): gate MatMulNF4 + up MatMul are not one format."""
    reason, _ = skipped_reason(swiglu(), passes=("weights4", "ffn"), weights="nf4", weights_min_elements=1,
                               weights_exclude="^up$")
    assert "different formats" in reason


def test_skip_ort_target():
    reason, _ = skipped_reason(swiglu(), passes=("weights4", "ffn"), weights="nf4", weights_target="ort")
    assert "onnxruntime's 4-bit op" in reason


# ----------------------------------------------------------------------------------------------------------------
# 4-bit weights and pass order
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,op", [("nf4", "FusedFFNNF4"), ("fp4", "FusedFFNNF4"), ("awq", "FusedFFNAWQ")])
@pytest.mark.parametrize("biases", [(False, False), (True, True)])
def test_four_bit_reuses_packed_weights(fmt, op, biases):
    m = swiglu(biases=biases)
    q, _ = run_passes(m, ["weights4"], weights=fmt)
    out, report = rewrite_and_compare(m, passes=("weights4", "ffn"), tol=1e-4, ref_model=q, expect_op=op, weights=fmt)
    assert ops(out) == [op, "MatMulAWQ" if fmt == "awq" else "MatMulNF4"], ops(out)
    fused = out.graph.node[0]
    q_inits = {i.name: nh.to_array(i) for i in q.graph.initializer}
    o_inits = {i.name: nh.to_array(i) for i in out.graph.initializer}
    n_w = 4 if fmt != "awq" else 6
    for name in fused.input[1:1 + n_w]:  # the same packed tensors, no requantisation
        np.testing.assert_array_equal(o_inits[name], q_inits[name])
    attrs = {a.name: oh.get_attribute_value(a) for a in fused.attribute}
    assert attrs["K"] == K and attrs["N"] == N
    assert report.rewritten("ffn")[0].details["op"] == op


def test_cli_default_order_gives_fused_4bit(tmp_path):
    from onnx_lowbit import cli
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(swiglu(), src)
    assert cli.main(["rewrite", str(src), str(dst), "--weights", "nf4"]) == 0
    assert ops(onnx.load(dst)) == ["FusedFFNNF4", "MatMulNF4"]
    # --passes ffn with --weights: weights4 is still placed before ffn
    assert cli.main(["rewrite", str(src), str(dst), "--passes", "ffn", "--weights", "awq"]) == 0
    assert ops(onnx.load(dst)) == ["FusedFFNAWQ", "MatMulAWQ"]
    # without the ffn pass: no fused op
    assert cli.main(["rewrite", str(src), str(dst), "--passes", "fplut,weights4", "--weights", "nf4"]) == 0
    assert not FUSED & set(ops(onnx.load(dst)))


ORDERS = [("ffn", "fplut"), ("fplut", "ffn"), ("ffn", "fplut", "weights4"), ("fplut", "ffn", "weights4"),
          ("fplut", "weights4", "ffn"), ("weights4", "ffn", "fplut"), ("weights4", "fplut", "ffn")]


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_any_order_gives_a_correct_model(order):
    """Every order is correct. With weights4 before ffn the fused op is 4-bit; after it, gate/up stay float in
    FusedFFN and only the down projection is quantised (documented in docs/ffn.md)."""
    m = swiglu(biases=(True, False))
    w4_first = "weights4" in order and order.index("weights4") < order.index("ffn")
    expect = "FusedFFNNF4" if w4_first else "FusedFFN"
    fplut_first = "fplut" in order and order.index("fplut") < order.index("ffn")
    # reference: the same quantisation of the same weights, without ffn (and with the exact SiLU)
    if "weights4" in order:
        q_passes = ["weights4"] if w4_first else []
        ref, _ = run_passes(m, q_passes, weights="nf4") if q_passes else (m, None)
        if not w4_first:  # only the down projection ends up quantised: quantise just that one for the reference
            ref, _ = run_passes(m, ["weights4"], weights="nf4", weights_exclude=["^gate$", "^up$"])
    else:
        ref = m
    tol = 5e-3 if fplut_first else 1e-4
    out, _ = rewrite_and_compare(m, passes=order, tol=tol, ref_model=ref, expect_op=expect, weights="nf4")
    assert "FPLUT" not in ops(out)  # the only activation was the SwiGLU's SiLU


def test_awq_calibration_shares_one_scale_for_gate_and_up():
    """weights4's AWQ calibration searches one activation scale for gate and up (they read the same x) and
    applies it once, so the block still fuses: FusedFFNAWQ, close to the weights4-only model (unfused) and to the
    float original."""
    m = swiglu(x_shape=("M", K))
    rng = np.random.default_rng(0)
    cal = {"x": rng.standard_normal((64, K)).astype(np.float32)}
    opts = dict(weights="awq", calibration=cal, group_size=32)
    out, report = run_passes(m, ["weights4", "ffn"], **opts)
    assert ops(out).count("FusedFFNAWQ") == 1 and ops(out).count("MatMulAWQ") == 1, ops(out)
    notes = " ".join(e.reason for e in report.rewritten("weights4"))
    assert "searched jointly" in notes
    unfused, _ = run_passes(m, ["weights4"], **opts)
    feeds = {"x": rng.standard_normal((5, K)).astype(np.float32)}
    got, mid, ref = run(out, feeds)[0], run(unfused, feeds)[0], run(m, feeds, ours=False)[0]
    assert rel_fro(got, mid) <= 1e-5
    assert rel_fro(got, ref) <= 0.2


@pytest.mark.parametrize("transposed", [False, True])
def test_mixed_precision_cast_weights(transposed):
    """MatMul(x, Cast(W16 -> float)) (fp16 weights, fp32 activations): FusedFFN with float16 W1/W3 (mixed mode)."""
    w1, w3, w2, b1, _ = weights(np.float16)
    b = Builder(np.float32)
    prj = []
    for name, w in (("gate", w1), ("up", w3)):
        if transposed:
            wsrc = b.node("Transpose", [b.const(f"{name}_wt", np.ascontiguousarray(w.T))], perm=[1, 0])
        else:
            wsrc = b.const(f"{name}_w", w)
        prj.append(b.node("MatMul", ["x", b.node("Cast", [wsrc], to=TP.FLOAT)], name=name))
    g = b.node("Add", [prj[0], b.const("b1", b1.astype(np.float32))])
    s = b.node("Mul", [silu(b, g), prj[1]], name="mul")
    y = b.node("MatMul", [s, b.const("down_w", w2.astype(np.float32))], name="down")
    out, report = rewrite_and_compare(b.model(y))
    node = out.graph.node[0]
    inits = {i.name: nh.to_array(i) for i in out.graph.initializer}
    assert inits[node.input[1]].dtype == np.float16 and inits[node.input[1]].shape == (N, K)
    assert "Cast" not in ops(out) and "Cast(W fp16)" in report.rewritten("ffn")[0].pattern


def test_subgraph():
    """A SwiGLU inside an If branch (outer-scope x, branch-local weights) is fused there."""
    inner = Builder()
    w1, w3, _, _, _ = weights()
    g = inner.node("MatMul", ["x", inner.const("w1", w1)], name="gate")
    u = inner.node("MatMul", ["x", inner.const("w3", w3)], name="up")
    s = inner.node("Mul", [silu(inner, g), u], name="mul")
    then_g = oh.make_graph(inner.nodes, "then", [], [oh.make_tensor_value_info(s, TP.FLOAT, [None, None])],
                           initializer=inner.inits)
    else_g = oh.make_graph([oh.make_node("Constant", [], ["z"], value=nh.from_array(np.zeros((1, N), np.float32)))],
                           "else", [], [oh.make_tensor_value_info("z", TP.FLOAT, [None, None])])
    node = oh.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="if")
    gr = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["M", K]),
                                     oh.make_tensor_value_info("c", TP.BOOL, [])],
                       [oh.make_tensor_value_info("y", TP.FLOAT, [None, None])])
    m = oh.make_model(gr, opset_imports=[oh.make_opsetid("", 17)], ir_version=10)
    out, report = run_passes(m, ["ffn"])
    onnx.checker.check_model(out, full_check=True)
    branch = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in branch.node] == ["FusedFFN"], report.to_table()
    feeds = {"x": np.random.default_rng(0).standard_normal((3, K)).astype(np.float32), "c": np.array(True)}
    assert rel_fro(run(out, feeds)[0], run(m, feeds, ours=False)[0]) <= 1e-5


def test_awq_shared_scale_folds_into_the_norm():
    """LayerNorm -> gate, up: the shared activation scale is folded into the norm's gamma/beta (its only readers
    are the two projections): no Mul is inserted and the block fuses."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(3)
    w1, w3, w2, _, _ = weights()
    inits = [numpy_helper.from_array(v, n) for n, v in
             [("gamma", (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)),
              ("beta", (0.1 * rng.standard_normal(K)).astype(np.float32)), ("w1", w1), ("w3", w3), ("w2", w2)]]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], axis=-1),
             helper.make_node("MatMul", ["h", "w1"], ["g"], name="gate"),
             helper.make_node("MatMul", ["h", "w3"], ["u"], name="up"),
             helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["s"], name="mul"),
             helper.make_node("MatMul", ["s", "w2"], ["y"], name="down")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", w2.shape[1]])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    cal = {"x": rng.standard_normal((64, K)).astype(np.float32)}
    # awq_holdout=0: the scales searched on all rows are used (on random data they need not beat RTN on held-out
    # rows, which the default requires); this test is about where the shared one goes
    out, report = run_passes(m, ["weights4", "ffn"], weights="awq", calibration=cal, group_size=32, awq_holdout=0)
    assert ops(out).count("FusedFFNAWQ") == 1 and ops(out).count("Mul") == 1, ops(out)  # the down proj's Mul
    assert any("folded into" in e.reason for e in report.rewritten("weights4"))
    feeds = {"x": rng.standard_normal((5, K)).astype(np.float32)}
    assert rel_fro(run(out, feeds)[0], run(m, feeds, ours=False)[0]) <= 0.2


# ----------------------------------------------------------------------------------------------------------------
# one gate_up product + Split (onnxruntime-genai's builder with --extra_options fuse_mlp_gate_up=true)
# ----------------------------------------------------------------------------------------------------------------
def swiglu_split(dtype=np.float32, spelling="matmul", split="num_outputs", gate_second=False, sizes=None, axis=-1,
                 x_shape=("B", "T", K), extra_reader=False, bias=False, down=True):
    """S = SiLU(gate) * up with gate, up = Split(x [W1 | W3] (+ [b1 | b3]), axis) (W3 first when gate_second):
    genai's spelling MatMul(x, W_gate_up) -> Split(axis=-1, num_outputs=2) and look-alikes."""
    w1, w3, w2, b1, b3 = weights(dtype)
    b = Builder(dtype)
    first, second = (w3, w1) if gate_second else (w1, w3)
    bb = np.concatenate([b3, b1] if gate_second else [b1, b3]) if bias else None
    gu = proj(b, "x", np.ascontiguousarray(np.concatenate([first, second], axis=1)), "gate_up", spelling, bb)
    outs = ["gu_0", "gu_1"]
    if split == "num_outputs":
        b.nodes.append(oh.make_node("Split", [gu], outs, name="split", axis=axis, num_outputs=2))
    else:
        b.nodes.append(oh.make_node("Split", [gu, b.const("sizes", np.array(sizes or [N, N], np.int64))], outs,
                                    name="split", axis=axis))
    g, u = (outs[1], outs[0]) if gate_second else outs
    s = b.node("Mul", [silu(b, g), u], name="mul")
    y = b.node("MatMul", [s, b.const("down_w", w2)], name="down") if down else s
    if extra_reader:
        b.extra_out.append(gu)
    return b.model(y, x_shape, opset=18), (w1, w3)


@pytest.mark.parametrize("spelling,x_shape", [("matmul", ("B", "T", K)), ("transpose", ("B", "T", K)),
                                              ("gemm_tb", ("M", K))])
@pytest.mark.parametrize("split,gate_second", [("num_outputs", False), ("sizes", True)])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_gate_up_split_fused(spelling, x_shape, split, gate_second, layout):
    """The gate_up product and its Split -> one FusedFFN with W1, W3 the two halves of the columns (gate's half
    whichever output of the Split gate is)."""
    m, (w1, w3) = swiglu_split(spelling=spelling, split=split, gate_second=gate_second, x_shape=x_shape)
    out, report = rewrite_and_compare(m, ffn_weights=layout)
    assert ops(out) == ["FusedFFN", "MatMul"], ops(out)
    (e,) = report.rewritten("ffn")
    assert e.details["K"] == K and e.details["N"] == N and "-> Split" in e.pattern
    node = out.graph.node[0]
    inits = {i.name: nh.to_array(i) for i in out.graph.initializer}
    got1, got3 = inits[node.input[1]], inits[node.input[2]]
    if layout == "nk":
        got1, got3 = got1.T, got3.T
    np.testing.assert_array_equal(got1, w1)
    np.testing.assert_array_equal(got3, w3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gate_up_split_with_bias_and_dtypes(dtype):
    m, _ = swiglu_split(dtype=dtype, bias=True)
    out, report = rewrite_and_compare(m, tol=1e-5 if dtype == np.float32 else 2e-3)
    assert report.rewritten("ffn")[0].details["bias"]


@pytest.mark.parametrize("case,expect", [("sizes", "not two equal halves"), ("axis", "not the last axis"),
                                         ("reader", "also read elsewhere")])
def test_gate_up_split_skips(case, expect):
    # unequal sizes: up [.., 1] broadcasts in the Mul; axis 0: halves of the rows (no down projection: S's width
    # is not N there)
    kw = {"sizes": dict(split="sizes", sizes=[2 * N - 1, 1], down=False),
          "axis": dict(axis=0, x_shape=("M", K), down=False),
          "reader": dict(extra_reader=True)}[case]
    m, _ = swiglu_split(**kw)
    reason, out = skipped_reason(m)
    assert expect in reason, reason
    assert ops(out) == ops(m)

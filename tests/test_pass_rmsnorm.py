"""Tests of the "rmsnorm" pass (passes/rmsnorm.py): LLaMA RMSNorm (+ the residual Add) -> one RMSNorm node.

Values: onnxruntime's CPU run of the ORIGINAL against rmsnorm.apply of the same inputs, against onnx.reference's
run of the rewritten model with rmsnorm.apply as the op (checks the wiring), and against
onnx_lowbit.InferenceSession's run of the rewritten model (the CPU kernel); fp32 within 1e-5 relative, fp16 within
one fp16 ulp (2^-10 relative; onnxruntime's CPU EP drops the fp16 Cast between the normalising Mul and the weight,
so its product is rounded once, the op's twice).
Real exports: a tiny transformers LlamaForCausalLM (2 layers, hidden 64, random norm weights) through the
TorchScript exporter (fp32, fp16; sequence axis dynamic) and the dynamo exporter (fp32): 2 RMSNorm per layer + 1,
no ReduceMean left, logits equal to the original's. Residual Adds fused: all but the first norm's in the dynamo
export (static shapes); in the TorchScript ones only where onnx's shape inference proves both inputs the same
shape (the other Adds add o_proj's output, whose dims it cannot relate to the residual's: 2 of 4).
"""
from __future__ import annotations

import os

from functools import partial

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from helpers import checked_rewrite, input_specs, run_cpu, tiny_llama_export

import onnx_lowbit
from onnx_lowbit import domain, passes, rmsnorm
from onnx_lowbit.passes.rmsnorm import PATTERN, RMSNormPass

CPU = ["CPUExecutionProvider"]
ET = {np.float32: TP.FLOAT, np.float16: TP.FLOAT16, np.float64: TP.DOUBLE}
EPS = 1e-5


@pytest.fixture(autouse=True, scope="module")
def registered():
    """The pass under its registry name (the lead registers it in passes/__init__.py; until then, for this file)."""
    added = "rmsnorm" not in passes.PASSES
    if added:
        passes.PASSES["rmsnorm"] = RMSNormPass()
    yield
    if added:
        del passes.PASSES["rmsnorm"]


def rms_model(dtype=np.float32, shape=(2, 5, 16), cast=None, square="pow", recip="div", swap_mul=False,
              swap_gamma=False, swap_eps=False, residual=False, sum_output=False, sum_reader=False, axes=-1,
              keepdims=1, gamma="init", gamma_shape=None, outputs=(), opset=17, back=None):
    """Graph inputs x (and r with ``residual``: h = Add(x, r)); RMSNorm of h as LlamaRMSNorm exports spell it ->
    output y. ``cast``: the Casts to float and back (default: for fp16); ``recip``: "div" Div(1, Sqrt),
    "reciprocal", "pow" (Pow(v, -0.5)), "divx" (Div(h32, Sqrt)); ``gamma``: "init", "constant" (a Constant node),
    "input" (a graph input), "identity" (an initializer through Identity); ``sum_output`` / ``sum_reader``: h also
    a graph output / read by another node (output z = Mul(h, h)); ``outputs``: intermediates made graph outputs;
    ``back``: the Cast back's type (default h's); opset >= 18: axes as an input."""
    cast = dtype != np.float32 if cast is None else cast
    cd = np.float32 if cast or dtype == np.float32 else dtype          # the type of the arithmetic's constants
    et = ET[dtype] if back is None else back                          # the output's type (and gamma's)
    gd = onnx.helper.tensor_dtype_to_np_dtype(et)
    d = shape[-1]
    rng = np.random.default_rng(7)
    gshape = [d] if gamma_shape is None else list(gamma_shape)
    g_val = (1 + 0.5 * rng.standard_normal(gshape)).astype(gd)
    nodes, inits, extra_in = [], [nh.from_array(np.array(EPS, cd), "eps")], []
    h = "x"
    if residual:
        nodes.append(oh.make_node("Add", ["x", "r"], ["h"], name="residual_add"))
        h = "h"
    h32 = h
    if cast:
        nodes.append(oh.make_node("Cast", [h], ["h32"], name="cast_in", to=TP.FLOAT))
        h32 = "h32"
    if square == "pow":
        inits.append(nh.from_array(np.array(2.0, cd), "two"))
        nodes.append(oh.make_node("Pow", [h32, "two"], ["p"], name="pow"))
    else:
        nodes.append(oh.make_node("Mul", [h32, h32], ["p"], name="square"))
    if opset >= 18:
        inits.append(nh.from_array(np.array([axes], np.int64), "axes"))
        nodes.append(oh.make_node("ReduceMean", ["p", "axes"], ["ms"], name="mean", keepdims=keepdims))
    else:
        nodes.append(oh.make_node("ReduceMean", ["p"], ["ms"], name="mean", axes=[axes], keepdims=keepdims))
    nodes.append(oh.make_node("Add", ["eps", "ms"] if swap_eps else ["ms", "eps"], ["v"], name="add_eps"))
    if recip == "pow":
        inits.append(nh.from_array(np.array(-0.5, cd), "mhalf"))
        nodes.append(oh.make_node("Pow", ["v", "mhalf"], ["rs"], name="rsqrt"))
    else:
        nodes.append(oh.make_node("Sqrt", ["v"], ["s"], name="sqrt"))
        if recip == "div":
            inits.append(nh.from_array(np.array(1.0, cd), "one"))
            nodes.append(oh.make_node("Div", ["one", "s"], ["rs"], name="recip"))
        elif recip == "reciprocal":
            nodes.append(oh.make_node("Reciprocal", ["s"], ["rs"], name="recip"))
    if recip == "divx":
        nodes.append(oh.make_node("Div", [h32, "s"], ["n"], name="normalise"))
    else:
        nodes.append(oh.make_node("Mul", ["rs", h32] if swap_mul else [h32, "rs"], ["n"], name="normalise"))
    yv = "n"
    if cast:
        nodes.append(oh.make_node("Cast", ["n"], ["yc"], name="cast_back", to=et))
        yv = "yc"
    gname = "gamma"
    if gamma == "init":
        inits.append(nh.from_array(g_val, "gamma"))
    elif gamma == "constant":
        nodes.insert(0, oh.make_node("Constant", [], ["gamma"], name="gamma_const", value=nh.from_array(g_val)))
    elif gamma == "identity":
        inits.append(nh.from_array(g_val, "gamma_w"))
        nodes.insert(0, oh.make_node("Identity", ["gamma_w"], ["gamma"], name="gamma_id"))
    else:
        extra_in.append(oh.make_tensor_value_info("gamma", et, gshape))
    nodes.append(oh.make_node("Mul", [yv, gname] if swap_gamma else [gname, yv], ["y"], name="scale"))
    inputs = [oh.make_tensor_value_info("x", ET[dtype], list(shape))]
    if residual:
        inputs.append(oh.make_tensor_value_info("r", ET[dtype], list(shape)))
    outs = [out_info("y", et, len(shape))]
    if sum_output:
        outs.append(out_info(h, et, len(shape)))
    if sum_reader:
        nodes.append(oh.make_node("Mul", [h, h], ["z"], name="reader"))
        outs.append(out_info("z", et, len(shape)))
    outs += [out_info(o, TP.FLOAT, len(shape)) for o in outputs]
    g = oh.make_graph(nodes, "rms", inputs + extra_in, outs, inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)


def out_info(name, et, rank):
    return oh.make_tensor_value_info(name, et, [f"{name}{i}" for i in range(rank)])


def ops(model):
    return sorted((n.domain, n.op_type) for n in model.graph.node)


def feeds_for(model, seed=0):
    rng = np.random.default_rng(seed)
    return {name: (3 * rng.standard_normal(shape)).astype(dt) for name, shape, dt in input_specs(model)}


run_ort = partial(run_cpu, ours=False)


run_session = run_cpu


def run_reference(model, feeds):
    """``model`` evaluated by onnx.reference (every op rounded to its type), with rmsnorm.apply as RMSNorm."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    class RMSNorm(OpRun):
        op_domain = domain.DOMAIN

        def _run(self, x, gamma, skip=None, epsilon=None):
            y, h = rmsnorm.apply(x, gamma, skip, epsilon)
            return (y, h)

    ev = ReferenceEvaluator(model, new_ops=[RMSNorm])
    return dict(zip(ev.output_names, ev.run(None, feeds)))


def assert_close(got, want, what=""):
    """fp32: 1e-5 relative; fp16: one fp16 ulp (2^-10 relative) + a tiny absolute part."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    rel, tiny = (1e-5, 1e-7) if want.dtype == np.float32 else (2.0 ** -10, 2.0 ** -20)
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.all(np.abs(g - w) <= rel * np.abs(w) + tiny), (what, np.abs(g - w).max())


def rewrite(model, which=("rmsnorm",)):
    return checked_rewrite(model, which)


def check_values(m, out, seeds=(0, 1)):
    """The original in onnx.reference (every op rounded to its type) == rmsnorm.apply of its inputs == the
    rewritten model in onnx.reference (with rmsnorm.apply) == the rewritten model in onnx_lowbit.InferenceSession,
    within assert_close; the original in onnxruntime agrees (ort_close)."""
    for seed in seeds:
        feeds = feeds_for(m, seed)
        want = run_reference(m, feeds)
        for k, v in run_ort(m, feeds).items():
            ort_close(v, want[k], k)
        gamma = {i.name: nh.to_array(i) for i in m.graph.initializer}.get("gamma")
        if gamma is not None and "x" in feeds:
            x = feeds["x"] if "r" not in feeds else (feeds["x"] + feeds["r"]).astype(feeds["x"].dtype)
            y, _ = rmsnorm.apply(x, gamma, None, EPS)
            assert_close(y, want["y"], "apply")
        for k, v in run_reference(out, feeds).items():
            assert_close(v, want[k], ("reference", k))
        for k, v in run_session(out, feeds).items():
            assert_close(v, want[k], ("session", k))


def ort_close(got, want, what=""):
    """onnxruntime's CPU run of the original: fp32 as assert_close; fp16 within 2^-9 relative: the CPU EP has no
    fp16 Add/Mul, it computes them in fp32 and drops the Casts between the nodes (see test_pass_rotary.ort_agrees),
    so the residual sum and the weight's product are not rounded to fp16 where the ONNX ops (and RMSNorm) round
    them; observed up to 2 fp16 ulps."""
    if want.dtype == np.float16:
        g, w = got.astype(np.float64), want.astype(np.float64)
        assert np.all(np.abs(g - w) <= 2.0 ** -9 * np.abs(w) + 2.0 ** -20), (what, np.abs(g - w).max())
    else:
        assert_close(got, want, what)


def assert_rewritten(m, fused=False):
    out, rep = rewrite(m)
    assert [n.op_type for n in out.graph.node if n.domain == domain.DOMAIN] == ["RMSNorm"]
    assert not [n for n in out.graph.node if n.op_type in ("ReduceMean", "Sqrt", "Cast")]
    (e,) = rep.rewritten("rmsnorm")
    assert not rep.skipped("rmsnorm") and e.pattern == PATTERN
    assert e.details["residual_fused"] is fused and e.details["residual"] == ("yes" if fused else "no")
    node = next(n for n in out.graph.node if n.op_type == "RMSNorm")
    assert node.name == e.details["new_node"] and list(node.output) == (["y", "h"] if fused else ["y"])
    assert list(node.input)[:2:] == (["x", "gamma"]) and (list(node.input)[2:] == (["r"] if fused else []))
    assert [a.f for a in node.attribute if a.name == "epsilon"] == [pytest.approx(EPS)]
    assert [(o.domain, o.version) for o in out.opset_import][-1] == (domain.DOMAIN, domain.DOMAIN_VERSION)
    return out, rep


# ----------------------------------------------------------------------------------------------------------------
# spellings
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(2, 5, 16), (5, 16)])
@pytest.mark.parametrize("residual", [False, True])
def test_pattern_becomes_one_rmsnorm(dtype, shape, residual):
    m = rms_model(dtype, shape, residual=residual)
    out, rep = assert_rewritten(m, fused=residual)
    n = 9 if dtype == np.float16 else 7
    assert len(rep.entries[0].nodes) == n + residual
    check_values(m, out)


SPELLINGS = [dict(recip="reciprocal"), dict(recip="pow"), dict(recip="divx"), dict(square="mul"),
             dict(swap_mul=True, swap_gamma=True, swap_eps=True), dict(axes=2), dict(opset=18),
             dict(opset=18, axes=2, dtype=np.float16), dict(cast=True), dict(gamma="constant"),
             dict(gamma="identity", dtype=np.float16), dict(recip="reciprocal", dtype=np.float16, swap_mul=True),
             dict(recip="divx", dtype=np.float16, residual=True, sum_output=True),
             dict(residual=True, sum_reader=True, dtype=np.float16), dict(residual=True, sum_output=True,
                                                                          sum_reader=True)]


@pytest.mark.parametrize("kw", SPELLINGS, ids=[",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in s.items())
                                                for s in SPELLINGS])
def test_other_spellings(kw):
    """Reciprocal / Pow(v, -0.5) / Div(h32, Sqrt), Mul(h32, h32), operand orders, axes [rank-1], axes as an input
    (opset 18), Casts to float in an fp32 graph (TorchScript), gamma from a Constant node or through Identity, the
    residual sum also a graph output / read by another node (RMSNorm's H output keeps it)."""
    m = rms_model(**kw)
    out, rep = assert_rewritten(m, fused=kw.get("residual", False))
    if kw.get("sum_output") or kw.get("sum_reader"):
        assert "h" in [o.name for o in out.graph.output] or any("h" in n.input for n in out.graph.node)
    check_values(m, out)


def test_float_cast_read_elsewhere_is_rewired():
    """TorchScript fp32: the residual stream is read from the norm's Cast (float -> float); those readers read h."""
    m = rms_model(cast=True, residual=True)
    m.graph.node.append(oh.make_node("Mul", ["h32", "h32"], ["z"], name="reader"))
    m.graph.output.append(out_info("z", TP.FLOAT, 3))
    out, _ = assert_rewritten(m, fused=True)
    assert next(n for n in out.graph.node if n.name == "reader").input[:] == ["h", "h"]
    check_values(m, out)
    m.graph.output.append(out_info("h32", TP.FLOAT, 3))     # a graph output: the Cast stays
    out, rep = rewrite(m)
    assert [n.op_type for n in out.graph.node].count("Cast") == 1 and len(rep.rewritten("rmsnorm")) == 1
    check_values(m, out)


def test_pattern_in_a_subgraph():
    inner = rms_model(np.float16, residual=True).graph
    then = oh.make_graph(list(inner.node), "then", [], [oh.make_tensor_value_info("y", TP.FLOAT16, [2, 5, 16])],
                         list(inner.initializer))
    other = oh.make_graph([oh.make_node("Identity", ["x"], ["x_id"])], "else", [],
                          [oh.make_tensor_value_info("x_id", TP.FLOAT16, [2, 5, 16])])
    g = oh.make_graph([oh.make_node("If", ["flag"], ["out"], name="if", then_branch=then, else_branch=other)], "sub",
                      list(inner.input) + [oh.make_tensor_value_info("flag", TP.BOOL, [])],
                      [oh.make_tensor_value_info("out", TP.FLOAT16, [2, 5, 16])])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    out, rep = rewrite(m)
    body = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in body.node] == ["RMSNorm"] and rep.rewritten("rmsnorm")[0].details["residual_fused"]
    feeds = feeds_for(rms_model(np.float16, residual=True))
    feeds["flag"] = np.array(True)
    want = run_ort(m, feeds)["out"]
    assert_close(run_reference(out, feeds)["out"], want)
    assert_close(run_session(out, feeds)["out"], want)


def test_residual_add_with_broadcast_or_unknown_shape_is_not_fused():
    m = rms_model(residual=True)
    m.graph.input[1].CopyFrom(oh.make_tensor_value_info("r", TP.FLOAT, [1, 5, 16]))    # broadcast
    out, rep = rewrite(m)
    (e,) = rep.rewritten("rmsnorm")
    assert not e.details["residual_fused"] and "not provably equal" in e.reason
    assert ops(out) == [("", "Add"), (domain.DOMAIN, "RMSNorm")]
    check_values(m, out)
    m.graph.input[1].CopyFrom(oh.make_tensor_value_info("r", TP.FLOAT, ["B", "S", "D"]))  # dims unknown
    (e,) = rewrite(m)[1].rewritten("rmsnorm")
    assert not e.details["residual_fused"] and "not provably equal" in e.reason


def test_one_add_goes_into_one_rmsnorm():
    """Two norms of the same sum: the first takes the Add, the second normalises its H output."""
    m = rms_model(residual=True)
    g = m.graph
    copies = [n for n in g.node if n.name != "residual_add"]
    for n in copies:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name += "_2"
        c.input[:] = [i if i in ("h", "eps", "two", "one", "gamma") else i + "_2" for i in c.input]
        c.output[:] = [o + "_2" for o in c.output]
        g.node.append(c)
    g.output.append(out_info("y_2", TP.FLOAT, 3))
    out, rep = rewrite(m)
    es = rep.rewritten("rmsnorm")
    assert [e.details["residual_fused"] for e in es] == [True, False] and not rep.skipped("rmsnorm")
    assert ops(out) == [(domain.DOMAIN, "RMSNorm")] * 2
    feeds = feeds_for(m)
    want, got = run_ort(m, feeds), run_session(out, feeds)
    for k in want:
        assert_close(got[k], want[k], k)


# ----------------------------------------------------------------------------------------------------------------
# skips and non-matches
# ----------------------------------------------------------------------------------------------------------------
SKIPS = [
    ("other axis", dict(axes=1), "not the last axis"),
    ("other axis, opset 18", dict(axes=0, opset=18), "not the last axis"),
    ("keepdims=0", dict(keepdims=0, shape=(16, 16)), "keepdims=0"),
    ("gamma a graph input", dict(gamma="input"), "graph input, not a constant"),
    ("gamma of a wrong shape", dict(gamma_shape=(1, 16)), "not [D] = [16]"),
    ("gamma of a wrong length", dict(gamma_shape=(1,)), "not [D] = [16]"),
    ("rsqrt output also a graph output", dict(outputs=("rs",)), "rs (Div) is used elsewhere: graph output"),
    ("mean also a graph output", dict(outputs=("ms",)), "ms (ReduceMean) is used elsewhere: graph output"),
    ("fp16 Cast read elsewhere", dict(dtype=np.float16, outputs=("h32",)), "h32 (Cast) is used elsewhere"),
    ("double", dict(dtype=np.float64, cast=True), "double: RMSNorm takes float or float16"),
    ("fp16 without Casts", dict(dtype=np.float16, cast=False), "without a Cast to float"),
    ("Cast back to float16 in an fp32 graph", dict(cast=True, back=TP.FLOAT16), "not h's type float32"),
]


@pytest.mark.parametrize("what,kw,reason", SKIPS, ids=[s[0] for s in SKIPS])
def test_candidates_that_cannot_be_rewritten_are_skipped(what, kw, reason):
    m = rms_model(**kw)
    out, rep = rewrite(m)
    assert ops(out) == ops(m), what
    (e,) = rep.skipped("rmsnorm")
    assert e.pattern == PATTERN and reason in e.reason, e.reason
    assert not rep.rewritten("rmsnorm")


def test_intermediate_read_elsewhere_is_skipped():
    m = rms_model()
    m.graph.node.append(oh.make_node("Neg", ["n"], ["z"], name="reader"))
    m.graph.output.append(out_info("z", TP.FLOAT, 3))
    out, rep = rewrite(m)
    assert "n (Mul) is used elsewhere: reader" in rep.skipped("rmsnorm")[0].reason and ops(out) == ops(m)


def test_gemma_one_plus_weight_and_other_reductions_are_left_alone():
    """Gemma's weight (1 + w, computed in the graph) is skipped; a ReduceMean of something else (LayerNorm's mean,
    a mean of |x|) is no candidate and is not reported."""
    m = rms_model()
    g = m.graph
    w = next(i for i in g.initializer if i.name == "gamma")
    w.name = "w"
    g.node.insert(0, oh.make_node("Add", ["one", "w"], ["gamma"], name="one_plus_w"))
    (e,) = rewrite(m)[1].skipped("rmsnorm")
    assert "not a constant (computed by Add one_plus_w)" in e.reason
    vi = lambda n, s=(2, 8): oh.make_tensor_value_info(n, TP.FLOAT, list(s))  # noqa: E731
    nodes = [oh.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), oh.make_node("Sub", ["x", "m"], ["d"]),
             oh.make_node("Abs", ["x"], ["a"]), oh.make_node("ReduceMean", ["a"], ["ma"], axes=[-1]),
             oh.make_node("Add", ["d", "ma"], ["y"])]
    m = oh.make_model(oh.make_graph(nodes, "plain", [vi("x")], [vi("y")]),
                      opset_imports=[oh.make_opsetid("", 17)], ir_version=8)
    out, rep = rewrite(m)
    assert ops(out) == ops(m) and not rep.entries


# ----------------------------------------------------------------------------------------------------------------
# real exports: a tiny LLaMA
# ----------------------------------------------------------------------------------------------------------------
LAYERS, VOCAB, SEQ = 2, 128, 7


def llama_export(exporter, dtype):
    return tiny_llama_export(exporter, dtype, LAYERS, VOCAB, SEQ, random_norms=True)


LLAMAS = [("torchscript", np.float32, 2), ("torchscript", np.float16, 2), ("dynamo", np.float32, 2 * LAYERS)]
IDS = ["ts-fp32", "ts-fp16", "dynamo-fp32"]


def logits_close(got, want, dtype):
    """fp32: 1e-5 of max |logits|; fp16: 1e-2 of it (one-ulp differences pass through the layers and lm_head)."""
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert np.abs(got.astype(np.float64) - want).max() <= tol * np.abs(want.astype(np.float64)).max()


@pytest.mark.parametrize("exporter,dtype,fused", LLAMAS, ids=IDS)
def test_llama_export(exporter, dtype, fused):
    """2 RMSNorm per layer + the final one, no ReduceMean left, residual Adds fused (see the module docstring),
    logits in onnx_lowbit.InferenceSession equal to the original's in onnxruntime."""
    m = llama_export(exporter, dtype)
    out, rep = rewrite(m)
    norms = [n for n in out.graph.node if n.op_type == "RMSNorm"]
    assert len(norms) == 2 * LAYERS + 1 and len(rep.rewritten("rmsnorm")) == 2 * LAYERS + 1
    assert not rep.skipped("rmsnorm") and not [n for n in out.graph.node if n.op_type == "ReduceMean"]
    es = rep.rewritten("rmsnorm")
    assert sum(e.details["residual_fused"] for e in es) == fused == sum(len(n.input) == 3 for n in norms)
    assert not es[0].details["residual_fused"]
    assert all("not provably equal" in e.reason for e in es[1:] if not e.details["residual_fused"])
    feeds = {"input_ids": np.random.default_rng(2).integers(0, VOCAB, (1, SEQ)).astype(np.int64)}
    logits = m.graph.output[0].name
    logits_close(run_session(out, feeds)[logits], run_ort(m, feeds)[logits], dtype)


@pytest.mark.parametrize("exporter,dtype", [("torchscript", np.float16), ("dynamo", np.float32)],
                         ids=["ts-fp16", "dynamo-fp32"])
def test_llama_all_passes(exporter, dtype):
    """Every registered pass (weights as NF4; rmsnorm is not a default pass, so named): the model runs, and every
    norm is still an RMSNorm. The default list leaves the norms alone."""
    m = llama_export(exporter, dtype)
    assert "rmsnorm" not in [p.name for p in passes.resolve()]
    default, rep0 = onnx_lowbit.rewrite(m, weights="nf4")
    assert not rep0.rewritten("rmsnorm") and not any(n.op_type == "RMSNorm" for n in default.graph.node)
    out, rep = onnx_lowbit.rewrite(m, passes=passes.available(), weights="nf4")
    assert len(rep.rewritten("rmsnorm")) == 2 * LAYERS + 1
    feeds = {"input_ids": np.random.default_rng(3).integers(0, VOCAB, (1, SEQ)).astype(np.int64)}
    logits = m.graph.output[0].name
    got = run_session(out, feeds)[logits]
    assert got.shape == (1, SEQ, VOCAB) and np.isfinite(got).all()


def test_cli_runs_rmsnorm_only_when_named(tmp_path):
    """`onnx-lowbit rewrite` without --passes leaves the norm alone; with rmsnorm named it fuses it."""
    import subprocess
    import sys
    src = tmp_path / "norm.onnx"
    onnx.save(rms_model(residual=True), str(src))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for extra, want in (([], 0), (["--passes", "rmsnorm"], 1)):
        dst = tmp_path / f"out{want}.onnx"
        p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", "rewrite", str(src), str(dst), *extra],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        assert sum(n.op_type == "RMSNorm" for n in onnx.load(str(dst)).graph.node) == want

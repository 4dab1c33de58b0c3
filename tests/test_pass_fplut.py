"""Tests of the pass framework (passes/__init__.py, passes/base.py) and of the "fplut" pass (passes/fplut.py).

Tolerances (outputs of the original model run by onnxruntime vs. the rewritten model run with our FPLUT op):

* one activation, fp32 (``ACT_RTOL`` / ``ACT_ATOL`` = 4e-3): FPLUT rounds its input to fp16 (relative 2^-11 =
  4.9e-4 on x, which moves f(x) by |x f'(x)| * 4.9e-4, at most ~2x that relative for these functions), interpolates
  in the table (``fplut.error_stats`` of the shipped tables: at most 1.8e-3 relative over all fp16 inputs) and
  rounds its output to fp16 (4.9e-4 relative); 4e-3 relative plus 4e-3 absolute (for outputs near 0, where
  relative errors are large) bounds the sum with about 2x margin. The rewritten output must also equal the numpy reference of the table bit for bit.
* whole models (``MODEL_TOL``): the max abs error relative to the output scale, max|a - b| / max|a| <= 5e-3.
  The per-activation errors above (<= ~2e-3 relative) go through Linear/Conv layers, which sum them with weights
  of random sign (they average rather than add up), so the output error stays at the per-activation level
  (observed: <= 7.5e-4 over all exports here, fp16 included); 5e-3 leaves margin for other seeds and layers.
  The MLPs have no residual, which would hide activation errors behind the scale of x.
"""
from __future__ import annotations

import io
import math
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

import onnx_lowbit
from onnx_lowbit import domain
from onnx_lowbit.passes import PASSES, available, inspect, run_passes

ACT_RTOL = 4e-3
ACT_ATOL = 4e-3
MODEL_TOL = 5e-3
ACTIVATION_OPS = {"Sigmoid", "Tanh", "Erf", "Gelu", "Swish", "HardSwish", "HardSigmoid", "Clip", "Pow", "Mish",
                  "Softplus", "Elu"}
ORT_MAX_OPSET = 21  # hand-built models above this are only rewritten and checked, not run

_NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.DOUBLE: np.float64}


def get_table(name):
    from onnx_lowbit.fplut_tables import get_table as _get
    return _get(name)


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def make_model(nodes, consts=None, opset=18, dtype=TP.FLOAT, shape=(4, 16), extra_outputs=(), opsets=()):
    consts = consts or {}
    np_t = _NP.get(dtype, np.float32)
    inits = [nh.from_array(np.asarray(v, dtype=np_t), k) for k, v in consts.items()]
    outputs = [oh.make_tensor_value_info(name, dtype, list(shape)) for name in ("y", *extra_outputs)]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", dtype, list(shape))], outputs,
                          initializer=inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset), *opsets], ir_version=10,
                          producer_name="test-producer", producer_version="9.9")
    onnx.helper.set_model_props(model, {"origin": "test"})
    onnx.checker.check_model(model, full_check=True)
    return model


def n(op, inputs, outputs, **attrs):
    return oh.make_node(op, inputs, outputs, name=f"{op}_{outputs[0]}", **attrs)


def fplut_nodes(model_or_graph):
    """FPLUT nodes of the graph and its subgraphs."""
    graph = getattr(model_or_graph, "graph", model_or_graph)
    found = []
    for nd in graph.node:
        if nd.domain == domain.DOMAIN and nd.op_type == "FPLUT":
            found.append(nd)
        for a in nd.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                found.extend(fplut_nodes(sub))
    return found


def functions(model):
    return sorted(oh.get_attribute_value(a).decode() for nd in fplut_nodes(model) for a in nd.attribute
                  if a.name == "function")


def ops(model):
    return [nd.op_type for nd in model.graph.node]


def run_ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_lowbit(model, feeds):
    return onnx_lowbit.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


def sample(shape=(4, 16), dtype=np.float32, scale=3.0, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    x.flat[:4] = [0.0, -0.0, 6.5, -7.25][: x.size]
    return x.astype(dtype)


def assert_act_close(ref, out, rtol=ACT_RTOL, atol=ACT_ATOL):
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    err = np.abs(ref - out)
    bound = atol + rtol * np.abs(ref)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), \
        f"max err {err.max():.3g}; worst at ref={ref.flat[worst]:.6g} out={out.flat[worst]:.6g}"


def assert_model_close(ref, out, tol=MODEL_TOL):
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    scale = max(np.abs(ref).max(), 1e-6)
    rel = np.abs(ref - out).max() / scale
    assert rel <= tol, f"max abs error {np.abs(ref - out).max():.3g} is {rel:.3g} of the output scale {scale:.3g}"


def rewrite_and_check(model, **options):
    before = model.SerializeToString()
    out, report = run_passes(model, **options)
    assert model.SerializeToString() == before, "run_passes modified its input"
    domain.register_schemas()
    onnx.checker.check_model(out, full_check=True)
    assert [i.name for i in out.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    assert out.ir_version == model.ir_version
    assert out.producer_name == model.producer_name and out.producer_version == model.producer_version
    ours = ("onnx_lowbit.requires", "onnx_lowbit.ops")  # added by run_passes when our ops are used
    assert {(p.key, p.value) for p in out.metadata_props if p.key not in ours} == \
        {(p.key, p.value) for p in model.metadata_props}
    orig_opsets = {(o.domain, o.version) for o in model.opset_import}
    expected = orig_opsets | ({(domain.DOMAIN, domain.DOMAIN_VERSION)} if fplut_nodes(out) else set())
    assert {(o.domain, o.version) for o in out.opset_import} == expected
    return out, report


# ----------------------------------------------------------------------------------------------------------------
# (a) every spelling -> exactly the expected function
# ----------------------------------------------------------------------------------------------------------------
SQRT2 = math.sqrt(2.0)
S2PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh_nodes(cube):
    """0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) with the cube spelled ``cube``."""
    if cube == "pow":
        c = [n("Pow", ["x", "three"], ["x3"])]
    elif cube == "x*(x*x)":   # TorchScript exporter
        c = [n("Mul", ["x", "x"], ["xx"]), n("Mul", ["x", "xx"], ["x3"])]
    else:                     # (x*x)*x
        c = [n("Mul", ["x", "x"], ["xx"]), n("Mul", ["xx", "x"], ["x3"])]
    return c + [n("Mul", ["kappa", "x3"], ["kx3"]), n("Add", ["x", "kx3"], ["inner"]),
                n("Mul", ["beta", "inner"], ["arg"]), n("Tanh", ["arg"], ["t"]), n("Add", ["one", "t"], ["p"]),
                n("Mul", ["x", "p"], ["xp"]), n("Mul", ["half", "xp"], ["y"])]


_GT_CONSTS = {"three": 3.0, "kappa": 0.044715, "beta": S2PI, "one": 1.0, "half": 0.5}

SPELLINGS = {
    # name: (nodes, consts, opset, expected functions)
    "silu x*sigmoid": ([n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])], {}, 18, ["silu"]),
    "silu sigmoid*x": ([n("Sigmoid", ["x"], ["s"]), n("Mul", ["s", "x"], ["y"])], {}, 18, ["silu"]),
    "silu Swish op": ([n("Swish", ["x"], ["y"])], {}, 24, ["silu"]),
    "silu Swish alpha=1": ([n("Swish", ["x"], ["y"], alpha=1.0)], {}, 24, ["silu"]),
    "quick_gelu Swish alpha=1.702": ([n("Swish", ["x"], ["y"], alpha=1.702)], {}, 24, ["quick_gelu"]),
    "quick_gelu const*x": ([n("Mul", ["k", "x"], ["a"]), n("Sigmoid", ["a"], ["s"]), n("Mul", ["x", "s"], ["y"])],
                           {"k": 1.702}, 18, ["quick_gelu"]),
    "quick_gelu x*const": ([n("Mul", ["x", "k"], ["a"]), n("Sigmoid", ["a"], ["s"]), n("Mul", ["s", "x"], ["y"])],
                           {"k": [1.702]}, 18, ["quick_gelu"]),
    "hardswish op": ([n("HardSwish", ["x"], ["y"])], {}, 18, ["hardswish"]),
    "hardswish x*HardSigmoid": ([n("HardSigmoid", ["x"], ["h"], alpha=1 / 6), n("Mul", ["x", "h"], ["y"])], {},
                                18, ["hardswish"]),
    "hardswish x*Clip(x+3,0,6)/6": ([n("Add", ["x", "three"], ["a"]), n("Clip", ["a", "zero", "six"], ["c"]),
                                     n("Mul", ["x", "c"], ["m"]), n("Div", ["m", "six"], ["y"])],
                                    {"three": 3.0, "zero": 0.0, "six": 6.0}, 18, ["hardswish"]),
    "mish op": ([n("Mish", ["x"], ["y"])], {}, 18, ["mish"]),
    "mish x*tanh(softplus)": ([n("Softplus", ["x"], ["sp"]), n("Tanh", ["sp"], ["t"]), n("Mul", ["t", "x"], ["y"])],
                              {}, 18, ["mish"]),
    "softplus": ([n("Softplus", ["x"], ["y"])], {}, 18, ["softplus"]),
    "elu": ([n("Elu", ["x"], ["y"])], {}, 18, ["elu"]),
    "sigmoid": ([n("Sigmoid", ["x"], ["y"])], {}, 18, ["sigmoid"]),
    "tanh": ([n("Tanh", ["x"], ["y"])], {}, 18, ["tanh"]),
    "gelu Gelu op": ([n("Gelu", ["x"], ["y"])], {}, 20, ["gelu"]),
    "gelu Gelu approximate=none": ([n("Gelu", ["x"], ["y"], approximate="none")], {}, 20, ["gelu"]),
    "gelu_tanh Gelu approximate=tanh": ([n("Gelu", ["x"], ["y"], approximate="tanh")], {}, 20, ["gelu_tanh"]),
    # erf form: TorchScript: (x * (erf(x / 1.4142135) + 1)) * 0.5
    "gelu erf torch": ([n("Div", ["x", "r2"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["e", "one"], ["p"]),
                        n("Mul", ["x", "p"], ["xp"]), n("Mul", ["xp", "half"], ["y"])],
                       {"r2": 1.4142135, "one": 1.0, "half": 0.5}, 18, ["gelu"]),
    # 0.5 first: (x * 0.5) * (1 + erf(x * 0.70710678))
    "gelu erf half-first mul-rsqrt2": ([n("Mul", ["x", "r"], ["a"]), n("Erf", ["a"], ["e"]),
                                        n("Add", ["one", "e"], ["p"]), n("Mul", ["x", "half"], ["hx"]),
                                        n("Mul", ["hx", "p"], ["y"])],
                                       {"r": 0.70710678, "one": 1.0, "half": 0.5}, 18, ["gelu"]),
    # x * (0.5 * (1 + erf(x / sqrt2)))
    "gelu erf half-on-sum": ([n("Div", ["x", "r2"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["one", "e"], ["p"]),
                              n("Mul", ["half", "p"], ["hp"]), n("Mul", ["hp", "x"], ["y"])],
                             {"r2": SQRT2, "one": 1.0, "half": 0.5}, 18, ["gelu"]),
    # (x * (1 + erf)) / 2
    "gelu erf div-by-2": ([n("Mul", ["r", "x"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["e", "one"], ["p"]),
                           n("Mul", ["p", "x"], ["xp"]), n("Div", ["xp", "two"], ["y"])],
                          {"r": 1 / SQRT2, "one": 1.0, "two": 2.0}, 18, ["gelu"]),
    "gelu_tanh pow": (_gelu_tanh_nodes("pow"), _GT_CONSTS, 18, ["gelu_tanh"]),
    "gelu_tanh x*(x*x)": (_gelu_tanh_nodes("x*(x*x)"), _GT_CONSTS, 18, ["gelu_tanh"]),
    "gelu_tanh (x*x)*x": (_gelu_tanh_nodes("(x*x)*x"), _GT_CONSTS, 18, ["gelu_tanh"]),
    # HF FastGELU / Megatron: 0.5 * x * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))
    "gelu_tanh x*(1+k*x*x)": ([n("Mul", ["x", "beta"], ["bx"]), n("Mul", ["kappa", "x"], ["kx"]),
                               n("Mul", ["kx", "x"], ["kxx"]), n("Add", ["one", "kxx"], ["q"]),
                               n("Mul", ["bx", "q"], ["arg"]), n("Tanh", ["arg"], ["t"]),
                               n("Add", ["t", "one"], ["p"]), n("Mul", ["x", "half"], ["hx"]),
                               n("Mul", ["hx", "p"], ["y"])], _GT_CONSTS, 18, ["gelu_tanh"]),
    # GPT-2 (HF): 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))  with 0.5*x first
    "gelu_tanh gpt2": ([n("Pow", ["x", "three"], ["x3"]), n("Mul", ["x3", "kappa"], ["kx3"]),
                        n("Add", ["x", "kx3"], ["inner"]), n("Mul", ["inner", "beta"], ["arg"]),
                        n("Tanh", ["arg"], ["t"]), n("Add", ["t", "one"], ["p"]), n("Mul", ["half", "x"], ["hx"]),
                        n("Mul", ["hx", "p"], ["y"])], _GT_CONSTS, 18, ["gelu_tanh"]),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_rewritten(name):
    nodes, consts, opset, expected = SPELLINGS[name]
    model = make_model(nodes, consts, opset=opset)
    out, report = rewrite_and_check(model)
    assert functions(out) == expected
    assert not ACTIVATION_OPS & set(ops(out)), ops(out)
    assert ops(out) == ["FPLUT"] * len(expected), ops(out)  # the whole decomposition is gone
    assert [e.details["function"] for e in report.rewritten()] == expected
    assert not report.skipped()
    if opset <= ORT_MAX_OPSET:
        x = sample()
        (ref,) = run_ort(model, {"x": x})
        (got,) = run_lowbit(out, {"x": x})
        np.testing.assert_array_equal(got, get_table(expected[0])(x))  # the op is the table's reference, exactly
        assert_act_close(ref, got)


def test_fp16_spellings():
    """fp16 graphs (fp16 constants: 0.044715, sqrt(2/pi), 1.702 are matched within the 1e-3 tolerance)."""
    for name in ("silu x*sigmoid", "quick_gelu const*x", "gelu erf torch", "gelu_tanh pow", "hardswish op"):
        nodes, consts, opset, expected = SPELLINGS[name]
        model = make_model(nodes, consts, opset=opset, dtype=TP.FLOAT16)
        out, _ = rewrite_and_check(model)
        assert functions(out) == expected, name
        x = sample(dtype=np.float16)
        (ref,) = run_ort(model, {"x": x})
        (got,) = run_lowbit(out, {"x": x})
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, get_table(expected[0])(x))
        assert_act_close(ref, got, rtol=2 * ACT_RTOL, atol=2 * ACT_ATOL)  # the original rounds through fp16 too


def test_bfloat16_rewritten():
    model = make_model([n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])], dtype=TP.BFLOAT16)
    out, _ = rewrite_and_check(model)
    assert functions(out) == ["silu"]


def test_other_dtypes_skipped_with_reason():
    model = make_model([n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])], dtype=TP.DOUBLE)
    out, report = rewrite_and_check(model)
    assert not fplut_nodes(out) and ops(out) == ["Sigmoid", "Mul"]
    reasons = [e.reason for e in report.skipped()]
    assert len(reasons) == 2 and all("double" in r for r in reasons), reasons  # the silu and the Sigmoid


@pytest.mark.parametrize("nodes, consts, opset, why", [
    ([n("Swish", ["x"], ["y"], alpha=2.0)], {}, 24, "alpha=2"),
    ([n("Gelu", ["x"], ["y"], approximate="fast")], {}, 20, "approximate"),
], ids=["swish-alpha-2", "gelu-unknown-approximate"])
def test_single_op_skipped_with_reason(nodes, consts, opset, why):
    model = oh.make_model(oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4])],
                                        [oh.make_tensor_value_info("y", TP.FLOAT, [4])]),
                          opset_imports=[oh.make_opsetid("", opset)], ir_version=10)
    out, report = run_passes(model)
    assert not fplut_nodes(out)
    assert len(report.skipped()) == 1 and why in report.skipped()[0].reason


def test_swish_beta_decomposed_skipped_sigmoid_still_converted():
    model = make_model([n("Mul", ["x", "k"], ["a"]), n("Sigmoid", ["a"], ["s"]), n("Mul", ["x", "s"], ["y"])],
                       {"k": 2.0})
    out, report = rewrite_and_check(model)
    assert functions(out) == ["sigmoid"] and ops(out).count("Mul") == 2
    (skip,) = report.skipped()
    assert "beta=2" in skip.reason


@pytest.mark.parametrize("consts", [
    {"r2": 2.0, "one": 1.0, "half": 0.5},         # erf(x/2): not GELU
    {"r2": SQRT2, "one": 1.0, "half": 0.45},      # wrong 0.5
    {"r2": 1.4, "one": 1.0, "half": 0.5},         # sqrt(2) off by 1%
], ids=["div2", "half-off", "sqrt2-off"])
def test_near_miss_gelu_not_rewritten(consts):
    model = make_model([n("Div", ["x", "r2"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["e", "one"], ["p"]),
                        n("Mul", ["x", "p"], ["xp"]), n("Mul", ["xp", "half"], ["y"])], consts)
    out, report = rewrite_and_check(model)
    assert not fplut_nodes(out) and "Erf" in ops(out)
    x = sample()
    np.testing.assert_allclose(run_lowbit(out, {"x": x})[0], run_ort(model, {"x": x})[0], rtol=1e-6, atol=1e-6)


def test_near_miss_gelu_tanh_becomes_tanh():
    consts = dict(_GT_CONSTS, kappa=0.05)
    model = make_model(_gelu_tanh_nodes("pow"), consts)
    out, _ = rewrite_and_check(model)
    assert functions(out) == ["tanh"] and "Pow" in ops(out)
    x = sample()
    assert_act_close(run_ort(model, {"x": x})[0], run_lowbit(out, {"x": x})[0])


def test_fplut_functions_option():
    silu = [n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])]
    out, report = rewrite_and_check(make_model(silu), fplut_functions={"sigmoid"})
    assert functions(out) == ["sigmoid"] and "Mul" in ops(out)
    assert any("not enabled" in e.reason and e.details.get("function") == "silu" for e in report.skipped())
    out, report = rewrite_and_check(make_model(silu), fplut_functions="silu,gelu")
    assert functions(out) == ["silu"]
    out, report = rewrite_and_check(make_model(silu), fplut_functions=["tanh"])
    assert not fplut_nodes(out) and len(report.skipped()) == 2
    with pytest.raises(ValueError, match="unknown function.*'swishy'"):
        run_passes(make_model(silu), fplut_functions={"swishy"})


def test_fplut_functions_decomposed_only():
    """``hardswish/decomposed`` (--device cpu's choice): the spelled-out x * Clip(x + 3, 0, 6) / 6 and x *
    HardSigmoid(x) become FPLUT, the HardSwish op stays (skipped with the reason); a bad suffix is an unknown name."""
    for name in ("hardswish x*Clip(x+3,0,6)/6", "hardswish x*HardSigmoid"):
        nodes, consts, opset, _ = SPELLINGS[name]
        out, _ = rewrite_and_check(make_model(nodes, consts, opset), fplut_functions={"hardswish/decomposed"})
        assert functions(out) == ["hardswish"], name
    nodes, consts, opset, _ = SPELLINGS["hardswish op"]
    out, report = rewrite_and_check(make_model(nodes, consts, opset), fplut_functions="gelu,hardswish/decomposed")
    assert not fplut_nodes(out) and ops(out) == ["HardSwish"]
    assert [e.reason for e in report.skipped()] == \
        ["function 'hardswish' enabled only where spelled out in several ops (fplut_functions: hardswish/decomposed)"]
    with pytest.raises(ValueError, match="unknown function.*'hardswish/fused'"):
        run_passes(make_model(nodes, consts, opset), fplut_functions={"hardswish/fused"})


def test_subgraph_rewritten():
    body = lambda name: oh.make_graph(  # noqa: E731 - reads the outer x
        [oh.make_node("Sigmoid", ["x"], [f"s_{name}"]), oh.make_node("Mul", ["x", f"s_{name}"], [f"o_{name}"])],
        name, [], [oh.make_tensor_value_info(f"o_{name}", TP.FLOAT, [4, 16])])
    nodes = [oh.make_node("If", ["cond"], ["y"], then_branch=body("then"), else_branch=body("else"))]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [4, 16]),
                                       oh.make_tensor_value_info("cond", TP.BOOL, [])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [4, 16])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    out, report = rewrite_and_check(model)
    assert len(report.rewritten()) == 2
    x = sample()
    for c in (True, False):
        feeds = {"x": x, "cond": np.array(c)}
        assert_act_close(run_ort(model, feeds)[0], run_lowbit(out, feeds)[0])


# ----------------------------------------------------------------------------------------------------------------
# (b) gating / squeeze-excitation is not a SiLU
# ----------------------------------------------------------------------------------------------------------------
def test_se_block_not_silu():
    rng = np.random.default_rng(1)
    consts = {"w": rng.standard_normal((8, 8, 1, 1)) * 0.5, "b": rng.standard_normal(8) * 0.1}
    nodes = [n("GlobalAveragePool", ["x"], ["pool"]), n("Conv", ["pool", "w", "b"], ["z"]),
             n("Sigmoid", ["z"], ["gate"]), n("Mul", ["x", "gate"], ["y"])]
    model = make_model(nodes, consts, shape=(1, 8, 5, 5))
    out, report = rewrite_and_check(model)
    assert functions(out) == ["sigmoid"]        # the gate itself is a standalone Sigmoid
    assert "Mul" in ops(out)                    # the gating multiply stays
    (skip,) = report.skipped()
    assert skip.details["function"] == "silu" and "not a SiLU" in skip.reason and "'z'" in skip.reason
    x = sample((1, 8, 5, 5))
    assert_act_close(run_ort(model, {"x": x})[0], run_lowbit(out, {"x": x})[0])


def test_sigmoid_squared_not_silu():
    model = make_model([n("Sigmoid", ["x"], ["s"]), n("Mul", ["s", "s"], ["y"])])
    out, report = rewrite_and_check(model)
    assert functions(out) == ["sigmoid"] and len(report.skipped()) == 1


# ----------------------------------------------------------------------------------------------------------------
# (c) intermediates with other consumers
# ----------------------------------------------------------------------------------------------------------------
def test_shared_sigmoid_kept_for_other_consumer():
    nodes = [n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["m"]), n("Add", ["m", "s"], ["y"])]
    model = make_model(nodes, extra_outputs=("s",))
    out, report = rewrite_and_check(model)
    assert functions(out) == ["sigmoid", "silu"] and "Add" in ops(out)
    silu = next(e for e in report.rewritten() if e.details["function"] == "silu")
    assert "kept Sigmoid" in silu.reason and "Add_y" in silu.reason
    x = sample()
    for ref, got in zip(run_ort(model, {"x": x}), run_lowbit(out, {"x": x})):
        assert_act_close(ref, got, rtol=2 * ACT_RTOL, atol=2 * ACT_ATOL)  # y = silu + sigmoid: two errors


def test_shared_gelu_intermediates_kept():
    """The Erf output and x*(1+erf) also feed other nodes: the GELU becomes FPLUT, what they read stays."""
    nodes = [n("Div", ["x", "r2"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["e", "one"], ["p"]),
             n("Mul", ["x", "p"], ["xp"]), n("Mul", ["xp", "half"], ["g"]),
             n("Add", ["g", "e"], ["ge"]), n("Sub", ["ge", "xp"], ["y"])]
    model = make_model(nodes, {"r2": SQRT2, "one": 1.0, "half": 0.5})
    out, report = rewrite_and_check(model)
    assert functions(out) == ["gelu"] and "Erf" in ops(out)
    (entry,) = report.rewritten()
    assert "kept Erf" in entry.reason and "kept Mul" in entry.reason
    x = sample()
    assert_act_close(run_ort(model, {"x": x})[0], run_lowbit(out, {"x": x})[0])


def test_activation_output_is_graph_output():
    model = make_model([n("Tanh", ["x"], ["t"]), n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])],
                       extra_outputs=("t",))
    out, _ = rewrite_and_check(model)
    assert functions(out) == ["silu", "tanh"]
    x = sample()
    for ref, got in zip(run_ort(model, {"x": x}), run_lowbit(out, {"x": x})):
        assert_act_close(ref, got)


# ----------------------------------------------------------------------------------------------------------------
# (d) real exports from torch
# ----------------------------------------------------------------------------------------------------------------
try:
    import torch
    from torch import nn
except ImportError:  # the torch tests are skipped; everything else still runs
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
_Module = nn.Module if torch is not None else object


class ConvBnSiLU(_Module):
    def __init__(self, cin, cout, k=3, s=1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class TinyYolo(_Module):
    """Conv+BN+SiLU stem, a C2f-like split/concat block with a residual, an SE gate and a 1x1 head."""

    def __init__(self):
        super().__init__()
        self.stem = ConvBnSiLU(3, 16, 3, 2)
        self.cv1 = ConvBnSiLU(16, 16, 1)
        self.m = nn.Sequential(ConvBnSiLU(8, 8), ConvBnSiLU(8, 8))
        self.cv2 = ConvBnSiLU(24, 16, 1)
        self.se_reduce = nn.Conv2d(16, 4, 1)
        self.se_expand = nn.Conv2d(4, 16, 1)
        self.head = nn.Conv2d(16, 10, 1)

    def forward(self, x):
        x = self.stem(x)
        a, b = self.cv1(x).chunk(2, 1)
        y = self.cv2(torch.cat([a, b, b + self.m(b)], 1))
        gate = torch.sigmoid(self.se_expand(nn.functional.silu(self.se_reduce(y.mean((2, 3), keepdim=True)))))
        return self.head(y * gate)


class Mlp(_Module):
    def __init__(self, act, d=32, h=64):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, h), act, nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _models():
    """name: (factory, input shape, expected FPLUT functions, skipped SiLU candidates (gates))"""
    return {
        "yolo": (TinyYolo, (1, 3, 16, 16), ["sigmoid"] + ["silu"] * 6, 1),
        "gpt2_mlp": (lambda: Mlp(nn.GELU(approximate="tanh")), (2, 5, 32), ["gelu_tanh"], 0),
        "bert_mlp": (lambda: Mlp(nn.GELU()), (2, 5, 32), ["gelu"], 0),
        "hardswish": (lambda: Mlp(nn.Hardswish()), (2, 5, 32), ["hardswish"], 0),
        "sigmoid": (lambda: Mlp(nn.Sigmoid()), (2, 5, 32), ["sigmoid"], 0),
        "tanh": (lambda: Mlp(nn.Tanh()), (2, 5, 32), ["tanh"], 0),
        "mish": (lambda: Mlp(nn.Mish()), (2, 5, 32), ["mish"], 0),
    }


def _export(module, x, dynamo, opset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            try:
                prog = torch.onnx.export(module, (x,), dynamo=True, opset_version=opset, input_names=["x"],
                                         output_names=["y"], verbose=False)
            except Exception as e:  # noqa: BLE001 - the dynamo exporter is optional (onnxscript, offline)
                pytest.skip(f"dynamo export unavailable: {type(e).__name__}: {str(e)[:200]}")
            return prog.model_proto
        f = io.BytesIO()
        torch.onnx.export(module, (x,), f, dynamo=False, opset_version=opset, input_names=["x"], output_names=["y"])
        return onnx.load_from_string(f.getvalue())


# TorchScript exporter at opset 17 and the dynamo exporter at 18 decompose GELU; both emit Gelu at opset 20.
# fp16 exports are run at the decomposing opsets only (opset 20 adds nothing to the fp16 side).
EXPORTS = [("torchscript", False, 17, False), ("torchscript", False, 20, False), ("dynamo", True, 18, False),
           ("dynamo", True, 20, False), ("torchscript", False, 17, True), ("dynamo", True, 18, True)]


@pytest.mark.parametrize("exporter, dynamo, opset, half", EXPORTS,
                         ids=[f"{e}-opset{o}-{'fp16' if h else 'fp32'}" for e, _, o, h in EXPORTS])
@pytest.mark.parametrize("kind", ["yolo", "gpt2_mlp", "bert_mlp", "hardswish", "sigmoid", "tanh", "mish"])
@needs_torch
def test_torch_export(kind, exporter, dynamo, opset, half):
    factory, shape, expected, gates = _models()[kind]
    torch.manual_seed(0)
    module = factory().eval()
    for m in module.modules():  # non-trivial BatchNorm statistics, so the folded Conv weights are not identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(*shape) * 2
    if half:
        module, x = module.half(), x.half()
    model = _export(module, x, dynamo, opset)
    out, report = rewrite_and_check(model)

    assert functions(out) == sorted(expected), report.to_table()
    assert not ACTIVATION_OPS & set(ops(out)), ops(out)
    assert len([e for e in report.skipped() if e.details.get("function") == "silu"]) == gates, report.to_table()
    feeds = {"x": x.numpy()}
    ref, got = run_ort(model, feeds)[0], run_lowbit(out, feeds)[0]
    assert got.dtype == ref.dtype
    assert_model_close(ref, got)


# ----------------------------------------------------------------------------------------------------------------
# (e) framework: registry, errors, report, inspect, the input model is not modified
# ----------------------------------------------------------------------------------------------------------------
def test_registry():
    assert available() == ["fplut", "weights4", "matmulnbits", "ffn", "merge", "rotary", "rotarykv", "kvattention",
                           "cacheattention", "rmsnorm", "ortnorm", "gru"]
    assert list(PASSES) == available()
    assert PASSES["fplut"].name == "fplut" and PASSES["fplut"].description


def test_unknown_pass_raises():
    model = make_model([n("Sigmoid", ["x"], ["y"])])
    before = model.SerializeToString()
    with pytest.raises(ValueError) as info:
        run_passes(model, passes=["fplut", "no_such_pass"])
    msg = str(info.value)
    assert "'no_such_pass'" in msg and "known passes: fplut" in msg
    with pytest.raises(ValueError, match="no_such_pass"):
        inspect(model, passes="no_such_pass")
    assert model.SerializeToString() == before


def test_input_not_modified_and_inspect():
    model = make_model([n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])])
    before = model.SerializeToString()
    report = inspect(model)
    assert model.SerializeToString() == before
    assert [e.details["function"] for e in report.rewritten()] == ["silu"]
    out, report2 = run_passes(model, passes=["fplut"])
    assert model.SerializeToString() == before
    assert report2.to_dict() == report.to_dict()
    out2, _ = onnx_lowbit.rewrite(model)  # the public API goes through run_passes
    assert functions(out2) == ["silu"]


def test_no_rewrite_no_domain_import():
    model = make_model([n("Relu", ["x"], ["y"])])
    out, report = rewrite_and_check(model)
    assert len(report) == 0 and not any(o.domain == domain.DOMAIN for o in out.opset_import)
    assert report.to_table() == "(no candidates matched)"


def test_report_table_and_dict():
    nodes = [n("GlobalAveragePool", ["x"], ["p"]), n("Sigmoid", ["p"], ["g"]), n("Mul", ["x", "g"], ["m"]),
             n("Sigmoid", ["m"], ["s"]), n("Mul", ["m", "s"], ["y"])]
    _, report = run_passes(make_model(nodes, shape=(1, 4, 3, 3)))
    d = report.to_dict()
    assert d["summary"] == {"fplut": {"rewritten": 2, "skipped": 1, "not_run": 0}}
    assert {e["action"] for e in d["entries"]} == {"rewritten", "skipped"}
    assert all(set(e) >= {"pass_name", "action", "pattern", "nodes", "reason"} for e in d["entries"])
    table = report.to_table().splitlines()
    assert table[0].split() == ["pass", "action", "pattern", "nodes", "reason"]
    assert set(table[1]) <= {"-", " "}
    assert "Mul_y" in report.to_table() and "fplut: 2 rewritten, 1 skipped" in table[-1]
    assert [e.action for e in report.rewritten()] == ["rewritten"] * 2 and len(report.skipped()) == 1


def test_model_path_accepted(tmp_path):
    model = make_model([n("Tanh", ["x"], ["y"])])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out, _ = run_passes(str(path))
    assert functions(out) == ["tanh"]

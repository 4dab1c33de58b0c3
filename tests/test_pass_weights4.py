"""Tests of the "weights4" pass (passes/weights4.py) and its CLI flags.

What is compared, and the tolerances:

* **ORT op layouts** (target "ort" run by stock onnxruntime vs. our numpy references ``onnx_lowbit.nf4.matmul`` /
  ``onnx_lowbit.awq.matmul``, evaluated by ``onnx.reference`` on the target-"lowbit" rewrite of the same model, which
  holds the same quantised bytes): both sides compute with the same dequantised weights, so they differ only by
  float rounding. fp32: relative Frobenius error <= ``REF_TOL32`` = 1e-5 (float32 accumulation over K <= 1024
  gives ~1e-6). fp16: <= ``REF_TOL16`` = 1e-2: the models round every intermediate to fp16 (2^-11 = 4.9e-4 relative
  per rounding, LayerNorm, Relu, a few MatMuls), MatMulBnb4 takes absmax in fp16 (another 4.9e-4 per weight) and
  MatMulNBits takes fp16 scales; a wrong layout gives errors of order 1. AWQ in fp32 models: <= ``REF_TOL_AWQ32``
  = 1e-3, because the MatMulAWQ reference rounds the dequantised weight (q - z) * s to fp16 (AutoAWQ's
  dequantize_gemm), which MatMulNBits does not (it keeps (q - z) * s in fp32): a relative rounding of at most
  2^-11 per element, 2^-11 / sqrt(3) = 2.8e-4 in the Frobenius norm (observed 2-3e-4).
* **quantised vs. float model**: with weights of relative Frobenius reconstruction error e_i (the pass reports
  them), a layer's output error is about e_i relative to its output for inputs not aligned with the error (a
  random-sign sum over K), and the independent errors of a chain of layers add in quadrature, so the output error
  is about sqrt(sum e_i^2) (observed 0.85-1.0x that here). The tests assert the looser
  ``rel_fro(out, ref) <= sum(e_i) + slack`` (``bound``; 1.7x the worst observed for 3-4 layers of similar e_i;
  slack 1e-2 for fp16 rounding). Observed, e.g.: NF4 e_i = 0.091 (3 layers): 0.162 <= 0.274.
* **AWQ activation scales are exact**: the rewritten model equals the float model whose weights are replaced by
  the effective quantised weights (act_scale * dequantised, the scale moved to where the pass folded it) to float
  rounding (fp32 <= 1e-5 relative Frobenius, target "lowbit" through the numpy reference; 1e-3 for target "ort"
  for the fp16 rounding explained above).
* size: an MLP-heavy fp16 model rewritten to NF4 (4 bits + one fp32 absmax per 64 weights = 4.5 bits) is at most
  0.3x the original's file size.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from onnx_lowbit import domain
from onnx_lowbit.passes import PASSES, available, run_passes
from onnx_lowbit.passes import weights4 as w4

nf4 = pytest.importorskip("onnx_lowbit.nf4")
awq = pytest.importorskip("onnx_lowbit.awq")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF_TOL32 = 1e-5
REF_TOL16 = 1e-2
REF_TOL_AWQ32 = 1e-3
EXACT_TOL32 = 1e-5
FP16_SLACK = 1e-2
_NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}
_ET = {np.float32: TP.FLOAT, np.float16: TP.FLOAT16}
FORMATS = ["nf4", "fp4", "awq"]
DTYPES = [np.float32, np.float16]


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def register_planned_ops():
    """Our schemas, plus the planned 4-bit ops (domain.register_schemas() registers domain.OPS only)."""
    domain.register_schemas()
    for op in {**domain.PLANNED_OPS, **domain.OPS}.values():
        if not onnx.defs.has(op.name, domain.DOMAIN_VERSION, domain.DOMAIN):
            onnx.defs.register_schema(domain._schema(op))


def rel_fro(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_ort(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _reference_ops():
    from onnx.reference.op_run import OpRun

    class MatMulNF4(OpRun):
        op_domain = domain.DOMAIN

        def _run(self, A, Q, absmax, bias=None, quant_type=None, block_size=None, K=None, N=None,  # noqa: N803
                 accuracy_level=None):
            qt = quant_type.decode() if isinstance(quant_type, bytes) else quant_type
            return (nf4.matmul(A, Q, absmax, qt, block_size, K, N, bias=bias, accuracy_level=accuracy_level or 0),)

    class MatMulAWQ(OpRun):
        op_domain = domain.DOMAIN

        def _run(self, A, qweight, qzeros, scales, bias=None, group_size=None, K=None, N=None):  # noqa: N803
            return (awq.matmul(A, qweight, qzeros, scales, group_size, K, N, bias=bias),)

    return [MatMulNF4, MatMulAWQ]


def run_reference(model, feeds):
    """The lowbit rewrite evaluated by onnx.reference with our numpy references for MatMulNF4 / MatMulAWQ."""
    from onnx.reference import ReferenceEvaluator
    ev = ReferenceEvaluator(model, new_ops=_reference_ops())
    return dict(zip(ev.output_names, ev.run(None, feeds)))


def ops(model):
    return [n.op_type for n in model.graph.node]


def vi(name, shape, et=TP.FLOAT):
    return oh.make_tensor_value_info(name, et, list(shape))


def make(nodes, inputs, outputs, consts):
    """A model of ``nodes`` (opset 17, IR 9); consts: {name: array} initializers."""
    g = oh.make_graph(nodes, "g", inputs, outputs, [nh.from_array(np.asarray(v), k) for k, v in consts.items()])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)


def inits(model):
    return {t.name: nh.to_array(t) for t in model.graph.initializer}


def rewrite(model, **options):
    before = model.SerializeToString()
    out, report = run_passes(model, passes=["weights4"], **options)
    assert model.SerializeToString() == before, "run_passes modified its input"
    register_planned_ops()
    onnx.checker.check_model(out, full_check=True)
    assert [i.name for i in out.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    assert out.ir_version == model.ir_version
    used = {n.domain for n in out.graph.node}
    expected = {(o.domain, o.version) for o in model.opset_import}
    if domain.DOMAIN in used:
        expected.add((domain.DOMAIN, domain.DOMAIN_VERSION))
    if "com.microsoft" in used:
        expected.add(("com.microsoft", 1))
    assert {(o.domain, o.version) for o in out.opset_import} == expected
    return out, report


def bound(report, outputs_path_entries=None, half=False):
    """The sum of the reconstruction errors of the rewritten weights (+ fp16 slack): see the module doc."""
    errs = [e.details["rel_error"] for e in report.rewritten("weights4")
            if outputs_path_entries is None or e.nodes[0] in outputs_path_entries]
    return sum(errs) + (FP16_SLACK if half else 0.0)


# ----------------------------------------------------------------------------------------------------------------
# the hand-built model: every spelling, and the look-alikes
# ----------------------------------------------------------------------------------------------------------------
K1 = 688  # not a multiple of 64 or 128


def zoo(dtype=np.float32, seed=0):
    """LayerNorm -> fc1 MatMul (K=688) + Add bias -> Relu -> fc2 MatMul(Transpose(w2t)) -> fc3 MatMul(Constant)
    -> Reshape -> Gemm(transB=1, alpha=0.5, beta=2, C [N]) -> {dyn: MatMul by a graph input (not a constant),
    lm_head: MatMul (to be excluded), small: MatMul 128x16 (below weights_min_elements)}."""
    rng = np.random.default_rng(seed)
    et = _ET[dtype]

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) / np.sqrt(shape[0] if scale is None else scale)).astype(dtype)

    consts = {"ln_s": (1 + 0.1 * rng.standard_normal(K1)).astype(dtype), "ln_b": w(K1, scale=100),
              "w1": w(K1, 256), "b1": w(256, scale=100), "w2t": w(128, 256, scale=256), "w4t": w(128, 128),
              "c4": w(128, scale=100), "wl": w(128, 512), "ws": w(128, 16), "shape": np.array([-1, 128], np.int64)}
    w3 = w(128, 128)
    n = oh.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln_s", "ln_b"], ["ln_out"], name="ln", axis=-1),
        n("MatMul", ["ln_out", "w1"], ["h1"], name="fc1"), n("Add", ["h1", "b1"], ["h1b"], name="fc1_bias"),
        n("Relu", ["h1b"], ["r1"], name="relu"),
        n("Transpose", ["w2t"], ["w2"], name="tw2", perm=[1, 0]), n("MatMul", ["r1", "w2"], ["h2"], name="fc2"),
        n("Constant", [], ["w3"], name="cw3", value=nh.from_array(w3, "w3v")),
        n("MatMul", ["h2", "w3"], ["h3"], name="fc3"),
        n("Reshape", ["h3", "shape"], ["h3f"], name="flat"),
        n("Gemm", ["h3f", "w4t", "c4"], ["g4"], name="gemm", transB=1, alpha=0.5, beta=2.0),
        n("MatMul", ["g4", "wdyn"], ["y_dyn"], name="dyn"),
        n("MatMul", ["g4", "wl"], ["logits"], name="lm_head"),
        n("MatMul", ["g4", "ws"], ["y_small"], name="small"),
    ]
    g = oh.make_graph(nodes, "zoo", [oh.make_tensor_value_info("x", et, [2, 5, K1]),
                                     oh.make_tensor_value_info("wdyn", et, [128, 64])],
                      [oh.make_tensor_value_info("logits", et, [10, 512]),
                       oh.make_tensor_value_info("y_dyn", et, [10, 64]),
                       oh.make_tensor_value_info("y_small", et, [10, 16])],
                      initializer=[nh.from_array(v, k) for k, v in consts.items()])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9, producer_name="test",
                         producer_version="1.0")


def zoo_feeds(dtype, seed=1):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((2, 5, K1)).astype(dtype),
            "wdyn": (rng.standard_normal((128, 64)) / 11).astype(dtype)}


REWRITTEN_ZOO = ["fc1", "fc2", "fc3", "gemm"]


def _options(fmt, target, **extra):
    return dict(weights=fmt, weights_target=target, weights_exclude=["lm_head"], **extra)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_lowbit_structure(fmt, dtype):
    model = zoo(dtype)
    out, report = rewrite(model, **_options(fmt, "lowbit"))
    op = "MatMulAWQ" if fmt == "awq" else "MatMulNF4"
    assert ops(out).count(op) == 4, ops(out)
    assert ops(out).count("MatMul") == 3 and not {"Gemm", "Transpose", "Constant", "Add"} & set(ops(out)), ops(out)
    values = inits(out)
    assert not {"w1", "w2t", "w4t"} & set(values)  # the float weights are gone
    by_name = {n.name: n for n in out.graph.node}
    for node in out.graph.node:
        if node.op_type != op:
            continue
        assert node.domain == domain.DOMAIN
        attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
        k, n_ = attrs["K"], attrs["N"]
        if fmt == "awq":
            assert attrs["group_size"] == 128
            qw, qz, sc = (values[i] for i in node.input[1:4])
            kp = -(-k // 128) * 128
            assert qw.dtype == np.int32 and qw.shape == (kp, n_ // 8)
            assert qz.dtype == np.int32 and qz.shape == (kp // 128, n_ // 8)
            assert sc.dtype == np.float16 and sc.shape == (kp // 128, n_)
        else:
            assert attrs["quant_type"] == fmt.encode() and attrs["block_size"] == 64
            q, am = values[node.input[1]], values[node.input[2]]
            assert q.dtype == np.uint8 and q.shape == ((k * n_ + 1) // 2,)
            assert am.dtype == np.float32 and am.shape == (-(-k * n_ // 64),)
    fc1 = next(n for n in out.graph.node if n.output[0] == "h1b")   # fc1 + its Add fused: bias input
    assert len(fc1.input) == (5 if fmt == "awq" else 4)
    np.testing.assert_array_equal(values[fc1.input[-1]], inits(model)["b1"])
    gemm = next(n for n in out.graph.node if n.output[0] == "g4")  # beta * C as the bias
    np.testing.assert_allclose(values[gemm.input[-1]].astype(np.float32),
                               2.0 * inits(model)["c4"].astype(np.float32), rtol=1e-3)
    assert {"dyn", "lm_head", "small"} <= set(by_name)
    # the report: 4 rewrites with figures, 3 skips with reasons
    done = report.rewritten("weights4")
    assert [e.nodes[0] for e in done] == REWRITTEN_ZOO
    assert done[0].nodes == ("fc1", "fc1_bias")
    for e in done:
        d = e.details
        assert d["format"] == fmt and d["op"] == op and d["bytes_after"] < d["bytes_before"] / 3
        assert 0.02 < d["rel_error"] < 0.2, d
    assert done[-1].details["totals"]["weights"] == 4
    skipped = {e.nodes[0]: e.reason for e in report.skipped("weights4")}
    assert set(skipped) == {"dyn", "lm_head", "small"}
    assert "not a constant" in skipped["dyn"] and "graph input" in skipped["dyn"]
    assert "weights_exclude" in skipped["lm_head"] and "lm_head" in skipped["lm_head"]
    assert "weights_min_elements" in skipped["small"]
    assert [e.pattern for e in done] == [f"{fmt}: MatMul(A, W) -> Add(bias)", f"{fmt}: MatMul(A, Transpose(W))",
                                         f"{fmt}: MatMul(A, Constant W)", f"{fmt}: Gemm(A, W, transB=1) + C"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_ort_target_runs_in_stock_onnxruntime(fmt, dtype):
    model = zoo(dtype)
    half = dtype == np.float16
    out, report = rewrite(model, **_options(fmt, "ort"))
    if fmt == "awq":
        assert ops(out).count("MatMulNBits") == 4 and "Add" not in ops(out)  # bias is MatMulNBits' input 5
    else:
        assert ops(out).count("MatMulBnb4") == 4 and ops(out).count("Add") == 2  # fc1's and Gemm's bias
    assert all(n.domain == "com.microsoft" for n in out.graph.node if n.op_type.startswith("MatMul") and
               n.op_type != "MatMul")
    feeds = zoo_feeds(dtype)
    got = run_ort(out, feeds)
    # (1) the ORT ops compute exactly what our numpy references compute on the same quantised weights
    lowbit, _ = rewrite(model, **_options(fmt, "lowbit"))
    ref = run_reference(lowbit, feeds)
    for name in ("logits", "y_dyn", "y_small"):
        assert got[name].dtype == dtype
        err = rel_fro(got[name], ref[name])
        assert err <= (REF_TOL16 if half else REF_TOL_AWQ32 if fmt == "awq" else REF_TOL32), (name, err)
    # (2) and the float model, within the bound from the reconstruction errors
    flt = run_ort(model, feeds)
    b = bound(report, half=half)
    for name in ("logits", "y_dyn", "y_small"):
        err = rel_fro(got[name], flt[name])
        assert err <= b, (name, err, b)


def test_ort_layout_single_layer_k688():
    """One MatMul with K=688 (NF4 blocks run across rows of W^T; AWQ pads K to 768): ORT == numpy reference."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((K1, 96)).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32)
    model = make([oh.make_node("MatMul", ["a", "w"], ["m"], name="mm"), oh.make_node("Add", ["m", "b"], ["y"])],
                 [vi("a", [3, K1])], [vi("y", [3, 96])], {"w": w, "b": b})
    a = rng.standard_normal((3, K1)).astype(np.float32)
    for fmt, bs in (("nf4", 64), ("fp4", 32), ("nf4", 256), ("awq", 128), ("awq", 16), ("awq", 256)):
        size = dict(block_size=bs) if fmt != "awq" else dict(group_size=bs)
        out, rep = rewrite(model, weights=fmt, weights_target="ort", **size)
        got = run_ort(out, {"a": a})["y"]
        if fmt == "awq":
            qw, qz, sc = awq.quantize_rtn(w, bs)
            ref = awq.matmul(a, qw, qz, sc, bs, K1, 96, bias=b)
        else:
            q, am = nf4.quantize(w, fmt, bs)
            ref = nf4.matmul(a, q, am, fmt, bs, K1, 96, bias=b)
        assert rel_fro(got, ref) <= (REF_TOL_AWQ32 if fmt == "awq" else REF_TOL32), (fmt, bs, rel_fro(got, ref))
        (e,) = rep.rewritten()
        assert e.details["K"] == K1 and e.details["N"] == 96
        assert ("not safe in CUDA graphs" in e.reason) == (fmt != "awq")    # MatMulBnb4's graph replays


# ----------------------------------------------------------------------------------------------------------------
# AWQ calibration and the input scales
# ----------------------------------------------------------------------------------------------------------------
def chain(dtype=np.float32, seed=5):
    """x -> LayerNorm -> fc0 MatMul -> fc1 MatMul (fc0's only reader) -> Relu -> fc2 MatMul + Add bias -> y.
    Input channels of very different magnitudes (as in LLM activations), which is what AWQ's scales are for."""
    rng = np.random.default_rng(seed)
    k = 256
    mk = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(dtype)  # noqa: E731
    consts = {"ln_s": np.exp(rng.standard_normal(k)).astype(dtype),
              "ln_b": (0.1 * rng.standard_normal(k)).astype(dtype), "w0": mk(k, k), "w1": mk(k, k),
              "w2": mk(k, 128), "b2": (0.1 * rng.standard_normal(128)).astype(dtype)}
    n = oh.make_node
    nodes = [n("LayerNormalization", ["x", "ln_s", "ln_b"], ["ln_out"], name="ln", axis=-1),
             n("MatMul", ["ln_out", "w0"], ["h0"], name="fc0"), n("MatMul", ["h0", "w1"], ["h1"], name="fc1"),
             n("Relu", ["h1"], ["r1"], name="relu"), n("MatMul", ["r1", "w2"], ["h2"], name="fc2"),
             n("Add", ["h2", "b2"], ["y"], name="fc2_bias")]
    et = _ET[dtype]
    g = oh.make_graph(nodes, "chain", [oh.make_tensor_value_info("x", et, ["B", 16, k])],
                      [oh.make_tensor_value_info("y", et, ["B", 16, 128])],
                      [nh.from_array(v, name) for name, v in consts.items()])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)


@pytest.fixture
def record_awq(monkeypatch):
    """Records every awq.search_scales call: [(w, ScaleSearch)]."""
    calls = []
    real = awq.search_scales

    def spy(w, x, group_size, *args, **kwargs):
        result = real(w, x, group_size, *args, **kwargs)
        calls.append((np.array(w), result))
        return result
    monkeypatch.setattr(awq, "search_scales", spy)
    return calls


def _effective(w_passed, found, group_size):
    """(effective weight, act_scale) of one calibrated AWQ op of a float32 model: act_scale (= 1/s, per row) *
    dequantised Q(W * s)."""
    s = np.asarray(found.scales, np.float32)
    qw, qz, sc = awq.quantize_rtn(w_passed * s[:, None], group_size)
    k, n = w_passed.shape
    act = (np.float32(1.0) / s).astype(np.float64)
    return awq.dequantize(qw, qz, sc, group_size, k, n).astype(np.float64) * act[:, None], act


@pytest.mark.parametrize("target", ["ort", "lowbit"])
def test_awq_calibrated_scales_folded_exactly(record_awq, target):
    model = chain()
    x_cal = np.random.default_rng(9).standard_normal((4, 16, 256)).astype(np.float32)  # every layer scales
    # awq_holdout=0: the scales searched on all rows are used (on this random data they need not win on held-out
    # rows, test_awq_holdout_keeps_rtn); this test is about where they go
    out, report = rewrite(model, weights="awq", weights_target=target, calibration={"x": x_cal}, awq_holdout=0)
    notes = {e.nodes[0]: e.reason for e in report.rewritten()}
    assert "LayerNormalization 'ln'" in notes["fc0"] and "scale and bias" in notes["fc0"]
    assert "the weight of MatMul 'fc0'" in notes["fc1"]
    assert "Mul" in notes["fc2"] and "in front" in notes["fc2"]   # behind a Relu: a Mul is inserted
    assert ops(out).count("Mul") == 1 and "LayerNormalization" in ops(out)
    assert all(e.details["calibrated"] for e in report.rewritten())
    # the three calls, last layer first (folds reach their producers before those are quantised)
    assert [c[0].shape for c in record_awq] == [(256, 128), (256, 256), (256, 256)]
    (w2p, r2), (w1p, r1), (w0p, r0) = record_awq
    orig = inits(model)
    np.testing.assert_array_equal(w2p, orig["w2"])
    np.testing.assert_array_equal(w1p, orig["w1"])
    e2, _ = _effective(w2p, r2, 128)
    e1, act1 = _effective(w1p, r1, 128)
    e0, act0 = _effective(w0p, r0, 128)
    np.testing.assert_allclose(w0p, orig["w0"] * act1[None, :].astype(np.float32), rtol=1e-6)  # fc1's fold
    # the float model with the effective weights: the model computes (LN(x) * act0) @ deq0 @ deq1 = LN(x) @ E0 @
    # deq1 with E0 ~ W0 * act1 (columns), i.e. LN(x) @ (E0 / act1) @ (act1 * deq1 = E1)
    eff = onnx.ModelProto()
    eff.CopyFrom(model)
    repl = {"w0": e0 / act1[None, :], "w1": e1, "w2": e2}
    for t in eff.graph.initializer:
        if t.name in repl:
            t.CopyFrom(nh.from_array(repl[t.name].astype(np.float32), t.name))
    x = np.random.default_rng(8).standard_normal((2, 16, 256)).astype(np.float32)
    expected = run_ort(eff, {"x": x})["y"]
    got = run_ort(out, {"x": x})["y"] if target == "ort" else run_reference(out, {"x": x})["y"]
    tol = EXACT_TOL32 if target == "lowbit" else REF_TOL_AWQ32  # MatMulNBits does not round W to fp16
    assert rel_fro(got, expected) <= tol, rel_fro(got, expected)
    flt = run_ort(model, {"x": x})["y"]
    assert rel_fro(got, flt) <= bound(report)


def test_awq_calibration_fp16_and_vs_rtn():
    model = chain(np.float16)
    x_cal = np.random.default_rng(7).standard_normal((4, 16, 256)).astype(np.float16)
    out, report = rewrite(model, weights="awq", weights_target="ort", calibration={"x": x_cal})
    rtn, rtn_report = rewrite(model, weights="awq", weights_target="ort")
    assert not any(e.details["calibrated"] for e in rtn_report.rewritten())
    x = np.random.default_rng(8).standard_normal((2, 16, 256)).astype(np.float16)
    flt = run_ort(model, {"x": x})["y"]
    got, got_rtn = run_ort(out, {"x": x})["y"], run_ort(rtn, {"x": x})["y"]
    err, err_rtn = rel_fro(got, flt), rel_fro(got_rtn, flt)
    assert err <= bound(report, half=True)
    assert err_rtn <= bound(rtn_report, half=True)
    assert err <= 1.25 * err_rtn, (err, err_rtn)   # calibrated AWQ is not worse than RTN on such inputs


def test_awq_mul_scale_and_gemm_fold():
    """A decomposed norm's gamma (Mul by a constant [K]) and a Gemm producer (transB=1, with C) take the fold."""
    rng = np.random.default_rng(11)
    k = 128
    consts = {"gamma": np.exp(rng.standard_normal(k)).astype(np.float32),
              "wg": (rng.standard_normal((k, k)) / 12).astype(np.float32),
              "cg": rng.standard_normal(k).astype(np.float32),
              "w1": (rng.standard_normal((k, k)) / 12).astype(np.float32),
              "w2": (rng.standard_normal((k, 64)) / 12).astype(np.float32)}
    n = oh.make_node
    nodes = [n("Mul", ["x", "gamma"], ["xg"], name="norm_scale"),
             n("Gemm", ["xg", "wg", "cg"], ["g"], name="gemm", transB=1),
             n("MatMul", ["g", "w1"], ["h1"], name="fc1"), n("MatMul", ["h1", "w2"], ["y"], name="fc2")]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [32, k])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [32, 64])],
                      [nh.from_array(v, name) for name, v in consts.items()])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)
    x_cal = rng.standard_normal((32, k)).astype(np.float32)
    out, report = rewrite(model, weights="awq", weights_target="ort", calibration={"x": x_cal},
                          weights_min_elements=0)
    notes = {e.nodes[0]: e.reason for e in report.rewritten()}
    assert "Mul 'norm_scale'" in notes["gemm"]
    assert "weight and bias of Gemm 'gemm'" in notes["fc1"]
    assert "MatMul 'fc1'" in notes["fc2"]
    assert ops(out).count("Mul") == 1  # no Mul inserted: every scale was folded
    x = rng.standard_normal((32, k)).astype(np.float32)
    assert rel_fro(run_ort(out, {"x": x})["y"], run_ort(model, {"x": x})["y"]) <= bound(report)


def test_awq_calibration_of_several_runs():
    """Calibration arrays keyed NAME#K (several runs: the gru pass's format, e.g. utterances of different lengths
    for a model with a GRU and a MatMul) are one run each; AWQ sees their rows in order, so the result equals one
    run over the same rows (weights4 stopped with "no graph input named 'x#0', 'x#1'", as on the speech denoiser
    of tests/data with --weights awq and its GRU calibration file)."""
    model = chain()
    rng = np.random.default_rng(9)
    a, b = (rng.standard_normal((1, n, 256)).astype(np.float32) for n in (16, 16))
    two, report = rewrite(model, weights="awq", weights_target="ort", calibration={"x#0": a, "x#1": b})
    one, _ = rewrite(model, weights="awq", weights_target="ort", calibration={"x": np.concatenate([a, b])})
    assert any(e.details["calibrated"] for e in report.rewritten())   # (a layer may keep RTN: AWQ <= RTN held out)
    assert two.SerializeToString() == one.SerializeToString()


def test_calibration_errors():
    model = chain()
    good = np.zeros((1, 16, 256), np.float32)
    with pytest.raises(ValueError, match="no graph input named 'z'"):
        run_passes(model, passes=["weights4"], weights="awq", calibration={"x": good, "z": good})
    with pytest.raises(ValueError, match=r"shape \[1, 8, 256\]"):
        run_passes(model, passes=["weights4"], weights="awq", calibration={"x": np.zeros((1, 8, 256), np.float32)})
    with pytest.raises(ValueError, match="only used by weights='awq'"):
        run_passes(model, passes=["weights4"], weights="nf4", calibration={"x": good})


# ----------------------------------------------------------------------------------------------------------------
# options, look-alikes, framework
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, needle", [
    (dict(weights="int3"), "weights: unknown format 'int3'"),
    (dict(weights="nf4", block_size=48), "block_size: 48 is not a power of two"),
    (dict(weights="nf4", block_size=16), "block_size: 16"),
    (dict(weights="fp4", block_size=8192), "block_size: 8192"),
    (dict(weights="awq", group_size=100, weights_target="ort"), "group_size: 100 is not supported by onnxruntime"),
    (dict(weights="awq", group_size=512, weights_target="ort"), "group_size: 512"),
    (dict(weights="nf4", block_size=512, weights_target="ort"), "MatMulBnb4"),
    (dict(weights="awq", group_size=0), "group_size: 0"),
    (dict(weights="awq", group_size=1 << 17), "group_size: 131072"),
    (dict(weights="nf4", weights_target="gpu"), "weights_target: unknown target 'gpu'"),
    (dict(weights="nf4", weights_exclude=["(unclosed"]), "weights_exclude: '(unclosed'"),
    (dict(weights="nf4", weights_min_elements=-1), "weights_min_elements"),
])
def test_bad_options_raise(options, needle):
    with pytest.raises(ValueError) as info:
        run_passes(zoo(), passes=["weights4"], **options)
    assert needle in str(info.value)


def test_awq_n_not_multiple_of_8_is_padded():
    """AWQ packs 8 columns per int32: N = 100 runs as N = 104 (zero columns) and a Slice back to 100; the ort
    target (MatMulNBits takes any N) gets the 100 columns as they are. tests/test_weights4_fidelity.py runs both."""
    rng = np.random.default_rng(0)
    model = make([oh.make_node("MatMul", ["a", "proj.weight"], ["y"], name="proj")], [vi("a", ["M", 256])],
                 [vi("y", ["M", 100])], {"proj.weight": rng.standard_normal((256, 100)).astype(np.float32)})
    out, report = rewrite(model, weights="awq")
    assert ops(out) == ["MatMulAWQ", "Slice"]
    node = out.graph.node[0]
    assert {a.name: oh.get_attribute_value(a) for a in node.attribute}["N"] == 104
    assert "padded to 104" in report.rewritten()[0].reason
    a = rng.standard_normal((64, 256)).astype(np.float32)
    y = run_reference(out, {"a": a})["y"]
    assert y.shape == (64, 100) and rel_fro(y, a @ inits(model)["proj.weight"]) <= bound(report)
    out, report = rewrite(model, weights="awq", weights_target="ort")
    assert ops(out) == ["MatMulNBits"]
    assert run_ort(out, {"a": a})["y"].shape == (64, 100)
    out, report = rewrite(model, weights="awq", weights_exclude="proj")  # excluding it stays possible
    assert ops(out) == ["MatMul"] and "--exclude" in report.skipped()[0].reason


def test_without_format_nothing_changes():
    model = zoo()
    out, report = rewrite(model)
    assert sorted(ops(out)) == sorted(ops(model))
    (entry,) = report.entries
    assert entry.action == "skipped" and "option weights" in entry.reason and "5 constant-weight" in entry.reason
    assert entry.pattern == "weights4: no format"
    # all passes by default: weights4 changes nothing without its option (the merge, on by default, is turned off:
    # it would merge the zoo's products that read one input)
    out, report = run_passes(model, merge_siblings=False)
    assert sorted(ops(out)) == sorted(ops(model))


def test_registry_order():
    assert available().index("weights4") == available().index("fplut") + 1
    assert PASSES["weights4"].description


def test_gemm_look_alikes_skipped():
    rng = np.random.default_rng(2)
    k = n_ = 96
    w = rng.standard_normal((k, n_)).astype(np.float32)
    cases = {
        "C [M, N] is not a bias": (["a", "w", "cfull"], {}, "is not a bias"),
        "C computed": (["a", "w", "cdyn"], {}, "not a constant"),
        "transA": (["at", "w", "c"], {"transA": 1}, "transA=1"),
    }
    for label, (inputs, attrs, needle) in cases.items():
        nodes = [oh.make_node("Relu", ["a"], ["cdyn"]), oh.make_node("Transpose", ["a"], ["at"]),
                 oh.make_node("Gemm", inputs, ["y"], name="g", **attrs)]
        model = make(nodes, [vi("a", [n_, k])], [vi("y", [n_, n_])],
                     {"w": w, "cfull": rng.standard_normal((n_, n_)).astype(np.float32), "c": np.ones(n_, np.float32)})
        out, report = rewrite(model, weights="nf4")
        assert "Gemm" in ops(out), label
        (skip,) = report.skipped()
        assert needle in skip.reason, (label, skip.reason)


def test_shared_weight_quantised_once_and_kept_float_noted():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((128, 128)).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["a", "w"], ["h"], name="mm1"),
             oh.make_node("MatMul", ["h", "w"], ["y"], name="mm2"),
             oh.make_node("Gather", ["w", "idx"], ["emb"], name="embed", axis=0)]
    model = make(nodes, [vi("a", [4, 128])], [vi("y", [4, 128]), vi("emb", [2, 128])],
                 {"w": w, "idx": np.array([0, 3], np.int64)})
    out, report = rewrite(model, weights="nf4", weights_target="ort")
    nb = [n for n in out.graph.node if n.op_type == "MatMulBnb4"]
    assert len(nb) == 2 and nb[0].input[1:] == nb[1].input[1:]   # one quantised copy
    assert "w" in inits(out)                                       # still read by the Gather
    e1, e2 = report.rewritten()
    assert "shares the quantised weight" in e2.reason + e1.reason
    assert all("kept: also read by embed" in e.reason for e in (e1, e2) if e.details["bytes_before"])
    t = w4.totals(report)
    assert t["bytes_before"] == w.nbytes and t["bytes_after"] > w.nbytes  # the float copy stays: no saving


def test_weight_the_format_refuses_is_skipped():
    w = np.random.default_rng(9).standard_normal((128, 64)).astype(np.float32)
    w[3, 5] = np.inf
    model = make([oh.make_node("MatMul", ["a", "w"], ["y"], name="mm")], [vi("a", [2, 128])], [vi("y", [2, 64])],
                 {"w": w})
    out, report = rewrite(model, weights="awq")
    assert ops(out) == ["MatMul"]
    (skip,) = report.skipped()
    assert "refused the weight" in skip.reason and "Inf" in skip.reason


def test_rank1_flattened_and_batched_weight_skipped():
    """A of rank 1 (and of unknown rank: tests/test_weights4_fidelity.py) is quantised around Reshapes; a 3-D
    constant B (a batched product, not a linear layer) is left alone."""
    rng = np.random.default_rng(6)
    nodes = [oh.make_node("MatMul", ["v", "w"], ["y1"], name="vec"),
             oh.make_node("MatMul", ["a3", "w3"], ["y2"], name="bmm")]
    model = make(nodes, [vi("v", [128]), vi("a3", [2, 4, 128])], [vi("y1", [128]), vi("y2", [2, 4, 128])],
                 {"w": rng.standard_normal((128, 128)).astype(np.float32),
                  "w3": rng.standard_normal((2, 128, 128)).astype(np.float32)})
    out, report = rewrite(model, weights="nf4")
    assert ops(out).count("MatMulNF4") == 1 and ops(out).count("Reshape") == 2 and ops(out).count("MatMul") == 1
    (done,) = report.rewritten()
    assert done.nodes == ("vec",) and "reshaped" in done.reason
    reasons = {e.nodes[0]: e.reason for e in report.skipped()}
    assert "not 2-D" in reasons["bmm"] and not report.skipped()[0].details.get("unquantised")
    v = rng.standard_normal(128).astype(np.float32)
    got = run_reference(out, {"v": v, "a3": np.zeros((2, 4, 128), np.float32)})["y1"]
    assert got.shape == (128,) and rel_fro(got, v @ inits(model)["w"]) <= bound(report)

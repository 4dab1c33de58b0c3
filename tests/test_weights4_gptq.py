"""GPTQ rounding (onnx_lowbit/gptq.py; weights4's weights_rounding="gptq", CLI --rounding gptq) and mixed precision
within a byte budget (passes/weights4_mixed.py; weights_budget, CLI --budget).

What is checked:
* the GPTQ result lies on the format's grid: AWQ's packed tensors and NF4's bytes dequantise exactly to the weight
  GPTQ's error figures were computed with;
* GPTQ's output error is below round-to-nearest's on the calibration rows and on held-out rows drawn from the same
  distribution, for NF4 blocks and AWQ int4 groups, on a weight alone and through the pass on a small MLP whose
  inputs have correlated channels (the case GPTQ exploits; with white inputs both would be about equal);
* with a budget the rewritten model's initializers stay within budget x the fp32 bytes, the most sensitive
  products are kept in int8 / fp16 (standard ops) and the model's output error falls;
* bad options and flags give a message naming them.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from onnx_lowbit import awq, gptq, nf4
from onnx_lowbit.bench import weight_bytes
from onnx_lowbit.passes import run_passes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, H, N = 256, 512, 128


def correlated(rows, k, seed):
    """Activations with correlated channels of unequal scale (as LLM activations are)."""
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(99).normal(size=(k, k)) / np.sqrt(k)
    scale = 1 + 3 * np.random.default_rng(98).random(k)
    return ((rng.normal(size=(rows, k)) @ mix) * scale).astype(np.float32)


def out_err(x, w, w_hat):
    return float(np.mean((x.astype(np.float64) @ (w.astype(np.float64) - w_hat)) ** 2))


@pytest.mark.parametrize("fmt", ["awq", "nf4", "fp4"])
def test_gptq_on_grid_and_below_rtn(fmt):
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(K, N)) * 0.05).astype(np.float32)
    fit, held = correlated(1024, K, 1), correlated(512, K, 2)
    h = gptq.hessian(fit)
    if fmt == "awq":
        r = gptq.gptq_awq(w, h, 128)
        qw, qz, sc = awq.pack(r.q, r.z, r.s)
        assert np.array_equal(awq.dequantize(qw, qz, sc, 128, K, N).astype(np.float32), r.w_hat)
        rtn = awq.fake_quantize(w, 128)
    else:
        r = gptq.gptq_nf4(w, h, fmt, 64)
        assert np.array_equal(nf4.dequantize(r.packed, r.absmax, fmt, 64, K, N), r.w_hat)
        p, a = nf4.quantize(w, fmt, 64)
        rtn = nf4.dequantize(p, a, fmt, 64, K, N)
    for x in (fit, held):
        assert out_err(x, w, r.w_hat) < 0.75 * out_err(x, w, rtn)


def test_gptq_awq_k_not_multiple_of_group_and_bad_input():
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(200, 16)) * 0.1).astype(np.float32)
    r = gptq.gptq_awq(w, gptq.hessian(correlated(300, 200, 4)), 128)
    assert r.q.shape == (256, 16)
    qw, qz, sc = awq.pack(r.q, r.z, r.s)
    assert np.array_equal(awq.dequantize(qw, qz, sc, 128, 200, 16).astype(np.float32), r.w_hat)
    with pytest.raises(ValueError, match="multiple of block_size"):
        gptq.gptq_nf4(w, gptq.hessian(correlated(300, 200, 4)), "nf4", 64)
    with pytest.raises(ValueError, match="K = 200"):
        gptq.gptq_awq(w, np.eye(64), 128)
    with pytest.raises(ValueError, match="NaN or Inf"):
        gptq.hessian(np.full((4, 8), np.nan))
    # a channel that is always 0 in calibration: handled (H[k, k] = 1), still on the grid
    x = correlated(300, 200, 5)
    x[:, 7] = 0
    r = gptq.gptq_awq(w, gptq.hessian(x), 64)
    assert np.all(np.isfinite(r.w_hat))


# ----------------------------------------------------------------------------------------------------------------
# through the pass: X [B, K] -> fc1 [K, H] -> Relu -> fc2 [H, H] -> Relu -> fc3 [H, N]

def mlp(seed=0):
    rng = np.random.default_rng(seed)
    ws = {"w1": rng.normal(size=(K, H)) / np.sqrt(K), "w2": rng.normal(size=(H, H)) / np.sqrt(H),
          "w3": rng.normal(size=(H, N)) / np.sqrt(H)}
    nodes = [oh.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"), oh.make_node("Relu", ["h1"], ["r1"]),
             oh.make_node("MatMul", ["r1", "w2"], ["h2"], name="fc2"), oh.make_node("Relu", ["h2"], ["r2"]),
             oh.make_node("MatMul", ["r2", "w3"], ["y"], name="fc3")]
    g = oh.make_graph(nodes, "mlp", [oh.make_tensor_value_info("x", TP.FLOAT, ["B", K])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["B", N])],
                      [nh.from_array(v.astype(np.float32), k) for k, v in ws.items()])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)


def run(model, x):
    from onnx_lowbit import InferenceSession
    return InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def data():
    model = mlp()
    calib, held = correlated(2048, K, 10), correlated(512, K, 11)
    return model, calib, held, run(model, calib), run(model, held)


@pytest.mark.parametrize("fmt", ["nf4", "awq"])
def test_pass_gptq_lowers_output_error(data, fmt):
    model, calib, held, ref_c, ref_h = data
    errs = {}
    for rounding in ("rtn", "gptq"):
        cal = {"x": calib} if rounding == "gptq" or fmt == "awq" else None   # (NF4 RTN takes no calibration)
        out, report = run_passes(model, passes=["weights4"], weights=fmt, calibration=cal, weights_rounding=rounding)
        onnx.checker.check_model(out, full_check=True)
        errs[rounding] = (rel(run(out, calib), ref_c), rel(run(out, held), ref_h))
        done = report.rewritten("weights4")
        assert len(done) == 3
        if rounding == "gptq":
            for e in done:
                d = e.details
                assert "GPTQ rounding" in e.reason or "RTN kept" in e.reason
                assert d["gptq_mse_fit"] < d["rtn_mse_fit"] and d["gptq_mse_heldout"] is not None
            assert sum(e.details["gptq_kept"] for e in done) >= 2
    assert errs["gptq"][0] < 0.8 * errs["rtn"][0], errs
    assert errs["gptq"][1] < 0.8 * errs["rtn"][1], errs


def test_budget_respected_and_sensitive_products_kept(data):
    model, calib, held, ref_c, ref_h = data
    fp32 = weight_bytes(model)
    four, _ = run_passes(model, passes=["weights4"], weights="nf4", calibration={"x": calib}, weights_rounding="gptq")
    all4 = weight_bytes(four)
    for form in ("int8", "fp16"):
        high = fp32 / 4 if form == "int8" else fp32 / 2        # every product in the higher form
        budget = (all4 + 0.5 * (high - all4)) / fp32             # room for some products, not all
        out, report = run_passes(model, passes=["weights4"], weights="nf4", calibration={"x": calib},
                                 weights_rounding="gptq", weights_budget=budget, weights_budget_form=form)
        onnx.checker.check_model(out, full_check=True)
        assert weight_bytes(out) <= budget * fp32
        info = report.rewritten("weights4")[-1].details["budget"]
        assert info["fp32_bytes"] == fp32 and info["met"] and 1 <= info["kept"][form] < 3
        kept = [e for e in report.rewritten("weights4") if e.details["format"] == form]
        assert len(kept) == info["kept"][form]
        assert all(f"kept in {form}" in e.reason and e.details["rel_out_error_high"] < e.details["rel_out_error_4bit"]
                   for e in kept)
        ops = [n.op_type for n in out.graph.node]
        assert ("DequantizeLinear" in ops) == (form == "int8") and "MatMulNF4" in ops
        assert rel(run(out, held), ref_h) < rel(run(four, held), ref_h)
    # a budget below the all-4-bit size: everything 4-bit, the plan says it is not met
    out, report = run_passes(model, passes=["weights4"], weights="nf4", calibration={"x": calib},
                             weights_budget=0.05)
    info = report.rewritten("weights4")[-1].details["budget"]
    assert not info["met"] and info["kept"] == {"int8": 0, "fp16": 0}


def test_budget_int8_transposed_and_gemm_weights():
    """int8's scale runs along the stored weight's N axis: MatMul(A, Transpose(Wt)) and Gemm(transB=1) store
    [N, K]; with a budget of 1.0 every product is int8 and the outputs stay within int8's rounding."""
    rng = np.random.default_rng(4)
    wt = (rng.normal(size=(N, K)) * np.linspace(0.1, 2, N)[:, None]).astype(np.float32)   # column scales differ
    wg = (rng.normal(size=(N, N)) * np.linspace(0.1, 2, N)[:, None]).astype(np.float32)
    nodes = [oh.make_node("Transpose", ["wt"], ["w"], perm=[1, 0]), oh.make_node("MatMul", ["x", "w"], ["h"]),
             oh.make_node("Gemm", ["h", "wg", "c"], ["y"], transB=1)]
    g = oh.make_graph(nodes, "t", [oh.make_tensor_value_info("x", TP.FLOAT, [64, K])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, [64, N])],
                      [nh.from_array(wt, "wt"), nh.from_array(wg, "wg"), nh.from_array(np.ones(N, np.float32), "c")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)
    x = correlated(64, K, 7)
    out, report = run_passes(model, passes=["weights4"], weights="awq", calibration={"x": x}, weights_budget=1.0)
    assert [e.details["format"] for e in report.rewritten("weights4")] == ["int8", "int8"]
    assert [n.op_type for n in out.graph.node].count("DequantizeLinear") == 2
    y, ref = run(out, x).astype(np.float64), run(model, x).astype(np.float64)
    col = np.linalg.norm(y - ref, axis=0) / np.linalg.norm(ref, axis=0)   # small columns: wrong axis gives ~10%
    assert col.max() < 2e-2, col.max()


@pytest.mark.parametrize("options, needle", [
    (dict(weights="nf4", weights_rounding="gptq"), "weights_rounding: needs calibration"),
    (dict(weights="awq", weights_budget=0.3), "weights_budget: needs calibration"),
    (dict(weights="nf4", weights_rounding="best", calibration={"x": np.ones((2, K), np.float32)}),
     "weights_rounding: 'best'"),
    (dict(weights="nf4", weights_budget=1.5, calibration={"x": np.ones((2, K), np.float32)}), "weights_budget: 1.5"),
    (dict(weights="nf4", weights_budget=0.3, weights_budget_form="int4", calibration={"x": np.ones((2, K))}),
     "weights_budget_form: 'int4'"),
    (dict(weights="nf4", calibration={"x": np.ones((2, K), np.float32)}), "calibration: only used by"),
])
def test_bad_options(options, needle):
    with pytest.raises(ValueError, match=needle):
        run_passes(mlp(), passes=["weights4"], **options)


def test_cli_flags(tmp_path, data):
    model, calib, *_ = data
    src, out, npz = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "c.npz"
    onnx.save(model, str(src))
    np.savez(npz, x=calib)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", *args], capture_output=True, text=True, env=env,
                           timeout=300)
        return p.returncode, p.stdout + p.stderr

    rc, text = cli("rewrite", str(src), str(out), "--weights", "nf4", "--rounding", "gptq")
    assert rc == 2 and "--rounding gptq needs --calibration" in text
    rc, text = cli("rewrite", str(src), str(out), "--rounding", "gptq")
    assert rc == 2 and "--rounding needs --weights" in text
    rc, text = cli("rewrite", str(src), str(out), "--weights", "nf4", "--budget", "2")
    assert rc == 2 and "expected a fraction in (0, 1]" in text
    rc, text = cli("rewrite", str(src), str(out), "--weights", "awq", "--rounding", "gptq", "--calibration", str(npz),
                   "--budget", "0.2", "--report-json", str(tmp_path / "r.json"))
    assert rc == 0, text
    import json
    reasons = [e["reason"] for e in json.load(open(tmp_path / "r.json"))["entries"] if e["pass_name"] == "weights4"]
    assert any("GPTQ rounding" in r for r in reasons) and any("kept in int8" in r for r in reasons)
    assert weight_bytes(onnx.load(str(out))) <= 0.2 * weight_bytes(model)


def test_tiny_llama_export(tmp_path):
    """A torch-exported tiny LLaMA (tied embedding / lm_head, past KV inputs): GPTQ and the budget through the
    whole graph; the budget's fp32 bytes are the model's parameters with the tied table once."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from onnx_lowbit.samples import export_causal_lm
    from onnx_lowbit.cli_options import calibration_session
    model = export_causal_lm.tiny_llama(layers=2, hidden=64, intermediate=192, vocab=1024, tie=True)
    path = tmp_path / "llm.onnx"
    export_causal_lm.export(model, str(path))
    params = 4 * sum(p.numel() for p in model.parameters())
    src = onnx.load(str(path))
    rng = np.random.default_rng(0)

    def feeds(ids):
        f = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
        for vi in src.graph.input:
            if vi.name.startswith("past_key_values"):
                d = [x.dim_value for x in vi.type.tensor_type.shape.dim]
                f[vi.name] = np.zeros((1, d[1], 0, d[3]), np.float32)
        return f

    calib, held = feeds(rng.integers(0, 1024, (1, 512))), feeds(rng.integers(0, 1024, (1, 128)))

    def logits(m, f):
        from onnx_lowbit import InferenceSession
        s = InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return s.run(["logits"], f)[0]

    ref = logits(src, held)
    common = dict(passes=["weights4"], weights="awq", group_size=64, calibration=calib,
                  calibration_session=calibration_session)
    rtn, _ = run_passes(src, **common)
    out, report = run_passes(src, weights_rounding="gptq", **common)
    done = report.rewritten("weights4")
    assert len(done) == 10 and all("gptq_mse_fit" in e.details for e in done)
    assert all(e.details["gptq_mse_fit"] < e.details["rtn_mse_fit"] for e in done)
    assert rel(logits(out, held), ref) < rel(logits(rtn, held), ref)
    all4 = weight_bytes(out)
    budget = (all4 + 0.5 * (params / 4 - all4 + params / 8)) / params
    mixed, report = run_passes(src, weights_rounding="gptq", weights_budget=budget, **common)
    info = report.rewritten("weights4")[-1].details["budget"]
    # the file's float constants at 4 bytes each, the transposed copy of the tied table (lm_head) once; the
    # exporter stores the 5 RMSNorm weights (all ones here) as one initializer, and adds a few float scalars
    consts = list(src.graph.initializer) + [n.attribute[0].t for n in src.graph.node if n.op_type == "Constant"]
    floats = 4 * sum(int(np.prod(t.dims)) for t in consts if t.data_type == TP.FLOAT)
    assert info["fp32_bytes"] == floats - 4 * 1024 * 64
    assert 0 <= info["fp32_bytes"] - (params - 4 * 4 * 64) < 4 * 64
    assert info["kept"]["int8"] >= 1 and info["met"]
    assert weight_bytes(mixed) <= budget * params
    assert rel(logits(mixed, held), ref) < rel(logits(out, held), ref)

"""weights4 on the shapes real models have (issue 33): AWQ with N not a multiple of 8 (padded columns + Slice) run
by the MatMulAWQ CPU kernel and by the CUDA kernel under the simulator; MatMuls whose A has an unknown rank with
Constant-node weights (quantised around Reshapes); constant weights left in float for a reason the user did not
choose (exit status 4, named on stderr); AWQ's held-out check (never worse than RTN on rows it did not fit).

Outputs are compared with the float model within the 4-bit error: the sum of the rewritten weights' relative
reconstruction errors (test_pass_weights4.bound), on enough rows that the output error concentrates near it."""
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from numba import config
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

import onnx_lowbit
from onnx_lowbit import awq
from onnx_lowbit.passes import run_passes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = bool(config.ENABLE_CUDASIM)


def rel_fro(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bound(report) -> float:
    return sum(e.details["rel_error"] for e in report.rewritten("weights4"))


def run(model, feeds, ours=True):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = (onnx_lowbit.InferenceSession if ours else ort.InferenceSession)(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    return p.returncode, p.stdout, p.stderr


def linear(n, k=256, bias=True, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = (0.1 * rng.standard_normal(n)).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["m" if bias else "y"], name="proj")]
    if bias:
        nodes.append(oh.make_node("Add", ["m", "b"], ["y"], name="proj_bias"))
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, ["B", "T", k])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["B", "T", n])],
                      [nh.from_array(w, "w")] + ([nh.from_array(b, "b")] if bias else []))
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9), w, b


@pytest.mark.parametrize("n", [161, 214])
def test_awq_n_not_multiple_of_8_cpu_kernel(n):
    model, w, b = linear(n)
    out, report = run_passes(model, passes=["weights4"], weights="awq")
    ops = [x.op_type for x in out.graph.node]
    assert ops == ["MatMulAWQ", "Slice"], ops
    node = out.graph.node[0]
    attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
    assert attrs["N"] == n + (-n) % 8 and len(node.input) == 5       # bias fused, padded with zeros
    x = np.random.default_rng(1).standard_normal((2, 32, 256)).astype(np.float32)
    (y,) = run(out, {"x": x})
    (ref,) = run(model, {"x": x}, ours=False)
    assert y.shape == (2, 32, n)
    assert rel_fro(y, ref) <= bound(report), (rel_fro(y, ref), bound(report))


@pytest.mark.parametrize("n", [161, 214])
def test_awq_n_not_multiple_of_8_cuda_kernel(n):
    """The rewritten node's arrays (N padded to a multiple of 8) through the CUDA MatMulAWQ kernel: under the
    simulator in CI, on the GPU with ONNX_LOWBIT_REAL_GPU=1. Its first N columns are the float model's output
    within the 4-bit error."""
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.awq import gemv_run_cuda
    model, w, b = linear(n, k=128)
    out, report = run_passes(model, passes=["weights4"], weights="awq")
    node = out.graph.node[0]
    attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
    inits = {t.name: nh.to_array(t) for t in out.graph.initializer}
    qw, qz, sc, bias = (inits[i] for i in node.input[1:5])
    x = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32)
    geo = {"ct": 8, "warps": 2} if SIM else {}
    y = gemv_run_cuda.run(x, (qw, qz, sc), None, bias, None, attrs["group_size"], attrs["K"], attrs["N"], **geo)
    assert y.shape == (3, attrs["N"]) and np.all(y[:, n:] == 0)   # the zero columns stay zero
    ref = x @ w + b
    assert rel_fro(y[:, :n], ref) <= 2 * bound(report), (rel_fro(y[:, :n], ref), bound(report))


def test_unknown_rank_constant_weight_quantised():
    """A Paddle-style graph: A with no shape information, the weight in a Constant node. Quantised (A flattened
    to [-1, K], the result reshaped back); rank 2 and rank 3 inputs both run."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((128, 96)) / 11).astype(np.float32)
    nodes = [oh.make_node("Constant", [], ["w"], value=nh.from_array(w, "wv")),
             oh.make_node("Relu", ["x"], ["a"]),
             oh.make_node("MatMul", ["a", "w"], ["y"], name="fc")]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, None)],
                      [oh.make_tensor_value_info("y", TP.FLOAT, None)])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)
    for fmt in ("nf4", "awq"):
        out, report = run_passes(model, passes=["weights4"], weights=fmt)
        (done,) = report.rewritten()
        assert not report.skipped() and "(A flattened)" in done.pattern and "Constant W" in done.pattern
        for shape in [(5, 128), (2, 3, 128)]:
            x = rng.standard_normal(shape).astype(np.float32)
            (y,) = run(out, {"x": x})
            ref = np.maximum(x, 0) @ w
            assert y.shape == ref.shape and rel_fro(y, ref) <= 1.5 * bound(report), (fmt, shape)


def test_unquantised_weights_are_loud(tmp_path):
    """A Gemm with transA=1 and a constant weight cannot be quantised: the CLI writes OUT, names the node on
    stderr and exits 4; --exclude makes it a choice (exit 0)."""
    rng = np.random.default_rng(4)
    nodes = [oh.make_node("Gemm", ["x", "w"], ["y"], name="odd_gemm", transA=1),
             oh.make_node("MatMul", ["y", "w2"], ["z"], name="fine")]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TP.FLOAT, [128, 4])],
                      [oh.make_tensor_value_info("z", TP.FLOAT, [4, 128])],
                      [nh.from_array(rng.standard_normal((128, 128)).astype(np.float32), "w"),
                       nh.from_array(rng.standard_normal((128, 128)).astype(np.float32), "w2")])
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9), str(src))
    rc, so, err = run_cli("rewrite", str(src), str(out), "--weights", "nf4")
    assert rc == 4 and out.exists(), so + err
    assert "1 constant weight stayed in float" in err and "odd_gemm: Gemm with transA=1" in err
    rc, so, err = run_cli("rewrite", str(src), str(out), "--weights", "nf4", "--exclude", "odd_gemm")
    assert rc == 0 and "stayed in float" not in err, so + err


def overfit_case():
    """One MatMul whose calibration rows have a huge channel 0 in the first three quarters only: AWQ's scales
    fitted there protect channel 0 at the others' expense; the held-out quarter (and the deployment data) has
    no such outlier, so there the scales lose to plain rounding."""
    rng = np.random.default_rng(5)
    k, n = 256, 128
    w = (rng.standard_normal((k, n)) / 16).astype(np.float32)
    g = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"], name="fc")], "g",
                      [oh.make_tensor_value_info("x", TP.FLOAT, ["B", k])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["B", n])], [nh.from_array(w, "w")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)
    cal = rng.standard_normal((256, k)).astype(np.float32)
    cal[:192, :8] *= 40.0
    deploy = rng.standard_normal((512, k)).astype(np.float32)
    return model, w, cal, deploy


def test_awq_never_worse_than_rtn_on_held_out_rows():
    model, w, cal, deploy = overfit_case()
    found = awq.search_scales(w, cal[:192], 128, x_holdout=cal[192:])
    assert found.alpha == 0.0 and found.holdout_awq > found.holdout_rtn          # the scales lost: RTN kept
    assert np.all(found.scales == 1)
    errs = {}
    for hold in (0.25, 0.0):   # the default (the last quarter held out) and the plain search (no held-out rows)
        out, report = run_passes(model, passes=["weights4"], weights="awq", calibration={"x": cal},
                                 awq_holdout=hold)
        (e,) = report.rewritten()
        (y,) = run(out, {"x": deploy})
        errs[hold] = rel_fro(y, deploy @ w)
        if hold:
            assert not e.details["calibrated"] and "RTN kept" in e.reason and "held-out" in e.reason
            assert e.details["heldout_mse_awq"] > e.details["heldout_mse_rtn"]
        else:
            assert e.details["calibrated"] and e.details["awq_alpha"] > 0
    assert errs[0.25] < errs[0.0], errs   # on data like the held-out rows, RTN (kept) beats the overfitted scales


def test_awq_scales_kept_when_they_win_on_held_out_rows():
    """The same layer calibrated on rows that all carry the outlier: the scales win on the held-out rows too."""
    model, w, cal, _ = overfit_case()
    cal[:, :8] = np.random.default_rng(6).standard_normal((256, 8)) * 40.0
    out, report = run_passes(model, passes=["weights4"], weights="awq", calibration={"x": cal})
    (e,) = report.rewritten()
    assert e.details["calibrated"] and e.details["heldout_mse_awq"] <= e.details["heldout_mse_rtn"]
    assert "AWQ scales alpha" in e.reason

"""The weights4 pass on torch exports (TorchScript and dynamo, fp32 and fp16), our ops against onnxruntime's own
ops on the same bytes, and the CLI's weights flags. Tolerances and helpers: tests/test_pass_weights4.py's
docstring."""
from __future__ import annotations

import io
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper as oh

from onnx_lowbit import domain
from onnx_lowbit.passes import weights4 as w4
from test_pass_weights4 import (DTYPES, FORMATS, K1, REF_TOL16, REF_TOL32, REF_TOL_AWQ32, _options, bound,
                                chain, ops, rel_fro, rewrite, run_ort, run_reference, zoo, zoo_feeds)

# ----------------------------------------------------------------------------------------------------------------
# torch exports (TorchScript and dynamo exporters, fp32 and fp16)
# ----------------------------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
nn = torch.nn


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(K1)
        self.fc1 = nn.Linear(K1, 1024)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(1024, K1)
        self.lm_head = nn.Linear(K1, 64, bias=False)

    def forward(self, x):
        return self.lm_head(self.fc2(self.act(self.fc1(self.ln(x)))))


_EXPORTS: dict = {}


def exported(exporter: str, half: bool):
    key = (exporter, half)
    if key not in _EXPORTS:
        torch.manual_seed(0)
        m = Mlp().eval()
        x = torch.randn(2, 5, K1)
        if half:
            m, x = m.half(), x.half()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                try:
                    prog = torch.onnx.export(m, (x,), dynamo=True, opset_version=18, input_names=["x"],
                                             output_names=["y"], verbose=False)
                except Exception as e:  # noqa: BLE001 - the dynamo exporter is optional (onnxscript)
                    pytest.skip(f"dynamo export unavailable: {type(e).__name__}: {str(e)[:200]}")
                model = prog.model_proto
            else:
                f = io.BytesIO()
                torch.onnx.export(m, (x,), f, dynamo=False, opset_version=17, input_names=["x"], output_names=["y"])
                model = onnx.load_from_string(f.getvalue())
        _EXPORTS[key] = (model, x.numpy())
    return _EXPORTS[key]


EXPORTS = [("torchscript", False), ("torchscript", True), ("dynamo", False), ("dynamo", True)]


@pytest.mark.parametrize("exporter, half", EXPORTS, ids=[f"{e}-{'fp16' if h else 'fp32'}" for e, h in EXPORTS])
def test_torch_export(exporter, half):
    model, x = exported(exporter, half)
    flt = run_ort(model, {"x": x})["y"]
    names = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
    head = names[-1]   # the lm_head (TorchScript: "/lm_head/MatMul"; dynamo: a generated name)
    for fmt in ("nf4", "awq"):
        out, report = rewrite(model, weights=fmt, weights_target="ort", weights_exclude=[head])
        assert [e.nodes[0] for e in report.skipped()] == [head]
        assert len(report.rewritten()) == 2
        got = run_ort(out, {"x": x})["y"]
        assert rel_fro(got, flt) <= bound(report, half=half), (fmt, rel_fro(got, flt), bound(report, half=half))
    if exporter == "torchscript":  # its node names carry the module path: the pattern "lm_head" finds the head
        _, report = rewrite(model, weights="nf4", weights_exclude="lm_head")
        assert [e.nodes[0] for e in report.skipped()] == ["/lm_head/MatMul"]
    if half:  # the lowbit target: file size
        out, report = rewrite(model, weights="nf4")
        assert len(report.rewritten()) == 3
        ratio = out.ByteSize() / model.ByteSize()
        assert ratio <= 0.3, ratio
        t = w4.totals(report)
        assert t["weights"] == 3 and 0.27 < t["ratio"] < 0.3


def _lowbit_session_available(op):
    if op not in domain.OPS:
        return f"{op} is not registered yet (domain.OPS)"
    try:
        import onnx_lowbit
        onnx_lowbit.SessionOptions()
    except Exception as e:  # noqa: BLE001
        return f"onnx_lowbit bridge unavailable: {type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_lowbit_target_runs_like_ort_target(fmt, dtype):
    """Our kernels (onnx_lowbit.InferenceSession) on the lowbit rewrite vs. stock onnxruntime on the ort rewrite and
    vs. the numpy reference, with the tolerances of the module doc (our MatMulAWQ CPU kernel, like MatMulNBits,
    keeps (q - z) * s in fp32 for fp32 models: it matches onnxruntime to ~3e-6, the fp16-rounding reference to
    ~3e-4)."""
    op = "MatMulAWQ" if fmt == "awq" else "MatMulNF4"
    why = _lowbit_session_available(op)
    if why:
        pytest.skip(why)
    import onnx_lowbit
    model = zoo(dtype)
    feeds = zoo_feeds(dtype)
    lowbit, _ = rewrite(model, **_options(fmt, "lowbit"))
    ortm, _ = rewrite(model, **_options(fmt, "ort"))
    sess = onnx_lowbit.InferenceSession(lowbit, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    ref_ort, ref_np = run_ort(ortm, feeds), run_reference(lowbit, feeds)
    tol = REF_TOL16 if dtype == np.float16 else REF_TOL_AWQ32 if fmt == "awq" else REF_TOL32
    for name in ref_ort:
        assert got[name].dtype == dtype
        assert rel_fro(got[name], ref_ort[name]) <= tol, (name, rel_fro(got[name], ref_ort[name]))
        assert rel_fro(got[name], ref_np[name]) <= tol, (name, rel_fro(got[name], ref_np[name]))


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
from helpers import cli  # noqa: E402  (the CLI in a fresh process)


def assert_bad(rc, err, needle):
    assert rc == 2, err
    assert "Traceback" not in err
    assert needle in err, err
    assert err.strip().splitlines()[-1].startswith("onnx-lowbit: error:")


@pytest.fixture(scope="module")
def chain_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    p = d / "chain.onnx"
    onnx.save(chain(), str(p))
    return d, p


def test_cli_rewrite_ort_and_calibration(chain_file):
    d, p = chain_file
    out = d / "q.onnx"
    rc, so, err = cli("rewrite", str(p), str(out), "--weights", "nf4", "--target", "ort", "--block-size", "128",
                      "--exclude", "fc2", "--exclude", "^fc1$", "--passes", "fplut", "--report")
    assert rc == 0, err
    assert "weights4: 1 weights" in so and "relative reconstruction error" in so and "fplut, weights4" in so
    m = onnx.load(str(out))
    assert ops(m).count("MatMulBnb4") == 1 and ops(m).count("MatMul") == 2
    node = next(n for n in m.graph.node if n.op_type == "MatMulBnb4")
    assert {a.name: oh.get_attribute_value(a) for a in node.attribute}["block_size"] == 128
    x = np.random.default_rng(0).standard_normal((2, 16, 256)).astype(np.float32)
    run_ort(m, {"x": x})
    cal = d / "cal.npz"
    np.savez(cal, x=np.random.default_rng(1).standard_normal((2, 16, 256)).astype(np.float32))
    out2 = d / "awq.onnx"
    rc, so, err = cli("rewrite", str(p), str(out2), "--weights", "awq", "--calibration", str(cal), "--group-size", "64",
                      "--target", "ort", "--report-json", str(d / "r.json"))
    assert rc == 0, err
    import json
    entries = json.load(open(d / "r.json"))["entries"]
    w4e = [e["details"] for e in entries if e["pass_name"] == "weights4"]
    assert len(w4e) == 3 and all(d["heldout_mse_rtn"] is not None for d in w4e)
    # a layer keeps its searched scales only when they beat RTN on the held-out rows
    assert all(d["calibrated"] == (d["awq_alpha"] > 0) and d["heldout_mse_awq"] <= d["heldout_mse_rtn"]
               for d in w4e if d["calibrated"])
    assert all(e["details"]["group_size"] == 64 for e in entries if e["action"] == "rewritten")
    run_ort(onnx.load(str(out2)), {"x": x})
    rc, so, err = cli("inspect", str(p), "--weights", "fp4")
    assert rc == 0 and "fp4: MatMul(A, W)" in so and "weights4: 3 weights" in so, so + err


def test_cli_errors(chain_file):
    d, p = chain_file
    out = str(d / "bad.onnx")
    bad_npz = d / "bad.npz"
    bad_npz.write_bytes(b"not a zip")
    np.savez(d / "names.npz", y=np.zeros((1, 16, 256), np.float32))
    np.savez(d / "shape.npz", x=np.zeros((1, 8, 256), np.float32))
    np.save(d / "single.npy", np.zeros(3, np.float32))
    cases = [
        (["--weights", "nf4", "--block-size", "48"], "block_size: 48"),
        (["--block-size", "64"], "--block-size needs --weights"),
        (["--weights", "awq", "--calibration", str(d / "missing.npz")], "missing.npz: no such file"),
        (["--weights", "awq", "--calibration", str(bad_npz)], "not a readable .npz"),
        (["--weights", "awq", "--calibration", str(d / "names.npz")], "'y' names no model input"),
        (["--weights", "awq", "--calibration", str(d / "single.npy")], "a single .npy array"),
        (["--weights", "awq", "--calibration", str(d / "shape.npz")], "has shape [1, 8, 256]"),
        (["--weights", "nf4", "--calibration", str(d / "shape.npz")], "only used by --weights awq"),
        (["--weights", "nf4", "--exclude", "(x"], "weights_exclude"),
    ]
    for extra, needle in cases:
        rc, _, err = cli("rewrite", str(p), out, *extra)
        assert_bad(rc, err, needle)
        assert not os.path.exists(out)
    rc, _, err = cli("rewrite", str(p), out, "--weights", "int8")
    assert rc == 2 and "invalid choice" in err and "Traceback" not in err

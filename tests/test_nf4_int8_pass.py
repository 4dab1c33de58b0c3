"""MatMulNF4's accuracy_level in the rewrite: weights4's option weights_nf4_accuracy, the CLI's --nf4-accuracy-level,
what merge and ffn keep of it, and --device cpu's default for nf4 / fp4 (onnx_lowbit/cpu_passes.py's CPU_WEIGHTS)."""
import json

import numpy as np
import onnx
import pytest

import onnx_lowbit
from onnx_lowbit import cpu_passes, model_io, samples
from onnx_lowbit.passes import run_passes

from helpers import cli
from test_cpu_ort_target import K, ops, qkv


def levels(model, op="MatMulNF4"):
    out = []
    for n in model.graph.node:
        if n.op_type == op:
            lv = [a.i for a in n.attribute if a.name == "accuracy_level"]
            out.append(lv[0] if lv else None)
    return out


def run(model, feeds):
    return onnx_lowbit.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]


def test_option_writes_the_level_and_merge_keeps_it():
    m = qkv()
    x = np.random.default_rng(1).standard_normal((1, 5, K)).astype(np.float32)
    got = {}
    for lvl in (None, 0, 4):
        opts = dict(weights="nf4") | ({} if lvl is None else dict(weights_nf4_accuracy=lvl))
        out, rep = run_passes(m, passes=["weights4", "merge"], **opts)
        onnx.checker.check_model(out, full_check=True)
        assert ops(out) >= {"MatMulNF4", "Split"} and levels(out) == [lvl]     # merged: one node, the level kept
        entries = rep.rewritten("weights4")
        assert len(entries) == 3
        if lvl is None:
            assert all("accuracy_level" not in e.details for e in entries)
        else:
            assert all(e.details["accuracy_level"] == lvl and f"MatMulNF4 accuracy_level {lvl}" in e.reason
                       for e in entries)
        got[lvl] = run(out, {"x": x})
    np.testing.assert_array_equal(got[None], got[0])
    rel = np.linalg.norm(got[4] - got[0]) / np.linalg.norm(got[0])
    assert 0 < rel < 0.02, rel


def test_option_errors_and_the_k_note():
    m = qkv()
    for opts, needle in ((dict(weights="awq", weights_nf4_accuracy=4), "needs weights='nf4' or 'fp4'"),
                         (dict(weights="nf4", weights_target="ort", weights_nf4_accuracy=4), "weights_target='lowbit'"),
                         (dict(weights="fp4", weights_nf4_accuracy=5), "is not one of 0, 1, 2, 3, 4"),
                         (dict(weights="nf4", weights_nf4_accuracy="x"), "must be an integer")):
        with pytest.raises(ValueError, match="weights_nf4_accuracy") as e:
            run_passes(m, passes=["weights4"], **opts)
        assert needle in str(e.value)


def test_ffn_fuses_with_the_level():
    model = model_io.load(samples.path("llama_mlp.onnx"))
    out, _ = run_passes(model, passes=["weights4", "ffn"], weights="nf4", weights_nf4_accuracy=4)
    assert levels(out, "FusedFFNNF4") == [4, 4] and levels(out) == [4, 4]      # the down projections stay MatMulNF4
    x = np.random.default_rng(0).standard_normal((1, 3, 128)).astype(np.float32)
    ref, _ = run_passes(model, passes=["weights4"], weights="nf4", weights_nf4_accuracy=4)
    np.testing.assert_allclose(run(out, {"x": x}), run(ref, {"x": x}), rtol=1e-4, atol=1e-4)


def test_cpu_table_default_for_nf4():
    for fmt in ("nf4", "fp4"):
        out, note = cpu_passes.cpu_weights_options({"weights": fmt})
        assert out["weights_target"] == "lowbit" and out["weights_nf4_accuracy"] == 4
        assert "weights_ort_accuracy" not in out
        assert f"--device cpu --weights {fmt}: our MatMulNF4 at accuracy_level 4" in note
    out, note = cpu_passes.cpu_weights_options({"weights": "nf4", "weights_nf4_accuracy": 0})
    assert out["weights_nf4_accuracy"] == 0 and "accuracy_level 0 as asked; 4 is the CPU default" in note
    out, _ = cpu_passes.cpu_weights_options({"weights": "awq"})
    assert "weights_nf4_accuracy" not in out


def test_cli_flag_summary_and_device_default(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(qkv(), src)
    rc, out, err = cli("rewrite", str(src), str(tmp_path / "a.onnx"), "--weights", "nf4", "--nf4-accuracy-level", "4",
                       "--report-json", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert levels(onnx.load(tmp_path / "a.onnx")) == [4] and "MatMulNF4, accuracy_level 4" in out
    entries = [e for e in json.loads((tmp_path / "r.json").read_text())["entries"]
               if e["pass_name"] == "weights4" and e["action"] == "rewritten"]
    assert len(entries) == 3 and all(e["details"]["accuracy_level"] == 4 for e in entries)
    rc, out, err = cli("rewrite", str(src), str(tmp_path / "b.onnx"), "--device", "cpu", "--weights", "fp4")
    assert rc == 0, err
    assert "--device cpu --weights fp4: our MatMulNF4 at accuracy_level 4" in err
    assert levels(onnx.load(tmp_path / "b.onnx")) == [4] and "MatMulNF4, accuracy_level 4" in out
    rc, out, err = cli("rewrite", str(src), str(tmp_path / "c.onnx"), "--device", "cpu", "--weights", "nf4",
                       "--nf4-accuracy-level", "0")
    assert rc == 0 and levels(onnx.load(tmp_path / "c.onnx")) == [0] and "accuracy_level 0 as asked" in err
    rc, out, err = cli("rewrite", str(src), str(tmp_path / "d.onnx"), "--weights", "nf4")   # no --device: not written
    assert rc == 0 and levels(onnx.load(tmp_path / "d.onnx")) == [None] and "accuracy_level" not in out


def test_cli_bad_combinations(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(qkv(), src)
    for args, needle in ((["--nf4-accuracy-level", "4"], "--nf4-accuracy-level needs --weights"),
                         (["--weights", "awq", "--nf4-accuracy-level", "4"], "--ort-accuracy-level is MatMulNBits'"),
                         (["--weights", "nf4", "--target", "ort", "--nf4-accuracy-level", "4"], "MatMulBnb4"),
                         (["--weights", "nf4", "--nf4-accuracy-level", "7"], "invalid choice")):
        rc, _, err = cli("rewrite", str(src), str(tmp_path / "q.onnx"), *args)
        assert rc == 2 and needle in err and "Traceback" not in err, (args, err)
        assert not (tmp_path / "q.onnx").exists()

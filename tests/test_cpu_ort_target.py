"""MatMulNBits' accuracy_level (weights4's weights_ort_accuracy, CLI --ort-accuracy-level) and --device cpu's
4-bit target (onnx_lowbit/cpu_passes.py's CPU_WEIGHTS): onnxruntime's MatMulNBits at accuracy_level 4 for AWQ,
our MatMulNF4 for NF4 / FP4 (never converted to int4)."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_lowbit import api, cpu_passes
from onnx_lowbit.passes import run_passes

K, N = 256, 96


def qkv(seed=0):
    """x [1, seq, K] -> three sibling MatMuls (merge packs them into one product + Split) -> their sum."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((K, N)) * 0.05).astype(np.float32), f"w{i}")
             for i in range(3)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}") for i in range(3)]
    nodes += [helper.make_node("Add", ["y0", "y1"], ["s"]), helper.make_node("Add", ["s", "y2"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", N])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def nbits_levels(model):
    """accuracy_level of every MatMulNBits node (None where not written)."""
    out = []
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            lv = [a.i for a in n.attribute if a.name == "accuracy_level"]
            out.append(lv[0] if lv else None)
    return out


def ops(model):
    return {n.op_type for n in model.graph.node}


def run(model, x):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


@pytest.mark.parametrize("form", ["awq", "compact"])
def test_accuracy_level_written_in_both_forms_and_close_to_level_0(form):
    m = qkv()
    x = np.random.default_rng(1).standard_normal((1, 5, K)).astype(np.float32)
    got = {}
    for lvl in (None, 0, 4):
        opts = dict(weights="awq", weights_target="ort", weights_ort_form=form)
        if lvl is not None:
            opts["weights_ort_accuracy"] = lvl
        out, rep = run_passes(m, passes=["weights4", "merge"], **opts)
        assert ops(out) >= {"MatMulNBits", "Split"}             # merged: the attribute survives the merge
        assert nbits_levels(out) == [lvl], nbits_levels(out)
        entries = rep.rewritten("weights4")
        assert len(entries) == 3 and all(e.details["accuracy_level"] == (lvl or 0) for e in entries)
        if lvl == 4:
            assert all("MatMulNBits accuracy_level 4 (int8 activations)" in e.reason for e in entries)
        got[lvl] = run(out, x)
    np.testing.assert_array_equal(got[None], got[0])            # not written = onnxruntime's 0
    rel = np.linalg.norm(got[4] - got[0]) / np.linalg.norm(got[0])
    assert 0 < rel < 0.02, rel                                  # int8 activations: close, not the same arithmetic


def test_accuracy_option_errors():
    m = qkv()
    for opts, needle in ((dict(weights="awq", weights_ort_accuracy=4), "needs weights='awq' and weights_target='ort'"),
                         (dict(weights="nf4", weights_target="ort", weights_ort_accuracy=4), "MatMulBnb4"),
                         (dict(weights="awq", weights_target="ort", weights_ort_accuracy=5), "is not one of 0, 1"),
                         (dict(weights="awq", weights_target="ort", weights_ort_accuracy="x"), "must be an integer")):
        with pytest.raises(ValueError, match="weights_ort_accuracy") as e:
            run_passes(m, passes=["weights4"], **opts)
        assert needle in str(e.value)


def test_cpu_weights_table_choices():
    out, note = cpu_passes.cpu_weights_options({"weights": "awq"})
    assert out["weights_target"] == "ort" and out["weights_ort_accuracy"] == 4
    assert "int8 activations: onnxruntime's fastest CPU 4-bit kernel; --target lowbit keeps our MatMulAWQ" in note
    assert note.startswith(out["weights_target_why"]) and "; measured: " in note    # the report's note, the figures
    for fmt in ("nf4", "fp4"):       # NF4 / FP4 are never re-quantised to int4; our MatMulNF4 measured faster
        out, note = cpu_passes.cpu_weights_options({"weights": fmt})
        assert out["weights_target"] == "lowbit" and "weights_ort_accuracy" not in out and "MatMulNF4" in note
    same = {"weights": "awq", "weights_target": "lowbit"}
    assert cpu_passes.cpu_weights_options(same) == (same, "")        # an explicit target is kept
    assert cpu_passes.cpu_weights_options({}) == ({}, "")
    out, note = cpu_passes.cpu_weights_options({"weights": "awq", "group_size": 100})
    assert out["weights_target"] == "lowbit" and "group size 100" in note
    out, note = cpu_passes.cpu_weights_options({"awq_checkpoint": "x.safetensors"})
    assert out["weights_target"] == "lowbit" and "--awq-checkpoint keeps our MatMulAWQ" in note
    out, note = cpu_passes.cpu_weights_options({"weights": "awq", "weights_ort_accuracy": 0})
    assert out["weights_ort_accuracy"] == 0 and "accuracy_level 0 as asked" in note


def test_api_device_cpu_awq_is_matmulnbits_level_4():
    out, report = api.rewrite(qkv(), device="cpu", weights="awq")
    assert "MatMulNBits" in ops(out) and nbits_levels(out) == [4]
    assert all("--device cpu --weights awq: onnxruntime's MatMulNBits at accuracy_level 4" in e.reason
               for e in report.rewritten("weights4"))
    out, _ = api.rewrite(qkv(), device="cpu", weights="awq", weights_target="lowbit")
    assert "MatMulAWQ" in ops(out) and "MatMulNBits" not in ops(out)


from helpers import cli  # noqa: E402  (the CLI in a fresh process)


def test_cli_device_cpu_picks_ort_level_4_and_says_so(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(qkv(), src)
    rc, out, err = cli("rewrite", str(src), str(tmp_path / "a.onnx"), "--device", "cpu", "--weights", "awq",
                       "--report-json", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert ("--device cpu --weights awq: onnxruntime's MatMulNBits at accuracy_level 4 (int8 activations: "
            "onnxruntime's fastest CPU 4-bit kernel; --target lowbit keeps our MatMulAWQ") in err
    assert "onnxruntime's MatMulNBits, accuracy_level 4" in out   # the summary and report say the level
    entries = [e for e in json.loads((tmp_path / "r.json").read_text())["entries"]
               if e["pass_name"] == "weights4" and e["action"] == "rewritten"]
    assert len(entries) == 3 and all(e["details"]["accuracy_level"] == 4 for e in entries)
    assert all("MatMulNBits accuracy_level 4 (int8 activations)" in e["reason"] and
               "--device cpu --weights awq: onnxruntime's MatMulNBits" in e["reason"] for e in entries)
    assert nbits_levels(onnx.load(tmp_path / "a.onnx")) == [4]
    rc, _, err = cli("rewrite", str(src), str(tmp_path / "b.onnx"), "--device", "cpu", "--weights", "awq",
                     "--target", "lowbit")
    assert rc == 0 and "MatMulNBits" not in err and "MatMulAWQ" in ops(onnx.load(tmp_path / "b.onnx"))
    rc, _, err = cli("rewrite", str(src), str(tmp_path / "c.onnx"), "--device", "cpu", "--weights", "nf4")
    assert rc == 0 and "our MatMulNF4" in err and "MatMulNF4" in ops(onnx.load(tmp_path / "c.onnx"))
    rc, _, err = cli("rewrite", str(src), str(tmp_path / "d.onnx"), "--weights", "awq", "--target", "ort",
                     "--ort-form", "compact", "--ort-accuracy-level", "2")
    assert rc == 0, err
    assert nbits_levels(onnx.load(tmp_path / "d.onnx")) == [2]
    rc, _, err = cli("rewrite", str(src), str(tmp_path / "e.onnx"), "--weights", "awq")   # no --device: ours
    assert rc == 0 and "MatMulAWQ" in ops(onnx.load(tmp_path / "e.onnx"))


def test_cli_accuracy_level_bad_combinations(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(qkv(), src)
    for args, needle in ((["--ort-accuracy-level", "4"], "--ort-accuracy-level needs --weights"),
                         (["--weights", "awq", "--ort-accuracy-level", "4"], "it needs --weights awq --target ort"),
                         (["--weights", "awq", "--target", "lowbit", "--ort-accuracy-level", "4"],
                          "it needs --weights awq --target ort"),
                         (["--weights", "nf4", "--target", "ort", "--ort-accuracy-level", "4"], "MatMulBnb4"),
                         (["--device", "cpu", "--weights", "nf4", "--ort-accuracy-level", "4"], "MatMulBnb4"),
                         (["--weights", "awq", "--target", "ort", "--ort-accuracy-level", "7"], "invalid choice")):
        rc, _, err = cli("rewrite", str(src), str(tmp_path / "q.onnx"), *args)
        assert rc == 2 and needle in err and "Traceback" not in err, (args, err)
        assert not (tmp_path / "q.onnx").exists()

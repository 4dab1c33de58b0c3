"""--verify: inputs made consistent with the graph (onnx_lowbit.feeds), the user's data (--verify-data, partial
arrays completed), --dim, the per-output figures, --verify-tol, and a failed verify keeping OUT.unverified.onnx.
The LLM exports (optimum-style past KV) are in tests/test_llm_fidelity.py."""
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from onnx_lowbit import cli, feeds, verify
from onnx_lowbit.errors import LowbitError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "samples", "tiny_yolo.onnx")


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "onnx_lowbit.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600)
    return p.returncode, p.stdout, p.stderr


def lm_like():
    """ids -> Gather(embedding [50, 8]) -> + past-mask sum -> logits: inputs shaped like an LLM export with a
    KV cache (dims 'batch', 'seq', 'past', 'past + seq')."""
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((50, 8)).astype(np.float32)
    w = rng.standard_normal((8, 50)).astype(np.float32)
    nodes = [oh.make_node("Gather", ["emb", "input_ids"], ["h"], axis=0),
             oh.make_node("Gather", ["pos_table", "position_ids"], ["p"], axis=0),
             oh.make_node("Add", ["h", "p"], ["hp"]),
             oh.make_node("MatMul", ["hp", "w"], ["logits"]),
             oh.make_node("Concat", ["past", "hp4"], ["present"], axis=2),
             oh.make_node("Unsqueeze", ["hp", "one"], ["hp4"]),
             oh.make_node("Cast", ["attention_mask"], ["mf"], to=TP.FLOAT),
             oh.make_node("ReduceSum", ["mf"], ["msum"], keepdims=0)]
    inputs = [oh.make_tensor_value_info("input_ids", TP.INT64, ["batch", "seq"]),
              oh.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "past + seq"]),
              oh.make_tensor_value_info("position_ids", TP.INT64, ["batch", "seq"]),
              oh.make_tensor_value_info("past", TP.FLOAT, ["batch", 1, "past", 8])]
    outputs = [oh.make_tensor_value_info("logits", TP.FLOAT, ["batch", "seq", 50]),
               oh.make_tensor_value_info("present", TP.FLOAT, ["batch", 1, "past + seq", 8]),
               oh.make_tensor_value_info("msum", TP.FLOAT, [])]
    inits = [nh.from_array(emb, "emb"), nh.from_array(w, "w"), nh.from_array(np.array([1], np.int64), "one"),
             nh.from_array(rng.standard_normal((20, 8)).astype(np.float32), "pos_table")]
    return oh.make_model(oh.make_graph(nodes, "lm", inputs, outputs, inits),
                         opset_imports=[oh.make_opsetid("", 17)], ir_version=9)


def test_made_up_inputs_are_consistent():
    m = lm_like()
    got, values, made_up = feeds.make_feeds(m, dims={"seq": 5, "past": 7})
    assert values == {"batch": 1, "seq": 5, "past": 7, "past + seq": 12}
    assert got["attention_mask"].shape == (1, 12) and np.all(got["attention_mask"] == 1)
    assert np.array_equal(got["position_ids"], [[7, 8, 9, 10, 11]])          # counting from the past length
    assert got["input_ids"].min() >= 0 and got["input_ids"].max() < 50     # within the Gather's table
    assert got["past"].shape == (1, 1, 7, 8) and sorted(made_up) == sorted(got)
    errors, _ = verify.compare(m, m, feeds=got)
    assert all(e.ok and e.rel == 0 for e in errors)
    logits = next(e for e in errors if e.name == "logits")
    assert logits.top1 == 1.0 and logits.rows == 5
    assert next(e for e in errors if e.name == "present").top1 is None  # not logit-like
    # a state output beside the logits is shown, not held to the tolerance (4-bit weights move an LLM's KV cache
    # much more than its logits); a NaN there still fails
    m2 = lm_like()
    nodes = m2.graph.node
    concat = next(n for n in nodes if n.op_type == "Concat")
    concat.input[1] = "hp4b"
    nodes.append(oh.make_node("Mul", ["hp4", "two"], ["hp4b"]))
    m2.graph.initializer.append(nh.from_array(np.array(2.0, np.float32), "two"))
    errors, _ = verify.compare(m, m2, feeds=got)
    present = next(e for e in errors if e.name == "present")
    assert present.rel > 0.1 and not present.checked and present.ok and all(e.ok for e in errors)
    assert "not checked" in verify.format_errors(errors, 0.02)
    m2.graph.initializer[-1].CopyFrom(nh.from_array(np.array(np.nan, np.float32), "two"))
    errors, _ = verify.compare(m, m2, feeds=got)
    assert not next(e for e in errors if e.name == "present").ok


def test_index_ranges_and_defaults():
    m = lm_like()
    assert feeds.index_ranges(m) == {"input_ids": 50, "position_ids": 20}
    values = feeds.resolve_dims(feeds.signature(m))
    assert values["batch"] == 1 and values["past"] == feeds.DEFAULT_PAST
    assert values["past + seq"] == values["past"] + values["seq"]


def test_dim_errors():
    sig = feeds.signature(lm_like())
    with pytest.raises(LowbitError, match="no input has such a symbolic dimension"):
        feeds.resolve_dims(sig, {"nope": 3})
    with pytest.raises(LowbitError, match="'past \\+ seq' is 9"):
        feeds.resolve_dims(sig, {"past + seq": 9, "past": 2, "seq": 3})
    with pytest.raises(LowbitError, match="VALUE an integer"):
        feeds.parse_dims(["seq"])
    # the user's arrays fix dims; two of them disagreeing is named
    with pytest.raises(LowbitError, match="'seq' is 3 in array 'input_ids' but 4"):
        feeds.dims_of(sig, {"input_ids": np.zeros((1, 3), np.int64), "position_ids": np.zeros((1, 4), np.int64)})


def cnn(h="height", w="width"):
    """Conv (stride 2) -> Upsample x2 -> Concat with the input: needs even H, W (a 2x2 image is fine, 3x3 not)."""
    rng = np.random.default_rng(1)
    nodes = [oh.make_node("Conv", ["x", "k"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
             oh.make_node("Resize", ["c", "", "scales"], ["u"], mode="nearest"),
             oh.make_node("Concat", ["x", "u"], ["cat"], axis=1),
             oh.make_node("Sigmoid", ["cat"], ["sg"]), oh.make_node("Mul", ["cat", "sg"], ["y"])]
    g = oh.make_graph(nodes, "cnn", [oh.make_tensor_value_info("x", TP.FLOAT, ["N", 3, h, w])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["N", 7, h, w])],
                      [nh.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "k"),
                       nh.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)


def test_cnn_with_symbolic_image_size(tmp_path):
    src, out = tmp_path / "cnn.onnx", tmp_path / "cnn.lowbit.onnx"
    onnx.save(cnn(), str(src))
    rc, so, err = run_cli("rewrite", str(src), str(out), "--verify")
    assert rc == 0, so + err
    assert "x [1, 3, 224, 224]" in so and "height=224" in so and "ok" in so and out.exists()
    rc, so, err = run_cli("rewrite", str(src), str(out), "--dim", "height=64", "--dim", "width=32")  # implies --verify
    assert rc == 0 and "x [1, 3, 64, 32]" in so, so + err
    rc, so, err = run_cli("rewrite", str(src), str(out), "--dim", "height=63")  # the model cannot run on it
    assert rc == 1 and "could not run the original model" in err and "--dim" in err, so + err
    assert (tmp_path / "cnn.lowbit.unverified.onnx").exists()
    rc, so, err = run_cli("rewrite", str(src), str(out), "--dim", "depth=3")
    assert rc == 2 and "depth" in err and "height, width" in err and "Traceback" not in err


def test_verify_data_partial_and_bad(tmp_path):
    m = lm_like()
    src, out = tmp_path / "lm.onnx", tmp_path / "o.onnx"
    onnx.save(m, str(src))
    np.savez(tmp_path / "ids.npz", input_ids=np.array([[1, 2, 3, 49]], np.int64))
    rc, so, err = run_cli("rewrite", str(src), str(out), "--verify-data", str(tmp_path / "ids.npz"),
                          "--dim", "past=4")
    assert rc == 0, so + err
    assert "ids.npz (--verify-data)" in so and "input_ids [1, 4], attention_mask [1, 8] (made up)" in so
    np.savez(tmp_path / "bad.npz", nope=np.zeros(3))
    rc, _, err = run_cli("rewrite", str(src), str(out), "--verify-data", str(tmp_path / "bad.npz"))
    assert rc == 2 and "'nope' names no model input" in err
    rc, _, err = run_cli("rewrite", str(src), str(out), "--verify-data", str(tmp_path / "missing.npz"))
    assert rc == 2 and "missing.npz: no such file (--verify-data)" in err


def test_failed_verify_keeps_the_rewrite(tmp_path):
    out = tmp_path / "y.onnx"
    rc, so, err = run_cli("rewrite", SAMPLE, str(out), "--verify", "--verify-tol", "1e-9")
    assert rc == 1 and "FAIL" in so and not out.exists()
    kept = tmp_path / "y.unverified.onnx"
    assert kept.exists() and "kept as" in err and str(kept) in err
    assert any(n.op_type == "FPLUT" for n in onnx.load(str(kept)).graph.node)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".onnx-lowbit-")]
    assert cli.unverified_path("a/b.onnx") == "a/b.unverified.onnx" and cli.unverified_path("m") == "m.unverified.onnx"


def test_figures():
    a = np.array([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]], np.float32)
    b = np.array([[1.0, 2.0, 3.0], [0.5, 0.1, 0.2]], np.float32)
    e = verify.compare_arrays("logits", a, b, tolerance=0.5)
    assert e.top1 == 0.5 and e.rows == 2 and e.max_abs == 1.0 and e.ok
    assert abs(e.rel - np.sqrt(2) / np.linalg.norm(a)) < 1e-6 and abs(e.max_rel - 1 / 3) < 1e-6
    e = verify.compare_arrays("y", a, np.where(a > 2, np.nan, a), tolerance=10)
    assert not e.ok and e.mismatched_nan == 1
    e = verify.compare_arrays("y", a, a[:1], tolerance=10)
    assert not e.ok and "shape" in e.note
    assert "top-1" in verify.format_errors([verify.compare_arrays("logits", a, b, 0.5)], 0.5)


def _sigmoid_model(shift, extra=0.0):
    """y = Reshape(Sigmoid(x - shift)) (+ extra: a made-up rewrite's error of that size)."""
    from onnx import TensorProto as TP, helper as h
    nodes = [h.make_node("Sub", ["x", "s"], ["t"]), h.make_node("Sigmoid", ["t"], ["p"]),
             h.make_node("Reshape", ["p", "shape"], ["y" if not extra else "q"])]
    inits = [nh.from_array(np.array(shift, np.float32), "s"), nh.from_array(np.array([1, -1], np.int64), "shape")]
    if extra:
        nodes.append(h.make_node("Add", ["q", "e"], ["y"]))
        inits.append(nh.from_array(np.array(extra, np.float32), "e"))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [1, 1, 32, 32])],
                     [h.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)


def test_near_zero_outputs_judged_against_a_floor_of_their_range():
    """A probability map near zero everywhere (a detector on random images): an absolute error of 2.7e-5 is a
    rel-L2 of several units, yet nothing is wrong; judged against 1% of the Sigmoid's range it passes, and the
    table says so. An error that matters on that scale (1e-3 everywhere) still fails; outputs that are not near
    zero are judged by rel-L2 as before."""
    m = _sigmoid_model(12.0)
    assert verify.output_ranges(m) == {"y": 1.0}
    errors, _ = verify.compare(m, _sigmoid_model(12.0, 2.7e-5))
    (e,) = errors
    assert e.rel > 1 and e.ok and e.floor == pytest.approx(0.01)
    assert e.judged == pytest.approx(2.7e-5 / 0.01, rel=1e-3)
    text = verify.format_errors(errors, 0.02)
    assert "ok (near zero: 0.0027 against the floor 0.01)" in text and "floor: an output whose RMS is under" in text
    (e,) = verify.compare(m, _sigmoid_model(12.0, 1e-3))[0]
    assert not e.ok and e.judged == pytest.approx(0.1, rel=1e-3)
    # not near zero (Sigmoid(x) ~ 0.5): plain rel-L2, no floor
    (e,) = verify.compare(_sigmoid_model(0.0), _sigmoid_model(0.0, 2.7e-5))[0]
    assert e.ok and e.floor is None and e.judged is None
    # no bound known (no Sigmoid): the floor is 1% of max |a|, which a near-constant output never goes under
    a = np.full(100, 1e-5)
    e = verify.compare_arrays("y", a, a + 2.7e-5, 0.02)
    assert not e.ok and e.floor is None


def test_unnamed_dims_set_by_input_and_axis(tmp_path):
    """Free dims with no name ('?') are set with --dim INPUT:AXIS=VALUE, in rewrite --verify as in bench."""
    from onnx import TensorProto as TP, helper as h
    x = h.make_tensor_value_info("x", TP.FLOAT, [None, 8, None])
    x.type.tensor_type.shape.dim[0].Clear()
    x.type.tensor_type.shape.dim[2].Clear()
    g = h.make_graph([h.make_node("Sigmoid", ["x"], ["s"]), h.make_node("Mul", ["x", "s"], ["y"])], "g", [x],
                     [h.make_tensor_value_info("y", TP.FLOAT, None)])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    got, values, _ = feeds.make_feeds(m, dims=feeds.parse_dims(["x:2=5", "x:0=3"]))
    assert got["x"].shape == (3, 8, 5) and values == {"x:0": 3, "x:2": 5}
    assert feeds.make_feeds(m)[0]["x"].shape == (1, 8, 16)
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    rc, out, err = run_cli("rewrite", str(src), str(tmp_path / "o.onnx"), "--dim", "x:2=5")
    assert rc == 0, err
    assert "made-up inputs (--verify-data FILE.npz for real ones): x [1, 8, 5]; dims: x:0=1, x:2=5" in out
    rc, out, err = run_cli("rewrite", str(src), str(tmp_path / "p.onnx"), "--dim", "x:1=5")
    assert rc == 2 and "--dim x:1: axis 1 of input 'x' is fixed at 8" in err
    rc, out, err = run_cli("rewrite", str(src), str(tmp_path / "p.onnx"), "--dim", "n=5")
    assert rc == 2 and "symbolic dims: none; unnamed ones ('?') by INPUT:AXIS: x:0, x:2" in err


def test_verify_on_a_calibration_file_of_several_runs(tmp_path):
    """--calibration FILE with NAME#K keys (one run per utterance, the gru pass's format: docs/gru.md) is also
    --verify's data when no --verify-data is given; verify runs its first run (it stopped before the rewrite with
    "arrays 'x#0', 'x#1' name no model input", as on the speech denoiser of tests/data). --verify-data with such a
    file does the same."""
    from onnx import TensorProto as TP, helper as h
    rng = np.random.default_rng(0)
    w = [nh.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
         for n, s in (("W", (1, 48, 8)), ("R", (1, 48, 16)), ("B", (1, 96)))]
    nodes = [h.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             h.make_node("GRU", ["xt", "W", "R", "B"], ["Y"], hidden_size=16),
             h.make_node("Sigmoid", ["Y"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [1, "t", 8])],
                     [h.make_tensor_value_info("y", TP.FLOAT, ["t", 1, 1, 16])], w)
    src = tmp_path / "m.onnx"
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9), src)
    np.savez(tmp_path / "cal.npz", **{"x#0": rng.standard_normal((1, 5, 8)).astype(np.float32),
                                      "x#1": rng.standard_normal((1, 7, 8)).astype(np.float32)})
    for flag in ("--calibration", "--verify-data"):
        rc, out, err = run_cli("rewrite", str(src), str(tmp_path / "o.onnx"), "--verify", flag,
                               str(tmp_path / "cal.npz"))
        assert rc == 0, out + err
        assert f"cal.npz ({flag}, its first run of 2): x [1, 5, 8]; dims: t=5" in out and "ok" in out, out
    arrays = {"x#1": np.ones(2), "x#0": np.zeros(3), "mask": np.ones(4), "plain": np.ones(1)}
    got, runs = feeds.first_run(arrays)
    assert runs == 2 and set(got) == {"x", "mask", "plain"} and got["x"].shape == (3,)
    one = {"x": np.ones(2), "y#z": np.ones(1)}       # no run numbers: as it is
    got, runs = feeds.first_run(one)
    assert runs == 1 and got is one


def _softmax_model(axis, opset, rank=3, name="out"):
    """out = Softmax(x @ w, axis) (+ a second output, feat = x @ w): a recogniser's per-step probabilities."""
    from onnx import TensorProto as TP, helper as h
    shape = [2, 6, 5][3 - rank:]
    w = nh.from_array(np.random.default_rng(1).standard_normal((5, 5)).astype(np.float32), "w")
    nodes = [h.make_node("MatMul", ["x", "w"], ["feat"]), h.make_node("Softmax", ["feat"], ["sm"], axis=axis),
             h.make_node("Identity", ["sm"], [name])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, shape)],
                     [h.make_tensor_value_info(name, TP.FLOAT, shape),
                      h.make_tensor_value_info("feat", TP.FLOAT, shape)], [w])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=8)


def test_softmax_outputs_get_top1_whatever_their_name():
    """A Softmax over the last axis (PaddleOCR's recogniser: 'softmax_11.tmp_0', [N, T, 6625], opset 12, axis 2) is
    per-row class probabilities: top-1 is given though no name pattern matches; a Softmax over another axis is
    not; the model's other outputs stay checked (only logit-like names make them 'not checked')."""
    assert verify.softmax_outputs(_softmax_model(2, 12)) == {"out"}
    assert verify.softmax_outputs(_softmax_model(-1, 17)) == {"out"}
    assert verify.softmax_outputs(_softmax_model(1, 12)) == set()          # axis 1 of a rank-3 output
    assert verify.softmax_outputs(_softmax_model(1, 11, rank=2)) == {"out"}  # the classifier's [N, 2]
    m = _softmax_model(2, 12)
    x = np.random.default_rng(2).standard_normal((2, 6, 5)).astype(np.float32)
    errors, _ = verify.compare(m, m, feeds={"x": x})
    out, feat = errors
    assert out.top1 == 1.0 and out.rows == 12 and feat.top1 is None and feat.checked and out.checked
    assert "12 rows of out" in verify.format_errors(errors, 0.02)
    (out, _), _ = verify.compare(_softmax_model(1, 12), _softmax_model(1, 12), feeds={"x": x})
    assert out.top1 is None


def test_dims_named_question_mark_are_free_dims(tmp_path):
    """Paddle exports name every unknown size '?' (PP-OCR's text-direction classifier: x [-1, 3, '?', '?']); two
    such dims are two free dims, not one: --verify-data with a 48 x 192 image stopped with "dim '?' is 48 in array
    'x' but 192 in 'x'". They are addressed as INPUT:AXIS, like dims with no name."""
    from onnx import TensorProto as TP, helper as h
    g = h.make_graph([h.make_node("Sigmoid", ["x"], ["s"]), h.make_node("Mul", ["x", "s"], ["y"])], "g",
                     [h.make_tensor_value_info("x", TP.FLOAT, [-1, 3, "?", "?"])],
                     [h.make_tensor_value_info("y", TP.FLOAT, [-1, 3, "?", "?"])])
    src = tmp_path / "m.onnx"
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9), src)
    assert feeds.signature(onnx.load(src))["x"][1] == [None, 3, None, None]
    np.savez(tmp_path / "img.npz", x=np.random.default_rng(0).standard_normal((2, 3, 48, 192)).astype(np.float32))
    rc, out, err = run_cli("rewrite", str(src), str(tmp_path / "o.onnx"), "--verify-data", str(tmp_path / "img.npz"))
    assert rc == 0, out + err
    assert "x [2, 3, 48, 192]; dims: x:0=2, x:2=48, x:3=192" in out and "ok" in out, out

"""Models with external data are rewritten streaming (weights read one at a time, new ones written as they are
made), give the same bytes as the in-memory path, never modify the input, and leave nothing behind on failure.
The memory figure for a model over 2 GB comes from benchmarks/big_model.py (docs/reliability.md)."""
import hashlib
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_lowbit import cli, model_io, nf4
from onnx_lowbit.passes import run_passes, weights4_quant


def build(folder, layers=2, d=1024, f=3584, dtype=np.float16, data="weights.bin", name="in.onnx", seed=0):
    """An MLP stack (~29 MB at the defaults) saved with all weights in one external data file."""
    rng = np.random.default_rng(seed)
    et = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((d, f)) * 0.05).astype(dtype), f"w1_{i}"),
                  numpy_helper.from_array((rng.standard_normal((f, d)) * 0.05).astype(dtype), f"w2_{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w1_{i}"], [f"h{i}"], name=f"up{i}"),
                  helper.make_node("Sigmoid", [f"h{i}"], [f"s{i}"], name=f"sig{i}"),
                  helper.make_node("Mul", [f"h{i}", f"s{i}"], [f"a{i}"], name=f"silu{i}"),
                  helper.make_node("MatMul", [f"a{i}", f"w2_{i}"], [f"y{i}"], name=f"down{i}")]
        x = f"y{i}"
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", et, ["n", d])],
                          [helper.make_tensor_value_info(x, et, ["n", d])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = os.path.join(folder, name)
    onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
    return path


def digest(folder):
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, f))}


def arrays(path):
    m = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


@pytest.fixture()
def no_full_load(monkeypatch):
    """Fails the test if anything loads a model's external data into memory wholesale."""
    def refuse(*a, **k):
        raise AssertionError("external data loaded wholesale: the streaming path was not taken")
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", refuse)


@pytest.mark.parametrize("fmt", ["nf4", "awq"])
def test_streamed_equals_in_memory(tmp_path, monkeypatch, fmt):
    src = build(str(tmp_path))
    before = digest(tmp_path)
    ref_model, _ = run_passes(model_io.load(src), weights=fmt)           # the in-memory path (whole weights)
    ref = {t.name: numpy_helper.to_array(t) for t in ref_model.graph.initializer}

    spilled = []
    real_spill = model_io.StagedOutput.spill
    monkeypatch.setattr(model_io.StagedOutput, "spill",
                        lambda self, name, a: spilled.append(name) or real_spill(self, name, a))
    monkeypatch.setattr(weights4_quant, "CHUNK_ELEMENTS", 1 << 20)       # several column chunks per weight
    with monkeypatch.context() as m:
        m.setattr(onnx.external_data_helper, "load_external_data_for_model",
                  lambda *a, **k: (_ for _ in ()).throw(AssertionError("not streamed")))
        out = tmp_path / "out.onnx"
        assert cli.main(["rewrite", src, str(out), "--weights", fmt]) == 0
    after = digest(tmp_path)
    assert {k: after[k] for k in before} == before                       # the input is not modified
    assert sorted(os.listdir(tmp_path)) == ["in.onnx", "out.onnx", "out.onnx.data", "weights.bin"]
    assert len(spilled) == 4 * (3 if fmt == "awq" else 2)                # every quantised tensor went out at once
    got = arrays(out)
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype and np.array_equal(got[name], ref[name]), name
    ops = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]
    assert ops.count("MatMulNF4" if fmt == "nf4" else "MatMulAWQ") == 4 and ops.count("FPLUT") == 2
    if fmt == "nf4":  # chunked quantisation = the whole weight quantised at once (bitsandbytes' bytes)
        w = numpy_helper.to_array(onnx.load(src).graph.initializer[0]).astype(np.float32)
        packed, absmax = nf4.quantize(w, "nf4", 64)
        assert np.array_equal(got["w1_0_nf4"], packed) and np.array_equal(got["w1_0_absmax"], absmax)


def test_streamed_verify_and_runs(tmp_path, no_full_load):
    src = build(str(tmp_path), layers=1, d=256, f=512, dtype=np.float32)
    out = tmp_path / "o.onnx"
    assert cli.main(["rewrite", src, str(out), "--weights", "nf4", "--verify", "--tolerance", "0.2"]) == 0
    assert (tmp_path / "o.onnx.data").exists()
    assert cli.main(["rewrite", src, str(tmp_path / "p.onnx"), "--weights", "nf4", "--verify",
                     "--tolerance", "1e-9"]) == 1                       # verify fails: OUT not written,
    assert not (tmp_path / "p.onnx").exists() and not (tmp_path / "p.onnx.data").exists()
    kept = tmp_path / "p.unverified.onnx"                                 # the rewrite kept under another name,
    assert kept.exists() and (tmp_path / "p.unverified.onnx.data").exists()  # its data file named after it
    assert {n.op_type for n in onnx.load(str(kept)).graph.node} >= {"MatMulNF4"}  # loads with its external data
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".onnx-lowbit-")]


@pytest.mark.parametrize("where", ["spill", "copy", "model"])
def test_failure_leaves_no_output(tmp_path, monkeypatch, where, capsys):
    src = build(str(tmp_path), layers=1, d=256, f=512)
    before = digest(tmp_path)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    if where == "spill":
        monkeypatch.setattr(model_io.StagedOutput, "_append", boom)
    elif where == "copy":
        monkeypatch.setattr(model_io.StagedOutput, "_copy_from", boom)
    else:
        real = model_io.StagedOutput.write

        def write_then_fail(self, model, src_dir):
            real(self, model, src_dir)
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(model_io.StagedOutput, "write", write_then_fail)
    args = ["rewrite", src, str(tmp_path / "out.onnx"), "--weights", "nf4"]
    if where == "copy":
        args += ["--exclude", "w2_0"]
    assert cli.main(args) == 2
    assert "No space left on device" in capsys.readouterr().err or where == "model"
    assert digest(tmp_path) == before  # no output, no temporary folder, input untouched


def test_in_memory_failure_leaves_no_output(tmp_path, monkeypatch):
    src = tmp_path / "small.onnx"
    onnx.save(onnx.load(os.path.join(os.path.dirname(__file__), "..", "samples", "tiny_yolo.onnx")), str(src))
    before = digest(tmp_path)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(onnx, "save_model", boom)
    assert cli.main(["rewrite", str(src), str(tmp_path / "out.onnx")]) == 2
    assert digest(tmp_path) == before


def test_output_data_may_not_replace_input_data(tmp_path):
    src = build(str(tmp_path), layers=1, d=256, f=512, data="out.onnx.data")
    before = digest(tmp_path)
    assert cli.main(["rewrite", src, str(tmp_path / "out.onnx"), "--weights", "nf4"]) == 2
    assert digest(tmp_path) == before


def test_external_data_file_too_short(tmp_path, capsys):
    src = build(str(tmp_path), layers=1, d=256, f=512)
    with open(tmp_path / "weights.bin", "r+b") as f:
        f.truncate(1000)
    assert cli.main(["rewrite", src, str(tmp_path / "out.onnx"), "--weights", "nf4"]) in (2, 3)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "weights.bin" in err
    assert not (tmp_path / "out.onnx").exists()


def test_streamed_output_runs_and_keeps_constant_nodes_inline(tmp_path):
    """Float tensors left in the graph (a Constant node's value, a small initializer) survive streaming: Constant
    attributes stay inline, initializers go to OUT.data; the output runs and matches the in-memory rewrite."""
    import onnx_lowbit
    rng = np.random.default_rng(5)
    d, f = 256, 512
    w = numpy_helper.from_array((rng.standard_normal((d, f)) * 0.05).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(f).astype(np.float32), "b")
    c = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
        rng.standard_normal(f).astype(np.float32), "cv"))
    nodes = [c, helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Mul", ["hb", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", f])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    src = str(tmp_path / "in.onnx")
    onnx.save_model(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="in.data",
                    size_threshold=4096)  # w external, b (2 KiB) inline
    out = str(tmp_path / "out.onnx")
    assert cli.main(["rewrite", src, out, "--weights", "nf4"]) == 0
    head = onnx.load(out, load_external_data=False)
    const = [n for n in head.graph.node if n.op_type == "Constant"]
    assert const and const[0].attribute[0].t.data_location != TensorProto.EXTERNAL
    x = rng.standard_normal((3, d)).astype(np.float32)
    y = onnx_lowbit.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref_model, _ = run_passes(model_io.load(src), weights="nf4")
    y_ref = onnx_lowbit.InferenceSession(ref_model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(y, y_ref)


def test_spilled_tensor_reads_back_at_once(tmp_path):
    """A later pass may read a constant an earlier one spilled (e.g. ffn fusing weights4's output)."""
    from onnx_lowbit.passes import base, external
    with model_io.StagedOutput(tmp_path / "o.onnx") as staged:
        a = np.arange(900, dtype=np.float32).reshape(30, 30)  # 3600 bytes: would sit in a write buffer
        c = external.constant("c", a, staged.spill)
        assert isinstance(c._values, external.ExternalValues)
        assert np.array_equal(base.constant_value(c), a)
        assert isinstance(c._values, external.ExternalValues)  # read, not cached in the graph
        small = external.constant("s", np.ones(4, np.float32), staged.spill)
        assert isinstance(small.values, np.ndarray)          # below SPILL_MIN_BYTES: kept in memory
    assert os.listdir(tmp_path) == []                        # left without commit: nothing stays


def _swiglu_external(tmp_path, seed):
    """A gated FFN (fp16, d=256, f=512, SiLU as x*Sigmoid(x)) saved with external data; returns its path."""
    rng = np.random.default_rng(seed)
    d, f = 256, 512
    ws = {n: numpy_helper.from_array((rng.standard_normal(s) * 0.05).astype(np.float16), n)
          for n, s in (("wg", (d, f)), ("wu", (d, f)), ("wd", (f, d)))}
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["act"]), helper.make_node("MatMul", ["x", "wu"], ["u"]),
             helper.make_node("Mul", ["act", "u"], ["h"]), helper.make_node("MatMul", ["h", "wd"], ["y"])]
    g = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n", d])], list(ws.values()))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    src = str(tmp_path / "in.onnx")
    onnx.save_model(m, src, save_as_external_data=True, all_tensors_to_one_file=True, location="in.data")
    return src


def test_streamed_swiglu_equals_in_memory(tmp_path, no_full_load):
    """A gated FFN: weights4 quantises gate/up/down (spilled), later passes read them back; same bytes and ops as
    the in-memory rewrite."""
    src = _swiglu_external(tmp_path, seed=7)
    out = str(tmp_path / "out.onnx")
    assert cli.main(["rewrite", src, out, "--weights", "nf4"]) == 0
    got_model = onnx.load(out)  # onnx.load itself (not model_io.load) is not blocked by no_full_load
    ref_model, _ = run_passes(onnx.load(src), weights="nf4")
    ops = [n.op_type for n in got_model.graph.node]
    assert ops == [n.op_type for n in ref_model.graph.node] and "MatMul" not in ops
    assert any(o in ("MatMulNF4", "FusedFFNNF4") for o in ops)
    ref = {t.name: numpy_helper.to_array(t) for t in ref_model.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in got_model.graph.initializer}
    assert sorted(got) == sorted(ref) and all(np.array_equal(got[k], ref[k]) for k in ref)


def test_streamed_ffn_spills_its_fused_weights(tmp_path, no_full_load, monkeypatch):
    """Without --weights, with --ffn-weights nk, the ffn pass makes new [N, K] weights; streaming writes them to
    OUT.data at once (the graph keeps references), with the same values and ops as the in-memory rewrite. (This
    fp16 model has dynamic rows: the default, auto, would keep the [K, N] weights, as the next test does.)"""
    src = _swiglu_external(tmp_path, seed=8)
    out = str(tmp_path / "out.onnx")
    from onnx_lowbit.passes import external
    spilled, real = [], external.constant

    def recording(name, array, spill=None):
        if spill is not None and array.nbytes >= external.SPILL_MIN_BYTES:
            spilled.append(name)
        return real(name, array, spill)
    monkeypatch.setattr(external, "constant", recording)
    assert cli.main(["rewrite", src, out, "--passes", "ffn", "--ffn-weights", "nk"]) == 0
    lazy = onnx.load(out, load_external_data=False)
    fused = [n for n in lazy.graph.node if n.op_type == "FusedFFN"]
    assert len(fused) == 1
    inits = {t.name: t for t in lazy.graph.initializer}
    for name in fused[0].input[1:3]:
        assert inits[name].data_location == onnx.TensorProto.EXTERNAL, name
        assert name in spilled, (name, spilled)  # written while the pass ran, not held until the end
    got_model = onnx.load(out)
    ref_model, _ = run_passes(onnx.load(src), passes="ffn", ffn_weights="nk")
    ref = {t.name: numpy_helper.to_array(t) for t in ref_model.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in got_model.graph.initializer}
    assert sorted(got) == sorted(ref) and all(np.array_equal(got[k], ref[k]) for k in ref)


def test_streamed_ffn_kn_reuses_the_stored_weights(tmp_path, no_full_load):
    """--ffn-weights kn on a streamed model: FusedFFN reads the [K, N] initializers as they are (external, never
    read, nothing spilled for them); same initializers and values as the in-memory rewrite."""
    src = _swiglu_external(tmp_path, seed=9)
    out = str(tmp_path / "out.onnx")
    assert cli.main(["rewrite", src, out, "--passes", "ffn", "--ffn-weights", "kn"]) == 0
    lazy = onnx.load(out, load_external_data=False)
    (fused,) = [n for n in lazy.graph.node if n.op_type == "FusedFFN"]
    assert list(fused.input[1:3]) == ["wg", "wu"]
    assert {t.name: t.data_location for t in lazy.graph.initializer}["wg"] == onnx.TensorProto.EXTERNAL
    got_model = onnx.load(out)
    ref_model, _ = run_passes(onnx.load(src), passes="ffn", ffn_weights="kn")
    ref = {t.name: numpy_helper.to_array(t) for t in ref_model.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in got_model.graph.initializer}
    assert sorted(got) == sorted(ref) == ["wd", "wg", "wu"] and all(np.array_equal(got[k], ref[k]) for k in ref)


def test_api_rewrite_file_and_inspect_stream(tmp_path, no_full_load, capsys):
    import onnx_lowbit
    src = build(str(tmp_path), layers=1, d=256, f=512)
    before = digest(tmp_path)
    report = onnx_lowbit.rewrite_file(src, tmp_path / "api.onnx", weights="nf4")
    assert len(report.rewritten("weights4")) == 2
    assert cli.main(["rewrite", src, str(tmp_path / "cli.onnx"), "--weights", "nf4"]) == 0
    assert {k: digest(tmp_path)[k] for k in before} == before
    a, b = arrays(tmp_path / "api.onnx"), arrays(tmp_path / "cli.onnx")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert cli.main(["inspect", src, "--weights", "nf4"]) == 0  # inspect reads external weights lazily too
    assert "weights4: 2 weights" in capsys.readouterr().out
    from onnx_lowbit.errors import LowbitError
    with pytest.raises(LowbitError, match="differ"):
        onnx_lowbit.rewrite_file(src, src)


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/hostname", "sub/../../secret.bin", ""])
def test_external_location_outside_the_folder_is_refused(tmp_path, capsys, location):
    """A model must not make rewrite/inspect read (and copy into OUT.data) files outside its folder."""
    (tmp_path / "secret.bin").write_bytes(b"s" * (256 * 512 * 2))
    folder = tmp_path / "m"
    folder.mkdir()
    src = build(str(folder), layers=1, d=256, f=512)
    m = onnx.load(src, load_external_data=False)
    for e in m.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = location
    onnx.save(m, src)
    for args in (["rewrite", src, str(folder / "out.onnx"), "--weights", "nf4"], ["inspect", src]):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert "w1_0" in err and ("outside the model's folder" in err or "absolute path" in err), err
    assert not (folder / "out.onnx").exists() and not (folder / "out.onnx.data").exists()
    from onnx_lowbit.errors import LowbitError
    with pytest.raises(LowbitError, match="w1_0"):  # also when the graph is handed to the passes directly
        run_passes(m, weights="nf4", external_data_dir=str(folder))


def test_symlinked_data_file_inside_the_folder_is_read(tmp_path):
    """Hugging Face caches link model files into a blobs folder: a symlink inside the model's folder is fine."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snap = tmp_path / "snapshot"
    snap.mkdir()
    src = build(str(blobs), layers=1, d=256, f=512)
    os.symlink(src, snap / "in.onnx")
    os.symlink(blobs / "weights.bin", snap / "weights.bin")
    assert cli.main(["rewrite", str(snap / "in.onnx"), str(tmp_path / "out.onnx"), "--weights", "nf4"]) == 0


def test_bad_option_on_streamed_model_from_another_folder(tmp_path, monkeypatch, capsys):
    """An option error on a model with external data names the option, also when the command runs from another
    folder (onnx's checker, asked whether the model is malformed, resolved the data file against the working
    directory and answered "not regular file" instead)."""
    (tmp_path / "m").mkdir()
    src = build(str(tmp_path / "m"), layers=1, d=256, f=512)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["rewrite", src, str(tmp_path / "out.onnx"), "--weights", "nf4", "--block-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "block_size: 3" in err and "malformed" not in err
    assert not (tmp_path / "out.onnx").exists()
    m = onnx.load(src, load_external_data=False)
    assert model_io.malformed(m) is None       # external tensors are not the checker's business here
    m.graph.node.add().CopyFrom(helper.make_node("NoSuchOp", ["x"], ["z"]))
    assert "NoSuchOp" in model_io.malformed(m)  # the rest of the model still is
    assert m.graph.initializer[0].data_location == TensorProto.EXTERNAL   # (the model itself is left as it was)

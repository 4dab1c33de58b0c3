"""A rewritten model says what it needs: metadata_props naming the package and how to register it, a clear error
(LibraryNotRegistered) instead of onnxruntime's bare "not a registered function/op", and `onnx-lowbit inspect`
listing our ops (and onnxruntime's com.microsoft ones) with their domain versions."""
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_lowbit
from onnx_lowbit import api, cli, domain
from onnx_lowbit.passes import OPS_KEY, REQUIRES_KEY, run_passes

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "samples", "tiny_yolo.onnx")


def _mlp(k=128, n=128):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", n])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_metadata_written_and_kept():
    src = onnx.load(SAMPLE)
    onnx.helper.set_model_props(src, {"author": "me"})
    out, _ = run_passes(src)
    meta = {p.key: p.value for p in out.metadata_props}
    assert meta["author"] == "me"
    assert "onnx-lowbit" in meta[REQUIRES_KEY] and "onnx_lowbit.register(sess_options)" in meta[REQUIRES_KEY]
    assert "onnx_lowbit.InferenceSession" in meta[REQUIRES_KEY]
    assert meta[OPS_KEY] == f"FPLUT (domain {domain.DOMAIN} v{domain.DOMAIN_VERSION})"
    out2, _ = run_passes(_mlp(), weights="nf4")
    assert {p.key: p.value for p in out2.metadata_props}[OPS_KEY].startswith("MatMulNF4 ")
    # stock-onnxruntime output (--target ort) needs nothing of ours: no requirement written
    out3, _ = run_passes(_mlp(), weights="nf4", weights_target="ort")
    assert not [p for p in out3.metadata_props if p.key.startswith("onnx_lowbit.")]


def test_unregistered_error_names_package(tmp_path):
    out, _ = run_passes(onnx.load(SAMPLE))
    path = str(tmp_path / "m.onnx")
    onnx.save(out, path)
    with pytest.raises(Exception, match="onnx_lowbit:FPLUT.* is not a registered function/op") as plain:
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    e = api.explain_error(plain.value, path)
    assert isinstance(e, onnx_lowbit.LibraryNotRegistered)
    for needle in ("onnx_lowbit.FPLUT", "onnx-lowbit package", "onnx_lowbit.register(so)",
                   "onnx_lowbit.InferenceSession(", "FPLUT (domain onnx_lowbit v1)"):
        assert needle in str(e), needle
    with pytest.raises(onnx_lowbit.LibraryNotRegistered, match="onnx_lowbit.register"):
        with onnx_lowbit.explained_errors(path):
            ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with pytest.raises(onnx_lowbit.LibraryNotRegistered, match="onnx_lowbit.register"):
        api.plain_session(out, providers=["CPUExecutionProvider"])
    # registered, it runs
    sess = onnx_lowbit.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert sess.get_outputs()


def test_other_errors_pass_through():
    assert api.explain_error(RuntimeError("something else")) is None
    assert api.explain_error(RuntimeError("Fatal error: com.foo:Bar(-1) is not a registered function/op")) is None
    with pytest.raises(ValueError, match="unrelated"):
        with api.explained_errors():
            raise ValueError("unrelated")
    ms, _ = run_passes(_mlp(), weights="nf4", weights_target="ort")
    sess = api.plain_session(ms, providers=["CPUExecutionProvider"])  # stock onnxruntime runs com.microsoft ops
    assert sess.run(None, {"x": np.ones((2, 128), np.float32)})[0].shape == (2, 128)


def test_inspect_lists_ops_and_versions(tmp_path, capsys):
    ours, _ = run_passes(_mlp(), weights="nf4")
    p = str(tmp_path / "ours.onnx")
    onnx.save(ours, p)
    assert cli.main(["inspect", p]) == 0
    so = capsys.readouterr().out
    assert f"uses onnx-lowbit ops (domain {domain.DOMAIN} v{domain.DOMAIN_VERSION}): MatMulNF4 x1" in so
    assert "onnx_lowbit.register(sess_options)" in so
    ms, _ = run_passes(_mlp(), weights="nf4", weights_target="ort")
    p2 = str(tmp_path / "ms.onnx")
    onnx.save(ms, p2)
    assert cli.main(["inspect", p2]) == 0
    so = capsys.readouterr().out
    assert "com.microsoft v1" in so and "MatMulBnb4 x1" in so and "onnx-lowbit ops" not in so
    # a newer domain version than this package implements is pointed out
    for o in ours.opset_import:
        if o.domain == domain.DOMAIN:
            o.version = domain.DOMAIN_VERSION + 1
    p3 = str(tmp_path / "newer.onnx")
    onnx.save(ours, p3)
    assert cli.main(["inspect", p3]) == 0
    assert f"implements v{domain.DOMAIN_VERSION}" in capsys.readouterr().out


def test_inspect_ops_inside_subgraphs(tmp_path, capsys):
    ours, _ = run_passes(_mlp(), weights="nf4")
    then = helper.make_graph(list(ours.graph.node), "then", [], list(ours.graph.output), list(ours.graph.initializer))
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["y2"])], "else", [],
                              [helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["n", 128])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["out"], then_branch=then, else_branch=other)], "top",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 128])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 128])])
    m = helper.make_model(g, opset_imports=list(ours.opset_import), ir_version=9)
    p = str(tmp_path / "sub.onnx")
    onnx.save(m, p)
    assert cli.main(["inspect", p]) == 0
    assert "MatMulNF4 x1" in capsys.readouterr().out


def test_registering_twice_is_harmless():
    """onnxruntime fails session creation ("Domain already set in registry") when a SessionOptions got our library
    twice; register() remembers the options it filled."""
    out, _ = run_passes(onnx.load(SAMPLE))
    so = onnx_lowbit.SessionOptions()
    onnx_lowbit.register(so)
    sess = onnx_lowbit.InferenceSession(out, so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal([d.dim_value or 1 for d in
                                                   out.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    assert sess.run(None, {out.graph.input[0].name: x})[0].size
    ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"])  # the same options again

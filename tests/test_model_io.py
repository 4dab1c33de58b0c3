"""Atomic saving, external data kept, and load errors."""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_lowbit import model_io
from onnx_lowbit.errors import LowbitError


def _mlp():
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Sigmoid", ["h"], ["s"]),
             helper.make_node("Mul", ["h", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_external_data_round_trip(tmp_path):
    m = _mlp()
    w0 = numpy_helper.to_array(m.graph.initializer[0]).copy()
    src = tmp_path / "in.onnx"
    onnx.save_model(m, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="in.weights",
                    size_threshold=0)
    loaded = model_io.load(src)
    assert model_io.uses_external_data(onnx.load(str(src), load_external_data=False))
    from onnx_lowbit import rewrite
    out, report = rewrite(loaded)
    dst = tmp_path / "out.onnx"
    model_io.save(out, dst, external_data=True)
    assert (tmp_path / "out.onnx.data").exists()
    back = model_io.load(dst)
    w = [numpy_helper.to_array(t) for t in back.graph.initializer if t.name == "w"][0]
    assert np.array_equal(w, w0)
    assert sorted(os.listdir(tmp_path)) == ["in.onnx", "in.weights", "out.onnx", "out.onnx.data"]


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    dst = tmp_path / "out.onnx"
    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(onnx, "save_model", boom)
    with pytest.raises(LowbitError, match="No space left"):
        model_io.save(_mlp(), dst)
    assert os.listdir(tmp_path) == []


def test_load_errors(tmp_path):
    with pytest.raises(LowbitError, match="no such file"):
        model_io.load(tmp_path / "x.onnx")
    with pytest.raises(LowbitError, match="directory"):
        model_io.load(tmp_path)

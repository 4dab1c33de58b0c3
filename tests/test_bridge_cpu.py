"""The onnxruntime bridge on the CPU EP: FPLUT through ordinary sessions, bit-exact with the reference,
clear error statuses, and concurrent runs."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import onnx_lowbit
from onnx_lowbit import fplut, halfbits

from helpers import SEED, fplut_model, random_like, run_bf16, same_in_threads, seed_table

CPU = ["CPUExecutionProvider"]


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 3, 4, 5), (0, 8), (257, 129)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fplut_bit_exact(dtype, shape):
    et = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    m = fplut_model(et, shape=[f"d{i}" for i in range(len(shape))])
    sess = onnx_lowbit.InferenceSession(m, providers=CPU)
    x = random_like(dtype, shape, seed=len(shape))
    y = sess.run(None, {"x": x})[0]
    ref = fplut.apply(x, SEED, seed_table().values)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert np.array_equal(y.view(np.uint8), ref.view(np.uint8))


def test_fplut_fp16_exhaustive_and_large():
    sess = onnx_lowbit.InferenceSession(fplut_model(TensorProto.FLOAT16, shape=["n"]), providers=CPU)
    x = halfbits.all_fp16().copy()
    big = np.tile(x, 4)  # above the parallel threshold
    for arr in (x, big):
        y = sess.run(None, {"x": arr})[0]
        assert np.array_equal(y.view(np.uint16), fplut.apply(arr, SEED, seed_table().values).view(np.uint16))


def test_fplut_bf16():
    from onnx import numpy_helper  # noqa: F401
    m = fplut_model(TensorProto.BFLOAT16, shape=["n"])
    sess = onnx_lowbit.InferenceSession(m, providers=CPU)
    x32 = random_like(np.float32, (1000,))
    xb = halfbits.f32_to_bf16_bits(x32)
    y, ytype = run_bf16(sess, xb)   # raw bits in and out (no bfloat16 numpy type)
    assert ytype == "tensor(bfloat16)"
    assert np.array_equal(y, fplut.apply(xb, SEED, seed_table().values, bf16=True))


def test_schema_checker_and_shape_inference():
    m = fplut_model(TensorProto.FLOAT16, shape=["N", 8])
    onnx_lowbit.domain.register_schemas()
    onnx.checker.check_model(m, full_check=True)
    inf = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    assert inf.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16


def _create_error(model):
    with pytest.raises(Exception) as ei:
        onnx_lowbit.InferenceSession(model, providers=CPU)
    return str(ei.value)


def test_bad_attribute_names_node_and_problem():
    attrs = fplut.node_attributes(seed_table())
    attrs["cut_points"] = attrs["cut_points"][:5] + [attrs["cut_points"][6], attrs["cut_points"][5]] + attrs["cut_points"][7:]
    msg = _create_error(fplut_model(attrs=attrs, name="my_act"))
    assert "onnx_lowbit.FPLUT" in msg and "my_act" in msg and "strictly increasing" in msg


def test_missing_attribute():
    attrs = fplut.node_attributes(seed_table())
    del attrs["table"]
    msg = _create_error(fplut_model(attrs=attrs, name="act_t"))
    assert "table" in msg


def test_wrong_table_length():
    attrs = fplut.node_attributes(seed_table())
    attrs["table"] = attrs["table"][:100]
    msg = _create_error(fplut_model(attrs=attrs))
    assert "259" in msg


def test_unsupported_input_type_is_refused():
    msg = _create_error(fplut_model(TensorProto.INT32))
    assert "FPLUT" in msg


def test_threads_on_one_session_agree():
    sess = onnx_lowbit.InferenceSession(fplut_model(TensorProto.FLOAT, shape=["n"]), providers=CPU)
    xs = [random_like(np.float32, (5000,), seed=s) for s in range(8)]
    want = [fplut.apply(x, SEED, seed_table().values) for x in xs]
    assert not same_in_threads(lambda x: sess.run(None, {"x": x})[0], xs, want,
                               lambda a, b: np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def test_two_sessions():
    s1 = onnx_lowbit.InferenceSession(fplut_model(TensorProto.FLOAT16, shape=["n"]), providers=CPU)
    s2 = onnx_lowbit.InferenceSession(fplut_model(TensorProto.FLOAT, shape=["n"]), providers=CPU)
    x = random_like(np.float32, (100,))
    with np.errstate(over="ignore"):
        x16 = x.astype(np.float16)
    assert np.array_equal(s2.run(None, {"x": x})[0].astype(np.float16), s1.run(None, {"x": x16})[0], equal_nan=True)

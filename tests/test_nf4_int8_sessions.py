"""accuracy_level 4 of MatMulNF4 / FusedFFNNF4 in sessions: the CPU faces' native entries (runtime/plans.py: replays
never reach Python; the same bytes as the Python path, NaN / Inf rows included) against onnx_lowbit.nf4_int8, and
the CUDA faces (simulator in CI), which take the attribute and compute in float."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_lowbit import domain, ffn, nf4, nf4_int8

from test_ffn4_kernels import _rel, _tol
from test_native_cpu import _specials, check_native_rows, native_and_python
from test_nf4_kernels import _cuda_ok, _quantized, call_op

ET = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


def model(op, inits, ins, k, n, dtype, attrs):
    et = ET[np.dtype(dtype)]
    node = helper.make_node(op, ins, ["y"], domain=domain.DOMAIN, name="op", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(ins[0], et, ["b", "m", k])],
                          [helper.make_tensor_value_info("y", et, ["b", "m", n])],
                          [numpy_helper.from_array(v, nm) for nm, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


CASES = [  # K, N, block size, quant type, dtype, bias
    (256, 40, 64, "nf4", np.float32, True),
    (352, 37, 64, "fp4", np.float16, True),    # K % bs != 0 (pieces of 32), tasks of two-column items, N odd
    (2048, 520, 64, "nf4", np.float32, False),  # several tasks of the pool
    (96, 27, 32, "fp4", np.float32, False),    # K < 128: one partial span
    (688, 24, 64, "nf4", np.float16, False),   # K % 32 != 0: level 4 computes as level 0
]


@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", CASES)
def test_matmulnf4_level4_native(k, n, bs, qt, dtype, bias):
    q, am = _quantized(k, n, bs, qt, seed=k)
    b = np.random.default_rng(1).standard_normal(n).astype(dtype) if bias else None
    inits = {"q": q, "am": am} | ({"b": b} if bias else {})
    m = model("MatMulNF4", inits, ["a", "q", "am"] + (["b"] if bias else []), k, n, dtype,
              dict(quant_type=qt, block_size=bs, K=k, N=n, accuracy_level=4))
    rng = np.random.default_rng(2)
    feeds = [{"a": _specials(rng.standard_normal((1, mm, k)).astype(dtype))} for mm in (1, 3, 1, 16, 17, 0)]
    for threads in (0, 1):
        native, _ = native_and_python(m, feeds, threads, python_only=lambda f: f["a"].shape[1] > 16)
    check_native_rows(native, feeds, "a", n, dtype,
                      lambda a: nf4.matmul(a, q, am, qt, bs, k, n, b, accuracy_level=4), _rel, _tol(dtype))
    for f in feeds:          # level 4 is not the float product, except where it computes as level 0 (K % 32 != 0)
        a = f["a"][0, 1:]
        if a.shape[0]:
            ref = nf4.matmul(a, q, am, qt, bs, k, n, b, accuracy_level=4)
            if nf4_int8.int8_group(k, bs) is None:
                np.testing.assert_array_equal(ref, nf4.matmul(a, q, am, qt, bs, k, n, b))
            else:
                assert _rel(nf4.matmul(a, q, am, qt, bs, k, n, b), ref) > 1e-4


@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", [(256, 40, 64, "nf4", np.float32, True),
                                                  (352, 37, 64, "fp4", np.float16, False),
                                                  (1024, 600, 128, "nf4", np.float32, True)])
def test_fusedffnnf4_level4_native(k, n, bs, qt, dtype, bias):
    q1, a1 = _quantized(k, n, bs, qt, seed=5)
    q3, a3 = _quantized(k, n, bs, qt, seed=6)
    rng = np.random.default_rng(4)
    b1, b3 = ((rng.standard_normal(n).astype(dtype) for _ in range(2)) if bias else (None, None))
    inits = {"q1": q1, "a1": a1, "q3": q3, "a3": a3} | ({"b1": b1, "b3": b3} if bias else {})
    m = model("FusedFFNNF4", inits, ["x", "q1", "a1", "q3", "a3"] + (["b1", "b3"] if bias else []), k, n, dtype,
              dict(quant_type=qt, block_size=bs, K=k, N=n, accuracy_level=4))
    feeds = [{"x": _specials((rng.standard_normal((1, mm, k)) + 0.2).astype(dtype))} for mm in (1, 3, 1, 16, 17, 0)]
    native, _ = native_and_python(m, feeds, 0, python_only=lambda f: f["x"].shape[1] > 16)
    check_native_rows(native, feeds, "x", n, dtype,
                      lambda x: ffn.swiglu_nf4_ref(x, q1, a1, q3, a3, qt, bs, k, n, b1, b3, accuracy_level=4), _rel,
                      _tol(dtype), finite_ref=True)


def test_bad_accuracy_level_is_refused():
    import onnx_lowbit
    q, am = _quantized(64, 8, 32, "nf4")
    m = model("MatMulNF4", {"q": q, "am": am}, ["a", "q", "am"], 64, 8, np.float32,
              dict(quant_type="nf4", block_size=32, K=64, N=8, accuracy_level=5))
    with pytest.raises(Exception, match="accuracy_level must be one of 0, 1, 2, 3, 4"):
        onnx_lowbit.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"a": np.ones((1, 1, 64), np.float32)})


@pytest.mark.skipif(not _cuda_ok(), reason="no GPU and the CUDA simulator is off")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cuda_faces_take_the_attribute_and_compute_in_float(dtype):
    k, n, bs, qt = 128, 12, 64, "nf4"
    q, am = _quantized(k, n, bs, qt, seed=7)
    a = np.random.default_rng(8).standard_normal((2, k)).astype(dtype)
    attrs = {"quant_type": qt, "block_size": bs, "K": k, "N": n, "accuracy_level": 4}
    y, kern = call_op("MatMulNF4", attrs, [a, q.reshape(-1), am.astype(np.float32), None], (2, n), dtype)
    assert kern.level == 4
    assert _rel(y, nf4.matmul(a, q, am, qt, bs, k, n)) <= _tol(dtype)                          # level 0: tight
    assert _rel(y, nf4.matmul(a, q, am, qt, bs, k, n, accuracy_level=4)) <= 0.03                # level 4: loose
    q3, a3 = _quantized(k, n, bs, qt, seed=9)
    s, kern = call_op("FusedFFNNF4", attrs, [a, q.reshape(-1), am.astype(np.float32), q3.reshape(-1),
                                             a3.astype(np.float32), None, None], (2, n), dtype)
    assert kern.level == 4
    assert _rel(s, ffn.swiglu_nf4_ref(a, q, am, q3, a3, qt, bs, k, n)) <= _tol(dtype)
    with pytest.raises(Exception, match="accuracy_level must be one of"):
        call_op("MatMulNF4", dict(attrs, accuracy_level=9), [a, q.reshape(-1), am.astype(np.float32), None],
                (2, n), dtype)

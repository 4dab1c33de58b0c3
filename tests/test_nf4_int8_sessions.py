"""accuracy_level 4 of MatMulNF4 / FusedFFNNF4 in sessions: the CPU faces' native entries (runtime/plans.py: replays
never reach Python; the same bytes as the Python path, NaN / Inf rows included) against onnx_lowbit.nf4_int8, and
the CUDA faces (simulator in CI), which take the attribute and compute in float."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_lowbit
from onnx_lowbit import domain, ffn, nf4, nf4_int8

from test_ffn4_kernels import _rel, _tol
from test_native_cpu import _specials, check_native_rows, native_and_python, session
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
    (576, 40, 32, "int4", np.float32, True),   # int4 (MatMulNBits converted): level divisor 128
    (688, 24, 64, "nf4", np.float16, False),   # K % 32 != 0: level 4 computes as level 0
]


def _native_max_m(k):
    """The most rows a level-4 node with constant weights serves natively: its packed entry's (VNNI CPUs, K % 32 ==
    0: the weights repacked) or the span entry's."""
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_int8_cpu as int8
    return int8.PACKED_MAX_M if int8.VNNI and k % 32 == 0 else int8.SMALL_M


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
        native, _ = native_and_python(m, feeds, threads, python_only=lambda f: f["a"].shape[1] > _native_max_m(k))
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


def _weight_inputs_model(k, n, bs, qt, dtype, bias):
    """MatMulNF4 level 4 whose Q and absmax (and bias) are graph inputs (not constant: nothing packed)."""
    et = ET[np.dtype(dtype)]
    ins = ["a", "q", "am"] + (["b"] if bias else [])
    node = helper.make_node("MatMulNF4", ins, ["y"], domain=domain.DOMAIN, name="op", quant_type=qt, block_size=bs,
                            K=k, N=n, accuracy_level=4)
    vis = [helper.make_tensor_value_info("a", et, ["b", "m", k]),
           helper.make_tensor_value_info("q", TensorProto.UINT8, None),
           helper.make_tensor_value_info("am", TensorProto.FLOAT, None)]
    vis += [helper.make_tensor_value_info("b", et, [n])] if bias else []
    g = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", et, ["b", "m", n])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", [(256, 40, 64, "nf4", np.float32, True),
                                                  (352, 37, 64, "fp4", np.float16, True),
                                                  (160, 50, 32, "nf4", np.float32, False),
                                                  (576, 60, 32, "int4", np.float16, True),
                                                  (2048, 1100, 128, "fp4", np.float32, False)])
def test_matmulnf4_level4_constant_vs_input_weights(monkeypatch, k, n, bs, qt, dtype, bias):
    """Constant Q / absmax: on VNNI CPUs repacked once per node (nf4col_cpu), every M of the node the same bytes per
    row (M = 1 and M = 3 rows of one session, native entry and Python path, 1 and 2 threads); weights fed as inputs:
    the span-layout kernels. Both within the level-4 tolerance of the reference, each other's too."""
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_int8_cpu as int8
    from onnx_lowbit.custom_ops.runtime import bridge
    monkeypatch.setattr(int8, "CHUNK_TILES", 2)           # chunks of two tiles: several claimed per task
    monkeypatch.setattr(int8, "CHUNKS_PER_TASK", 64)
    q, am = _quantized(k, n, bs, qt, seed=k + 1)
    rng = np.random.default_rng(k)
    b = rng.standard_normal(n).astype(dtype) if bias else None
    inits = {"q": q, "am": am} | ({"b": b} if bias else {})
    const = model("MatMulNF4", inits, ["a", "q", "am"] + (["b"] if bias else []), k, n, dtype,
                  dict(quant_type=qt, block_size=bs, K=k, N=n, accuracy_level=4))
    a3 = _specials(rng.standard_normal((1, 3, k)).astype(dtype))
    a20 = rng.standard_normal((1, 20, k)).astype(dtype)
    feeds = [{"a": a3}, {"a": a3[:, 1:2].copy()}, {"a": a3[:, 2:3].copy()}, {"a": a20}]
    results = []
    for threads in (1, 2):
        native, _ = native_and_python(const, feeds, threads, python_only=lambda f: f["a"].shape[1] > _native_max_m(k))
        results.append(native)
        (y3,), (y1,), (y2,), (y20,) = native
        assert np.array_equal(y3[:, 1:2].view(np.uint8), y1.view(np.uint8))        # M = 1 rows = M = 3 rows
        assert np.array_equal(y3[:, 2:3].view(np.uint8), y2.view(np.uint8))
    for x, y in zip(results[0], results[1]):                                           # 1 vs 2 threads
        assert np.array_equal(x[0].view(np.uint8), y[0].view(np.uint8))
    live = session(const)      # the node's kernel object: packed where the CPU has VNNI
    live.run(None, feeds[1])
    kernels = [kk for kk in bridge._kernels.values() if getattr(kk, "node_name", None) == "op"
               and kk.spec.name == "MatMulNF4" and kk.n == n and kk.k == k]
    assert kernels and all((kk.packed is not None) == int8.VNNI for kk in kernels)
    del live
    inp = _weight_inputs_model(k, n, bs, qt, dtype, bias)
    wfeeds = {"q": q.reshape(-1), "am": am.astype(np.float32).reshape(-1)} | ({"b": b} if bias else {})
    sess = onnx_lowbit.InferenceSession(inp.SerializeToString(), providers=["CPUExecutionProvider"])
    for f, (y,) in zip(feeds, results[0]):
        (yi,) = sess.run(None, f | wfeeds)
        a = f["a"][0]
        ref = nf4.matmul(a, q, am, qt, bs, k, n, b, accuracy_level=4)
        fin = np.isfinite(a.astype(np.float32)).all(axis=1)
        assert np.array_equal(np.isnan(y[0]), ~fin[:, None] & np.ones((1, n), bool))
        assert np.array_equal(np.isnan(yi[0]), np.isnan(y[0]))
        if fin.any():
            assert _rel(y[0][fin], ref[fin]) <= _tol(dtype) and _rel(yi[0][fin], ref[fin]) <= _tol(dtype)
            assert _rel(y[0][fin], yi[0][fin]) <= 2 * _tol(dtype)


@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", [(256, 40, 64, "nf4", np.float32, True),
                                                  (352, 37, 64, "fp4", np.float16, False),
                                                  (576, 48, 32, "int4", np.float32, True),
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
    row = {"x": feeds[1]["x"][:, 1:2].copy()}    # row 1 of the M = 3 call, alone: the same bytes at every M
    native, _ = native_and_python(m, feeds + [row], 0, python_only=lambda f: f["x"].shape[1] > _native_max_m(k))
    np.testing.assert_array_equal(native[1][0][:, 1:2].view(np.uint8), native[-1][0].view(np.uint8))
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_int8_cpu as int8
    from onnx_lowbit.custom_ops.runtime import bridge
    live = session(m)          # the node's kernel object: W1 and W3 packed where the CPU has VNNI
    live.run(None, feeds[0])
    kernels = [kk for kk in bridge._kernels.values() if getattr(kk, "node_name", None) == "op"
               and kk.spec.name == "FusedFFNNF4" and kk.n == n and kk.k == k]
    assert kernels and all((kk.packs is not None) == int8.VNNI for kk in kernels)
    del live
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

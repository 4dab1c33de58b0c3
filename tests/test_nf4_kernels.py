"""MatMulNF4 / DequantNF4 kernels against onnx_lowbit.nf4: CPU through onnxruntime sessions, CUDA under the
simulator in CI (real GPU with ONNX_LOWBIT_REAL_GPU=1). fp32 accumulation vs the float64 reference: relative
error (max |err| / max |ref|) below 1e-5 for fp32 outputs, and within fp16 rounding (2^-10) for fp16 outputs."""
import numpy as np
import onnxruntime as ort
import pytest
from numba import config
from onnx import TensorProto, helper, numpy_helper

import onnx_lowbit
from onnx_lowbit import domain, nf4

CASES = [  # M (leading dims), K, N, block size, quant type, dtype, bias
    ((1,), 64, 16, 32, "nf4", np.float32, True),
    ((1, 3), 688, 24, 64, "fp4", np.float16, False),   # K not a multiple of the block; blocks straddle rows
    ((2,), 128, 8, 64, "nf4", np.float16, True),
    ((17,), 64, 8, 32, "nf4", np.float32, False),      # M > 16: the prefill path
    ((0,), 64, 8, 64, "nf4", np.float32, True),        # empty batch
]


def _quantized(k, n, bs, qt, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, am = nf4.quantize(w, qt, bs)
    return q, am


def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 2.0 ** -10


def _rel(y, ref):
    ref = np.asarray(ref, np.float64)
    return np.abs(np.asarray(y, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12) if ref.size else 0.0


def matmul_model(lead, k, n, bs, qt, dtype, bias, q, am, b=None):
    et = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    inits = [numpy_helper.from_array(q, "q"), numpy_helper.from_array(am, "am")]
    ins = ["a", "q", "am"]
    if bias:
        inits.append(numpy_helper.from_array(b, "b"))
        ins.append("b")
    node = helper.make_node("MatMulNF4", ins, ["y"], domain=domain.DOMAIN, name="mm", quant_type=qt, block_size=bs,
                            K=k, N=n)
    dims = [f"d{i}" for i in range(len(lead))]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", et, dims + [k])],
                          [helper.make_tensor_value_info("y", et, dims + [n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,bias", CASES)
def test_matmul_cpu_session(lead, k, n, bs, qt, dtype, bias):
    q, am = _quantized(k, n, bs, qt)
    rng = np.random.default_rng(1)
    a = rng.standard_normal(lead + (k,)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    sess = onnx_lowbit.InferenceSession(matmul_model(lead, k, n, bs, qt, dtype, bias, q, am, b),
                                        providers=["CPUExecutionProvider"])
    y = sess.run(None, {"a": a})[0]
    ref = nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert _rel(y, ref) <= _tol(dtype)


@pytest.mark.parametrize("transposed", [0, 1])
@pytest.mark.parametrize("adt", [np.float32, np.float16])
def test_dequant_cpu_session(transposed, adt):
    k, n, bs, qt = 688, 24, 64, "nf4"
    q, am = _quantized(k, n, bs, qt)
    am = am.astype(adt)
    et = TensorProto.FLOAT if adt == np.float32 else TensorProto.FLOAT16
    node = helper.make_node("DequantNF4", ["q", "am"], ["w"], domain=domain.DOMAIN, quant_type=qt, block_size=bs,
                            K=k, N=n, transposed=transposed)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("q", TensorProto.UINT8, [q.size]),
                                        helper.make_tensor_value_info("am", et, [am.size])],
                          [helper.make_tensor_value_info("w", et, [n, k] if transposed else [k, n])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)
    w = onnx_lowbit.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"q": q, "am": am})[0]
    ref = nf4.dequantize(q, am.astype(np.float32), qt, bs, k, n, np.float32).astype(adt)
    assert np.array_equal(w, ref.T if transposed else ref)


def test_bad_absmax_count_names_the_input():
    k, n, bs, qt = 64, 16, 32, "nf4"
    q, am = _quantized(k, n, bs, qt)
    sess = onnx_lowbit.InferenceSession(matmul_model((1,), k, n, bs, qt, np.float32, False, q, am[:-1]),
                                        providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="absmax"):
        sess.run(None, {"a": np.ones((1, k), np.float32)})


def test_bad_block_size_attribute():
    k, n, qt = 64, 16, "nf4"
    q, am = _quantized(k, n, 32, qt)
    m = matmul_model((1,), k, n, 48, qt, np.float32, False, q, am)
    with pytest.raises(Exception, match="block_size"):
        onnx_lowbit.InferenceSession(m, providers=["CPUExecutionProvider"])


def test_wrong_k_in_activation():
    k, n, bs, qt = 64, 16, 32, "nf4"
    q, am = _quantized(k, n, bs, qt)
    sess = onnx_lowbit.InferenceSession(matmul_model((1,), k, n, bs, qt, np.float32, False, q, am),
                                        providers=["CPUExecutionProvider"])
    with pytest.raises(Exception):
        sess.run(None, {"a": np.ones((1, k + 1), np.float32)})


# ---------------------------------------------------------------------------------------------------------------
SIM = bool(config.ENABLE_CUDASIM)


def _cuda_ok():
    if SIM:
        return True
    from numba import cuda
    return cuda.is_available()


@pytest.mark.skipif(not _cuda_ok(), reason="no GPU and the CUDA simulator is off")
@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,bias", CASES)
def test_matmul_cuda_kernel(lead, k, n, bs, qt, dtype, bias):
    from onnx_lowbit.custom_ops import matmulnf4_cuda
    q, am = _quantized(k, n, bs, qt)
    rng = np.random.default_rng(2)
    a = rng.standard_normal(lead + (k,)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    ref = nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)
    m = int(np.prod(lead))
    modes = ["generic"] + (["fast"] if matmulnf4_cuda.fast_path(m, k) else []) + (
        ["m1"] if matmulnf4_cuda.m1_path(m, k) else [])
    for mode in modes:  # every kernel that can take this shape
        y = matmulnf4_cuda.run_arrays(a, q, am, nf4.code(qt).astype(np.float32), k, n, bs, b if bias else None,
                                      mode=mode)
        assert y.shape == ref.shape and _rel(y, ref) <= _tol(dtype), mode


@pytest.mark.skipif(not _cuda_ok(), reason="no GPU and the CUDA simulator is off")
@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", [(96, 45, 32, "nf4", np.float16, True),    # partial warp, tails
                                                  (512, 37, 64, "fp4", np.float32, False)])  # full warp
def test_matmul_cuda_m1_kernel(k, n, bs, qt, dtype, bias):
    """The M=1 kernel on column slices of several steps with a partial last one, and its variants."""
    from onnx_lowbit.custom_ops import matmulnf4_cuda
    q, am = _quantized(k, n, bs, qt, seed=4)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1, k)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    ref = nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)
    for opts in (None, {"COLS": 4, "prefetch": True}, {"COLS": 2}):
        y = matmulnf4_cuda.run_arrays(a, q, am, nf4.code(qt).astype(np.float32), k, n, bs, b if bias else None,
                                      mode="m1", m1_opts=opts)
        assert y.shape == ref.shape and _rel(y, ref) <= _tol(dtype), opts


@pytest.mark.skipif(not _cuda_ok(), reason="no GPU and the CUDA simulator is off")
@pytest.mark.parametrize("transposed", [False, True])
def test_dequant_cuda_kernel(transposed):
    from onnx_lowbit.custom_ops import dequantnf4_cuda
    for k, n, bs, qt in [(688, 24, 64, "fp4"), (64, 16, 32, "nf4"), (33, 3, 32, "nf4")]:
        q, am = _quantized(k, n, bs, qt)
        w = dequantnf4_cuda.run_arrays(q, am, nf4.code(qt).astype(np.float32), k, n, bs, transposed)
        ref = nf4.dequantize(q, am, qt, bs, k, n, np.float32)
        assert np.array_equal(w, ref.T if transposed else ref)


@pytest.mark.skipif(SIM or "CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu and a GPU")
@pytest.mark.parametrize("lead,k,n,bs,qt,dtype,bias", CASES)
def test_matmul_cuda_session(lead, k, n, bs, qt, dtype, bias):
    q, am = _quantized(k, n, bs, qt)
    rng = np.random.default_rng(3)
    a = rng.standard_normal(lead + (k,)).astype(dtype)
    b = rng.standard_normal(n).astype(dtype)
    sess = onnx_lowbit.InferenceSession(matmul_model(lead, k, n, bs, qt, dtype, bias, q, am, b),
                                        providers=["CUDAExecutionProvider"])
    y = sess.run(None, {"a": a})[0]
    assert _rel(y, nf4.matmul(a, q, am, qt, bs, k, n, b if bias else None)) <= _tol(dtype)

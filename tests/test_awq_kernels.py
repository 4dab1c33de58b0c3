"""MatMulAWQ / DequantAWQ CPU kernels against the numpy reference (onnx_lowbit.awq), through the full onnxruntime
bridge (one-node models in the onnx_lowbit domain), and the helpers the AWQ CUDA tests share (test_awq_cuda.py:
the kernels; test_awq_sessions_cuda.py: the kernel objects as sessions call them).

Tolerances. DequantAWQ is bit-exact (one fp32 product, one RNE rounding to fp16, as the reference).
MatMulAWQ kernels multiply with the exact value (q - z) * s (fp32), while the reference ``awq.matmul`` uses W
rounded to fp16 and sums in float64. So, per output, with S = sum_k |x_k| |W16[k, n]| and
E = 32 * sum_k |x_k| |s[k // G, n]| (the magnitudes the fp32 sums go through: P = sum x (1 + q/16), S_x = sum x):
  * against the exact-product float64 reference: |y - ref| <= 2^-18 E  (fp32 sums of <= max(G, 32) terms of
    magnitude <= E plus the zero-point correction s (16 P - (16 + z) S_x), the 8 in-block and the split-K
    partials (or BLAS sgemm): about n u E with n ~ 64 terms and u = 2^-24; the observed errors are >= 30x below)
    + 2^-11 |ref| + 2^-24 for float16 outputs (one rounding);
  * against awq.matmul: the above + 2^-11 S (the fp16 rounding of each weight, at most half an fp16 ulp).
"""
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnx_lowbit
from onnx_lowbit import awq, domain

REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
CPU = ["CPUExecutionProvider"]
ET = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


# ---------------------------------------------------------------------------------------------------- helpers
_WEIGHTS = {}


def weights(K, N, G=128, seed=0):  # noqa: N803
    key = (K, N, G, seed)
    if key not in _WEIGHTS:
        rng = np.random.default_rng(seed + 1000 * K + N)
        w = (rng.standard_normal((K, N)) * rng.uniform(0.01, 0.2, N)).astype(np.float32)
        _WEIGHTS[key] = awq.quantize_rtn(w, G)
    return _WEIGHTS[key]


def activations(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 0.3).astype(dtype)  # a non-zero mean exercises the zero correction


def exact_ref(a, qw, qz, sc, G, K, N, bias=None):  # noqa: N803
    """float64 Y with the exact weights (q - z) * s (no fp16 rounding of W), and the bound E of the docstring."""
    q, z = awq.unpack(qw, qz)
    s = np.repeat(sc.astype(np.float64), G, axis=0)[:K]
    w = (q[:K].astype(np.float64) - np.repeat(z, G, axis=0)[:K]) * s
    x = a.reshape(-1, K).astype(np.float64)
    y = x @ w + (0.0 if bias is None else bias.astype(np.float64))
    return y.reshape(a.shape[:-1] + (N,)), (32 * np.abs(x) @ np.abs(s)).reshape(a.shape[:-1] + (N,))


def check_matmul(y, a, qw, qz, sc, G, K, N, bias=None):  # noqa: N803
    assert y.dtype == a.dtype and y.shape == a.shape[:-1] + (N,)
    if y.size == 0:
        return
    ref, e = exact_ref(a, qw, qz, sc, G, K, N, bias)
    y64 = y.astype(np.float64)
    out_round = 2.0 ** -11 * np.abs(ref) + 2.0 ** -24 if a.dtype == np.float16 else 0.0
    tol = 2.0 ** -18 * e + out_round
    assert np.all(np.abs(y64 - ref) <= tol), f"vs exact weights: max excess {np.max(np.abs(y64 - ref) - tol)}"
    w16 = np.abs(awq.dequantize(qw, qz, sc, G, K, N).astype(np.float64))
    s_w = (np.abs(a.reshape(-1, K).astype(np.float64)) @ w16).reshape(ref.shape)
    ref16 = awq.matmul(a, qw, qz, sc, G, K, N, bias).astype(np.float64)
    tol16 = tol + 2.0 ** -11 * s_w + (2.0 ** -11 * np.abs(ref16) if a.dtype == np.float16 else 0.0)
    assert np.all(np.abs(y64 - ref16) <= tol16), "vs awq.matmul"


def awq_model(op, K, N, G, *, a_dtype=np.float32, lead=("M",), bias=False, name="awq0", attrs=None,  # noqa: N803
              initializers=None):
    """One-node model. Inputs: A (MatMulAWQ), qweight, qzeros, scales, bias as graph inputs unless given in
    ``initializers`` (name -> array)."""
    Kp = -(-K // G) * G  # noqa: N806
    init = initializers or {}
    specs = [("qweight", TensorProto.INT32, [Kp, N // 8]), ("qzeros", TensorProto.INT32, [Kp // G, N // 8]),
             ("scales", TensorProto.FLOAT16, [Kp // G, N])]
    if op == "MatMulAWQ":
        specs = [("A", ET[np.dtype(a_dtype)], list(lead) + [K])] + specs
        if bias:
            specs.append(("bias", ET[np.dtype(a_dtype)], [N]))
        out = helper.make_tensor_value_info("Y", ET[np.dtype(a_dtype)], list(lead) + [N])
    else:
        out = helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [K, N])
    attrs = attrs if attrs is not None else {"group_size": G, "K": K, "N": N}
    node = helper.make_node(op, [s[0] for s in specs], ["Y"], domain=domain.DOMAIN, name=name, **attrs)
    inputs = [helper.make_tensor_value_info(n, t, [None] * len(shape) if n in ("qzeros", "bias") else shape)
              for n, t, shape in specs if n not in init]
    g = helper.make_graph([node], "g", inputs, [out],
                          initializer=[onnx.numpy_helper.from_array(v, n) for n, v in init.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


def session(model):
    return onnx_lowbit.InferenceSession(model, providers=CPU)


# --------------------------------------------------------------------------------------- CPU through onnxruntime
def test_ops_are_declared_in_the_domain():
    """The bridge declares domain.OPS; the AWQ ops must be there (no monkeypatching needed any more)."""
    assert "MatMulAWQ" in domain.OPS and "DequantAWQ" in domain.OPS


@pytest.mark.parametrize("K,N", [(128, 8), (688, 136), (256, 64), (688, 8), (128, 136)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_matmul_vs_reference(K, N, dtype):  # noqa: N803
    G = 128  # noqa: N806
    qw, qz, sc = weights(K, N, G)
    for hb in (False, True):
        sess = session(awq_model("MatMulAWQ", K, N, G, a_dtype=dtype, bias=hb, lead=("B", "T")))
        bias = activations((N,), dtype, seed=5) if hb else None
        for lead in [(1, 1), (1, 3), (2, 8), (1, 17), (0, 4)]:   # M = 1, 3, 16, 17, 0
            a = activations(lead + (K,), dtype, seed=sum(lead))
            feeds = {"A": a, "qweight": qw, "qzeros": qz, "scales": sc}
            if hb:
                feeds["bias"] = bias
            y = sess.run(None, feeds)[0]
            check_matmul(y, a, qw, qz, sc, G, K, N, bias)


@pytest.mark.parametrize("K,N,G", [(256, 64, 32), (100, 16, 7), (688, 136, 688)])
def test_cpu_matmul_group_sizes_and_initializers(K, N, G):  # noqa: N803
    """Other group sizes (odd, per-channel), weights stored as initializers, 1-D and 3-D A."""
    qw, qz, sc = weights(K, N, G, seed=3)
    init = {"qweight": qw, "qzeros": qz, "scales": sc}
    for lead in [(), (2, 2, 5)]:
        sess = session(awq_model("MatMulAWQ", K, N, G, lead=[f"d{i}" for i in range(len(lead))],
                                 initializers=init))
        a = activations(lead + (K,), np.float32, seed=7)
        check_matmul(sess.run(None, {"A": a})[0], a, qw, qz, sc, G, K, N)


@pytest.mark.parametrize("K,N,G", [(128, 8, 128), (688, 136, 128), (256, 64, 32), (100, 16, 7)])
def test_cpu_dequant_bit_exact(K, N, G):  # noqa: N803
    qw, qz, sc = weights(K, N, G, seed=1)
    sess = session(awq_model("DequantAWQ", K, N, G))
    w = sess.run(None, {"qweight": qw, "qzeros": qz, "scales": sc})[0]
    assert w.dtype == np.float16 and w.shape == (K, N)
    assert np.array_equal(w.view(np.uint16), awq.dequantize(qw, qz, sc, G, K, N).view(np.uint16))


def test_schema_checker_and_shape_inference():
    domain.register_schemas()
    for op in ("MatMulAWQ", "DequantAWQ"):
        m = awq_model(op, 688, 136, 128, a_dtype=np.float16, bias=True)
        onnx.checker.check_model(m, full_check=True)


def _run_error(model, feeds):
    sess = session(model)
    with pytest.raises(Exception) as ei:
        sess.run(None, feeds)
    return str(ei.value)


def test_cpu_bad_inputs_name_the_input():
    K, N, G = 688, 136, 128  # noqa: N806
    qw, qz, sc = weights(K, N, G)
    a = activations((1, K), np.float32)
    m = awq_model("MatMulAWQ", K, N, G, name="proj")
    msg = _run_error(m, {"A": a, "qweight": qw, "qzeros": qz[:-1], "scales": sc})
    assert "qzeros" in msg and "[6, 17]" in msg and "[5, 17]" in msg and "proj" in msg and "MatMulAWQ" in msg
    msg = _run_error(awq_model("DequantAWQ", K, N, G, name="dq"), {"qweight": qw, "qzeros": qz[:, :-1], "scales": sc})
    assert "qzeros" in msg and "[6, 17]" in msg and "dq" in msg
    mb = awq_model("MatMulAWQ", K, N, G, bias=True)
    msg = _run_error(mb, {"A": a, "qweight": qw, "qzeros": qz, "scales": sc, "bias": np.zeros(N - 8, np.float32)})
    assert "bias" in msg and f"[{N}]" in msg


def test_cpu_bad_attributes_fail_at_creation():
    for attrs, word in [({"group_size": 128, "K": 688, "N": 132}, "'N'"), ({"group_size": 0, "K": 688, "N": 136},
                                                                          "'group_size'"),
                        ({"group_size": 128, "K": 0, "N": 136}, "'K'")]:
        with pytest.raises(Exception) as ei:
            session(awq_model("MatMulAWQ", 688, 136, 128, attrs=attrs, name="bad"))
        assert word in str(ei.value) and "bad" in str(ei.value)


def test_host_entry_points_check_inputs():
    from onnx_lowbit.custom_ops import KernelError
    from onnx_lowbit.custom_ops.awq import dequantawq_cpu, matmulawq_cpu
    qw, qz, sc = weights(128, 8)
    with pytest.raises(KernelError, match="'A' must have last dimension K=128"):
        matmulawq_cpu.matmul(np.zeros((1, 127), np.float32), qw, qz, sc, 128, 128, 8)
    with pytest.raises(KernelError, match="'scales' must be float16"):
        dequantawq_cpu.dequantize(qw, qz, sc.astype(np.float32), 128, 128, 8)
    with pytest.raises(KernelError, match="'qweight' must have shape \\[128, 1\\]"):
        dequantawq_cpu.dequantize(qw[:64], qz, sc, 128, 128, 8)

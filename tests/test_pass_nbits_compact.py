"""weights4 with --target ort --ort-form compact (passes/nbits_compact.py): onnxruntime's MatMulNBits in its compact
symmetric form (block 32, no zero points, scales in the model's dtype), quantised exactly as onnxruntime's own
quantiser does, run on stock onnxruntime's CPU EP."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits

from onnx_lowbit import cli
from onnx_lowbit.passes import run_passes
from onnx_lowbit.passes.nbits_compact import dequantize, quantize_symmetric


@pytest.mark.parametrize("K,N,bs,dtype", [(64, 16, 32, np.float32), (80, 24, 32, np.float32),
                                          (256, 8, 128, np.float32), (64, 16, 32, np.float16)])
def test_same_codes_as_onnxruntime_quantiser(K, N, bs, dtype):
    """B and scales byte for byte those of onnxruntime's quantize_matmul_4bits(is_symmetric=True) (B's rows past K
    excepted: padding, which MatMulNBits never reads; ours are code 8, onnxruntime's 0)."""
    w = np.random.default_rng(K + N).standard_normal((K, N)).astype(dtype)
    nb = -(-K // bs)
    packed, scales = np.zeros((N, nb, bs // 2), np.uint8), np.zeros(N * nb, dtype)
    quantize_matmul_4bits(packed, w, scales, np.zeros(N * ((nb + 1) // 2), np.uint8), bs, N, K, True)
    b, sc, q, s32 = quantize_symmetric(w, bs, dtype)
    assert sc.dtype == dtype and np.array_equal(sc, scales)
    whole = (K // bs) * (bs // 2)                        # bytes of each column that hold rows < K only
    assert np.array_equal(b.reshape(N, -1)[:, :whole], packed.reshape(N, -1)[:, :whole])
    if K % bs:
        rest = (K % bs) // 2
        assert np.array_equal(b.reshape(N, nb, -1)[:, -1, :rest], packed[:, -1, :rest])
    # the value of largest magnitude of each block is code 0; the others within half a step, or one step where
    # they clip at code 15 (+7 steps: the grid holds -8..+7 steps)
    w_hat = dequantize(q, s32, K, bs)
    step = np.repeat(np.abs(s32), bs, axis=0)[:K].astype(np.float64)
    err = np.abs(w_hat - w.astype(np.float64))
    clipped = q[:K] == 15
    assert np.all(err[~clipped] <= step[~clipped] * 0.5 * (1 + 1e-3) + 1e-7)
    assert np.all(err[clipped] <= step[clipped] * (1 + 1e-3) + 1e-7)
    g = np.zeros((nb * bs, N), np.float32)
    g[:K] = w
    extreme = np.argmax(np.abs(g.reshape(nb, bs, N)), axis=1)
    assert np.all(np.take_along_axis(q.reshape(nb, bs, N), extreme[:, None, :], axis=1) == 0)


def mlp(dtype, K=64, N=96, seed=0):
    """x [B, K] -> MatMul + Add(bias) -> Relu -> MatMul -> y."""
    rng = np.random.default_rng(seed)
    et = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits = [numpy_helper.from_array((rng.standard_normal((K, N)) / np.sqrt(K)).astype(dtype), "w1"),
             numpy_helper.from_array((rng.standard_normal(N) * 0.1).astype(dtype), "b1"),
             numpy_helper.from_array((rng.standard_normal((N, K)) / np.sqrt(N)).astype(dtype), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", et, ["B", K])],
                          [helper.make_tensor_value_info("y", et, ["B", K])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_compact_form_runs_in_stock_onnxruntime(dtype):
    m = mlp(dtype)
    out, rep = run_passes(m, ["weights4"], weights="awq", weights_target="ort", weights_ort_form="compact",
                          weights_min_elements=1)
    nbits = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 and not [n for n in out.graph.node if n.op_type == "Add"]   # bias: input 5
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    for n in nbits:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["block_size"] == 32 and attrs["bits"] == 4
        assert len(n.input) in (3, 6) and all(not i for i in n.input[3:5])          # no zero points, no g_idx
        assert inits[n.input[2]].dtype == dtype                                      # scales in A's dtype
    for e in rep.rewritten("weights4"):
        assert e.details["ort_form"] == "compact" and "compact form" in e.reason
        assert 0.05 < e.details["rel_error"] < 0.15                                   # 4-bit, block 32
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(dtype)
    got = run(out, x).astype(np.float64)
    # (1) exactly the product with the dequantised weights (onnxruntime's CPU kernel runs fp32 inside)
    w = {n.input[1]: n for n in nbits}
    q1 = quantize_symmetric(numpy_helper.to_array([t for t in m.graph.initializer if t.name == "w1"][0]), 32, dtype)
    q2 = quantize_symmetric(numpy_helper.to_array([t for t in m.graph.initializer if t.name == "w2"][0]), 32, dtype)
    assert len(w) == 2
    b1 = numpy_helper.to_array([t for t in m.graph.initializer if t.name == "b1"][0]).astype(np.float64)
    h = np.maximum(x.astype(np.float64) @ dequantize(q1[2], q1[3], 64, 32) + b1, 0)
    if dtype == np.float16:
        h = h.astype(np.float16).astype(np.float64)
    ref = h @ dequantize(q2[2], q2[3], 96, 32)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (2e-3 if dtype == np.float16 else 1e-5)
    # (2) the float model, within 4-bit tolerance
    flt = run(m, x).astype(np.float64)
    assert np.linalg.norm(got - flt) / np.linalg.norm(flt) < 0.2


def test_default_form_unchanged_and_options_checked():
    out, rep = run_passes(mlp(np.float16), ["weights4"], weights="awq", weights_target="ort", weights_min_elements=1)
    nbits = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(len(n.input) >= 4 and n.input[3] for n in nbits)             # AWQ's zero points
    for bad, match in ((dict(weights_target="lowbit"), "needs weights='awq' and weights_target='ort'"),
                       (dict(weights="nf4"), "needs weights='awq'"), (dict(weights_ort_form="fast"), "not one of"),
                       (dict(calibration={"x": np.zeros((4, 64), np.float16)}), "not with an AWQ checkpoint")):
        opts = {**dict(weights="awq", weights_target="ort", weights_ort_form="compact"), **bad}
        with pytest.raises(ValueError, match=match):
            run_passes(mlp(np.float16), ["weights4"], **opts)
    out, rep = run_passes(mlp(np.float16), ["weights4"], weights="awq", weights_target="ort", group_size=64,
                          weights_ort_form="compact", weights_min_elements=1)
    assert {e.details["group_size"] for e in rep.rewritten("weights4")} == {64}


def test_cli_ort_form(tmp_path, capsys):
    import onnx
    src, dst = str(tmp_path / "m.onnx"), str(tmp_path / "o.onnx")
    onnx.save(mlp(np.float16, K=64, N=128), src)
    assert cli.main(["rewrite", src, dst, "--weights", "awq", "--target", "ort", "--ort-form", "compact"]) == 0
    out = onnx.load(dst)
    nbits = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(len([i for i in n.input if i]) in (3, 4) for n in nbits)
    assert cli.main(["rewrite", src, dst + "2", "--ort-form", "compact"]) == 2
    assert "--ort-form needs --weights" in capsys.readouterr().err

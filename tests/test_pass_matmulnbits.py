"""Pass matmulnbits (passes/matmulnbits.py) and the MatMulNBits -> AWQ conversion (onnx_lowbit/matmulnbits.py), on
graphs spelled as onnxruntime-genai's model builder writes them (built here with onnx.helper: the builder itself is
exercised in tests/test_genai.py when onnxruntime-genai is installed).

genai's int4 MLP: gate = MatMulNBits(x), up = MatMulNBits(x), Mul(Mul(gate, Sigmoid(gate)), up), down =
MatMulNBits; B uint8 [N, K/32, 16], scales [N, K/32] in A's dtype, no zero points (symmetric, zero point 8)."""
import numpy as np
import onnxruntime as ort
import pytest
from helpers import checked_rewrite, run_cpu
from onnx import TensorProto, helper, numpy_helper

from onnx_lowbit import awq, matmulnbits
from onnx_lowbit.passes.weights4_quant import nbits_layout

MS = "com.microsoft"


def nbits_weight(K, N, bs, dtype, zero_points, seed):
    """Random MatMulNBits tensors (B, scales, zero_points or None) of a [K, N] weight."""
    rng = np.random.default_rng(seed)
    nb = -(-K // bs)
    q = rng.integers(0, 16, (nb * bs, N)).astype(np.uint8)
    z = rng.integers(0, 16, (nb, N)).astype(np.uint8) if zero_points else np.full((nb, N), 8, np.uint8)
    s = (rng.uniform(0.5, 2.0, (nb, N)) * 0.02).astype(dtype)
    qweight, qzeros = awq.pack_int4(q), awq.pack_int4(z)
    b, sc, zp = nbits_layout(qweight, qzeros, s.astype(np.float16), nb * bs, bs, dtype)
    sc = s.T.reshape(-1)  # the scales in their own dtype (nbits_layout goes through fp16)
    return b, sc.reshape(N, nb), (zp if zero_points else None)


def nbits_node(name, x, y, K, N, bs, b, s, zp, inits, bits=4):
    inits += [numpy_helper.from_array(b, f"{name}_B"), numpy_helper.from_array(s, f"{name}_s")]
    ins = [x, f"{name}_B", f"{name}_s"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, f"{name}_zp"))
        ins.append(f"{name}_zp")
    return helper.make_node("MatMulNBits", ins, [y], domain=MS, name=name, K=K, N=N, bits=bits, block_size=bs)


def genai_mlp(K=64, N=128, bs=32, dtype=np.float16, zero_points=False, up_first=False, sig_first=False,
              extra_reader=False, seed=0):
    """x [B, S, K] -> genai's int4 SwiGLU MLP -> y [B, S, K] (and 'gate' as a second output with extra_reader)."""
    et = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits, nodes = [], []
    for i, (nm, k, n, out) in enumerate((("gate", K, N, "g"), ("up", K, N, "u"))):
        b, s, zp = nbits_weight(k, n, bs, dtype, zero_points, seed + i)
        nodes.append(nbits_node(nm, "x", out, k, n, bs, b, s, zp, inits))
    nodes.append(helper.make_node("Sigmoid", ["g"], ["sg"], name="act_fn/Sigmoid"))
    nodes.append(helper.make_node("Mul", ["sg", "g"] if sig_first else ["g", "sg"], ["a"], name="act_fn/Mul"))
    nodes.append(helper.make_node("Mul", ["u", "a"] if up_first else ["a", "u"], ["m"], name="mlp/Mul"))
    b, s, zp = nbits_weight(N, K, bs, dtype, zero_points, seed + 2)
    nodes.append(nbits_node("down", "m", "y", N, K, bs, b, s, zp, inits))
    outs = [helper.make_tensor_value_info("y", et, ["B", "S", K])]
    if extra_reader:
        outs.append(helper.make_tensor_value_info("g", et, ["B", "S", N]))
    g = helper.make_graph(nodes, "genai_mlp", [helper.make_tensor_value_info("x", et, ["B", "S", K])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10)


def ops(model):
    return sorted((n.domain, n.op_type) for n in model.graph.node)


def rel_to_onnxruntime(m, out, shape, dtype, seed):
    """Relative L2 difference of ``out`` (our session) from ``m`` (onnxruntime alone) on one random x of ``shape``."""
    x = (np.random.default_rng(seed).standard_normal(shape)).astype(dtype)
    want = run_cpu(m, {"x": x}, ours=False)["y"].astype(np.float32)
    got = run_cpu(out, {"x": x})["y"].astype(np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def ort_dequant(b, s, zp, K, N, bs):
    """onnxruntime's own MatMulNBits on A = identity [K, K] (fp16): its dequantised weight, rounded to fp16."""
    inits = []
    node = nbits_node("w", "a", "y", K, N, bs, b, s, zp, inits)
    g = helper.make_graph([node], "dq", [helper.make_tensor_value_info("a", TensorProto.FLOAT16, [K, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [K, N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)], ir_version=10)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"a": np.eye(K, dtype=np.float16)})[0]


@pytest.mark.parametrize("K,N,bs,zero_points", [(64, 128, 32, False), (64, 24, 32, True), (80, 16, 32, True),
                                                 (256, 32, 128, False), (96, 8, 16, True), (64, 16, 64, False)])
def test_conversion_bit_exact(K, N, bs, zero_points):
    """AWQ's dequantised fp16 weight of the converted tensors == onnxruntime's MatMulNBits weight (fp16), bit for
    bit; and == the numpy reading of MatMulNBits (matmulnbits.dequantize)."""
    b, s, zp = nbits_weight(K, N, bs, np.float16, zero_points, seed=K + N)
    qweight, qzeros, scales, rel = matmulnbits.to_awq(b, s, zp, K, N, bs)
    assert rel == 0.0
    ours = awq.dequantize(qweight, qzeros, scales, bs, K, N)
    ref = matmulnbits.dequantize(b, s, zp, K, N, bs, np.float16)
    theirs = ort_dequant(b, s, zp, K, N, bs)
    assert ours.dtype == theirs.dtype == np.float16
    assert np.array_equal(ours.view(np.uint16), ref.view(np.uint16))
    assert np.array_equal(ours.view(np.uint16), theirs.view(np.uint16))


def test_conversion_round_trip_with_weights4_layout():
    """to_awq inverts weights4's nbits_layout (the --target ort writer): the same packed AWQ tensors back."""
    rng = np.random.default_rng(3)
    K, N, bs = 64, 16, 32
    q, z = rng.integers(0, 16, (K, N)), rng.integers(0, 16, (K // bs, N))
    s = (rng.uniform(0.01, 0.05, (K // bs, N))).astype(np.float16)
    qweight, qzeros, s16 = awq.pack(q, z, s)
    b, sc, zp = nbits_layout(qweight, qzeros, s16, K, bs, np.float16)
    back = matmulnbits.to_awq(b, sc, zp, K, N, bs)
    assert np.array_equal(back[0], qweight) and np.array_equal(back[1], qzeros) and np.array_equal(back[2], s16)


def test_fp32_scales_need_lossy():
    K, N, bs = 64, 16, 32
    b, s, zp = nbits_weight(K, N, bs, np.float32, False, seed=1)
    with pytest.raises(ValueError, match="not lossless"):
        matmulnbits.to_awq(b, s, zp, K, N, bs)
    *_, rel = matmulnbits.to_awq(b, s, zp, K, N, bs, lossy=True)
    assert 0.0 < rel < 1e-3                      # fp16 scales: about 2^-12 relative


def test_bad_tensors_raise():
    with pytest.raises(ValueError, match="multiple of 8"):
        matmulnbits.to_awq(np.zeros((12, 2, 16), np.uint8), np.ones(24, np.float16), None, 64, 12, 32)
    with pytest.raises(ValueError, match="B must be uint8"):
        matmulnbits.unpack(np.zeros((16, 2, 8), np.uint8), np.ones(32, np.float16), None, 64, 16, 32)


@pytest.mark.parametrize("up_first,sig_first,zero_points", [(False, False, False), (True, True, True)])
def test_genai_mlp_fused(up_first, sig_first, zero_points):
    """matmulnbits + ffn: one FusedFFNAWQ on the same integers, the down projection stays MatMulNBits; the output
    agrees with onnxruntime's unfused graph within fp16 summation order."""
    m = genai_mlp(up_first=up_first, sig_first=sig_first, zero_points=zero_points)
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"], check=False)
    assert ops(out) == [("com.microsoft", "MatMulNBits"), ("onnx_lowbit", "FusedFFNAWQ")]
    [conv] = rep.rewritten("matmulnbits")
    assert "lossless" in conv.reason and conv.details["group_size"] == 32
    assert len(rep.rewritten("ffn")) == 1
    rel = rel_to_onnxruntime(m, out, (2, 3, 64), np.float16, 5)
    assert rel < 2e-3, rel


def test_named_with_default_passes():
    """Not a default pass: the defaults leave MatMulNBits (ffn's skip names this pass); named with them, fplut's
    SiLU is read by ffn and the block is fused."""
    out, rep = checked_rewrite(genai_mlp(), None, check=False)
    assert ("onnx_lowbit", "FusedFFNAWQ") not in ops(out)
    assert any("matmulnbits pass" in e.reason for e in rep.skipped("ffn"))
    out, rep = checked_rewrite(genai_mlp(), ["fplut", "matmulnbits", "ffn"], check=False)
    assert ("onnx_lowbit", "FusedFFNAWQ") in ops(out) and ("onnx_lowbit", "FPLUT") not in ops(out)


def test_fp32_scales_skipped_unless_lossy():
    m = genai_mlp(dtype=np.float32)
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"], check=False)
    assert ops(out) == ops(m)
    [skip] = rep.skipped("matmulnbits")
    assert "float32" in skip.reason and "matmulnbits_lossy" in skip.reason
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"], check=False, matmulnbits_lossy=True)
    assert ("onnx_lowbit", "FusedFFNAWQ") in ops(out)
    assert "lossy" in rep.rewritten("matmulnbits")[0].reason
    assert rel_to_onnxruntime(m, out, (1, 4, 64), np.float32, 6) < 2e-3


def test_skips_and_target_ort():
    m = genai_mlp(extra_reader=True)
    out, rep = checked_rewrite(m, ["matmulnbits"], check=False)
    assert ops(out) == ops(m)
    assert "also read outside" in rep.skipped("matmulnbits")[0].reason
    out, rep = checked_rewrite(genai_mlp(), ["matmulnbits", "ffn"], check=False, weights_target="ort")
    assert ops(out) == ops(genai_mlp()) and not list(rep.rewritten("matmulnbits"))
    m8 = genai_mlp()
    for n in m8.graph.node:
        if n.name == "gate":
            for a in n.attribute:
                if a.name == "bits":
                    a.i = 8
    out, rep = checked_rewrite(m8, ["matmulnbits"], check=False)
    assert "bits=8" in rep.skipped("matmulnbits")[0].reason


def test_float_genai_mlp_fused_by_ffn():
    """genai's fp16 / fp32 MLP (MatMul gate/up, Sigmoid, Mul, Mul) needs no conversion: ffn fuses it."""
    rng = np.random.default_rng(0)
    K, N = 32, 64
    inits = [numpy_helper.from_array((rng.standard_normal((K, N)) * 0.1).astype(np.float32), n) for n in "GU"]
    inits.append(numpy_helper.from_array((rng.standard_normal((N, K)) * 0.1).astype(np.float32), "D"))
    nodes = [helper.make_node("MatMul", ["x", "G"], ["g"]), helper.make_node("MatMul", ["x", "U"], ["u"]),
             helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["a"]),
             helper.make_node("Mul", ["a", "u"], ["m"]), helper.make_node("MatMul", ["m", "D"], ["y"])]
    g = helper.make_graph(nodes, "f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", K])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"])
    assert ("onnx_lowbit", "FusedFFN") in ops(out) and not list(rep.rewritten("matmulnbits"))
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    np.testing.assert_allclose(run_cpu(out, {"x": x})["y"], run_cpu(m, {"x": x}, ours=False)["y"], rtol=1e-4,
                               atol=1e-5)


def genai_fused_mlp(K=64, N=128, bs=32, dtype=np.float16, zero_points=False, gate_second=False, sizes=False,
                    bits=4, seed=0):
    """genai's int4 MLP built with --extra_options fuse_mlp_gate_up=true: gu = MatMulNBits(x) of N = 2 n columns
    (gate's, then up's; up's first with gate_second), gate, up = Split(gu, axis=-1, num_outputs=2) (or split =
    [n, n] with sizes), Mul(Mul(gate, Sigmoid(gate)), up), down = MatMulNBits. Returns (model, the gate_up
    tensors (b, s, zp))."""
    et = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits, nodes = [], []
    b, s, zp = nbits_weight(K, 2 * N, bs, dtype, zero_points, seed)
    nodes.append(nbits_node("gate_up", "x", "gu", K, 2 * N, bs, b, s, zp, inits, bits=bits))
    if sizes:
        inits.append(numpy_helper.from_array(np.array([N, N], np.int64), "sizes"))
        nodes.append(helper.make_node("Split", ["gu", "sizes"], ["h0", "h1"], name="split", axis=-1))
    else:
        nodes.append(helper.make_node("Split", ["gu"], ["h0", "h1"], name="split", axis=-1, num_outputs=2))
    g, u = ("h1", "h0") if gate_second else ("h0", "h1")
    nodes.append(helper.make_node("Sigmoid", [g], ["sg"], name="act_fn/Sigmoid"))
    nodes.append(helper.make_node("Mul", [g, "sg"], ["a"], name="act_fn/Mul"))
    nodes.append(helper.make_node("Mul", ["a", u], ["m"], name="mlp/Mul"))
    db, ds, dz = nbits_weight(N, K, bs, dtype, zero_points, seed + 2)
    nodes.append(nbits_node("down", "m", "y", N, K, bs, db, ds, dz, inits))
    graph = helper.make_graph(nodes, "genai_fused_mlp", [helper.make_tensor_value_info("x", et, ["B", "S", K])],
                              [helper.make_tensor_value_info("y", et, ["B", "S", K])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                          ir_version=10)
    return m, (b, s, zp)


@pytest.mark.parametrize("K,N,bs,zero_points,gate_second,sizes", [(64, 128, 32, False, False, False),
                                                                  (64, 64, 32, True, True, True),
                                                                  (96, 32, 64, True, False, False)])
def test_genai_fused_gate_up_mlp(K, N, bs, zero_points, gate_second, sizes):
    """The fused gate_up MatMulNBits + Split: cut into its two halves of columns, one FusedFFNAWQ whose W1 / W3
    dequantise bit for bit to onnxruntime's own gate_up weight's gate / up columns; the output agrees with
    onnxruntime's unfused graph within fp16 summation order."""
    m, (b, s, zp) = genai_fused_mlp(K, N, bs, zero_points=zero_points, gate_second=gate_second, sizes=sizes)
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"], check=False)
    assert ops(out) == [("com.microsoft", "MatMulNBits"), ("onnx_lowbit", "FusedFFNAWQ")]
    [conv] = rep.rewritten("matmulnbits")
    assert "lossless" in conv.reason and "gate_up -> Split" in conv.pattern
    assert conv.details["N"] == N and conv.details["zero_points"] == zero_points
    [fused] = [n for n in out.graph.node if n.op_type == "FusedFFNAWQ"]
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    w1, w3 = (awq.dequantize(*(inits[n] for n in fused.input[i:i + 3]), bs, K, N) for i in (1, 4))
    both = ort_dequant(b, s, zp, K, 2 * N, bs)
    gate_cols, up_cols = (both[:, N:], both[:, :N]) if gate_second else (both[:, :N], both[:, N:])
    assert np.array_equal(w1.view(np.uint16), gate_cols.view(np.uint16))
    assert np.array_equal(w3.view(np.uint16), up_cols.view(np.uint16))
    assert rel_to_onnxruntime(m, out, (2, 3, K), np.float16, 7) < 2e-3


def test_genai_fused_gate_up_skips():
    """bits=8 (genai's -p int8), fp32 scales (-e cpu) without the lossy option: skipped with the reason, the graph
    unchanged; with matmulnbits_lossy the fp32 one converts and runs close to onnxruntime's."""
    m8, _ = genai_fused_mlp(bits=8)
    out, rep = checked_rewrite(m8, ["matmulnbits", "ffn"], check=False)
    assert ops(out) == ops(m8)
    assert "bits=8" in rep.skipped("matmulnbits")[0].reason and "gate_up" in rep.skipped("matmulnbits")[0].pattern
    assert "bits=8" in rep.skipped("ffn")[0].reason
    m32, _ = genai_fused_mlp(dtype=np.float32)
    out, rep = checked_rewrite(m32, ["matmulnbits", "ffn"], check=False)
    assert ops(out) == ops(m32) and "float32" in rep.skipped("matmulnbits")[0].reason
    out, rep = checked_rewrite(m32, ["matmulnbits", "ffn"], check=False, matmulnbits_lossy=True)
    assert ("onnx_lowbit", "FusedFFNAWQ") in ops(out) and ("", "Split") not in ops(out)
    x = (np.random.default_rng(8).standard_normal((1, 4, 64))).astype(np.float32)
    want, got = run_cpu(m32, {"x": x}, ours=False)["y"], run_cpu(out, {"x": x})["y"]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_half_failing_leaves_the_block_untouched():
    """The up half of an fp32 gate_up fails to convert (a scale past fp16's range) after the gate half converted:
    the block is skipped with the reason and the graph keeps no node of the gate half (same ops, same output)."""
    m, _ = genai_fused_mlp(dtype=np.float32)
    init = next(t for t in m.graph.initializer if t.name == "gate_up_s")
    s = numpy_helper.to_array(init).copy()
    s[-1, 0] = 1e6                                                # the last column: up's half
    init.CopyFrom(numpy_helper.from_array(s, "gate_up_s"))
    out, rep = checked_rewrite(m, ["matmulnbits"], matmulnbits_lossy=True)
    assert ops(out) == ops(m) and "overflows fp16" in rep.skipped("matmulnbits")[0].reason
    assert not list(rep.rewritten("matmulnbits"))
    x = (np.random.default_rng(9).standard_normal((1, 2, 64))).astype(np.float32)
    np.testing.assert_array_equal(run_cpu(out, {"x": x}, ours=False)["y"], run_cpu(m, {"x": x}, ours=False)["y"])


# ---------------------------------------------------------------------------------------------- the int4 target
def _set_level(model, level):
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            n.attribute.append(helper.make_attribute("accuracy_level", level))
    return model


@pytest.mark.parametrize("K,N,bs,dtype", [(64, 24, 32, np.float16), (256, 8, 128, np.float32),
                                          (64, 16, 64, np.float32)])
def test_to_int4_exact(K, N, bs, dtype):
    """MatMulNF4 int4's float32 weight == MatMulNBits' (q - 8) * s, bit for bit, for fp16 and fp32 scales (no zero
    points, or all 8); == onnxruntime's own MatMulNBits weight (fp16 models: its fp16 rounding of it)."""
    from onnx_lowbit import nf4
    b, s, _ = nbits_weight(K, N, bs, dtype, False, seed=K + N)
    ref = matmulnbits.dequantize(b, s, None, K, N, bs, np.float32)
    for zp in (None, np.full(N * ((K // bs + 1) // 2), 0x88, np.uint8)):
        packed, absmax = matmulnbits.to_int4(b, s, zp, K, N, bs)
        assert packed.dtype == np.uint8 and packed.size == K * N // 2 and absmax.dtype == np.float32
        ours = nf4.dequantize(packed, absmax, "int4", bs, K, N)
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    if dtype == np.float16:
        theirs = ort_dequant(b, s, None, K, N, bs)
        assert np.array_equal(ours.astype(np.float16).view(np.uint16), theirs.view(np.uint16))


def test_to_int4_refusals():
    b, s, zp = nbits_weight(64, 16, 32, np.float16, True, seed=2)
    with pytest.raises(ValueError, match="zero points other than 8"):
        matmulnbits.to_int4(b, s, zp, 64, 16, 32)
    b, s, _ = nbits_weight(80, 16, 32, np.float16, False, seed=3)
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        matmulnbits.to_int4(b, s, None, 80, 16, 32)
    b, s, _ = nbits_weight(64, 16, 16, np.float16, False, seed=4)
    with pytest.raises(ValueError, match="MatMulNF4 takes powers of two in 32..4096"):
        matmulnbits.to_int4(b, s, None, 64, 16, 16)
    b, s, _ = nbits_weight(64, 16, 32, np.float32, False, seed=5)
    with pytest.raises(ValueError, match="overflows"):
        matmulnbits.to_int4(b, np.full_like(s, 1e38), None, 64, 16, 32)


@pytest.mark.parametrize("dtype,level", [(np.float16, 0), (np.float32, 4), (np.float32, 0)])
def test_int4_target_every_product(dtype, level):
    """matmulnbits_to=int4: gate, up AND down become MatMulNF4 int4 (the node's accuracy_level), ffn fuses the pair
    into FusedFFNNF4; the output agrees with onnxruntime's graph (at level 4: the same int8 activations, fp32 sums in
    another order)."""
    m = _set_level(genai_mlp(dtype=dtype), level)
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"], check=False, matmulnbits_to="int4")
    assert ops(out) == [("onnx_lowbit", "FusedFFNNF4"), ("onnx_lowbit", "MatMulNF4")]
    conv = rep.rewritten("matmulnbits")
    assert len(conv) == 3 and all(e.reason == "MatMulNBits -> MatMulNF4 int4 (lossless)" for e in conv)
    assert {e.details["accuracy_level"] for e in conv} == {level}
    assert all(a.s == b"int4" for n in out.graph.node for a in n.attribute if a.name == "quant_type")
    rel = rel_to_onnxruntime(m, out, (2, 3, 64), dtype, 8)
    assert rel < (2e-3 if dtype == np.float16 else 1e-5), rel


@pytest.mark.parametrize("gate_second,sizes", [(False, False), (True, True)])
def test_int4_target_fused_gate_up(gate_second, sizes):
    """The fused gate_up product + Split: two MatMulNF4 halves (the Split gone), fused by ffn; outputs agree."""
    m, _ = genai_fused_mlp(dtype=np.float32, gate_second=gate_second, sizes=sizes)
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"], check=False, matmulnbits_to="int4")
    assert ops(out) == [("onnx_lowbit", "FusedFFNNF4"), ("onnx_lowbit", "MatMulNF4")]
    split = [e for e in rep.rewritten("matmulnbits") if "Split" in e.pattern]
    assert len(split) == 1 and len(split[0].details["new_nodes"]) == 2
    assert rel_to_onnxruntime(m, out, (1, 5, 64), np.float32, 9) < 1e-5


def test_int4_target_skips_and_bad_option():
    """Zero points other than 8 and bits=8 stay MatMulNBits, each reported; an unknown target is refused."""
    m = genai_mlp(zero_points=True)
    out, rep = checked_rewrite(m, ["matmulnbits", "ffn"], check=False, matmulnbits_to="int4")
    assert ops(out) == ops(m)
    assert len(rep.skipped("matmulnbits")) == 3
    assert all("zero points other than 8" in e.reason for e in rep.skipped("matmulnbits"))
    m8, _ = genai_fused_mlp(bits=8)             # gate_up 8-bit, down 4-bit
    out, rep = checked_rewrite(m8, ["matmulnbits"], check=False, matmulnbits_to="int4")
    [skip], [done] = rep.skipped("matmulnbits"), rep.rewritten("matmulnbits")
    assert "bits=8" in skip.reason and skip.nodes == ("gate_up",) and done.nodes == ("down",)
    with pytest.raises(Exception, match="matmulnbits_to must be one of awq, int4"):
        checked_rewrite(genai_mlp(), ["matmulnbits"], check=False, matmulnbits_to="nf4")


@pytest.mark.parametrize("config_provider,args,want", [
    ([], [], "MatMulNF4"),                                                 # the default: the int4 target; on the
    ([{"cuda": {}}], ["--provider", "cuda"], "FusedFFNNF4"),               # CPU the products alone, on CUDA fused
    ([], ["--to", "awq"], "FusedFFNAWQ")])                                 # --to awq: the SwiGLU pairs only, fused
def test_genai_cli_target(tmp_path, config_provider, args, want):
    """onnx-lowbit genai on a genai-shaped folder (genai_config.json + model.onnx; genai itself not needed): every
    MatMulNBits to MatMulNF4 int4 by default (on the CPU not fused: genai_config.CPU_PASSES), --to awq the SwiGLU
    pairs to MatMulAWQ, fused (ffn added to the CPU default for it)."""
    import json
    import os

    import onnx

    from onnx_lowbit import cli
    src, dst = tmp_path / "src", tmp_path / "dst"
    os.makedirs(src)
    onnx.save(genai_mlp(), str(src / "model.onnx"))
    cfg = {"model": {"decoder": {"filename": "model.onnx", "session_options": {"provider_options": config_provider}}}}
    (src / "genai_config.json").write_text(json.dumps(cfg))
    assert cli.main(["genai", str(src), str(dst)] + args) == 0
    got = onnx.load(str(dst / "model.onnx"))
    assert ("onnx_lowbit", want) in ops(got)
    assert (("com.microsoft", "MatMulNBits") in ops(got)) == (want == "FusedFFNAWQ")    # down stays for awq
    assert (("onnx_lowbit", "FusedFFNNF4") in ops(got)) == (want == "FusedFFNNF4")


def test_int4_target_malformed_tensors_skipped():
    """A B whose size does not hold N columns of K / block blocks: skipped with the reason, no numpy error."""
    m = genai_mlp(dtype=np.float32)
    for t in m.graph.initializer:
        if t.name == "gate_B":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).reshape(-1)[:-16].copy(), "gate_B"))
    out, rep = checked_rewrite(m, ["matmulnbits"], check=False, matmulnbits_to="int4")
    [skip] = rep.skipped("matmulnbits")
    assert skip.nodes == ("gate",) and "do not hold N=128 columns" in skip.reason
    assert len(rep.rewritten("matmulnbits")) == 2

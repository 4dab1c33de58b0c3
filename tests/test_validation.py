"""Every op checks its attributes when onnxruntime creates the kernel and its inputs at each run, and fails with an
onnxruntime error naming the op, the node, the attribute or input, and the value it expected; NaN/Inf inputs give
the outputs docs/reliability.md defines. CPU kernels through onnxruntime sessions; the CUDA faces share the same
checks (custom_ops/nf4/common.py, dequantawq_cpu.parse_attrs/check_*) and are run under the simulator in
test_nf4_kernels / test_awq_kernels / test_fplut_cuda."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_lowbit
from helpers import seed_table
from onnx_lowbit import awq, domain, fplut, nf4

CPU = ["CPUExecutionProvider"]
ET = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
      np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int32): TensorProto.INT32,
      np.dtype(np.int64): TensorProto.INT64}


def model(op, inputs, attrs, name="n0", out_type=TensorProto.FLOAT):
    """One node of ``op``; ``inputs``: [(name, elem type)] as graph inputs of unknown shape (so onnxruntime hands
    any shape to the kernel)."""
    node = helper.make_node(op, [n for n, _ in inputs], ["y"], domain=domain.DOMAIN, name=name, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                          [helper.make_tensor_value_info("y", out_type, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


def create_error(m) -> str:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    with pytest.raises(Exception) as ei:
        onnx_lowbit.InferenceSession(m, so, providers=CPU)
    return str(ei.value)


def run_error(m, feeds) -> str:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = onnx_lowbit.InferenceSession(m, so, providers=CPU)
    with pytest.raises(Exception) as ei:
        sess.run(None, feeds)
    return str(ei.value)


def expect(msg, *needles):
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


# ------------------------------------------------------------------------------------------------------ FPLUT
def _fplut_attrs(**over):
    a = fplut.node_attributes(seed_table())
    a.update(over)
    return a


_CUTS = list(fplut.node_attributes(seed_table())["cut_points"])


@pytest.mark.parametrize("attrs,needles", [
    (dict(cut_points=_CUTS[:5] + [_CUTS[6], _CUTS[5]] + _CUTS[7:]), ["cut_points", "strictly increasing"]),
    (dict(cut_points=_CUTS[:10]), ["cut_points", "11", "got 10"]),
    (dict(cut_points=_CUTS[:10] + [0.1]), ["cut_points", "fp16-representable"]),
    (dict(cut_points=_CUTS[:10] + [float("inf")]), ["cut_points", "finite"]),
    (dict(table=list(fplut.node_attributes(seed_table())["table"])[:258]), ["table", "259", "got 258"]),
    (dict(table=[float("nan")] * 259), ["table", "finite"]),
])
def test_fplut_bad_attributes_at_creation(attrs, needles):
    msg = create_error(model("FPLUT", [("x", TensorProto.FLOAT)], _fplut_attrs(**attrs), name="act7"))
    expect(msg, "onnx_lowbit.FPLUT", "act7", *needles)


def test_fplut_missing_attribute_and_bad_dtype():
    a = _fplut_attrs()
    del a["cut_points"]
    expect(create_error(model("FPLUT", [("x", TensorProto.FLOAT)], a, name="act8")),
           "FPLUT", "act8", "'cut_points'", "required")
    msg = create_error(model("FPLUT", [("x", TensorProto.INT32)], _fplut_attrs(), name="act9",
                             out_type=TensorProto.INT32))
    expect(msg, "FPLUT", "act9")  # onnxruntime's type check: int32 is not one of float/float16/bfloat16


# --------------------------------------------------------------------------------------------- NF4 / FP4 ops
K, N, BS = 64, 16, 32


def _nf4_weights(k=K, n=N, bs=BS, qt="nf4"):
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    return nf4.quantize(w, qt, bs)


def _nf4_attrs(**over):
    a = dict(quant_type="nf4", block_size=BS, K=K, N=N)
    a.update(over)
    return {k: v for k, v in a.items() if v is not None}


_NF4_IN = [("a", TensorProto.FLOAT), ("q", TensorProto.UINT8), ("am", TensorProto.FLOAT)]


@pytest.mark.parametrize("op", ["MatMulNF4", "DequantNF4"])
@pytest.mark.parametrize("over,needles", [
    (dict(quant_type="int3"), ["'quant_type'", "'nf4', 'fp4', 'int4'", "'int3'"]),
    (dict(block_size=48), ["'block_size'", "power of two in 32..4096", "48"]),
    (dict(block_size=8192), ["'block_size'", "8192"]),
    (dict(block_size=16), ["'block_size'", "16"]),
    (dict(K=0), ["'K'", "positive", "K=0"]),
    (dict(N=-3), ["'N'", "positive", "N=-3"]),
    (dict(N=None), ["'N'", "required"]),
])
def test_nf4_bad_attributes_at_creation(op, over, needles):
    ins = _NF4_IN if op == "MatMulNF4" else _NF4_IN[1:]
    expect(create_error(model(op, ins, _nf4_attrs(**over), name="w7")), f"onnx_lowbit.{op}", "w7", *needles)


def test_matmulnf4_bad_inputs_at_run():
    q, am = _nf4_weights()
    a = np.ones((2, K), np.float32)
    m = model("MatMulNF4", _NF4_IN, _nf4_attrs(), name="proj")
    expect(run_error(m, {"a": np.ones((2, K + 1), np.float32), "q": q, "am": am}),
           "onnx_lowbit.MatMulNF4", "proj", "input 0 'A'", "last dimension K=64", "[2, 65]")
    expect(run_error(m, {"a": np.ones((), np.float32), "q": q, "am": am}), "'A'", "K=64", "[]")
    expect(run_error(m, {"a": a, "q": q[:-1], "am": am}), "proj", "input 1 'Q'", "ceil(K*N/2) = 512", "[511]")
    expect(run_error(m, {"a": a, "q": q, "am": am[:-1]}), "proj", "input 2 'absmax'", "= 32", "[31]")
    mb = model("MatMulNF4", _NF4_IN + [("b", TensorProto.FLOAT)], _nf4_attrs(), name="projb")
    expect(run_error(mb, {"a": a, "q": q, "am": am, "b": np.zeros(N - 1, np.float32)}),
           "projb", "input 3 'bias'", "[16]", "[15]")
    expect(run_error(mb, {"a": a, "q": q, "am": am, "b": np.zeros((1, N), np.float32)}), "'bias'", "[16]", "[1, 16]")
    # the dtype of every input is checked by onnxruntime against the op's schema (type constraint T)
    msg = create_error(model("MatMulNF4", [("a", TensorProto.INT32)] + _NF4_IN[1:], _nf4_attrs(), name="pi"))
    expect(msg, "MatMulNF4", "pi")


def test_dequantnf4_bad_transposed_attribute():
    msg = create_error(model("DequantNF4", _NF4_IN[1:], _nf4_attrs(transposed=2), name="dqt"))
    expect(msg, "onnx_lowbit.DequantNF4", "dqt", "'transposed'", "0 (W [K, N]) or 1", "got 2")


def test_dequantnf4_bad_inputs_at_run():
    q, am = _nf4_weights()
    m = model("DequantNF4", _NF4_IN[1:], _nf4_attrs(), name="dq")
    expect(run_error(m, {"q": q[:100], "am": am}), "onnx_lowbit.DequantNF4", "dq", "input 0 'Q'", "512")
    expect(run_error(m, {"q": q, "am": np.ones(3, np.float32)}), "dq", "input 1 'absmax'", "32", "[3]")


# ------------------------------------------------------------------------------------------------------ AWQ ops
AK, AN, AG = 96, 16, 64  # Kp = 128: qweight [128, 2], qzeros [2, 2], scales [2, 16]


def _awq_weights():
    w = np.random.default_rng(0).standard_normal((AK, AN)).astype(np.float32)
    return awq.quantize_rtn(w, AG)


def _awq_attrs(**over):
    a = dict(group_size=AG, K=AK, N=AN)
    a.update(over)
    return {k: v for k, v in a.items() if v is not None}


_AWQ_IN = [("a", TensorProto.FLOAT), ("qw", TensorProto.INT32), ("qz", TensorProto.INT32), ("sc", TensorProto.FLOAT16)]


@pytest.mark.parametrize("op", ["MatMulAWQ", "DequantAWQ"])
@pytest.mark.parametrize("over,needles", [
    (dict(N=12), ["'N'", "multiple of 8", "12"]),
    (dict(N=0), ["'N'", "0"]),
    (dict(group_size=0), ["'group_size'", "positive", "0"]),
    (dict(group_size=-1), ["'group_size'", "-1"]),
    (dict(K=-5), ["'K'", "positive", "-5"]),
    (dict(K=None), ["'K'", "required"]),
])
def test_awq_bad_attributes_at_creation(op, over, needles):
    ins = _AWQ_IN if op == "MatMulAWQ" else _AWQ_IN[1:]
    msg = create_error(model(op, ins, _awq_attrs(**over), name="g7",
                             out_type=TensorProto.FLOAT if op == "MatMulAWQ" else TensorProto.FLOAT16))
    expect(msg, f"onnx_lowbit.{op}", "g7", *needles)


def test_matmulawq_bad_inputs_at_run():
    qw, qz, sc = _awq_weights()
    a = np.ones((3, AK), np.float32)
    m = model("MatMulAWQ", _AWQ_IN, _awq_attrs(), name="o_proj")
    ok = {"a": a, "qw": qw, "qz": qz, "sc": sc}
    for key, bad, needles in [
        ("a", np.ones((3, AK - 1), np.float32), ["input 0 'A'", "K=96", "[3, 95]"]),
        ("qw", qw[:AK], ["input 1 'qweight'", "[128, 2]", "[96, 2]", "rounded up to a multiple of group_size"]),
        ("qz", qz[:1], ["input 2 'qzeros'", "[2, 2]", "[1, 2]"]),
        ("sc", sc[:, :8], ["input 3 'scales'", "[2, 16]", "[2, 8]"]),
        ("qw", qw.reshape(-1), ["'qweight'", "[128, 2]", "[256]"]),
    ]:
        expect(run_error(m, {**ok, key: bad}), "onnx_lowbit.MatMulAWQ", "o_proj", *needles)
    mb = model("MatMulAWQ", _AWQ_IN + [("b", TensorProto.FLOAT)], _awq_attrs(), name="ob")
    expect(run_error(mb, {**ok, "b": np.zeros(AN + 8, np.float32)}), "ob", "input 4 'bias'", "[16]", "[24]")
    # qweight as int64 / scales as float32: onnxruntime refuses the type at session creation
    for i, t in ((1, TensorProto.INT64), (3, TensorProto.FLOAT)):
        ins = list(_AWQ_IN)
        ins[i] = (ins[i][0], t)
        expect(create_error(model("MatMulAWQ", ins, _awq_attrs(), name="ot")), "MatMulAWQ", "ot")


def test_dequantawq_bad_inputs_at_run():
    qw, qz, sc = _awq_weights()
    m = model("DequantAWQ", _AWQ_IN[1:], _awq_attrs(), name="dqa", out_type=TensorProto.FLOAT16)
    expect(run_error(m, {"qw": qw, "qz": qz, "sc": sc[:1]}), "onnx_lowbit.DequantAWQ", "dqa", "input 2 'scales'",
           "[2, 16]", "[1, 16]")
    expect(run_error(m, {"qw": qw[:, :1], "qz": qz, "sc": sc}), "dqa", "input 0 'qweight'", "[128, 2]")


def test_a_session_survives_a_bad_run():
    """A failed run is an error status, not a crash: the next good run of the same session works."""
    q, am = _nf4_weights()
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = onnx_lowbit.InferenceSession(model("MatMulNF4", _NF4_IN, _nf4_attrs(), name="p"), so, providers=CPU)
    with pytest.raises(Exception, match="'A'"):
        sess.run(None, {"a": np.ones((1, K + 3), np.float32), "q": q, "am": am})
    a = np.random.default_rng(2).standard_normal((1, K)).astype(np.float32)
    y = sess.run(None, {"a": a, "q": q, "am": am})[0]
    assert np.allclose(y, nf4.matmul(a, q, am, "nf4", BS, K, N), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------- NaN / Inf
def _session(m):
    return onnx_lowbit.InferenceSession(m, providers=CPU)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fplut_nan_inf(dtype):
    """FPLUT: NaN -> NaN; x is clamped to [c0, c10] first, so +Inf / -Inf give the table's value at the last /
    first cut point, like every finite input beyond them (never NaN)."""
    et = ET[np.dtype(dtype)]
    sess = _session(model("FPLUT", [("x", et)], _fplut_attrs(), out_type=et))
    x = np.array([np.nan, np.inf, -np.inf, _CUTS[-1], -60000.0, 1.0], dtype)
    y = sess.run(None, {"x": x})[0]
    ref = fplut.apply(x, _CUTS, seed_table().values)
    assert np.isnan(y[0]) and np.array_equal(y[1:].view(np.uint8), np.asarray(ref[1:], dtype).view(np.uint8))
    assert y[1] == y[3] and y[2] == y[4]  # +-Inf behave as the cut-point ends
    assert np.isfinite(y[1:]).all()


def _nan_rows(dtype, m=4):
    a = np.random.default_rng(3).standard_normal((m, K)).astype(dtype)
    a[1, 5] = np.nan
    a[2, 7] = np.inf
    a[3, 9] = -np.inf
    return a


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m_rows", [4, 20])  # the decode kernel (M <= 16) and the dequantise + BLAS path
def test_matmulnf4_nan_inf_stay_in_their_row(dtype, m_rows):
    """MatMulNF4: a NaN in row m of A makes y[m, :] NaN; an Inf makes y[m, :] non-finite (+-Inf, or NaN where the
    weight is exactly 0 or Infs of both signs meet); the other rows are unaffected (equal to the reference)."""
    q, am = _nf4_weights()
    et = ET[np.dtype(dtype)]
    sess = _session(model("MatMulNF4", [("a", et), ("q", TensorProto.UINT8), ("am", TensorProto.FLOAT)],
                          _nf4_attrs(), out_type=et))
    a = _nan_rows(dtype, m_rows)
    y = sess.run(None, {"a": a, "q": q, "am": am})[0].astype(np.float64)
    assert np.isnan(y[1]).all()
    assert not np.isfinite(y[2]).any() and not np.isfinite(y[3]).any()
    ok = [0] + list(range(4, m_rows))
    ref = nf4.matmul(a[ok], q, am, "nf4", BS, K, N).astype(np.float64)
    assert np.allclose(y[ok], ref, rtol=2e-3, atol=2e-3)
    # a NaN absmax poisons exactly the columns of its block (block 0 = the first 32 elements of W^T: column 0)
    am2 = am.copy()
    am2[0] = np.nan
    y2 = sess.run(None, {"a": np.ones((1, K), dtype), "q": q, "am": am2})[0]
    assert np.isnan(y2[0, 0]) and np.isfinite(y2[0, 1:]).all()


def test_matmulnf4_fp16_overflow_is_inf():
    """fp32 accumulation, one rounding to fp16 at the end: results past 65504 become +-Inf, never NaN."""
    q, am = _nf4_weights()
    sess = _session(model("MatMulNF4", [("a", TensorProto.FLOAT16), ("q", TensorProto.UINT8),
                                        ("am", TensorProto.FLOAT)], _nf4_attrs(), out_type=TensorProto.FLOAT16))
    a = np.full((1, K), 60000.0, np.float16)
    y = sess.run(None, {"a": a, "q": q, "am": am})[0]
    ref = nf4.matmul(a.astype(np.float32), q, am, "nf4", BS, K, N)
    big = np.abs(ref[0]) > 65520
    assert big.any() and np.isinf(y[0][big]).all() and not np.isnan(y).any()


def test_dequantnf4_nan_absmax():
    q, am = _nf4_weights()
    am = am.copy()
    am[1] = np.inf
    sess = _session(model("DequantNF4", _NF4_IN[1:], _nf4_attrs()))
    w = sess.run(None, {"q": q, "am": am})[0]  # [K, N]; block 1 = column 0, rows 32..63
    bad = ~np.isfinite(w)
    assert bad[32:, 0].any() and not bad[:32].any() and not bad[:, 1:].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("m_rows", [4, 20])  # the decode kernel (M <= 16) and the dequantise + BLAS path
def test_matmulawq_nan_inf_stay_in_their_row(dtype, m_rows):
    """MatMulAWQ: a NaN or Inf in row m of A makes y[m, :] NaN or +-Inf (the decode kernel computes
    s * (sum x*q - z * sum x), so an Inf usually becomes NaN there); other rows equal the reference."""
    qw, qz, sc = _awq_weights()
    et = ET[np.dtype(dtype)]
    ins = [("a", et)] + _AWQ_IN[1:]
    sess = _session(model("MatMulAWQ", ins, _awq_attrs(), out_type=et))
    a = np.random.default_rng(4).standard_normal((m_rows, AK)).astype(dtype)
    a[1, 5], a[2, 7] = np.nan, np.inf
    y = sess.run(None, {"a": a, "qw": qw, "qz": qz, "sc": sc})[0].astype(np.float64)
    assert np.isnan(y[1]).all() and not np.isfinite(y[2]).any()
    ok = [i for i in range(m_rows) if i not in (1, 2)]
    ref = awq.matmul(a[ok], qw, qz, sc, AG, AK, AN).astype(np.float64)
    assert np.allclose(y[ok], ref, rtol=5e-3, atol=5e-3)


def test_dequantawq_inf_scale():
    """DequantAWQ: W = (q - z) * s rounded to fp16: an Inf scale gives +-Inf (NaN where q == z) in its group's
    column only; finite scales whose product passes 65504 give +-Inf."""
    qw, qz, sc = _awq_weights()
    sc = sc.copy()
    sc[0, 3] = np.inf
    sess = _session(model("DequantAWQ", _AWQ_IN[1:], _awq_attrs(), out_type=TensorProto.FLOAT16))
    w = sess.run(None, {"qw": qw, "qz": qz, "sc": sc})[0]
    bad = ~np.isfinite(w)
    assert bad[:AG, 3].all() and bad.sum() == AG


def test_nan_inputs_do_not_fail_under_strict_numpy_error_state():
    """The caller's np.seterr(all='raise') / warnings-as-errors do not reach the kernels: NaN/Inf inputs still give
    the defined outputs instead of a failed run."""
    import warnings
    q, am = _nf4_weights()
    qw, qz, sc = _awq_weights()
    nf = _session(model("MatMulNF4", [("a", TensorProto.FLOAT16), ("q", TensorProto.UINT8),
                                      ("am", TensorProto.FLOAT)], _nf4_attrs(), out_type=TensorProto.FLOAT16))
    aw = _session(model("MatMulAWQ", _AWQ_IN, _awq_attrs()))
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        y = nf.run(None, {"a": np.full((1, K), 60000.0, np.float16), "q": q, "am": am})[0]
        assert np.isinf(y).any()
        a = np.ones((20, AK), np.float32)
        a[0, 0] = np.inf
        y = aw.run(None, {"a": a, "qw": qw, "qz": qz, "sc": sc})[0]
        assert not np.isfinite(y[0]).any() and np.isfinite(y[1:]).all()

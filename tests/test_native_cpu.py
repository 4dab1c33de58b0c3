"""Native CPU dispatch (runtime/plans.py, "CPU kernels"): after the first call for a key, a CPU op is served by the
shim calling the kernel's compiled entry point, with no Python on the path. Per op: the native path gives the same
bytes as the Python path (native replay off) and as the numpy reference, NaN / Inf included, at edge shapes; a
shape change makes a new plan; replays never call the Python callback (bridge.stats["python_computes"])."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnx_lowbit
from onnx_lowbit import fplut, halfbits
from onnx_lowbit.custom_ops.runtime import bridge

from helpers import SEED, fplut_model, random_like, run_bf16, seed_table

CPU = ["CPUExecutionProvider"]


def session(model, threads=0):
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    onnx_lowbit.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=CPU)


def python_calls(sess, feeds, runs=3):
    """(outputs of the first run, how many of ``runs`` runs reached the Python callback)."""
    before = bridge.stats["python_computes"]
    outs = [sess.run(None, feeds) for _ in range(runs)]
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    return outs[0], bridge.stats["python_computes"] - before


def native_and_python(model, feeds_list, threads=0, python_only=lambda feeds: False):
    """Runs every feed dict through one session with native replay on (3 runs each; checks that only the first run
    of each new shape reaches Python, or every run where ``python_only(feeds)``: shapes without a native entry),
    then through a fresh session with it off; returns both lists of outputs."""
    sess = session(model, threads)
    native, seen = [], set()
    for feeds in feeds_list:
        key = tuple((k, v.shape, v.dtype.str) for k, v in sorted(feeds.items()))
        outs, calls = python_calls(sess, feeds)
        want = 3 if python_only(feeds) else 0 if key in seen else 1
        assert calls == want, f"{calls} Python computes for {key}, expected {want}"
        seen.add(key)
        native.append(outs)
    bridge.set_native_cpu(False)
    try:
        off = session(model, threads)
        python = []
        for feeds in feeds_list:
            outs, calls = python_calls(off, feeds, runs=2)
            assert calls == 2
            python.append(outs)
    finally:
        bridge.set_native_cpu(True)
    for n, p in zip(native, python):
        for a, b in zip(n, p):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    return native, python


# ---------------------------------------------------------------------------------------------------- FPLUT
@pytest.mark.parametrize("threads", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fplut(dtype, threads):
    et = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    m = fplut_model(et, shape=["a", "b"])
    shapes = [(3, 5), (1, 1), (3, 5), (0, 8), (70001, 3)]   # a repeat, an empty tensor, one split over the pool
    feeds = [{"x": random_like(dtype, s, seed=i)} for i, s in enumerate(shapes)]
    if dtype == np.float16:
        feeds.append({"x": halfbits.all_fp16().reshape(256, 256).copy()})   # every fp16 value, NaNs included
    native, _ = native_and_python(m, feeds, threads)
    for f, (y,) in zip(feeds, native):
        ref = fplut.apply(f["x"], SEED, seed_table().values)
        assert np.array_equal(y.view(np.uint8), ref.view(np.uint8))


def test_fplut_streaming_size():
    """fp32 outputs of fplut_cpu.STREAM_MIN_BYTES and more take the non-temporal stores (the split path in Python,
    the native entry's stream parameter in onnxruntime's pool): the same bytes as the reference."""
    from onnx_lowbit.custom_ops.fplut import fplut_cpu
    n = fplut_cpu.STREAM_MIN_BYTES // 4 + 1001
    assert fplut_cpu.streams(np.dtype(np.float32), 4 * n)
    feeds = [{"x": random_like(np.float32, (n,), seed=5)}]
    native, _ = native_and_python(fplut_model(TensorProto.FLOAT, shape=["n"]), feeds)
    ref = fplut.apply(feeds[0]["x"], SEED, seed_table().values)
    assert np.array_equal(native[0][0].view(np.uint8), ref.view(np.uint8))


def test_fplut_bf16_native():
    m = fplut_model(TensorProto.BFLOAT16, shape=["n"])
    sess = session(m)
    xb = halfbits.f32_to_bf16_bits(random_like(np.float32, (40000,)))
    want = fplut.apply(xb, SEED, seed_table().values, bf16=True)
    before = bridge.stats["python_computes"]
    for _ in range(3):
        y, _ = run_bf16(sess, xb)
        assert np.array_equal(y, want)
    assert bridge.stats["python_computes"] - before == 1


def test_switch_off_sends_every_call_through_python_and_back_on_replays():
    sess = session(fplut_model(TensorProto.FLOAT, shape=["n"]))
    x = {"x": random_like(np.float32, (10,))}
    y0, calls = python_calls(sess, x)
    assert calls == 1
    bridge.set_native_cpu(False)
    try:
        y1, calls = python_calls(sess, x)
        assert calls == 3
    finally:
        bridge.set_native_cpu(True)
    y2, calls = python_calls(sess, x)
    assert calls == 0                                   # the plan recorded before is used again
    assert np.array_equal(y0[0].view(np.uint32), y1[0].view(np.uint32))
    assert np.array_equal(y0[0].view(np.uint32), y2[0].view(np.uint32))


def test_pool_off_gives_the_same_bytes():
    sess = session(fplut_model(TensorProto.FLOAT16, shape=["n"]))
    x = {"x": random_like(np.float16, (200000,))}
    y0, _ = python_calls(sess, x)
    bridge.set_native_cpu(True, pool=False)
    try:
        y1, calls = python_calls(sess, x)
    finally:
        bridge.set_native_cpu(True)
    assert calls == 0 and np.array_equal(y0[0].view(np.uint16), y1[0].view(np.uint16))


# ------------------------------------------------------------------------------------------ MatMulNF4 / DequantNF4
def _specials(a):
    """NaN, +Inf, -Inf at the start of the first row (when there is one)."""
    if a.size:
        a.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    return a


def check_native_rows(native, feeds, key, n, dtype, ref, rel, tol, finite_ref=False):
    """The outputs of ``native`` (one [1, M, n] array per feeds, input ``key``): shape and dtype; rows past the first
    (which holds NaN / Inf) within ``tol`` of ``ref(rows)`` by ``rel`` (``finite_ref``: the reference finite there);
    the first row all NaN (NaN and Inf of opposite signs meet in every column)."""
    for f, (y,) in zip(feeds, native):
        a = f[key][0]
        assert y.shape == (1, a.shape[0], n) and y.dtype == dtype
        if a.shape[0] > 1:
            r = ref(a[1:])
            assert (not finite_ref or np.isfinite(r).all()) and rel(y[0, 1:], r) <= tol
        if a.shape[0]:
            assert np.isnan(y[0, 0]).all()


@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", [
    (64, 16, 32, "nf4", np.float32, True),
    (688, 24, 64, "fp4", np.float16, False),   # K not a multiple of the block: tasks start on whole blocks
    (65, 40, 32, "nf4", np.float16, True),     # odd K: blocks start on a byte's low nibble
    (256, 520, 64, "nf4", np.float32, False),  # split over several tasks of the pool
    (352, 36, 64, "nf4", np.float32, True),    # blocks straddle rows, 32 | K: the fast kernels per 32 elements
])
def test_matmulnf4(k, n, bs, qt, dtype, bias):
    from onnx_lowbit import nf4
    from test_nf4_kernels import _quantized, matmul_model
    q, am = _quantized(k, n, bs, qt)
    b = np.random.default_rng(1).standard_normal(n).astype(dtype) if bias else None
    model = matmul_model((1, 1), k, n, bs, qt, dtype, bias, q, am, b)
    rng = np.random.default_rng(2)
    feeds = [{"a": _specials(rng.standard_normal((1, m, k)).astype(dtype))} for m in (1, 3, 1, 16, 17, 0)]
    for threads in (0, 1):
        native, _ = native_and_python(model, feeds, threads, python_only=lambda f: f["a"].shape[1] > 16)
    check_native_rows(native, feeds, "a", n, dtype, lambda a: nf4.matmul(a, q, am, qt, bs, k, n, b), _rel,
                      1e-5 if dtype == np.float32 else 2.0 ** -10)


def _rel(y, ref):
    ref = np.asarray(ref, np.float64)
    return np.abs(np.asarray(y, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12)


@pytest.mark.parametrize("k,n,bs,adt", [(688, 24, 64, np.float32), (688, 24, 64, np.float16), (65, 40, 32, np.float16),
                                        (512, 300, 128, np.float32)])
@pytest.mark.parametrize("transposed", [0, 1])
def test_dequantnf4(k, n, bs, adt, transposed):
    from onnx import helper
    from onnx_lowbit import domain, nf4
    from test_nf4_kernels import _quantized
    q, am = _quantized(k, n, bs, "nf4")
    am = am.astype(adt)
    am[1] = np.inf                                        # a block of Inf (and NaN where its code is 0)
    et = TensorProto.FLOAT if adt == np.float32 else TensorProto.FLOAT16
    node = helper.make_node("DequantNF4", ["q", "am"], ["w"], domain=domain.DOMAIN, quant_type="nf4", block_size=bs,
                            K=k, N=n, transposed=transposed)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("q", TensorProto.UINT8, ["nq"]),
                                        helper.make_tensor_value_info("am", et, ["nb"])],
                          [helper.make_tensor_value_info("w", et, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)
    native, _ = native_and_python(m, [{"q": q, "am": am}])
    with np.errstate(invalid="ignore"):
        ref = nf4.dequantize(q, am.astype(np.float32), "nf4", bs, k, n, np.float32).astype(adt)
    ref = np.ascontiguousarray(ref.T if transposed else ref)
    assert np.isinf(ref).any() and np.array_equal(native[0][0].view(np.uint8), ref.view(np.uint8))


# ---------------------------------------------------------------------------------------------------- RMSNorm
def rmsnorm_model(dtype, d, skip, h):
    """(model, gamma): one RMSNorm node over [B, S, d] (skip an input, H an output when asked)."""
    from onnx import helper, numpy_helper

    from onnx_lowbit import domain
    et = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    gamma = (1 + 0.3 * np.random.default_rng(7).standard_normal(d)).astype(dtype)
    g = numpy_helper.from_array(gamma, "g")
    ins = [helper.make_tensor_value_info("x", et, ["B", "S", d])]
    if skip:
        ins.append(helper.make_tensor_value_info("s", et, ["B", "S", d]))
    outs = [helper.make_tensor_value_info(n, et, ["B", "S", d]) for n in (["y", "h"] if h else ["y"])]
    node = helper.make_node("RMSNorm", ["x", "g"] + (["s"] if skip else []), [o.name for o in outs],
                            domain=domain.DOMAIN, epsilon=1e-5)
    return helper.make_model(helper.make_graph([node], "rms", ins, outs, [g]),
                             opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10), gamma


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("skip,h", [(True, True), (True, False), (False, False)])
def test_rmsnorm(dtype, skip, h):
    """RMSNorm's native entry (rows over onnxruntime's pool): the Python path's bytes and the reference's (H
    bit-exact, Y within the op's roundings), D = 576: a decode row, several rows, a row with NaN / Inf (that row
    NaN, the others not), no rows."""
    from onnx_lowbit import rmsnorm
    rng = np.random.default_rng(11)
    feeds = []
    for b, s_, d in ((1, 1, 576), (2, 5, 576), (1, 1, 576), (3, 0, 576)):
        f = {"x": (3 * rng.standard_normal((b, s_, d))).astype(dtype)}
        if skip:
            f["s"] = rng.standard_normal((b, s_, d)).astype(dtype)
        feeds.append(f)
    feeds[1]["x"][0, 0, :3] = [np.nan, np.inf, -np.inf]
    model, g = rmsnorm_model(dtype, 576, skip, h)
    for threads in (0, 1):
        native, _ = native_and_python(model, feeds, threads)
    for f, outs in zip(feeds, native):
        y_ref, h_ref = rmsnorm.apply(f["x"], g, f.get("s"), 1e-5)
        if h:
            assert np.array_equal(outs[1].view(np.uint8), np.asarray(h_ref, dtype).view(np.uint8))
        y = outs[0].astype(np.float64)
        want = np.asarray(y_ref, dtype).astype(np.float64)
        fin = np.isfinite(want)
        assert np.array_equal(fin, np.isfinite(y))
        tol = 2 * 2.0 ** -10 if dtype == np.float16 else 1e-5
        np.testing.assert_allclose(y[fin], want[fin], rtol=tol, atol=tol * 1e-2)
    assert np.isnan(native[1][0][0, 0]).all() and np.isfinite(native[1][0][1:]).all()


# ------------------------------------------------------------------------------------------ MatMulAWQ / DequantAWQ
@pytest.mark.parametrize("K,N,G,dtype,bias", [(128, 8, 128, np.float32, True), (688, 136, 128, np.float16, False),
                                              (100, 16, 7, np.float16, True), (256, 4096, 32, np.float32, False)])
def test_matmulawq(K, N, G, dtype, bias):  # noqa: N803
    from test_awq_kernels import activations, awq_model, check_matmul, weights
    qw, qz, sc = weights(K, N, G)
    b = activations((N,), dtype, seed=5) if bias else None
    model = awq_model("MatMulAWQ", K, N, G, a_dtype=dtype, bias=bias, lead=("B", "T"),
                      initializers={"qweight": qw, "qzeros": qz, "scales": sc, **({"bias": b} if bias else {})})
    feeds = [{"A": _specials(activations((1, m, K), dtype, seed=m))} for m in (1, 3, 1, 16, 17, 0)]
    for threads in (0, 1):
        native, _ = native_and_python(model, feeds, threads, python_only=lambda f: f["A"].shape[1] > 16)
    for f, (y,) in zip(feeds, native):
        a = f["A"]
        assert y.shape == a.shape[:-1] + (N,) and y.dtype == dtype
        check_matmul(y[:, 1:], a[:, 1:], qw, qz, sc, G, K, N, b)   # rows past the one with NaN / Inf
        if a.shape[1]:
            assert np.isnan(y[0, 0]).all()


@pytest.mark.parametrize("K,N,G", [(128, 8, 128), (688, 136, 128), (100, 16, 7), (1024, 512, 32)])
def test_dequantawq(K, N, G):  # noqa: N803
    from onnx_lowbit import awq
    from test_awq_kernels import awq_model, weights
    qw, qz, sc = weights(K, N, G, seed=1)
    sc = sc.copy()
    sc[0, :3] = [np.inf, -np.inf, np.nan]
    native, _ = native_and_python(awq_model("DequantAWQ", K, N, G), [{"qweight": qw, "qzeros": qz, "scales": sc}])
    with np.errstate(invalid="ignore"):
        ref = awq.dequantize(qw, qz, sc, G, K, N)
    assert np.array_equal(native[0][0].view(np.uint16), ref.view(np.uint16))


# ---------------------------------------------------------------------------------------------------- QuantGRU
@pytest.mark.parametrize("T,N,C,H,direction,bits,layout,lens,h0", [
    (5, 1, 3, 4, "forward", 8, 0, False, False),
    (9, 3, 5, 8, "reverse", 16, 0, True, True),
    (6, 4, 7, 16, "bidirectional", 8, 1, True, True),
    (1, 1, 16, 32, "bidirectional", 16, 1, False, True),
])
def test_quantgru(T, N, C, H, direction, bits, layout, lens, h0):  # noqa: N803
    from onnx_lowbit import gru_int
    from test_gru_kernels import gru_node_model, random_gru
    X, p, H0, L, _ = random_gru(T, N, C, H, direction, bits, seed=T * 31 + H)
    X.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    m = gru_node_model(p, H, direction, bits, layout, with_lens=lens, with_h0=h0)
    feeds = []
    for t in (T, T + 2, T, 0):                                   # a shape change, back, no steps
        x = np.resize(X, (t, N, C)).astype(np.float32)
        f = {"X": x if layout == 0 else x.transpose(1, 0, 2).copy()}
        if lens:
            f["sequence_lens"] = np.minimum(L, t).astype(np.int32)
        if h0:
            f["h0"] = H0 if layout == 0 else H0.transpose(1, 0, 2).copy()
        feeds.append(f)
    native, _ = native_and_python(m, feeds)
    for f, (y, yh) in zip(feeds, native):
        ref = gru_int.quant_gru(f["X"], p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], f.get("sequence_lens"),
                                f.get("h0"), hidden_size=H, bits=bits, exponents=p["exponents"],
                                zero_points=p["zero_points"], direction=direction, layout=layout)
        assert np.array_equal(y.view(np.uint32), ref[0].view(np.uint32))
        assert np.array_equal(yh.view(np.uint32), ref[1].view(np.uint32))


def test_quantgru_long_inputs_and_bad_lengths_go_through_python():
    from test_gru_kernels import gru_node_model, random_gru
    X, p, _, _, _ = random_gru(4, 2, 3, 4, "forward", 8, seed=2)
    sess = session(gru_node_model(p, 4, "forward", 8, 0, with_lens=True, with_h0=False))
    good = {"X": X, "sequence_lens": np.array([4, 1], np.int32)}
    _, calls = python_calls(sess, good)
    assert calls == 1
    before = bridge.stats["python_computes"]
    with pytest.raises(Exception, match=r"sequence_lens must be in 0\.\.4"):   # declined by the entry: Python says why
        sess.run(None, {"X": X, "sequence_lens": np.array([5, 1], np.int32)})
    assert bridge.stats["python_computes"] == before + 1
    _, calls = python_calls(sess, good)
    assert calls == 0
    big = gru_node_model(random_gru(4, 2, 64, 64, "forward", 8, seed=3)[1], 64, "forward", 8, 0, with_lens=True,
                         with_h0=False)
    long = {"X": np.resize(X, (200, 2, 64)).astype(np.float32), "sequence_lens": np.array([200, 7], np.int32)}
    _, calls = python_calls(session(big), long)          # 200 * 2 * 64 * 192 multiply-adds: over NATIVE_MACS
    assert calls == 3



def weights_as_inputs(model):
    """The model with W and R turned from constant initializers into graph inputs; returns it and their values."""
    from onnx import helper, numpy_helper
    g = model.graph
    moved = [t for t in g.initializer if t.name in ("W", "R")]
    keep = [t for t in g.initializer if t.name not in ("W", "R")]
    del g.initializer[:]
    g.initializer.extend(keep)
    for t in moved:
        g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return model, {t.name: numpy_helper.to_array(t).copy() for t in moved}


def new_kernels(make):
    """(what make() returns, the kernel objects created meanwhile)."""
    before = set(bridge._kernels)
    out = make()
    return out, [k for kid, k in bridge._kernels.items() if kid not in before]


@pytest.mark.parametrize("bits", [8, 16])
def test_quantgru_packs_constant_weights_once(bits):
    """W and R as constant initializers reach the kernel as constants (bridge: KernelInfoGetConstantInput_tensor)
    and, on VNNI hosts, are packed once (QuantGRUKernel.packs); as graph inputs they are neither, and W and R
    changed in place between runs (same addresses, the plan replayed) give the new values' results."""
    from onnx_lowbit import gru_int
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    from test_gru_kernels import gru_node_model, random_gru
    X, p, h0, _, _ = random_gru(1, 2, 24, 18, "forward", bits, seed=77 + bits)
    m = gru_node_model(p, 18, "forward", bits, 0, with_lens=False, with_h0=True)
    sess, (k,) = new_kernels(lambda: session(m))
    assert sorted(k.constants) == [1, 2, 3, 4, 5]
    assert np.array_equal(k.constants[1].numpy(), p["W"]) and np.array_equal(k.constants[2].numpy(), p["R"])
    assert (k.packs is not None) == quantgru_cpu.VNNI
    sess_in, (ki,) = new_kernels(lambda: session(weights_as_inputs(gru_node_model(p, 18, "forward", bits, 0,
                                                                                  with_lens=False, with_h0=True))[0]))
    assert sorted(ki.constants) == [3, 4, 5] and ki.packs is None
    w, r = p["W"].copy(), p["R"].copy()
    rng = np.random.default_rng(bits)
    for run in range(3):
        before = bridge.stats["python_computes"]
        y, yh = sess_in.run(None, {"X": X, "h0": h0, "W": w, "R": r})
        assert bridge.stats["python_computes"] - before == (run == 0)
        ref = gru_int.quant_gru(X, w, r, p["B"], p["channel_exp"], p["luts"], None, h0, hidden_size=18, bits=bits,
                                exponents=p["exponents"], zero_points=p["zero_points"])
        assert np.array_equal(y, ref[0]) and np.array_equal(yh, ref[1])
        if run == 0:
            assert np.array_equal(y, sess.run(None, {"X": X, "h0": h0})[0])
        lo, hi = gru_int.qrange(bits)
        w[...] = rng.integers(lo, hi + 1, w.shape)
        r[...] = rng.integers(lo, hi + 1, r.shape)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("N,layout,direction,const", [(1, 0, "forward", True), (3, 1, "forward", True),
                                                      (1, 1, "reverse", True), (3, 0, "bidirectional", True),
                                                      (1, 0, "forward", False), (3, 1, "bidirectional", False)])
def test_quantgru_streaming_frames(bits, N, layout, direction, const):  # noqa: N803
    """A streaming GRU in a session: one frame per run (T = 1) with Y_h fed back as initial_h, then calls of 1, 2,
    7, 8, 9 steps and around PACK_MIN_STEPS: only each new shape's first run reaches Python (the native entry
    serves the rest), and the calls give the whole-sequence reference bit for bit (reverse: from the sequence's
    end; bidirectional: a pass per direction, as test_gru_kernels' streaming test). W and R as constant
    initializers (packed once on VNNI hosts) and as graph inputs (the per-call paths)."""
    from onnx_lowbit import gru_int
    from test_gru_kernels import STREAM_CALLS, gru_node_model, random_gru, stream, stream_passes
    T, C, H = sum(STREAM_CALLS), 33, 20  # noqa: N806
    X, p, h0, _, _ = random_gru(T, N, C, H, direction, bits, seed=5000 + 10 * N + bits + layout)
    whole = gru_int.quant_gru(X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], None, h0, hidden_size=H,
                              bits=bits, exponents=p["exponents"], zero_points=p["zero_points"], direction=direction)
    m, feeds = gru_node_model(p, H, direction, bits, layout, with_lens=False, with_h0=True), {}
    if not const:
        m, feeds = weights_as_inputs(m)
    sess = session(m)
    seen = set()

    def run(x, h):
        if layout == 1:
            x, h = x.transpose(1, 0, 2).copy(), h.transpose(1, 0, 2).copy()
        before = bridge.stats["python_computes"]
        y, yh = sess.run(None, {"X": x, "h0": h, **feeds})
        assert bridge.stats["python_computes"] - before == (0 if x.shape in seen else 1)
        seen.add(x.shape)
        return (y, yh) if layout == 0 else (y.transpose(1, 2, 0, 3), yh.transpose(1, 0, 2))

    for sizes in ((1,) * T, STREAM_CALLS):
        for k, rev in stream_passes(direction):
            y, yh = stream(run, X, h0, sizes, rev)
            assert np.array_equal(y[:, k].view(np.uint32), whole[0][:, k].view(np.uint32))
            assert np.array_equal(yh[k].view(np.uint32), whole[1][k].view(np.uint32))


def _entries(monkeypatch):
    """The entry functions quantgru_cpu compiles from now on (native.compile_entry's arguments), in order."""
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    seen, real = [], quantgru_cpu.native.compile_entry
    monkeypatch.setattr(quantgru_cpu.native, "compile_entry", lambda fn: seen.append(fn) or real(fn))
    return seen


@pytest.mark.parametrize("bits,narrow", [(8, False), (16, False), (16, True)])
@pytest.mark.parametrize("tasks,threads", [(2, 2), (3, 1), (2, 4), (1, 2)])
def test_quantgru_tasks_entry(bits, narrow, tasks, threads, monkeypatch):
    """Batch 1 on constant (packed) W and R from MIN_STEPS steps: quantgru_tasks' entry, the packed path as items
    taken by the tasks on onnxruntime's pool (``tasks`` of them; ``threads`` intra-op threads, fewer than the
    tasks too: they then run one after another; each step two items, the halves of the hidden units). Bit-exact with the reference at T = 16,
    17, 37 (input tiles, the last one partial), with shorter sequence_lens and 0 steps; both directions, initial_h,
    NaN / Inf in X, int16 weights in the int8 range (packed as int8); only each shape's first run reaches Python;
    a frame (T = 1) at this H (< quantgru_frames.MIN_H) takes the single-task entry; a failing sequence_lens is
    declined by the set-up item and named by Python."""
    from onnx_lowbit import gru_int
    from onnx_lowbit.custom_ops.gru import quantgru_cpu, quantgru_tasks
    from test_gru_kernels import gru_node_model, random_gru
    if not quantgru_cpu.VNNI:
        pytest.skip("the packed path needs AVX-512 VNNI")
    monkeypatch.setattr(quantgru_cpu.native, "CLAIM_TASKS", tasks)
    C, H = 21, 80  # noqa: N806 - the halves: units 0..32 and 32..80 (whole 16-row blocks of each gate)
    X, p, H0, _, _ = random_gru(37, 1, C, H, "bidirectional", bits, seed=900 + bits + tasks)
    if narrow:
        p["W"], p["R"] = p["W"] >> 8, p["R"] >> 8
    X.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    entries = _entries(monkeypatch)
    sess = session(gru_node_model(p, H, "bidirectional", bits, 0, with_lens=True, with_h0=True), threads)
    for t, ln in ((16, 16), (17, 5), (37, 37), (37, 30), (37, 0), (1, 1)):
        f = {"X": np.ascontiguousarray(X[:t]), "sequence_lens": np.array([ln], np.int32), "h0": H0}
        ref = gru_int.quant_gru(f["X"], p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], f["sequence_lens"],
                                H0, hidden_size=H, bits=bits, exponents=p["exponents"],
                                zero_points=p["zero_points"], direction="bidirectional")
        (y, yh), calls = python_calls(sess, f)
        assert calls == (0 if t == 37 and ln != 37 else 1)   # (37, 30), (37, 0): the plan of (37, 37)'s shapes
        assert np.array_equal(y.view(np.uint32), ref[0].view(np.uint32)), (t, ln)
        assert np.array_equal(yh.view(np.uint32), ref[1].view(np.uint32)), (t, ln)
    assert entries == [quantgru_tasks.native_gru_tasks] * 3 + [quantgru_cpu._native_gru]   # H < MIN_H
    assert not quantgru_tasks.pays(37, 70) and not quantgru_tasks.pays(15, 80) and quantgru_tasks.pays(16, 64)
    before = bridge.stats["python_computes"]
    with pytest.raises(Exception, match=r"sequence_lens must be in 0\.\.37"):
        sess.run(None, {"X": X, "sequence_lens": np.array([38], np.int32), "h0": H0})
    assert bridge.stats["python_computes"] == before + 1
    (y, _), calls = python_calls(sess, {"X": X, "sequence_lens": np.array([37], np.int32), "h0": H0})
    assert calls == 0


@pytest.mark.parametrize("bits,narrow", [(8, False), (16, False), (16, True)])
@pytest.mark.parametrize("threads,layout", [(2, 0), (1, 1), (4, 0)])
def test_quantgru_frames_entry(bits, narrow, threads, layout, monkeypatch):
    """Frames (T = 1, batch 1) on constant (packed) W and R: quantgru_frames' entry, one item per direction and half
    of the hidden units on onnxruntime's pool (``threads`` intra-op threads: fewer, as many as or more than the
    items). Bit-exact with the reference over a stream of frames (the state fed back), at H = 80 (halves of 2 and 3
    blocks per gate, listed over the gates: 6 and 9 blocks, padded to whole groups), H = 144 and H = 72 (not a
    multiple of 16: blocks holding rows of two gates, listed for both); both directions, both layouts,
    initial_h given or not, sequence_lens 1 and 0, NaN / Inf in X, int16 weights in the int8 range; only the first
    run of a shape reaches Python; a failing sequence_lens is declined by every item (nothing written) and named by
    Python."""
    from onnx_lowbit import gru_int
    from onnx_lowbit.custom_ops.gru import quantgru_cpu, quantgru_frames
    from test_gru_kernels import gru_node_model, random_gru
    if not quantgru_cpu.VNNI:
        pytest.skip("the packed path needs AVX-512 VNNI")
    assert quantgru_frames.pays(1, 256) and not quantgru_frames.pays(2, 256) and not quantgru_frames.pays(1, 128)
    monkeypatch.setattr(quantgru_frames, "MIN_H", 64)   # small shapes here

    def feeds(x, ln, h0):   # layout 0 arrays ([T, N, C], [D, N, H]) in the session's layout
        if layout:
            x, h0 = x.transpose(1, 0, 2), h0.transpose(1, 0, 2)
        return {"X": np.ascontiguousarray(x), "sequence_lens": np.array([ln], np.int32),
                "h0": np.ascontiguousarray(h0)}
    for C, H in ((21, 80), (33, 144), (17, 72)):  # noqa: N806
        X, p, H0, _, _ = random_gru(6, 1, C, H, "bidirectional", bits, seed=700 + bits + H + threads)
        if narrow:
            p["W"], p["R"] = p["W"] >> 8, p["R"] >> 8
        X.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
        entries = _entries(monkeypatch)
        sess = session(gru_node_model(p, H, "bidirectional", bits, layout, with_lens=True, with_h0=True), threads)
        h = H0
        for i in range(X.shape[0]):
            ln = 0 if i == 3 else 1
            ref = gru_int.quant_gru(X[i:i + 1], p["W"], p["R"], p["B"], p["channel_exp"], p["luts"],
                                    np.array([ln], np.int32), h, hidden_size=H, bits=bits,
                                    exponents=p["exponents"], zero_points=p["zero_points"], direction="bidirectional")
            (y, yh), calls = python_calls(sess, feeds(X[i:i + 1], ln, h))
            assert calls == (1 if i == 0 else 0)
            if layout:
                y, yh = y.transpose(1, 2, 0, 3), yh.transpose(1, 0, 2)
            assert np.array_equal(y.view(np.uint32), ref[0].view(np.uint32)), (H, i)
            assert np.array_equal(yh.view(np.uint32), ref[1].view(np.uint32)), (H, i)
            h = np.ascontiguousarray(yh) if ln else H0
        assert entries == [quantgru_frames.native_gru_frame]
        before = bridge.stats["python_computes"]
        with pytest.raises(Exception, match=r"sequence_lens must be in 0\.\.1"):
            sess.run(None, feeds(X[:1], 2, H0))
        assert bridge.stats["python_computes"] == before + 1
    p1 = {k: np.asarray(v)[:gru_int.NQ if k in ("exponents", "zero_points") else 1] for k, v in p.items()}
    # one direction, no initial_h, no sequence_lens
    sess1 = session(gru_node_model(p1, H, "forward", bits, 0, with_lens=False, with_h0=False), threads)
    ref = gru_int.quant_gru(X[:1], p1["W"], p1["R"], p1["B"], p1["channel_exp"], p1["luts"], None, None,
                            hidden_size=H, bits=bits, exponents=p1["exponents"], zero_points=p1["zero_points"])
    (y, yh), _ = python_calls(sess1, {"X": np.ascontiguousarray(X[:1])})
    assert np.array_equal(y.view(np.uint32), ref[0].view(np.uint32))
    assert np.array_equal(yh.view(np.uint32), ref[1].view(np.uint32))


def test_quantgru_tasks_entry_long_sequence_on_one_thread():
    """A long call (over the single-task entry's NATIVE_MACS, which sends such calls to the Python path and Numba's
    pool) on a session of one intra-op thread: served natively (no Python after the first run) and bit-exact."""
    from onnx_lowbit import gru_int
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    from test_gru_kernels import gru_node_model, random_gru
    if not quantgru_cpu.VNNI:
        pytest.skip("the packed path needs AVX-512 VNNI")
    T, C, H = 300, 64, 96  # noqa: N806
    assert T * C * 3 * H > quantgru_cpu.NATIVE_MACS
    X, p, h0, _, _ = random_gru(T, 1, C, H, "forward", 16, seed=31)
    ref = gru_int.quant_gru(X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], None, h0, hidden_size=H,
                            bits=16, exponents=p["exponents"], zero_points=p["zero_points"])
    (y, yh), calls = python_calls(session(gru_node_model(p, H, "forward", 16, 0, with_lens=False, with_h0=True), 1),
                                  {"X": X, "h0": h0})
    assert calls == 1
    assert np.array_equal(y.view(np.uint32), ref[0].view(np.uint32))
    assert np.array_equal(yh.view(np.uint32), ref[1].view(np.uint32))


# ---------------------------------------------------------------------------------------------------- FusedFFN
@pytest.mark.parametrize("xdt,wdt,kn,bias", [(np.float32, np.float32, 0, True), (np.float16, np.float16, 0, False),
                                             (np.float32, np.float16, 1, True), (np.float16, np.float16, 1, True)])
def test_fusedffn(xdt, wdt, kn, bias):
    from onnx_lowbit import ffn
    from test_ffn_kernels import data, ffn_model
    K, N = 72, 40  # noqa: N806
    x, w1, w3, b1, b3 = data(K, N, xdt, wdt, (1,))
    if kn:
        w1, w3 = np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T)
    init = {"W1": w1, "W3": w3, **({"B1": b1, "B3": b3} if bias else {})}
    model = ffn_model(K, N, xdt, wdt, lead=("B", "T"), b1=bias, b3=bias, init=init, kn=kn)
    rng = np.random.default_rng(3)
    feeds = [{"X": _specials(rng.standard_normal((1, m, K)).astype(xdt))} for m in (1, 4, 1, 16, 17, 0)]
    for threads in (0, 1):
        native, _ = native_and_python(model, feeds, threads, python_only=lambda f: f["X"].shape[1] > 16)
    for f, (s,) in zip(feeds, native):
        xs = f["X"][0]
        assert s.shape == (1, xs.shape[0], N) and s.dtype == xdt
        if xs.shape[0] > 1:
            ref = ffn.swiglu_ref(xs[1:], w1, w3, b1 if bias else None, b3 if bias else None, kn=bool(kn))
            err = np.abs(s[0, 1:].astype(np.float64) - ref).max() / np.abs(ref).max()
            assert err <= (1e-5 if xdt == np.float32 else 2.0 ** -10)
        if xs.shape[0]:
            assert np.isnan(s[0, 0]).all()


# ------------------------------------------------------------------------------------ FusedFFNNF4 / FusedFFNAWQ
FFN4_MS = (1, 3, 1, 16, 17, 0)     # a repeat (replayed), M = 16 (the last native M), 17 (the Python path), empty


def _ffn4_feeds(k, dtype, seed):
    rng = np.random.default_rng(seed)
    return [{"x": _specials((rng.standard_normal((1, m, k)) + 0.2).astype(dtype))} for m in FFN4_MS]


@pytest.mark.parametrize("k,n,bs,qt,dtype,bias", [
    (64, 16, 32, "nf4", np.float32, True),
    (688, 24, 64, "fp4", np.float16, False),   # K not a multiple of the block: tasks start on whole blocks
    (65, 41, 32, "nf4", np.float16, True),     # odd K (blocks start on low nibbles), odd N
    (96, 27, 64, "fp4", np.float32, False),    # blocks straddle rows, 32 | K: absmax per 32 elements
    (256, 520, 64, "nf4", np.float32, True),   # several tasks of the pool
])
def test_fusedffnnf4(k, n, bs, qt, dtype, bias):
    from onnx_lowbit import ffn
    from test_ffn4_kernels import _rel as rel, _tol, nf4_model, nf4_weights
    ws = nf4_weights(k, n, bs, qt, seed=k + n)
    rng = np.random.default_rng(4)
    b1, b3 = ((rng.standard_normal(n).astype(dtype) for _ in range(2)) if bias else (None, None))
    model = nf4_model((1, 1), k, n, bs, qt, dtype, ws, b1, b3)
    feeds = _ffn4_feeds(k, dtype, seed=5)
    for threads in (0, 1):
        native, _ = native_and_python(model, feeds, threads, python_only=lambda f: f["x"].shape[1] > 16)
    check_native_rows(native, feeds, "x", n, dtype, lambda x: ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3), rel,
                      _tol(dtype), finite_ref=True)


@pytest.mark.parametrize("k,n,g,dtype,bias", [(128, 8, 128, np.float32, True), (688, 136, 128, np.float16, False),
                                              (100, 16, 7, np.float16, True), (256, 4096, 32, np.float32, True)])
def test_fusedffnawq(k, n, g, dtype, bias):
    from test_ffn4_kernels import awq_model, awq_weights, check_awq
    w1, w3 = awq_weights(k, n, g, seed=3)
    rng = np.random.default_rng(6)
    b1, b3 = ((rng.standard_normal(n).astype(dtype) for _ in range(2)) if bias else (None, None))
    model = awq_model((1, 1), k, n, g, dtype, w1, w3, b1, b3)
    feeds = _ffn4_feeds(k, dtype, seed=7)
    for threads in (0, 1):
        native, _ = native_and_python(model, feeds, threads, python_only=lambda f: f["x"].shape[1] > 16)
    for f, (s,) in zip(feeds, native):
        x = f["x"][0]
        assert s.shape == (1, x.shape[0], n) and s.dtype == dtype
        check_awq(s[0, 1:], x[1:], w1, w3, g, k, n, b1, b3)
        if x.shape[0]:
            assert np.isnan(s[0, 0]).all()


def test_awq_scales_changed_at_the_same_address_are_widened_again():
    """MatMulAWQ's entry takes the float32 scales it widened when the plan was recorded only where the call's fp16
    scales still widen to them (scales_f32 checks the task's columns): scales given as a graph input and changed
    in place between runs give the new product, native and replayed; unchanged ones return the cached copy."""
    from onnx_lowbit.custom_ops.awq import matmulawq_cpu as mc
    from test_awq_kernels import activations, awq_model, check_matmul, weights
    K, N, G = 256, 1024, 64  # noqa: N806
    qw, qz, sc = weights(K, N, G)
    sc = sc.copy()
    sess = session(awq_model("MatMulAWQ", K, N, G, lead=("B", "T"), initializers={"qweight": qw, "qzeros": qz}))
    a = activations((1, 2, K), np.float32, seed=1)
    feeds = {"A": a, "scales": sc}
    before = bridge.stats["python_computes"]
    for step in range(3):
        y = sess.run(None, feeds)[0]
        check_matmul(y, a, qw, qz, sc, G, K, N)
        sc[:, 7 + 300 * step] *= np.float16(-2.0)   # the columns of one task, then another's
    assert bridge.stats["python_computes"] - before == 1
    # the check itself: the cached copy while the task's columns agree, a fresh widening where one differs
    groups, c0, c1 = K // G, 8, 24
    cached = np.empty(sc.size, np.float32)
    from onnx_lowbit.custom_ops.device.half_cpu import widen_f16
    widen_f16(sc.view(np.uint16).reshape(-1), cached.view(np.uint32))
    got = mc.scales_f32(np.uint64(sc.ctypes.data), np.uint64(cached.ctypes.data), groups, N, c0, c1)
    assert got.ctypes.data == cached.ctypes.data
    sc[1, 8 * c1] = np.float16(5.0)                 # outside the task's columns: still the cached copy
    got = mc.scales_f32(np.uint64(sc.ctypes.data), np.uint64(cached.ctypes.data), groups, N, c0, c1)
    assert got.ctypes.data == cached.ctypes.data
    sc[1, 8 * c1 - 1] = np.float16(5.0)             # inside: widened again, its columns exact
    got = mc.scales_f32(np.uint64(sc.ctypes.data), np.uint64(cached.ctypes.data), groups, N, c0, c1)
    assert got.ctypes.data != cached.ctypes.data
    assert np.array_equal(got[:, 8 * c0:8 * c1], sc[:, 8 * c0:8 * c1].astype(np.float32))


def test_concurrent_runs_replay_without_the_gil():
    """One session run from several threads at once: replays take no GIL and share nothing per call."""
    from helpers import same_in_threads
    sess = session(fplut_model(TensorProto.FLOAT16, shape=["n"]))
    inputs = [random_like(np.float16, (n,), seed=i) for i, n in enumerate((5, 40000, 70001, 5, 1, 40000))]
    want = [fplut.apply(x, SEED, seed_table().values) for x in inputs]
    for x in inputs:
        sess.run(None, {"x": x})                       # record the plans
    before = bridge.stats["python_computes"]
    bad = same_in_threads(lambda x: sess.run(None, {"x": x})[0], inputs, want,
                          lambda a, b: np.array_equal(a.view(np.uint16), b.view(np.uint16)), repeats=10, threads=len(inputs))
    assert not bad and bridge.stats["python_computes"] == before


def _thread_probe():
    """An entry point writing the calling OS thread's id over its range of a float32 output (stands in for FPLUT's
    entry: shows which threads ran which tasks)."""
    import ctypes

    from numba import cfunc

    from onnx_lowbit.custom_ops.device import native
    gettid = ctypes.CDLL(None).gettid
    gettid.restype, gettid.argtypes = ctypes.c_int, []

    @cfunc(native.SIGNATURE)
    def probe(p, begin, end):
        y = native.vector(p[1], end, np.uint32)
        t = gettid()
        for i in range(begin, end):
            y[i] = t
        return 0
    return probe


def test_entries_run_on_onnxruntimes_intra_op_threads(monkeypatch):
    import threading

    from onnx_lowbit.custom_ops.device import native
    from onnx_lowbit.custom_ops.fplut import fplut_cpu
    probe = _thread_probe()
    monkeypatch.setattr(native, "compile_entry", lambda fn: probe.address)
    x = {"x": np.zeros(32 * fplut_cpu.GRAIN, np.float32)}      # 32 tasks
    one = session(fplut_model(TensorProto.FLOAT, shape=["n"]), threads=1)
    for _ in range(3):    # one intra-op thread: every task on the thread that called run()
        assert set(one.run(None, x)[0].view(np.uint32).tolist()) == {threading.get_native_id()}
    two = session(fplut_model(TensorProto.FLOAT, shape=["n"]), threads=2)
    seen = set()
    for _ in range(200):   # onnxruntime's second thread takes tasks (not in every run on a busy machine)
        ids = set(two.run(None, x)[0].view(np.uint32).tolist())
        assert len(ids) <= 2
        seen.add(len(ids))
        if 2 in seen:
            break
    assert 2 in seen


def test_cached_entries_calling_parallel_kernels_in_a_fresh_process():
    """A fresh process whose first Numba work is an entry loaded from the disk cache that calls a parallel kernel
    (FusedFFN's decode kernel, QuantGRU's batched recurrence): Numba's thread pool must be started first (it crashed
    the process before)."""
    import os
    import subprocess
    import sys
    script = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_ffn_kernels import data, ffn_model
from test_native_cpu import session
x, w1, w3, _, _ = data(72, 40, np.float32, np.float32, (1, 2))
s = session(ffn_model(72, 40, np.float32, np.float32, lead=("B", "T"), init={{"W1": w1, "W3": w3}}))
a, b = (s.run(None, {{"X": x}})[0] for _ in range(2))
assert np.array_equal(a, b)
print("ok")
""".format(tests=os.path.dirname(os.path.abspath(__file__)))
    for _ in range(2):   # the first may compile (a cold cache), the second loads from the cache
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]

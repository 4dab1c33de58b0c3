"""QuantGRU CPU kernel (Numba) against the integer reference onnx_lowbit.gru_int: bit-exact, through onnxruntime
sessions (one-node models in the onnx_lowbit domain), and the reference against the float GRU / onnxruntime's GRU.

Parameters are calibrated (gru_quant) on random weights, and also perturbed ("stress": finer exponents, shifted
zero points) so saturation, left shifts and the table ends are exercised.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_lowbit
from onnx_lowbit import domain, gru_float, gru_int, gru_quant

CPU = ["CPUExecutionProvider"]
QT = {8: TensorProto.INT8, 16: TensorProto.INT16}


def random_gru(T, N, C, H, direction, bits, seed=0, stress=False, clip=None):  # noqa: N803
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    k = 1.0 / np.sqrt(H)
    W = rng.uniform(-k, k, (d, 3 * H, C))
    R = rng.uniform(-k, k, (d, 3 * H, H))
    B = rng.uniform(-k, k, (d, 6 * H))
    X = (rng.standard_normal((T, N, C)) * 1.5 + 0.2).astype(np.float32)
    ranges = gru_quant.calibrate(X, W, R, B, direction=direction, clip=clip)
    p = gru_quant.quant_params(W, R, B, ranges, bits=bits, clip=clip)
    if stress:  # finer scales (more saturation) and shifted zero points, kept only where the op accepts them
        e, z = np.array(p["exponents"]), np.array(p["zero_points"])
        lo, hi = gru_int.qrange(bits)
        for i in range(len(e)):
            name = gru_int.QUANTITIES[i % gru_int.NQ]
            e2, z2 = e.copy(), z.copy()
            e2[i] += int(rng.integers(0, 3))
            if name != "g_out":
                z2[i] = np.clip(z2[i] + int(rng.integers(-(hi // 4), hi // 4)), lo, hi)
            try:
                a = gru_int.GRUAttrs(H, bits, e2, z2, direction)
                gru_int.check_inputs(a, X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"])
            except ValueError:
                continue
            e, z = e2, z2
        p["exponents"], p["zero_points"] = e.tolist(), z.tolist()
    h0 = rng.standard_normal((d, N, H)).astype(np.float32) * 0.5
    lens = rng.integers(0, T + 1, N).astype(np.int32)
    return X, p, h0, lens, (W, R, B)


def gru_node_model(p, H, direction, bits, layout, *, with_lens, with_h0, outputs=("Y", "Y_h"), name="gru0",  # noqa: N803
                   attrs=None):
    inits = [onnx.numpy_helper.from_array(np.asarray(p[k]), k) for k in ("W", "R", "B", "channel_exp", "luts")]
    ins = ["X", "W", "R", "B", "channel_exp", "luts", "sequence_lens" if with_lens else "", "h0" if with_h0 else ""]
    while ins[-1] == "":
        ins.pop()
    a = dict(hidden_size=H, direction=direction, layout=layout, bits=bits, exponents=list(p["exponents"]),
             zero_points=list(p["zero_points"]))
    a.update(attrs or {})
    node = helper.make_node("QuantGRU", ins, list(outputs), domain=domain.DOMAIN, name=name, **a)
    graph_in = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["d0", "d1", "C"])]
    if with_lens:
        graph_in.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, ["N"]))
    if with_h0:
        graph_in.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["e0", "e1", "H"]))
    ranks = {"Y": 4, "Y_h": 3}
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [f"{o}{i}" for i in range(ranks[o])])
            for o in outputs if o]
    g = helper.make_graph([node], "g", graph_in, outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=9)


def run_model(m, feeds):
    sess = onnx_lowbit.InferenceSession(m.SerializeToString(), providers=CPU)
    return sess.run(None, feeds)


CASES = [  # T, N, C, H, direction, bits, layout, lens, h0, stress
    (5, 1, 3, 4, "forward", 8, 0, False, False, False),
    (9, 3, 5, 8, "reverse", 16, 0, True, True, False),
    (6, 4, 7, 16, "bidirectional", 8, 1, True, True, True),
    (12, 2, 4, 24, "bidirectional", 16, 0, False, True, True),
    (8, 5, 6, 12, "forward", 16, 1, True, False, True),
    (4, 3, 16, 32, "reverse", 8, 1, False, False, True),
    (1, 2, 3, 5, "bidirectional", 16, 1, True, False, False),
]


@pytest.mark.parametrize("T,N,C,H,direction,bits,layout,lens,h0,stress", CASES)
def test_cpu_kernel_bit_exact(T, N, C, H, direction, bits, layout, lens, h0, stress):  # noqa: N803
    X, p, H0, L, _ = random_gru(T, N, C, H, direction, bits, seed=T * 31 + H, stress=stress)
    if layout == 1:
        X, H0 = X.transpose(1, 0, 2).copy(), H0.transpose(1, 0, 2).copy()
    ref = gru_int.quant_gru(X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], L if lens else None,
                            H0 if h0 else None, hidden_size=H, bits=bits, exponents=p["exponents"],
                            zero_points=p["zero_points"], direction=direction, layout=layout)
    feeds = {"X": X}
    if lens:
        feeds["sequence_lens"] = L
    if h0:
        feeds["h0"] = H0
    m = gru_node_model(p, H, direction, bits, layout, with_lens=lens, with_h0=h0)
    onnx_lowbit.domain.register_schemas()
    onnx.checker.check_model(m, full_check=True)
    y, yh = run_model(m, feeds)
    assert y.shape == ref[0].shape and yh.shape == ref[1].shape
    np.testing.assert_array_equal(y, ref[0])
    np.testing.assert_array_equal(yh, ref[1])
    if lens:  # padded steps are exactly 0
        yt = ref[0] if layout == 0 else ref[0].transpose(1, 2, 0, 3)
        for n in range(N):
            assert not np.any(yt[L[n]:, :, n])


def test_reference_primitives():
    v = np.array([5, 6, 7, -5, -6, -7, 2 ** 40 + 2], np.int64)
    assert gru_int.rshift(v, 2).tolist() == [1, 2, 2, -1, -1, -2, 2 ** 38 + 1]   # half up: 6/4 -> 2, -6/4 -> -1
    assert gru_int.rshift(v, 0).tolist() == v.tolist()
    assert gru_int.rshift(np.array([3, -3]), -2).tolist() == [12, -12]
    assert gru_int.rshift(np.array([2 ** 61, -2 ** 61]), 63).tolist() == [0, 0]
    assert gru_int.rshift(np.array([6, 6]), np.array([2, -1])).tolist() == [2, 12]
    assert gru_int.quantize(np.array([0.5, 1.5, -0.5, np.nan, np.inf, -np.inf, 1e30]), 0, 3, 8).tolist() == \
        [3, 5, 3, 3, 127, -128, 127]
    assert gru_int.sat(np.array([-200, 200]), 8).tolist() == [-128, 127]
    t = np.arange(gru_int.lut_len(16), dtype=np.int64) * 64 - 32768                # identity table
    q = np.array([-32768, -32767, -1, 0, 31, 32, 32767])
    assert gru_int.lut(q, t, 16).tolist() == q.tolist()


def test_float_reference_matches_onnxruntime():
    rng = np.random.default_rng(3)
    T, N, C, H = 6, 3, 4, 5  # noqa: N806
    for direction in ("forward", "reverse", "bidirectional"):
        d = 2 if direction == "bidirectional" else 1
        for lbr in (0, 1):
            W, R = rng.standard_normal((d, 3 * H, C)) * 0.5, rng.standard_normal((d, 3 * H, H)) * 0.5
            B, X = rng.standard_normal((d, 6 * H)) * 0.5, rng.standard_normal((T, N, C))
            h0, lens = rng.standard_normal((d, N, H)), np.array([6, 2, 0], np.int32)
            arrs = [a.astype(np.float32) for a in (X, W, R, B)] + [lens, h0.astype(np.float32)]
            node = helper.make_node("GRU", ["X", "W", "R", "B", "L", "H0"], ["Y", "Yh"], hidden_size=H,
                                    direction=direction, linear_before_reset=lbr, clip=1.5)
            vi = lambda n, t=TensorProto.FLOAT: helper.make_tensor_value_info(n, t, None)  # noqa: E731
            g = helper.make_graph([node], "g", [vi("X"), vi("W"), vi("R"), vi("B"), vi("L", TensorProto.INT32),
                                                vi("H0")], [vi("Y"), vi("Yh")])
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
            y, yh = ort.InferenceSession(m.SerializeToString(), providers=CPU).run(
                None, dict(zip(["X", "W", "R", "B", "L", "H0"], arrs)))
            ry, ryh = gru_float.gru(*arrs, direction=direction, linear_before_reset=lbr, clip=1.5)
            np.testing.assert_allclose(ry, y, atol=2e-6)
            np.testing.assert_allclose(ryh, yh, atol=2e-6)


@pytest.mark.parametrize("attrs,needle", [
    ({"direction": "sideways"}, "direction must be one of"),
    ({"exponents": [1, 2, 3]}, "exponents and zero_points must hold"),
    ({"bits": 4}, "bits must be 8 or 16"),
])
def test_bad_attributes(attrs, needle):
    X, p, _, _, _ = random_gru(4, 1, 3, 4, "forward", 8, seed=1)
    m = gru_node_model(p, 4, "forward", 8, 0, with_lens=False, with_h0=False, attrs=attrs)
    with pytest.raises(Exception, match=needle) as ei:
        run_model(m, {"X": X})
    assert "QuantGRU node 'gru0'" in str(ei.value)


def test_bad_inputs():
    X, p, _, _, _ = random_gru(4, 2, 3, 4, "forward", 8, seed=2)
    m = gru_node_model(p, 4, "forward", 8, 0, with_lens=True, with_h0=False)
    sess = onnx_lowbit.InferenceSession(m.SerializeToString(), providers=CPU)
    with pytest.raises(Exception, match=r"sequence_lens must be in 0\.\.4"):
        sess.run(None, {"X": X, "sequence_lens": np.array([5, 1], np.int32)})
    with pytest.raises(Exception, match=r"input W must have shape \[1, 12, 7\]"):
        sess.run(None, {"X": np.zeros((4, 2, 7), np.float32), "sequence_lens": np.array([1, 1], np.int32)})


def test_empty_shapes():
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    X, p, _, _, _ = random_gru(5, 2, 3, 4, "bidirectional", 16, seed=4)
    kw = dict(hidden_size=4, bits=16, exponents=p["exponents"], zero_points=p["zero_points"],
              direction="bidirectional")
    for x in (X[:0], X[:, :0]):  # T = 0, N = 0
        args = (x, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"])
        got, ref = quantgru_cpu.quant_gru(*args, **kw), gru_int.quant_gru(*args, **kw)
        for g, r in zip(got, ref):
            assert g.shape == r.shape
            np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("bits", [8, 16])
def test_cpu_kernel_long_rows_and_extremes(bits):
    """Rows longer than the kernel's int32 chunk (quantgru_steps.CHUNK), the parallel input GEMM, and the largest
    products the format allows (every weight qmin, x and h at qmin with zero point qmax: |d| = 2^bits - 1), where
    a wrong chunk bound would overflow int32: bit-exact with the reference."""
    from onnx_lowbit.custom_ops.gru import quantgru_cpu, quantgru_steps
    T, N, C, H = 40, 2, 300, 200  # noqa: N806
    assert C > quantgru_steps.CHUNK and H > quantgru_steps.CHUNK and T * N * 3 * H * C >= quantgru_cpu.PARALLEL_MACS
    X, p, h0, lens, _ = random_gru(T, N, C, H, "bidirectional", bits, seed=7, stress=True)
    kw = dict(hidden_size=H, bits=bits, exponents=p["exponents"], zero_points=p["zero_points"],
              direction="bidirectional")
    args = [X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], lens, h0]
    for g, r in zip(quantgru_cpu.quant_gru(*args, **kw), gru_int.quant_gru(*args, **kw)):
        np.testing.assert_array_equal(g, r)
    lo, hi = gru_int.qrange(bits)
    z = np.array(p["zero_points"]).reshape(2, gru_int.NQ)
    z[:, gru_int.Q["x"]] = z[:, gru_int.Q["h"]] = hi
    kw["zero_points"] = z.reshape(-1).tolist()
    args[1], args[2] = np.full_like(p["W"], lo), np.full_like(p["R"], lo)
    args[0], args[7] = np.full_like(X, -1e9), np.full_like(h0, -1e9)
    got, ref = quantgru_cpu.quant_gru(*args, **kw), gru_int.quant_gru(*args, **kw)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("bits", [8, 16])
def test_cpu_kernel_batch_one_pipelined(bits):
    """Batch 1, long enough for quantgru_cpu.pipelined (the steps in blocks, the next block's input rows projected
    on the other thread), both directions, full and shorter sequence_lens (block boundaries not aligned with T):
    bit-exact with the reference."""
    from onnx_lowbit.custom_ops.gru import quantgru_cpu, quantgru_steps
    T, C, H = 70, 300, 200  # noqa: N806
    assert T * 3 * H * C >= quantgru_cpu.PARALLEL_MACS and 53 >= 2 * quantgru_steps.PIPE_BLOCK
    X, p, h0, _, _ = random_gru(T, 1, C, H, "bidirectional", bits, seed=3, stress=True)
    kw = dict(hidden_size=H, bits=bits, exponents=p["exponents"], zero_points=p["zero_points"],
              direction="bidirectional")
    for lens in (None, np.array([53], np.int32)):
        args = (X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], lens, h0)
        for g, r in zip(quantgru_cpu.quant_gru(*args, **kw), gru_int.quant_gru(*args, **kw)):
            np.testing.assert_array_equal(g, r)


def _paths():
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    return ["portable", "packed", "direct"] if quantgru_cpu.VNNI else ["portable"]


PACKED_CASES = [  # T, N, C, H, direction, layout, lens, h0, stress
    (1, 1, 3, 1, "forward", 0, False, False, False),
    (5, 3, 7, 1, "bidirectional", 1, True, True, True),
    (6, 1, 19, 17, "reverse", 0, False, True, False),
    (9, 4, 33, 33, "bidirectional", 0, True, True, True),
    (4, 2, 64, 48, "forward", 1, True, False, True),
    (21, 1, 257, 70, "forward", 0, False, True, False),
    (3, 5, 11, 100, "reverse", 0, True, True, True),
]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("case", PACKED_CASES)
def test_cpu_paths_edges(bits, case):
    """The packed and the direct VNNI paths (quantgru_cpu.run_direction_path, each forced for every length) and the
    portable path, bit-exact with the reference: H = 1 and H not a multiple of 16, T = 1, batch > 1 with
    sequence_lens (0 included), reverse and bidirectional, both layouts, initial_h, stressed parameters
    (saturation)."""
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    T, N, C, H, direction, layout, with_lens, with_h0, stress = case  # noqa: N806
    X, p, h0, lens, _ = random_gru(T, N, C, H, direction, bits, seed=T + 7 * H, stress=stress)
    if with_lens and N > 1:
        lens[0], lens[-1] = 0, T
    if layout == 1:
        X, h0 = X.transpose(1, 0, 2).copy(), h0.transpose(1, 0, 2).copy()
    kw = dict(hidden_size=H, bits=bits, exponents=p["exponents"], zero_points=p["zero_points"], direction=direction,
              layout=layout)
    args = (X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], lens if with_lens else None,
            h0 if with_h0 else None)
    ref = gru_int.quant_gru(*args, **kw)
    assert np.abs(ref[0]).max() > 0
    for path in _paths():
        for g, r in zip(quantgru_cpu.quant_gru(*args, **kw, path=path), ref):
            np.testing.assert_array_equal(g, r, err_msg=path)


def _in_int8_range(w):
    """quantgru_steps.narrow_range of every direction of w [D, rows, K]."""
    from onnx_lowbit.custom_ops.gru import quantgru_steps
    return all(quantgru_steps.narrow_range(np.ascontiguousarray(m)) for m in w)


def _narrow(p, rng):
    """p with W and R replaced by random int16 values in [-128, 127] (int8 weights widened), none all-zero."""
    q = dict(p)
    for k in ("W", "R"):
        q[k] = rng.integers(-128, 128, p[k].shape).astype(np.int16)
    return q


@pytest.mark.parametrize("case", PACKED_CASES)
def test_cpu_int16_narrow_weights(case):
    """int16 with every weight in [-128, 127] (the packed path's int8 weights, activations split into two
    bytes): bit-exact with the reference; one weight outside the range (128 or -129) takes the int16 products,
    also bit-exact."""
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    T, N, C, H, direction, layout, with_lens, with_h0, stress = case  # noqa: N806
    rng = np.random.default_rng(T * 31 + H)
    X, p, h0, lens, _ = random_gru(T, N, C, H, direction, 16, seed=T + 5 * H, stress=stress)
    p = _narrow(p, rng)
    if with_lens and N > 1:
        lens[0], lens[-1] = 0, T
    assert _in_int8_range(p["W"]) and _in_int8_range(p["R"])
    kw = dict(hidden_size=H, bits=16, exponents=p["exponents"], zero_points=p["zero_points"], direction=direction)
    for W, R in ((p["W"], p["R"]), (p["W"], p["R"].copy()), (p["W"].copy(), p["R"])):  # noqa: N806
        if R is not p["R"]:
            R[0, -1, -1] = 128
            assert not _in_int8_range(R)
        if W is not p["W"]:
            W[0, 0, 0] = -129
            assert not _in_int8_range(W)
        args = (X, W, R, p["B"], p["channel_exp"], p["luts"], lens if with_lens else None, h0 if with_h0 else None)
        ref = gru_int.quant_gru(*args, **kw)
        assert np.abs(ref[0]).max() > 0
        for path in _paths():
            for g, r in zip(quantgru_cpu.quant_gru(*args, **kw, path=path), ref):
                np.testing.assert_array_equal(g, r, err_msg=path)


@pytest.mark.parametrize("bits,narrow", [(8, False), (16, False), (16, True)])
def test_cpu_packed_extremes(bits, narrow):
    """The largest products each packed form allows, in rows longer than its exact int32 chunks (int16: 256
    products; C = 600 and H = 300 need several): every weight at the bottom of its range, x and h at qmin with
    zero point qmax (|d| = 2^bits - 1), then every weight at the top; bit-exact with the reference on both
    paths."""
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    T, N, C, H = 5, 2, 600, 300  # noqa: N806
    X, p, h0, lens, _ = random_gru(T, N, C, H, "bidirectional", bits, seed=11, stress=True)
    lo, hi = gru_int.qrange(bits)
    wlo, whi = (-128, 127) if narrow else (lo, hi)
    z = np.array(p["zero_points"]).reshape(2, gru_int.NQ)
    z[:, gru_int.Q["x"]] = z[:, gru_int.Q["h"]] = hi
    kw = dict(hidden_size=H, bits=bits, exponents=p["exponents"], zero_points=z.reshape(-1).tolist(),
              direction="bidirectional")
    for wv, xv in ((wlo, -1e9), (whi, -1e9), (wlo, 1e9)):
        W, R = np.full_like(p["W"], wv), np.full_like(p["R"], wv)  # noqa: N806
        if bits == 16:
            assert _in_int8_range(R) == narrow
        args = (np.full_like(X, xv), W, R, p["B"], p["channel_exp"], p["luts"], lens, np.full_like(h0, xv))
        ref = gru_int.quant_gru(*args, **kw)
        for path in _paths():
            for g, r in zip(quantgru_cpu.quant_gru(*args, **kw, path=path), ref):
                np.testing.assert_array_equal(g, r, err_msg=path)
    # random weights over the full range in the same long rows
    rng = np.random.default_rng(3)
    W = rng.integers(wlo, whi + 1, p["W"].shape).astype(p["W"].dtype)  # noqa: N806
    R = rng.integers(wlo, whi + 1, p["R"].shape).astype(p["R"].dtype)  # noqa: N806
    args = (X, W, R, p["B"], p["channel_exp"], p["luts"], lens, h0)
    ref = gru_int.quant_gru(*args, **kw)
    for path in _paths():
        for g, r in zip(quantgru_cpu.quant_gru(*args, **kw, path=path), ref):
            np.testing.assert_array_equal(g, r, err_msg=path)


def test_cpu_packed_products():
    """The VNNI product intrinsics against numpy on random packed operands (every variant the kernel uses;
    rows / blocks / k not multiples of the tile, int16 rows longer than one exact chunk) and the weight packing
    against a numpy transpose."""
    from onnx_lowbit.custom_ops.gru import quantgru_steps as q
    if not q.VNNI:
        pytest.skip("no AVX-512 VNNI on this CPU")
    rng = np.random.default_rng(0)
    for rows, K in ((1, 1), (17, 5), (75, 37), (1200, 400), (40, 257)):
        for dt, g in ((np.int8, 4), (np.int16, 2)):
            W = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max + 1, (rows, K)).astype(dt)  # noqa: N806
            kg = -(-K // g)
            nbp = -(-(-(-rows // 16)) // q.NB_REC) * q.NB_REC
            wp = np.full(nbp * kg * 64 // W.itemsize, 99, dt)
            rs = np.empty(rows, np.int64)
            q.pack_weights(W, nbp, wp, rs)
            Wp = np.zeros((nbp * 16, kg * g), dt)  # noqa: N806
            Wp[:rows, :K] = W
            np.testing.assert_array_equal(wp, Wp.reshape(nbp, 16, kg, g).transpose(0, 2, 1, 3).ravel())
            np.testing.assert_array_equal(rs, W.astype(np.int64).sum(1))
            for rec in (True, False):
                m = 1 if rec else 2 * q.MR_GEMM
                adt = np.uint8 if dt == np.int8 else np.int16
                for split in ((False, True) if dt == np.int8 else (True,)):
                    a0 = rng.integers(0, 256, (m, kg * g)).astype(adt)
                    a1 = rng.integers(0, 256, (m, kg * g)).astype(adt)
                    if dt == np.int16:
                        a0 = (a0.astype(np.int16) - 128).astype(adt)      # the high byte of a signed int16
                    acc = np.empty(m * nbp * 16, np.int64)
                    o0, o1 = np.empty(m * nbp * 16, np.int32), np.empty(m * nbp * 16, np.int32)
                    _products_py(rec, wp, a0.ravel(), a1.ravel(), kg * g, m // (1 if rec else q.MR_GEMM), nbp, kg,
                                 o0, o1, acc, nbp * 16, split)
                    w64 = W.astype(np.int64)
                    want = a0[:, :K].astype(np.int64) @ w64.T
                    if split:
                        want = want * 256 + a1[:, :K].astype(np.int64) @ w64.T
                    np.testing.assert_array_equal(acc.reshape(m, nbp * 16)[:, :rows], want)


def _products_py(*args):
    from numba import njit
    from onnx_lowbit.custom_ops.gru import quantgru_steps as q
    global _PRODUCTS
    if "_PRODUCTS" not in globals():
        @njit
        def run(rec, wp, a0, a1, a_stride, m_groups, nbp, kg, o0, o1, acc, n_out, split):
            q._products(rec, wp, a0, a1, a_stride, m_groups, nbp, kg, o0, o1, acc, n_out, split)
        _PRODUCTS = run
    return _PRODUCTS(*args)


def test_cpu_listed_products():
    """A half of the hidden units as one list of blocks over the three gates (quantgru_steps.half_blocks, what the
    tasks and frames entries multiply): the list covers every row of the half in each gate, its length is a whole
    number of NB_REC groups within list_capacity, and listed_products' sums read at acc[base[g] + row] equal numpy's
    for every row of the half, for each weight width and activation split, H a multiple of 16 or not."""
    from onnx_lowbit.custom_ops.gru import quantgru_steps as q
    if not q.VNNI:
        pytest.skip("no AVX-512 VNNI on this CPU")
    rng = np.random.default_rng(1)
    for H, K in ((72, 40), (80, 257), (144, 64), (400, 400)):  # noqa: N806
        rows = 3 * H
        halves = ((0, H // 2 // 16 * 16), (H // 2 // 16 * 16, H), (0, H), (5, 37))
        for dt, g in ((np.int8, 4), (np.int16, 2)):
            W = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max + 1, (rows, K)).astype(dt)  # noqa: N806
            kg = -(-K // g)
            nbp = -(-(-(-rows // 16)) // q.NB_REC) * q.NB_REC
            wp = np.zeros(nbp * kg * 64 // W.itemsize, dt)
            q.pack_weights(W, nbp, wp, np.empty(rows, np.int64))
            adt = np.uint8 if dt == np.int8 else np.int16
            for split in ((False, True) if dt == np.int8 else (True,)):
                a0 = rng.integers(0, 256, kg * g).astype(adt)
                a1 = rng.integers(0, 256, kg * g).astype(adt)
                if dt == np.int16:
                    a0 = (a0.astype(np.int16) - 128).astype(adt)
                want = W.astype(np.int64) @ a0[:K].astype(np.int64)
                if split:
                    want = want * 256 + W.astype(np.int64) @ a1[:K].astype(np.int64)
                for u0, u1 in halves:
                    cap = q.list_capacity(H)
                    blk, base = np.full(cap, -1, np.int64), np.empty(3, np.int64)
                    n = q.half_blocks(H, u0, u1, blk, base)
                    assert n % q.NB_REC == 0 and n <= cap and blk[:n].min() >= 0 and blk[:n].max() < nbp
                    acc = np.empty(n * 16, np.int64)
                    o0, o1 = np.empty(n * 16, np.int32), np.empty(n * 16, np.int32)
                    _listed_py(wp, blk[:n], a0, a1, kg, o0, o1, acc, split)
                    for gate in range(3):
                        r = np.arange(gate * H + u0, gate * H + u1)
                        np.testing.assert_array_equal(acc[base[gate] + r], want[r], err_msg=f"H={H} {dt} {u0}:{u1}")


def _listed_py(*args):
    from numba import njit
    from onnx_lowbit.custom_ops.gru import quantgru_steps as q
    global _LISTED
    if "_LISTED" not in globals():
        @njit
        def run(wp, blk, a0, a1, kg, o0, o1, acc, split):
            q.listed_products(wp, blk, a0, a1, kg, o0, o1, acc, split)
        _LISTED = run
    return _LISTED(*args)


@pytest.mark.parametrize("bits", [8, 16])
def test_cpu_table_lookups(bits):
    """The cell's table lookups (quantgru_cpu._luts: vector gathers on AVX-512 hosts, eight at a time, the rest
    one by one) against gru_int.lut for every value of the width, in place and not, lengths not a multiple of
    8, on a random table."""
    from numba import njit
    from onnx_lowbit.custom_ops.gru import quantgru_steps as q

    @njit
    def run(tab, qv, out, lo, sh, rnd):
        q._luts(tab, qv, out, lo, sh, rnd)

    rng = np.random.default_rng(bits)
    lo, hi = gru_int.qrange(bits)
    sh = gru_int.LUT_SHIFT[bits]
    tab = rng.integers(lo, hi + 1, gru_int.lut_len(bits)).astype(np.int32)
    allq = np.arange(lo, hi + 1, dtype=np.int64)
    want = gru_int.lut(allq, tab, bits)
    for n in (allq.size, 1, 7, 13, 200):
        qv = rng.permutation(allq)[:n].copy()
        out = np.full(n, 12345, np.int64)
        run(tab, qv, out, lo, sh, (1 << sh) >> 1)
        np.testing.assert_array_equal(out, want[qv - lo])
        run(tab, qv, qv, lo, sh, (1 << sh) >> 1)      # in place
        np.testing.assert_array_equal(qv, out)


def test_cpu_rowdot_products():
    """The direct path's row-dot intrinsics (quantgru_vnni.rowdot: the weights as stored) against numpy: rows not
    a multiple of ROWDOT_MR, k below, at and past one 64-byte vector up to ROWDOT_MAX_K, activations exactly k
    long (the last vector's loads masked), random over each form's full range, then its largest products."""
    from numba import njit
    from onnx_lowbit.custom_ops.gru import quantgru_vnni as q
    if not q.VNNI:
        pytest.skip("no AVX-512 VNNI on this CPU")

    @njit
    def run(w, a0, a1, c, out):
        q.rowdot(w, a0, a1, c, out)

    def check(w, d, c=0):
        out = np.full(w.shape[0], -7, np.int64)
        if w.dtype == np.int8:   # d = a0 - c, a0 unsigned bytes
            run(w, (d + c).astype(np.uint8), np.zeros(0, np.uint8), c, out)
        else:                    # d = 256 a0 + a1
            run(w, (d >> 8).astype(np.int16), (d & 255).astype(np.int16), 0, out)
        np.testing.assert_array_equal(out, w.astype(np.int64) @ d)

    rng = np.random.default_rng(5)
    kmax = q.ROWDOT_MAX_K
    for rows, K in ((1, 1), (3, 5), (5, 32), (6, 64), (7, 65), (13, 100), (1203, 257), (9, kmax)):  # noqa: N806
        for dt in (np.int8, np.int16):
            info = np.iinfo(dt)
            w = rng.integers(info.min, info.max + 1, (rows, K)).astype(dt)
            c = int(rng.integers(0, 256))          # int8: d = a0 - c in [-c, 255 - c]
            check(w, rng.integers(-c, 256 - c, K) if dt == np.int8 else rng.integers(-65535, 65536, K), c)
    for dt, dext in ((np.int8, 255), (np.int16, 65535)):   # |d| at its largest: c = 255 or 0 for int8
        info = np.iinfo(dt)
        for wv, dv in ((info.min, -dext), (info.min, dext), (info.max, dext)):
            check(np.full((5, kmax), wv, dt), np.full(kmax, dv), max(-dv, 0))


def _stream_calls():
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    k = quantgru_cpu.PACK_MIN_STEPS
    return tuple(sorted({1, 2, 7, 8, 9, k - 1, k, k + 1})) + (1,)


STREAM_CALLS = _stream_calls()   # steps per call: 1, 2, 7, 8, 9 and either side of PACK_MIN_STEPS


def stream(run, X, h0, sizes, rev):  # noqa: N803
    """Runs X [T, N, C] in calls of ``sizes`` steps (from the sequence's end when rev), each call's Y_h fed back as
    the next one's initial_h; run(x, h) -> (Y, Y_h) in layout 0. Returns Y [T, D, N, H] put together from the
    calls' and the last Y_h."""
    t_all, y, state, t0 = X.shape[0], None, h0, 0
    for size in sizes:
        sl = slice(t_all - t0 - size, t_all - t0) if rev else slice(t0, t0 + size)
        ys, state = run(X[sl], state)
        if y is None:
            y = np.zeros((t_all,) + ys.shape[1:], ys.dtype)
        y[sl] = ys
        t0 += size
    assert t0 == t_all
    return y, state


def stream_passes(direction):
    """(direction index, frames from the end) of each streaming pass: forward in order, reverse from the end;
    bidirectional both, one pass each (each pass checks its own direction)."""
    return {"forward": [(0, False)], "reverse": [(0, True)], "bidirectional": [(0, False), (1, True)]}[direction]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("N,C,H", [(1, 70, 37), (3, 5, 70)])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_cpu_streaming_equals_whole_sequence(bits, N, C, H, direction):  # noqa: N803
    """A sequence run frame by frame (T = 1) and in calls of 1, 2, 7, 8, 9 steps and around PACK_MIN_STEPS (on VNNI
    hosts the direct path below it, the packed one from it), each call's Y_h fed back as the next initial_h, gives the
    whole-sequence run's Y and Y_h bit for bit, and every call equals the reference. Reverse: the calls from the
    sequence's end; bidirectional: a pass in order for the forward direction, one from the end for the reverse."""
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    T = sum(STREAM_CALLS)  # noqa: N806
    X, p, h0, _, _ = random_gru(T, N, C, H, direction, bits, seed=4000 + 100 * N + bits + len(direction))
    kw = dict(hidden_size=H, bits=bits, exponents=p["exponents"], zero_points=p["zero_points"], direction=direction)
    weights = (p["W"], p["R"], p["B"], p["channel_exp"], p["luts"])
    whole = gru_int.quant_gru(X, *weights, None, h0, **kw)
    assert np.abs(whole[0]).max() > 0

    def run(x, h):
        got = quantgru_cpu.quant_gru(x, *weights, None, h, **kw)
        for g, r in zip(got, gru_int.quant_gru(x, *weights, None, h, **kw)):
            np.testing.assert_array_equal(g, r)
        return got

    for sizes in (STREAM_CALLS, (1,) * T):
        for k, rev in stream_passes(direction):
            y, yh = stream(run, X, h0, sizes, rev)
            np.testing.assert_array_equal(y[:, k], whole[0][:, k])
            np.testing.assert_array_equal(yh[k], whole[1][k])


def test_cpu_cached_parallel_kernels_in_a_new_process(tmp_path):
    """A new process that finds run_direction_packed in Numba's disk cache (compiled by this one) runs it with an
    input projection long enough for its parallel kernel: quantgru_cpu._run starts Numba's thread pool first (a
    cached caller of a parallel kernel finds none started otherwise and the process dies: a session's second run
    of a long input did)."""
    import subprocess
    import sys

    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    T, C, H = 100, 128, 128  # noqa: N806
    assert T * 3 * H * C >= quantgru_cpu.PARALLEL_MACS
    X, p, h0, _, _ = random_gru(T, 2, C, H, "forward", 8, seed=5)
    np.savez(tmp_path / "g.npz", X=X, h0=h0, exponents=p["exponents"], zero_points=p["zero_points"],
             **{k: p[k] for k in ("W", "R", "B", "channel_exp", "luts")})
    code = (
        "import numpy as np, sys\n"
        "from onnx_lowbit import gru_int\n"
        "from onnx_lowbit.custom_ops.gru import quantgru_cpu as q\n"
        "d = np.load(sys.argv[1])\n"
        f"a = gru_int.GRUAttrs({H}, 8, d['exponents'], d['zero_points'], 'forward', 0)\n"
        "packs = [q.pack_direction(d['W'][0], d['R'][0])]\n"
        "args = (d['X'], d['W'], d['R'], d['B'], d['channel_exp'], d['luts'], None, d['h0'])\n"
        "y, yh = q._run(a, *args, packs=packs)\n"
        "ref = gru_int.quant_gru(*args, hidden_size=a.hidden_size, bits=8, exponents=d['exponents'],\n"
        "                        zero_points=d['zero_points'])\n"
        "assert np.array_equal(y, ref[0]) and np.array_equal(yh, ref[1])\n"
        "print('ok')\n")
    script = tmp_path / "run.py"
    script.write_text(code)
    for _ in range(2):   # the first may compile (and so start the pool); the second loads everything cached
        r = subprocess.run([sys.executable, str(script), str(tmp_path / "g.npz")], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])

"""QuantGRU CUDA kernel (custom_ops/gru/quantgru_cuda.py) bit-exact against the integer reference
onnx_lowbit.gru_int.quant_gru.

Kernel level: ``run_arrays`` under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, tiny shapes, one launch per
step, 32-thread blocks) or on a real GPU with ONNX_LOWBIT_REAL_GPU=1 (one cooperative launch for all steps,
also forced per-step launches and several block splits). Random parameters cover the whole integer range:
weights, tables and zero points anywhere in int8/int16, exponents that make every scalar rescale a left shift,
no shift or a right shift, X with NaN / inf / huge values (saturation at entry), sequence_lens with zeros.
Through onnxruntime CUDA-EP sessions where onnxruntime-gpu and a GPU are present (skipped otherwise).

The per-call parameter kernel (quantgru_prep_cuda.prep) against the host reference on random valid inputs, and its
clamps of bad values; the onnxruntime kernel's compute with a stand-in context (simulator or GPU, no
onnxruntime): bit-exact, no value checks (bad values clamped, end to end), scratch from the context only; under the
simulator its native plan is replayed as the shim replays it, on new inputs, outputs and scratch.
"""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import gru_int

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"


def _cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.gru import quantgru_cuda
    return quantgru_cuda


def random_case(T, N, C, H, bits, direction, *, seed=0, lens=True, h0=True, specials=True, layout=0):  # noqa: N803
    """Inputs and attributes of a valid QuantGRU call with random parameters."""
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    lo, hi = gru_int.qrange(bits)
    qt = gru_int.QTYPES[bits]
    e = np.zeros((d, gru_int.NQ), np.int64)
    z = np.zeros((d, gru_int.NQ), np.int64)
    ch = np.zeros((d, 4, 3 * H), np.int32)
    for k in range(d):
        while True:
            ek = rng.integers(2, 12, gru_int.NQ)
            ek[gru_int.Q["z_out"]] = rng.integers(bits // 2, bits)
            ee = {n: int(ek[gru_int.Q[n]]) for n in gru_int.QUANTITIES}
            if all(s >= -gru_int.MAX_LEFT_SHIFT for _, _, s in gru_int.scalar_shifts(ee)):
                break
        e[k] = ek
        z[k] = rng.integers(lo // 2, hi // 2, gru_int.NQ)
        z[k, gru_int.Q["g_out"]] = 0
        E = lambda n: ee[n]  # noqa: E731
        ch[k, gru_int.CH_W] = E("Wx") - E("x") + rng.integers(bits // 2, bits + 6, 3 * H)
        ch[k, gru_int.CH_R] = E("Rh") - E("h") + rng.integers(bits // 2, bits + 6, 3 * H)
        tg = np.concatenate([np.full(H, E("z_pre")), np.full(H, E("r_pre")), np.full(H, E("g_pre"))])
        ch[k, gru_int.CH_BX] = tg + rng.integers(0, 8, 3 * H)
        tg[2 * H:] = E("Rh_add_br")
        ch[k, gru_int.CH_BR] = tg + rng.integers(0, 8, 3 * H)
    W = rng.integers(lo, hi + 1, (d, 3 * H, C)).astype(qt)
    R = rng.integers(lo, hi + 1, (d, 3 * H, H)).astype(qt)
    B = rng.integers(-(1 << 20), 1 << 20, (d, 6 * H)).astype(np.int32)
    L = gru_int.lut_len(bits)
    luts = np.sort(rng.integers(lo, hi + 1, (d, 3, L)), axis=-1).astype(qt)
    scale = 2.0 ** -float(e[:, gru_int.Q["x"]].mean()) * (hi - lo) / 4
    X = (rng.standard_normal((T, N, C) if layout == 0 else (N, T, C)) * scale).astype(np.float32)
    if specials and X.size >= 4:
        X.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, 1e30]
    sl = rng.integers(0, T + 1, N).astype(np.int32) if lens else None
    if sl is not None and N > 1:
        sl[0] = T
    ih = None
    if h0:
        ih = (rng.standard_normal((d, N, H) if layout == 0 else (N, d, H)) * 4).astype(np.float32)
    attrs = dict(hidden_size=H, bits=bits, exponents=e.reshape(-1).tolist(), zero_points=z.reshape(-1).tolist(),
                 direction=direction, layout=layout)
    return (X, W, R, B, ch, luts, sl, ih), attrs


def check(qg, args, attrs, **kw):
    want_y, want_h = gru_int.quant_gru(*args, **attrs)
    y, yh = qg.run_arrays(*args, **attrs, **kw)
    assert y.shape == want_y.shape and yh.shape == want_h.shape
    assert np.array_equal(y.view(np.uint32), want_y.view(np.uint32)), \
        f"Y differs at {np.argwhere(y != want_y)[:5].tolist()} of {y.size}"
    assert np.array_equal(yh.view(np.uint32), want_h.view(np.uint32)), "Y_h differs"


# (T, N, C, H, bits, direction, lens, h0, layout)
CASES = [
    (3, 1, 5, 4, 8, "forward", False, False, 0),
    (3, 2, 3, 5, 16, "forward", True, True, 0),
    (2, 3, 4, 3, 8, "reverse", True, True, 0),
    (3, 2, 2, 4, 16, "bidirectional", True, False, 0),
    (2, 5, 3, 3, 8, "bidirectional", True, True, 1),
    (4, 1, 3, 6, 16, "reverse", False, True, 1),
]


@pytest.mark.parametrize("T,N,C,H,bits,direction,lens,h0,layout", CASES,
                         ids=[f"T{c[0]}N{c[1]}C{c[2]}H{c[3]}-int{c[4]}-{c[5]}{'-lens' if c[6] else ''}"
                              f"{'-h0' if c[7] else ''}-L{c[8]}" for c in CASES])
def test_kernel_bit_exact(T, N, C, H, bits, direction, lens, h0, layout):  # noqa: N803
    qg = _cuda()
    args, attrs = random_case(T, N, C, H, bits, direction, seed=T * 100 + N * 10 + H, lens=lens, h0=h0,
                              layout=layout)
    check(qg, args, attrs)


def test_kernel_block_splits_and_empty():
    """Units split over several blocks (a barrier group of 2..H blocks), T = 0, all sequence lengths 0."""
    qg = _cuda()
    args, attrs = random_case(3, 2, 3, 5, 16, "bidirectional", seed=7)
    for units in (1, 2, 5):
        check(qg, args, attrs, units=units)
    args, attrs = random_case(0, 2, 3, 4, 8, "forward", seed=8, lens=False)
    check(qg, args, attrs)
    args, attrs = random_case(2, 2, 3, 4, 8, "reverse", seed=9)
    args = args[:6] + (np.zeros(2, np.int32),) + args[7:]
    check(qg, args, attrs)


def test_bad_inputs_raise_clear_errors():
    qg = _cuda()
    args, attrs = random_case(2, 2, 3, 4, 8, "forward", seed=1)
    bad = args[:6] + (np.array([3, 1], np.int32),) + args[7:]
    with pytest.raises(ValueError, match="sequence_lens"):
        qg.run_arrays(*bad, **attrs)
    with pytest.raises(ValueError, match="R must have shape"):
        qg.run_arrays(*(args[:2] + (args[2][:, :, :3],) + args[3:]), **attrs)


def xproj_check(qg, args, attrs, **kw):
    """The xproj kernel's qWx [D, T, N, 3H] against gru_int.input_gemm, direction by direction."""
    X, W, R, B, ch, luts, sl, ih = args
    p = qg.Prepared(*args, **attrs, **kw)
    p.launch(what="xproj")
    got = p.qwx.copy_to_host()[: p.d * p.t * p.n * 3 * p.h].reshape(p.d, p.t, p.n, 3 * p.h)
    a = gru_int.GRUAttrs(attrs["hidden_size"], attrs["bits"], attrs["exponents"], attrs["zero_points"],
                         attrs["direction"], attrs["layout"])
    x = X if attrs["layout"] == 0 else X.transpose(1, 0, 2)
    for k in range(p.d):
        e, z = a.exponents[k], a.zero_points[k]
        qx = gru_int.quantize(x, e[gru_int.Q["x"]], z[gru_int.Q["x"]], a.bits)
        wq = W[k].astype(np.int64)
        want = gru_int.input_gemm(qx, wq, wq.sum(1), ch[k, gru_int.CH_W].astype(np.int64), e, z, a.bits)
        assert np.array_equal(got[k], want), f"direction {k}: qWx differs at {np.argwhere(got[k] != want)[:5]}"


@pytest.mark.parametrize("bits", [8, 16])
def test_xproj_tiles_edges_and_chunks(bits):
    """Every tile on rows (T N = 21) and columns (3H = 21) that are no multiple of the tile, K (C = 13) no
    multiple of the round depth, both layouts, two directions; and the chunked accumulation (exact float sums
    moved into the integer accumulator every kc products) with kc = the smallest tile's round depth bk and
    C = 3 kc + 1 (chunks kc, kc, kc, 1; kc must be a multiple of bk)."""
    qg = _cuda()
    small = qg.XTILES[bits][-1]
    for layout in (0, 1):
        args, attrs = random_case(3, 7, 13, 7, bits, "bidirectional", seed=bits + layout, layout=layout)
        for t in qg.XTILES[bits]:
            xproj_check(qg, args, attrs, xtile=t.name)
    args, attrs = random_case(3, 7, 3 * small.bk + 1, 7, bits, "bidirectional", seed=bits + 5)
    xproj_check(qg, args, attrs, xtile=small.name, kc=small.bk)


def worst_case(bits, C, runs):  # noqa: N803
    """A GEMM whose float sums reach the exactness limit: zp_x = qmin, x quantised to qmax (x - zp_x =
    2^bits - 1), weight rows of runs of +-qmax (odd products), then a tail of small values, so that the partial sums
    climb to runs * (2^bits - 1) qmax in magnitude and come back to a small result that the int8/int16 output
    shows unsaturated (shift 0, zp_Wx = 0). Row 2 starts with a run of qmin (-2^(bits-1)), the largest |w|."""
    lo, hi = gru_int.qrange(bits)
    args, attrs = random_case(1, 2, C, 1, bits, "forward", seed=bits, lens=False, h0=False, specials=False)
    X, W, R, B, ch, luts, sl, ih = args
    e = np.array(attrs["exponents"]).reshape(1, -1)
    z = np.array(attrs["zero_points"]).reshape(1, -1)
    e[0, gru_int.Q["x"]] = 0
    z[0, gru_int.Q["x"]] = lo
    z[0, gru_int.Q["Wx"]] = 0
    ch = ch.copy()
    ch[0, gru_int.CH_W] = e[0, gru_int.Q["Wx"]]      # eW + e_x - e_Wx = 0
    X = np.full((1, 2, C), hi - lo, np.float32)                # quantised: x - zp_x = hi - lo = 2^bits - 1
    X[0, :, 2 * runs:] = np.arange(C - 2 * runs) % 3           # x - zp_x = 0, 1, 2 in the tail
    W = np.zeros((1, 3, C), W.dtype)
    W[0, 0, :runs], W[0, 0, runs:2 * runs] = -hi, hi
    W[0, 1, :runs], W[0, 1, runs:2 * runs] = hi, -hi
    r2 = 2 * runs // 3
    W[0, 2, :r2], W[0, 2, r2:2 * r2], W[0, 2, 2 * r2:3 * r2] = lo, hi, 1
    W[0, :, 2 * runs:] = np.arange(C - 2 * runs) % 2
    attrs = dict(attrs, exponents=e.reshape(-1).tolist(), zero_points=z.reshape(-1).tolist())
    return (X, W, R, B, ch, luts, None, None), attrs


def test_xproj_exact_at_the_float_limits():
    """int8 through float32 sums of K_F32 = 512 products at the proven bound (the partial sums reach
    512 * 255 * 127 and run on past 2^24 without the chunking: a single float32 sum of these 600-product runs is
    inexact, checked below, so the test fails if the chunk were too long); int16 through float64 (float32 would
    be inexact from the second product on), also chunked into int64 every kc products (kc = the largest round
    depth of the int16 tiles, so a multiple of every tile's: several chunks over C = 300)."""
    qg = _cuda()
    args, attrs = worst_case(8, 1300, 600)
    row = args[0][0, 0] * args[1][0, 0].astype(np.float32)            # (x - zp_x) w, x - zp_x = X here
    one_sum = np.float32(0)
    for v in row:
        one_sum += v
    assert int(one_sum) != int(row.astype(np.int64).sum())      # what an unchunked float32 sum would give
    xproj_check(qg, args, attrs)
    args, attrs = worst_case(16, 300, 140)
    xproj_check(qg, args, attrs)
    xproj_check(qg, args, attrs, kc=max(t.bk for t in qg.XTILES[16]))


@pytest.mark.skipif(SIM or not REAL_GPU, reason="real GPU only (ONNX_LOWBIT_REAL_GPU=1)")
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("T,N,C,H,direction", [(20, 1, 64, 256, "forward"), (7, 33, 40, 96, "bidirectional"),
                                               (9, 4, 16, 520, "reverse")])
def test_gpu_bit_exact_larger(T, N, C, H, direction, bits):  # noqa: N803
    qg = _cuda()
    args, attrs = random_case(T, N, C, H, bits, direction, seed=H + N)
    check(qg, args, attrs)
    check(qg, args, attrs, per_step=True)
    check(qg, args, attrs, units=max(1, H // 3), repeat=2)
    for t in qg.XTILES[bits]:
        xproj_check(qg, args, attrs, xtile=t.name)


def calibrated_case(T, N, C, H, bits, direction, *, seed=0, layout=0, lens=True):  # noqa: N803
    """A float GRU's weights quantised by gru_quant from its own calibration run (values mostly in range)."""
    from onnx_lowbit import gru_quant
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    k = 1 / np.sqrt(H)
    W = rng.uniform(-k, k, (d, 3 * H, C))
    R = rng.uniform(-k, k, (d, 3 * H, H))
    B = rng.uniform(-k, k, (d, 6 * H))
    X = rng.standard_normal((T, N, C) if layout == 0 else (N, T, C)).astype(np.float32)
    ih = (rng.standard_normal((d, N, H) if layout == 0 else (N, d, H)) * 0.3).astype(np.float32)
    sl = rng.integers(1, T + 1, N).astype(np.int32) if lens else None
    ranges = gru_quant.calibrate(X, W, R, B, sl, ih, hidden_size=H, direction=direction, layout=layout)
    p = gru_quant.quant_params(W, R, B, ranges, bits=bits)
    attrs = dict(hidden_size=H, bits=bits, exponents=p["exponents"], zero_points=p["zero_points"],
                 direction=direction, layout=layout)
    return (X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], sl, ih), attrs


@pytest.mark.parametrize("bits", [8, 16])
def test_kernel_bit_exact_calibrated(bits):
    qg = _cuda()
    args, attrs = calibrated_case(4, 3, 5, 6, bits, "bidirectional", seed=bits)
    check(qg, args, attrs, units=2)


@pytest.mark.skipif(SIM or not REAL_GPU, reason="real GPU only (ONNX_LOWBIT_REAL_GPU=1)")
@pytest.mark.parametrize("bits", [8, 16])
def test_gpu_bit_exact_calibrated_benchmark_shapes(bits):
    qg = _cuda()
    for T, N, C, H in [(100, 1, 256, 256), (30, 32, 512, 512)]:
        args, attrs = calibrated_case(T, N, C, H, bits, "forward", seed=bits + N, lens=N > 1)
        check(qg, args, attrs)


# ------------------------------------------------------------------------------- onnxruntime CUDA-EP sessions
def _ort_cuda():
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here")
    if SIM:
        pytest.skip("needs a real GPU (the simulator is on)")
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no real GPU for Numba")
    return ort


@pytest.mark.parametrize("direction,bits,layout,lens,h0", [("forward", 8, 0, False, False),
                                                           ("bidirectional", 16, 1, True, True),
                                                           ("reverse", 16, 0, True, False)])
def test_cuda_session_bit_exact(direction, bits, layout, lens, h0):
    """One-node models on the CUDA EP (weights as initializers, X / sequence_lens / h0 fed): bit-exact with the
    reference, repeated runs and changing batch sizes on one session."""
    _ort_cuda()
    import onnx_lowbit
    from test_gru_kernels import gru_node_model
    args, attrs = calibrated_case(6, 5, 7, 40, bits, direction, seed=bits, layout=layout, lens=lens)
    X, W, R, B, ch, luts, sl, ih = args
    p = {"W": W, "R": R, "B": B, "channel_exp": ch, "luts": luts, "exponents": attrs["exponents"],
         "zero_points": attrs["zero_points"]}
    m = gru_node_model(p, 40, direction, bits, layout, with_lens=lens, with_h0=h0)
    sess = onnx_lowbit.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
    for T, N in [(6, 5), (6, 3), (2, 1)]:  # noqa: N806 - one session, changing shapes
        x = X[:T, :N] if layout == 0 else X[:N, :T]
        n_sl = np.minimum(sl[:N], T) if lens else None
        n_h0 = (ih[:, :N] if layout == 0 else ih[:N]) if h0 else None
        feeds = {"X": np.ascontiguousarray(x)}
        if lens:
            feeds["sequence_lens"] = n_sl
        if h0:
            feeds["h0"] = np.ascontiguousarray(n_h0)
        want = gru_int.quant_gru(feeds["X"], W, R, B, ch, luts, n_sl, feeds.get("h0"), **attrs)
        for _ in range(2):
            got = sess.run(None, feeds)
            for g, w in zip(got, want):
                assert np.array_equal(g.view(np.uint32), w.view(np.uint32))


# ------------------------------------------------------------------ the parameter kernel (quantgru_prep_cuda)
def _prep_inputs(bits, direction, H, seed, valid=True):  # noqa: N803
    """Attributes and B / channel_exp: valid ones anywhere in the allowed range (every per-channel shift from 0
    up to 62 + the exponent gap, so also past 63; biases over all of int32), or bad ones (exponents below their
    targets, beyond +-62, at the int32 limits)."""
    rng = np.random.default_rng(seed)
    _, attrs = random_case(2, 2, 3, H, bits, direction, seed=seed, lens=False, h0=False)
    a = gru_int.GRUAttrs(H, bits, attrs["exponents"], attrs["zero_points"], direction)
    d = a.num_directions
    from onnx_lowbit.custom_ops.gru.quantgru_prep_cuda import standin_channel_exp
    low = standin_channel_exp(a).astype(np.int64)           # the smallest valid exponent of every entry
    if valid:
        ce = rng.integers(low, gru_int.MAX_EXP + 1)
    else:
        ce = low + rng.integers(-70, 70, low.shape)
        ce.reshape(-1)[:4] = [-(1 << 31), (1 << 31) - 1, 1000, -1000]
    B = rng.integers(-(1 << 31), 1 << 31, (d, 6 * H))
    B.reshape(-1)[:2] = [-(1 << 31), (1 << 31) - 1]
    return a, B.astype(np.int32), ce.astype(np.int32)


def _run_prep(qg, a, B, ce, sl, T, N):  # noqa: N803
    """The parameter launch alone on a scratch filled with 0xA5: (pch [D, 10H], lens [N], counters)."""
    from numba import cuda
    cp = qg.CallPlan(a, T, N, 3, 4, False, sl is not None)
    params = qg.Params(a)
    bufs = {k: cuda.to_device(np.ascontiguousarray(v).reshape(-1)) for k, v in
            (("b", B), ("ce", ce), ("seql", sl if sl is not None else np.zeros(1, np.int32)))}
    scratch = cuda.to_device(np.full(cp.nbytes, 0xA5, np.uint8))
    ptrs = {k: qg._dptr(v) for k, v in bufs.items()}
    ptrs["scratch"] = qg._dptr(scratch)
    qg.issue(cp, params, ptrs, 0, what="prep")
    host = scratch.copy_to_host()
    at = lambda name, n, dt: host[cp.off[name]:cp.off[name] + n * np.dtype(dt).itemsize].view(dt)  # noqa: E731
    d, h = a.num_directions, a.hidden_size
    return (at("pch", d * qg.PC * h, np.int64).reshape(d, -1), at("lens", N, np.int32),
            at("cnt", cp.plan.groups, np.uint64))


@pytest.mark.parametrize("bits,direction", [(8, "forward"), (16, "bidirectional"), (8, "reverse")])
def test_prep_kernel_equals_host_parameters(bits, direction):
    """On valid inputs the device's per-channel parameters equal the host reference (channel_params) bit for bit;
    the lengths are sequence_lens (or T), the barrier counters 0 (the scratch was filled with 0xA5 first)."""
    qg = _cuda()
    from onnx_lowbit.custom_ops.gru.quantgru_prep_cuda import channel_params
    for seed in range(3):
        a, B, ce = _prep_inputs(bits, direction, 5 + seed, seed)
        X = np.zeros((4, 3, 2), np.float32)
        sl = np.array([4, 0, 2], np.int32)
        gru_int.check_inputs(a, X, np.zeros((a.num_directions, 3 * a.hidden_size, 2), gru_int.QTYPES[bits]),
                             np.zeros((a.num_directions, 3 * a.hidden_size, a.hidden_size), gru_int.QTYPES[bits]),
                             B, ce, np.zeros((a.num_directions, 3, gru_int.lut_len(bits)), gru_int.QTYPES[bits]), sl)
        want = channel_params(a, B, ce)
        assert want[:, :6 * a.hidden_size].max() >= 63 or seed, "no shift past 63 exercised"
        for lens in (sl, None):
            pch, got_lens, cnt = _run_prep(qg, a, B, ce, lens, 4, 3)
            assert np.array_equal(pch, want)
            assert np.array_equal(got_lens, sl if lens is not None else np.full(3, 4))
            assert not cnt.any()


def test_prep_kernel_clamps_bad_values():
    """Values the host does not check (they stay on the device): every per-channel shift clamped to >= 0 (so
    channel exponents below their target, beyond +-62 or at the int32 limits give defined parameters) and
    sequence_lens clamped to 0..T."""
    qg = _cuda()
    for bits, direction, seed in ((16, "bidirectional", 1), (8, "forward", 2)):
        a, B, ce = _prep_inputs(bits, direction, 6, seed, valid=False)
        d, h = a.num_directions, a.hidden_size
        want = np.zeros((d, qg.PC * h), np.int64)
        c64, b64 = ce.astype(np.int64), B.astype(np.int64)
        for k in range(d):
            E = lambda n: int(a.exponents[k, gru_int.Q[n]])  # noqa: E731
            rs = lambda v, s: gru_int.rshift(v, np.maximum(s, 0))  # noqa: E731
            want[k, :3 * h] = np.maximum(c64[k, gru_int.CH_W] + E("x") - E("Wx"), 0)
            want[k, 3 * h:6 * h] = np.maximum(c64[k, gru_int.CH_R] + E("h") - E("Rh"), 0)
            bx, br, cbx, cbr = b64[k, :3 * h], b64[k, 3 * h:], c64[k, gru_int.CH_BX], c64[k, gru_int.CH_BR]
            for g, tgt in enumerate(("z_pre", "r_pre")):
                sl_ = slice(g * h, (g + 1) * h)
                want[k, (6 + g) * h:(7 + g) * h] = rs(bx[sl_], cbx[sl_] - E(tgt)) + rs(br[sl_], cbr[sl_] - E(tgt))
            want[k, 8 * h:9 * h] = rs(bx[2 * h:], cbx[2 * h:] - E("g_pre"))
            want[k, 9 * h:] = rs(br[2 * h:], cbr[2 * h:] - E("Rh_add_br"))
        sl = np.array([-5, 9, 3, -(1 << 31), (1 << 31) - 1], np.int32)
        pch, lens, cnt = _run_prep(qg, a, B, ce, sl, 4, 5)
        assert np.array_equal(pch, want)
        assert lens.tolist() == [0, 4, 3, 0, 4] and not cnt.any()


# ------------------------------------------------------------------ the onnxruntime kernel's compute (no onnxruntime)
class FakeContext:
    """bridge.Context for compute without onnxruntime: outputs (NaN) and scratch (0xA5: nothing may rely on its
    contents) are device arrays of ours; a recorder as bridge.Context. Simulator or GPU."""

    def __init__(self, has_scratch=True):
        self.stream, self.has_scratch, self.recorder = 0, has_scratch, None
        self.outs, self.scratches = {}, []

    def output(self, index, shape):
        from numba import cuda
        from onnx_lowbit.custom_ops.gru.quantgru_cuda import _dptr
        n = int(np.prod(shape))
        a = cuda.to_device(np.full(max(n, 1), np.nan, np.float32))
        self.outs[index] = (a, tuple(shape))
        ptr = _dptr(a) if n else 0
        if self.recorder is not None:
            self.recorder.output(index, tuple(shape), ptr)
        return ptr

    def scratch(self, nbytes):
        from numba import cuda
        from onnx_lowbit.custom_ops.gru.quantgru_cuda import _dptr
        buf = cuda.to_device(np.full(max(nbytes, 1), 0xA5, np.uint8))
        self.scratches.append(buf)
        if self.recorder is not None:
            self.recorder.scratch(_dptr(buf), nbytes)
        return _dptr(buf)

    def result(self, index):
        from numba import cuda
        cuda.synchronize()
        a, shape = self.outs[index]
        return a.copy_to_host()[:int(np.prod(shape))].reshape(shape)


def ort_kernel(attrs):
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.gru.quantgru_cuda import QuantGRUCudaKernel
    qt = 3 if attrs["bits"] == 8 else 5
    return QuantGRUCudaKernel(spec=domain.OPS["QuantGRU"], attrs=dict(attrs), node_name="gru0",
                              in_types=[1, qt, qt, 6, 6, qt, 6, 1], out_types=[1, 1])


ELEM = {np.dtype(np.float32): 1, np.dtype(np.int8): 3, np.dtype(np.int16): 5, np.dtype(np.int32): 6}


def tensors(args):
    """bridge.Tensor views of device copies of host arrays (None for absent inputs), and the copies."""
    from numba import cuda
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.gru.quantgru_cuda import _dptr
    keep = [None if v is None else cuda.to_device(np.ascontiguousarray(v).reshape(-1) if v.size
                                                  else np.zeros(1, v.dtype)) for v in args]
    return [None if v is None else Tensor(_dptr(d), ELEM[v.dtype], tuple(v.shape)) for v, d in zip(args, keep)], keep


def ort_compute(kernel, args, ctx=None):
    ctx = ctx or FakeContext()
    ts, keep = tensors(args)
    kernel.compute(ctx, ts)
    return ctx.result(0), ctx.result(1), ctx


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(g.view(np.uint32), w.view(np.uint32))


def test_ort_compute_bit_exact():
    """QuantGRUCudaKernel.compute as onnxruntime calls it (pointers in, outputs and scratch from the context):
    bit-exact with the reference; one kernel, several shapes (batch split over two blocks per group: H = 5 with
    two directions), optional inputs present and absent, scratch poisoned."""
    _cuda()
    args, attrs = random_case(3, 2, 3, 5, 16, "bidirectional", seed=21, layout=1)
    k = ort_kernel(attrs)
    for sub in (args, args[:6] + (None, None), args[:6] + (None, args[7])):
        assert_same(ort_compute(k, sub)[:2], gru_int.quant_gru(*sub, **attrs))
    args, attrs = random_case(4, 3, 5, 4, 8, "reverse", seed=22)
    k = ort_kernel(attrs)
    y, yh, ctx = ort_compute(k, args)
    assert_same((y, yh), gru_int.quant_gru(*args, **attrs))
    assert len(ctx.scratches) == 1 and ctx.scratches[0].size == k.calls[(4, 3, 5, True, True)].nbytes
    assert not k._own
    x2 = args[0][:, :2]
    sub = (x2,) + args[1:6] + (args[6][:2], args[7][:, :2])
    assert_same(ort_compute(k, sub)[:2], gru_int.quant_gru(*sub, **attrs))


def test_ort_compute_bad_values_are_clamped_not_raised():
    """compute checks shapes only: sequence_lens outside 0..T act as clamped to 0..T, channel exponents below
    their targets as the smallest valid ones (every per-channel shift clamped to 0) -- no error, no read past
    the inputs; the shape errors stay onnxruntime errors."""
    _cuda()
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    from onnx_lowbit.custom_ops.gru.quantgru_prep_cuda import standin_channel_exp
    args, attrs = random_case(3, 4, 3, 4, 8, "reverse", seed=23)
    X, W, R, B, ch, luts, sl, ih = args
    k = ort_kernel(attrs)
    bad_sl = np.array([-2, 7, 3, 1 << 30], np.int32)
    a = gru_int.GRUAttrs(4, 8, attrs["exponents"], attrs["zero_points"], "reverse")
    low = standin_channel_exp(a)
    bad_ce = ch.copy()
    bad_ce[0, gru_int.CH_BX, :3] = low[0, gru_int.CH_BX, :3] - np.array([1, 5, 40])
    bad_ce[0, gru_int.CH_W, 5] = low[0, gru_int.CH_W, 5] - 3
    with pytest.raises(ValueError):
        gru_int.check_inputs(a, X, W, R, B, bad_ce, luts)
    got = ort_compute(k, (X, W, R, B, bad_ce, luts, bad_sl, ih))[:2]
    want = gru_int.quant_gru(X, W, R, B, np.maximum(bad_ce, low), luts, np.clip(bad_sl, 0, 3), ih, **attrs)
    assert_same(got, want)
    for bad, needle in ((R[:, :, :3], "R must have shape"), (ch[:, :3], "channel_exp must have shape")):
        sub = list(args)
        sub[2 if needle[0] == "R" else 4] = bad
        with pytest.raises(KernelError, match=needle):
            ort_compute(k, sub)


def _replay(plan, ins, outs, scratch, bits):
    """What the shim's replay does (ortshim.c run_plan), with the simulator's launchers: every recorded step with
    this call's input / output / scratch pointers patched in."""
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.gru import quantgru_cuda as qg
    from onnx_lowbit.custom_ops.gru import quantgru_prep_cuda as qp
    from onnx_lowbit.custom_ops.device.launch import Array, SimLauncher
    wdt = np.int8 if bits == 8 else np.int16
    kernels = {id(qp.prep): SimLauncher(qp.prep, qp.signature())}
    kernels.update({id(f): SimLauncher(f, qg._sig_xproj(wdt)) for f in qg._xproj_fns.values()})
    kernels.update({id(f): SimLauncher(f, qg._sig_rec(wdt)) for f in qg._rec_fns.values()})
    owned = []
    for s in range(plan.n_steps):
        st = plan.steps[s]
        assert st.kind == plans.LAUNCH
        vals = [int(st.params[i]) for i in range(st.n_params)]
        patched = set()
        for j in range(st.n_patch):
            kind, idx, off = st.patch_kind[j], st.patch_index[j], st.patch_off[j]
            base = ins[idx] if kind == plans.INPUT else outs[idx] if kind == plans.OUTPUT else scratch
            vals[st.patch_slot[j]] = base + off
            patched.add(st.patch_slot[j])
        launcher = kernels[st.func]
        args, o = [], 0
        for sig in launcher.sig:
            if isinstance(sig, Array):
                args.append((vals[o + 4], (vals[o + 2],)))
                if o + 4 not in patched:
                    owned.append(vals[o + 4])
                o += 7
            else:
                args.append(vals[o] - (1 << 64) if vals[o] >= 1 << 63 else vals[o])
                o += 1
        launcher.launch(st.grid, st.block, 0, *args, shmem=st.shmem)
    return owned


@pytest.mark.skipif(not SIM, reason="replays with the simulator's launchers (the GPU: test_native_plans_cuda.py)")
@pytest.mark.parametrize("H,direction", [(4, "forward"), (5, "bidirectional")])  # noqa: N803 - groups of 1 / 2 blocks
def test_native_plan_replays_bit_exact(H, direction):  # noqa: N803
    """compute records a valid native plan (steps, scratch size, pointer patches); replaying it as the shim does,
    on new inputs, outputs and a new scratch, gives the reference's result for the new inputs; the only pointers
    not patched are the node's read-only Params. Without onnxruntime's scratch the call is not replayable."""
    _cuda()
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.gru import quantgru_cuda as qg
    from onnx_lowbit.custom_ops.runtime.abi import LbPlan
    assert qg.QuantGRUCudaKernel.native_plans is True
    args, attrs = random_case(3, 2, 3, H, 16, direction, seed=H)
    k = ort_kernel(attrs)
    args = [np.ascontiguousarray(v) for v in args]
    plan, ctx = LbPlan(), FakeContext()
    ts, keep = tensors(args)
    plans.compute_and_record(k, ctx, ts, plan)
    assert_same((ctx.result(0), ctx.result(1)), gru_int.quant_gru(*args, **attrs))
    cp = k.calls[(3, 2, 3, True, True)]
    assert plan.valid == 1 and plan.scratch == cp.nbytes
    assert plan.n_steps == 2 + (3 if cp.per_step else 1)          # prep, xproj, the recurrence (per step here)
    new = list(args)
    new[0] = random_case(3, 2, 3, H, 16, direction, seed=H + 50)[0][0]
    new[6] = np.array([1, 3], np.int32)
    outs = [np.full(ctx.outs[i][1], np.nan, np.float32) for i in (0, 1)]
    scratch = np.full(plan.scratch, 0x5A, np.uint8)
    owned = _replay(plan, [v.ctypes.data for v in new], [o.ctypes.data for o in outs], scratch.ctypes.data, 16)
    assert_same(outs, gru_int.quant_gru(*new, **attrs))
    assert set(owned) <= {p for p, _ in (k.params.prm, k.params.qsc, k.params.dq, k.params.ex)}
    plan2 = LbPlan()
    ctx2 = FakeContext(has_scratch=False)
    ts2, keep2 = tensors(args)
    plans.compute_and_record(k, ctx2, ts2, plan2)
    assert plan2.valid == 0 and not ctx2.scratches and k._own            # the kernel's own buffer, no plan
    assert_same((ctx2.result(0), ctx2.result(1)), gru_int.quant_gru(*args, **attrs))


def test_cooperative_launch_is_never_recorded_as_a_plain_one():
    """The recurrence's cooperative launch, when a native plan is being recorded: marked cooperative (on the
    CUfunction it was launched with) where the bridge has cooperative steps, else the call is not replayable --
    never kept as a plain cuLaunchKernel step."""
    import ctypes
    qg = _cuda()
    from onnx_lowbit.custom_ops.runtime import plans

    class Launched:   # Launcher.launch's recording, without a GPU
        def launch(self, *args, **kw):
            plans.active().launch(0xB2, 20, 256, 0, [0x10], [0])

    coop = qg._CoopLauncher.__new__(qg._CoopLauncher)
    coop.launcher, coop.func = Launched(), ctypes.c_void_p(0xC3)
    rec = plans.Recorder([], [4])
    plans._tls.rec = rec
    try:
        coop.launch(20, 256, 0)
    finally:
        plans._tls.rec = None
    if hasattr(rec, "mark_cooperative"):
        assert rec.ok and rec.steps[-1][:2] == (plans.COOP, 0xC3)
    else:
        assert not rec.ok

"""QuantGRU CUDA kernels (custom_ops/gru/quantgru_cuda.py, quantgru_xproj_cuda.py, quantgru_rec_cuda.py) bit-exact
against the integer reference onnx_lowbit.gru_int.quant_gru, and its routing table.

Kernel level: ``run_arrays`` under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, tiny shapes, one launch per
step, 32-thread blocks) or on a real GPU with ONNX_LOWBIT_REAL_GPU=1 (one cooperative launch for all steps,
also forced per-step launches and several block splits). Random parameters cover the whole integer range:
weights, tables and zero points anywhere in int8/int16, exponents that make every scalar rescale a left shift,
no shift or a right shift, X with NaN / inf / huge values (saturation at entry), sequence_lens with zeros.
Through onnxruntime CUDA-EP sessions where onnxruntime-gpu and a GPU are present (skipped otherwise). The parameter
kernel, the onnxruntime kernel's compute and its native plans: tests/test_gru_ort_cuda.py.
"""
import os

import numpy as np
import pytest
from numba import config

from gru_cuda_cases import calibrated_case, cuda_module, random_case
from onnx_lowbit import gru_int
from onnx_lowbit.custom_ops.runtime import routing

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"


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
    qg = cuda_module()
    args, attrs = random_case(T, N, C, H, bits, direction, seed=T * 100 + N * 10 + H, lens=lens, h0=h0,
                              layout=layout)
    check(qg, args, attrs)


def test_kernel_block_splits_and_empty():
    """Units split over several blocks (a barrier group of 2..H blocks), T = 0, all sequence lengths 0."""
    qg = cuda_module()
    args, attrs = random_case(3, 2, 3, 5, 16, "bidirectional", seed=7)
    for units in (1, 2, 5):
        check(qg, args, attrs, units=units)
    args, attrs = random_case(0, 2, 3, 4, 8, "forward", seed=8, lens=False)
    check(qg, args, attrs)
    args, attrs = random_case(2, 2, 3, 4, 8, "reverse", seed=9)
    args = args[:6] + (np.zeros(2, np.int32),) + args[7:]
    check(qg, args, attrs)


def test_bad_inputs_raise_clear_errors():
    qg = cuda_module()
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
    qg = cuda_module()
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
    qg = cuda_module()
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
    qg = cuda_module()
    args, attrs = random_case(T, N, C, H, bits, direction, seed=H + N)
    check(qg, args, attrs)
    check(qg, args, attrs, per_step=True)
    check(qg, args, attrs, units=max(1, H // 3), repeat=2)
    for t in qg.XTILES[bits]:
        xproj_check(qg, args, attrs, xtile=t.name)


@pytest.mark.parametrize("bits", [8, 16])
def test_kernel_bit_exact_calibrated(bits):
    qg = cuda_module()
    args, attrs = calibrated_case(4, 3, 5, 6, bits, "bidirectional", seed=bits)
    check(qg, args, attrs, units=2)


@pytest.mark.skipif(SIM or not REAL_GPU, reason="real GPU only (ONNX_LOWBIT_REAL_GPU=1)")
@pytest.mark.parametrize("bits", [8, 16])
def test_gpu_bit_exact_calibrated_benchmark_shapes(bits):
    qg = cuda_module()
    for T, N, C, H in [(100, 1, 256, 256), (30, 32, 512, 512)]:
        args, attrs = calibrated_case(T, N, C, H, bits, "forward", seed=bits + N, lens=N > 1)
        check(qg, args, attrs)


# ------------------------------------------------------------------------------- onnxruntime CUDA-EP sessions
def _ortcuda_module():
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
    _ortcuda_module()
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


# ------------------------------------------------------------------------------------------------ routing
def _old_tile(qg, bits, m, g3, dirs, sms):
    """The xproj tile the code before ROUTES picked: the first tile of XTILES whose grid gives every SM a block,
    else the smallest."""
    tiles = qg.XTILES[bits]
    return next((t for t in tiles if t.blocks(m, g3, dirs) >= sms), tiles[-1]).name


def test_routes():
    """The table read from the old code: the xproj tile (pick_xtile) for shapes on both sides of every tile's
    threshold and a forced tile; the recurrence's launch (cooperative with a barrier and a resident grid, per step
    with a barrier otherwise or when forced, else one plain launch); every kernel it names has a launcher (no
    cooperative one under the simulator, where it is never routed)."""
    qg = cuda_module()
    for bits in (8, 16):
        wdt = "int8" if bits == 8 else "int16"
        for m, g3, dirs, sms in [(100, 768, 1, 132), (3200, 1536, 1, 132), (800, 768, 2, 132), (21, 21, 2, 4),
                                 (1, 3, 1, 1), (64, 48, 1, 2), (4096, 3072, 2, 8)]:
            case = routing.Case("float32", m, 5, g3, wdtype=wdt, opts=routing.options(stage="xproj", dirs=dirs,
                                                                                      sms=sms, xtile=None))
            assert routing.route(qg.ROUTES, case).kernel == "xproj " + _old_tile(qg, bits, m, g3, dirs, sms)
            for t in qg.XTILES[bits]:
                forced = routing.Case("float32", m, 5, g3, wdtype=wdt, opts=routing.options(
                    stage="xproj", dirs=dirs, sms=sms, xtile=t.name))
                assert routing.route(qg.ROUTES, forced).kernel == "xproj " + t.name
    for barrier in (False, True):
        for per_step in (False, True):
            for resident in (False, True):
                case = routing.Case("float32", 2, 5, 3, wdtype="int8", opts=routing.options(
                    stage="rec", barrier=barrier, per_step=per_step, resident=resident))
                old_per_step = per_step or (barrier and not resident)
                want = "rec per step" if old_per_step else "rec cooperative" if barrier else "rec"
                assert routing.route(qg.ROUTES, case).kernel == want
    for name in routing.kernels(qg.ROUTES):
        lau = qg.launcher_of(name, 8, 1, 5)
        assert (lau is None) == (SIM and name == "rec cooperative")

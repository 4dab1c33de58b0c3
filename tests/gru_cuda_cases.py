"""Inputs for the QuantGRU CUDA tests (tests/test_gru_cuda.py: the kernels; tests/test_gru_ort_cuda.py: the parameter
kernel, the onnxruntime kernel's compute, native plans): random valid calls over the whole integer range and calls
quantised from a float GRU's calibration."""
import numpy as np
import pytest
from numba import config

from onnx_lowbit import gru_int

SIM = bool(config.ENABLE_CUDASIM)


def cuda_module():
    """quantgru_cuda, or a skip when neither the simulator nor a GPU is there."""
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

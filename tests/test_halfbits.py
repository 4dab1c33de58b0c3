"""The integer fp16/bf16 conversions shared by the CPU and CUDA kernels, against numpy (exhaustive where possible)."""
import numpy as np
from numba import njit

from onnx_lowbit import halfbits

f32_to_f16 = njit(halfbits.f32bits_to_f16bits)
f16_to_f32 = njit(halfbits.f16bits_to_f32bits)
f32_to_bf16 = njit(halfbits.f32bits_to_bf16bits)


@njit
def _map(fn_id, xs, out):
    for i in range(xs.size):
        if fn_id == 0:
            out[i] = f32_to_f16(xs[i])
        elif fn_id == 1:
            out[i] = f16_to_f32(xs[i])
        else:
            out[i] = f32_to_bf16(xs[i])


def test_f16_to_f32_exhaustive():
    h = np.arange(65536, dtype=np.uint32)
    out = np.empty(65536, np.uint32)
    _map(1, h, out)
    ref = h.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(h.astype(np.uint16).view(np.float16))
    assert np.array_equal(out[~nan], ref[~nan])
    assert np.all(np.isnan(out[nan].view(np.float32)))


def test_f32_to_f16_matches_numpy_rne():
    rng = np.random.default_rng(1)
    fp16_vals = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    # every fp16 value, the midpoints between neighbours (ties) and their nextafters, random wide-range floats
    finite = np.sort(fp16_vals[np.isfinite(fp16_vals)])
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    xs = np.concatenate([fp16_vals, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                         rng.standard_normal(200_000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 200_000),
                         np.array([65504, 65519.99, 65520, 1e30, -1e30, np.inf, -np.inf, 2 ** -25, 2 ** -24, 3e-8], np.float32)]).astype(np.float32)
    out = np.empty(xs.size, np.uint32)
    _map(0, xs.view(np.uint32), out)
    with np.errstate(over="ignore"):
        ref = xs.astype(np.float16).view(np.uint16)
    nan = np.isnan(xs)
    assert np.array_equal(out[~nan].astype(np.uint16), ref[~nan])
    assert np.all(np.isnan(out[nan].astype(np.uint16).view(np.float16)))


def test_bf16_rounding():
    rng = np.random.default_rng(2)
    xs = np.concatenate([rng.standard_normal(100_000).astype(np.float32), np.array([np.nan, np.inf, -np.inf, 0, -0.0], np.float32)])
    out = np.empty(xs.size, np.uint32)
    _map(2, xs.view(np.uint32), out)
    assert np.array_equal(out.astype(np.uint16), halfbits.f32_to_bf16_bits(xs))
    back = halfbits.bf16_bits_to_f32(out.astype(np.uint16))
    ok = np.isfinite(xs)
    assert np.all(np.abs(back[ok] - xs[ok]) <= np.abs(xs[ok]) * 2 ** -8)

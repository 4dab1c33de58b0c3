"""FPLUT numpy reference: the seed's figures, dtypes, NaN/Inf, table validation."""
import numpy as np
import pytest

from onnx_lowbit import fplut, halfbits

SEED = [-20.359375, -17.109375, -8.3671875, -1.9755859375, -0.255615234375, -0.007244110107421875,
        0.0072174072265625, 0.228515625, 1.58203125, 10.46875, 65504.0]


def test_seed_figures_exhaustive():
    st = fplut.error_stats("silu", SEED)
    assert st["max_abs"] == pytest.approx(5.8e-3, abs=0.05e-3)
    assert st["max_rel"] == pytest.approx(8.1e-3, abs=0.05e-3)
    assert st["exact_pct"] == pytest.approx(80.4, abs=0.05)
    assert st["within_1ulp_pct"] == pytest.approx(96.4, abs=0.05)


def test_table_layout():
    t = fplut.Table.build("silu", SEED)
    pts = fplut.sample_points(SEED)
    assert t.values.shape == (259,) and pts[0] == SEED[0] and pts[1] == SEED[1] and pts[257] == SEED[9]
    assert pts[258] == SEED[10] and pts[33] == SEED[2]
    # table points are reproduced exactly (alpha = 0 at every sample point that is an fp16 value)
    x = np.array([SEED[1], SEED[2], SEED[5]], np.float16)
    assert np.array_equal(fplut.apply(x, SEED, t.values), t.values[[1, 33, 129]])


def test_dtypes_nan_inf():
    t = fplut.Table.build("silu", SEED)
    x32 = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, 1.0, -3.0], np.float32)
    y32 = t(x32)
    assert y32.dtype == np.float32 and np.isnan(y32[0])
    assert y32[1] == np.float32(t.values[-1]) and y32[3] == np.float32(t.values[-1])
    assert y32[2] == np.float32(t.values[0]) and y32[4] == np.float32(t.values[0])
    y16 = t(x32.astype(np.float16))
    assert y16.dtype == np.float16
    assert np.array_equal(y16[1:].astype(np.float32), y32[1:])  # fp32 result = widened fp16 result
    xb = halfbits.f32_to_bf16_bits(x32)
    yb = t(xb, bf16=True)
    assert yb.dtype == np.uint16 and np.isnan(halfbits.bf16_bits_to_f32(yb)[0])
    assert np.array_equal(yb[1:], halfbits.f32_to_bf16_bits(y32[1:]))


def test_expand_table_is_the_function():
    t = fplut.Table.build("silu", SEED)
    m = fplut.expand_table(SEED, t.values)
    allx = halfbits.all_fp16()
    assert np.array_equal(m, fplut.apply(allx, SEED, t.values).view(np.uint16))


@pytest.mark.parametrize("cuts,msg", [
    (SEED[:10], "11 values"),
    (SEED[:5] + [SEED[6], SEED[5]] + SEED[7:], "strictly increasing"),
    ([0.1] + SEED[1:], "fp16-representable"),
])
def test_validate_rejects(cuts, msg):
    with pytest.raises(fplut.TableError, match=msg):
        fplut.validate(cuts)


def test_validate_rejects_bad_values():
    t = fplut.Table.build("silu", SEED)
    with pytest.raises(fplut.TableError, match="259"):
        fplut.validate(SEED, t.values[:10])
    bad = t.values.astype(np.float64)
    bad[3] = 0.1
    with pytest.raises(fplut.TableError, match="fp16-representable"):
        fplut.validate(SEED, bad)

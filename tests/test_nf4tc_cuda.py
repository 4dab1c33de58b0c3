"""The NF4/FP4 tensor-core decode kernel (custom_ops/nf4tc_cuda.py: MatMulNF4 nw=1, FusedFFNNF4 nw=2) against
onnx_lowbit's float64 references, under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, small shapes) or on a real
GPU (ONNX_LOWBIT_REAL_GPU=1). Bar: max |y - ref| / max |ref| <= 2^-10 (fp16 X and output; the code values are
rounded to fp16 inside, <= 2^-12 relative per weight). Non-finite X: only that row is non-finite."""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import ffn, nf4

SIM = bool(config.ENABLE_CUDASIM)


def _mod():
    if not SIM and not os.environ.get("ONNX_LOWBIT_REAL_GPU"):
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 or a GPU (ONNX_LOWBIT_REAL_GPU=1)")
    from onnx_lowbit.custom_ops import nf4tc_cuda
    return nf4tc_cuda


def _rel(y, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / max(float(np.max(np.abs(ref))), 1e-12))


def _mm_ref(x, q, am, qt, bs, k, n, b=None):
    y = x.astype(np.float64) @ nf4.dequantize(q, am, qt, bs, k, n, np.float32).astype(np.float64)
    return y if b is None else y + b.astype(np.float64)


def _case(m, k, n, bs, qt, biases, seed):
    rng = np.random.default_rng(seed)
    w1, w3 = (rng.standard_normal((k, n)).astype(np.float32) for _ in range(2))
    ws = nf4.quantize(w1, qt, bs) + nf4.quantize(w3, qt, bs)
    x = (rng.standard_normal((m, k)) + 0.2).astype(np.float16)
    b1 = rng.standard_normal(n).astype(np.float16) if biases[0] else None
    b3 = rng.standard_normal(n).astype(np.float16) if biases[1] else None
    return ws, x, b1, b3


CASES = [  # m, k, n, block size, type, biases, warps, chunks per batch, row chunks of 8 per block (None: the
    # default, 2 from M = 9) (simulator: keep M * N small)
    (1, 128, 40, 64, "nf4", (True, True), 2, 1, None),      # 3 tiles, the last partial
    (1, 384, 40, 64, "nf4", (True, True), 2, 2, None),      # 6 chunks: 2 warps x 2 batches of 2, the last partial
    (3, 192, 16, 128, "fp4", (False, True), 2, 1, None),    # 3 chunks over 2 warps: one warp idles on its second
    (3, 192, 16, 128, "fp4", (False, True), 1, 2, None),    # one warp, a batch half past K
    (9, 64, 20, 64, "nf4", (True, False), 1, 2, 1),         # two row chunks in two blocks (the second partial)
    (9, 64, 20, 64, "nf4", (True, False), 1, 2, None),      # both in one block (the second one row)
    (16, 192, 40, 64, "nf4", (False, True), 2, 1, None),    # both whole, 3 tiles, 3 chunks of K over 2 warps
    (1, 256, 16, 4096, "nf4", (False, False), 2, 2, None),  # absmax blocks straddle rows
]


@pytest.mark.parametrize("m,k,n,bs,qt,biases,warps,cpl,rc", CASES)
def test_tc_kernel_vs_reference(m, k, n, bs, qt, biases, warps, cpl, rc):
    tc = _mod()
    ws, x, b1, b3 = _case(m, k, n, bs, qt, biases, 7)
    code = nf4.code(qt)
    s = tc.run(x, *ws, code, bs, k, n, b1, b3, warps=warps, sms=1 if SIM else None, cpl=cpl, rc=rc)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    assert s.shape == ref.shape and _rel(s, ref) <= 2.0 ** -10
    y = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, warps=warps, sms=1 if SIM else None, cpl=cpl, rc=rc)
    yref = _mm_ref(x, ws[0], ws[1], qt, bs, k, n, b1)
    assert _rel(y, yref) <= 2.0 ** -10


@pytest.mark.parametrize("m,bad", [(3, 1), (11, 9)])   # M = 11: a row of the second chunk (both in one block)
def test_tc_kernel_nonfinite_rows(m, bad):
    tc = _mod()
    ws, x, _, _ = _case(m, 128, 16, 64, "nf4", (False, False), 8)
    x[bad, 5] = np.nan
    y = tc.run(x, ws[0], ws[1], None, None, nf4.code("nf4"), 64, 128, 16, warps=2, sms=1 if SIM else None)
    yref = _mm_ref(x, ws[0], ws[1], "nf4", 64, 128, 16)
    good = [r for r in range(m) if r != bad]
    assert np.isnan(y[bad]).all() and np.isfinite(y[good]).all()
    assert _rel(y[good], yref[good]) <= 2.0 ** -10


def test_tc_lut_is_fp16_code_pairs():
    tc = _mod()
    code = nf4.code("nf4")
    t = tc.lut(code)
    h = t.view(np.uint16).reshape(256, 2).view(np.float16)
    v = np.arange(256)
    assert np.array_equal(h[:, 0], code[v >> 4].astype(np.float16))
    assert np.array_equal(h[:, 1], code[v & 15].astype(np.float16))
    assert tc.ok(True, 16, 4096, 11008, 64) and not tc.ok(False, 1, 4096, 11008, 64)
    assert not tc.ok(True, 1, 4096, 11008, 32) and not tc.ok(True, 17, 4096, 11008, 64)
    assert not tc.ok(True, 1, 4000, 11008, 64) and not tc.ok(True, 1, 65536, 65536, 64)

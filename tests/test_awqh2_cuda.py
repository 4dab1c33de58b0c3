"""The experimental packed-fp16 AWQ M=1 kernel (custom_ops/awqh2_cuda.py) under Numba's CUDA simulator
(NUMBA_ENABLE_CUDASIM=1, small shapes) or on a real GPU (ONNX_LOWBIT_REAL_GPU=1), against float64 products with the
exact weights (q - z) * s: its fp16 chains of 4 rows round X (after a power-of-two scale) and the partial sums to
fp16, so the bar is the packed-fp16 decode's (4 * 2^-10 of the largest |y|), with X of non-zero mean (the zero-point
correction) and K splits met by the last block."""
import os

import numpy as np
import pytest
from numba import config

from test_awq_kernels import exact_ref, weights

SIM = bool(config.ENABLE_CUDASIM)
TOL = 4 * 2.0 ** -10


def _mod():
    if not SIM and os.environ.get("ONNX_LOWBIT_REAL_GPU") != "1":
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 or a GPU (ONNX_LOWBIT_REAL_GPU=1)")
    from onnx_lowbit.custom_ops import awqh2_cuda
    return awqh2_cuda


CASES = [  # K, N, group, rows, warps, bias
    (128, 64, 64, 32, 2, True),      # 2 splits, 2 tiles of which the second is partial (N / 32 = 2 chunks)
    (256, 32, 128, 16, 4, False),    # 4 splits of 64 rows, one chunk
    (96, 1056, 32, 8, 4, True),      # 3 splits, 2 tiles (33 chunks: the second tile holds one)
]
GPU_CASES = [(4096, 11008, 128, 32, 4, True), (2048, 6144, 128, 32, 4, False), (11008, 4096, 128, 16, 8, True)]


@pytest.mark.parametrize("k,n,g,rows,warps,has_bias", CASES + ([] if SIM else GPU_CASES))
def test_awqh2_m1(k, n, g, rows, warps, has_bias):
    m = _mod()
    qw, qz, sc = weights(k, n, g)
    rng = np.random.default_rng(k + n)
    x = (rng.standard_normal(k) + 0.3).astype(np.float16)
    b = (rng.standard_normal(n) * 0.1).astype(np.float16) if has_bias else None
    y = m.run_arrays(x, qw, qz, sc, g, k, n, b, rows=rows, warps=warps).astype(np.float64)
    ref, _ = exact_ref(x.reshape(1, k), qw, qz, sc, g, k, n, b)
    err = np.abs(y - ref[0]).max() / np.abs(ref).max()
    assert err <= TOL, err


@pytest.mark.parametrize("scale", [2.0 ** -14, 3e3])
def test_awqh2_x_range(scale):
    """Tiny and large X: the power-of-two scale keeps the chains in fp16's range and tiny values normal."""
    m = _mod()
    k, n, g = 64, 32, 64
    qw, qz, sc = weights(k, n, g)
    x = ((np.random.default_rng(5).standard_normal(k) + 0.3) * scale).astype(np.float16)
    y = m.run_arrays(x, qw, qz, sc, g, k, n, rows=16, warps=2).astype(np.float64)
    ref, _ = exact_ref(x.reshape(1, k).astype(np.float32), qw, qz, sc, g, k, n)
    assert np.all(np.isfinite(y))
    assert np.abs(y - ref[0]).max() / np.abs(ref).max() <= TOL


def test_awqh2_refuses_other_shapes():
    m = _mod()
    qw, qz, sc = weights(64, 40, 64)
    with pytest.raises(ValueError, match="N % 32"):
        m.run_arrays(np.ones(64, np.float16), qw, qz, sc, 64, 64, 40)

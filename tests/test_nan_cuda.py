"""NaN/Inf behaviour of the CUDA faces (simulator in CI, real GPU with ONNX_LOWBIT_REAL_GPU=1): the same
definitions as the CPU faces (docs/reliability.md, tests/test_validation.py), on small shapes."""
import numpy as np
import pytest
from numba import config

from onnx_lowbit import awq

SIM = bool(config.ENABLE_CUDASIM)


def _cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")


def _rows(m, k, dtype, seed=0):
    a = np.random.default_rng(seed).standard_normal((m, k)).astype(dtype)
    a[1, 3] = np.nan
    a[2, 5] = np.inf
    return a


def test_matmulawq_cuda_nan_inf_rows():
    _cuda()
    from onnx_lowbit.custom_ops.awq import gemv_run_cuda
    k, n, g = 64, 16, 32
    qw, qz, sc = awq.quantize_rtn(np.random.default_rng(1).standard_normal((k, n)).astype(np.float32), g)
    a = _rows(3, k, np.float32)
    geo = {"ct": 4, "warps": 2} if SIM else {}
    for generic in (False, True):
        y = gemv_run_cuda.run(a, (qw, qz, sc), None, None, None, g, k, n, generic=generic, **geo).astype(np.float64)
        ref = awq.matmul(a[:1], qw, qz, sc, g, k, n).astype(np.float64)
        assert np.allclose(y[0], ref[0], rtol=2e-3, atol=2e-3)
        assert np.isnan(y[1]).all() and not np.isfinite(y[2]).any()


def test_fplut_cuda_nan_inf():
    _cuda()
    from helpers import SEED, direct_run, seed_table
    from onnx_lowbit import fplut
    x = np.array([np.nan, np.inf, -np.inf, 65504.0, -60000.0, 0.5, 1e30, -1e30], np.float32)
    (y,) = direct_run("FPLUT", {"cut_points": SEED, "table": seed_table().values}, [x], [(x.shape, x.dtype)])
    ref = fplut.apply(x, SEED, seed_table().values)
    assert np.isnan(y[0]) and np.array_equal(y[1:], ref[1:]) and np.isfinite(y[1:]).all()
    assert y[1] == y[3] == y[6] and y[2] == y[4] == y[7]

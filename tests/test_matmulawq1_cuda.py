"""MatMulAWQ's small-M tensor-core GEMV (custom_ops/awq/matmulawq1_cuda: M = 1, and up to 16 rows per launch in chunks
of 8) against the numpy reference (onnx_lowbit.awq), through its runner ``run`` (the configurations sessions pick by
shape and SM count, at the simulator's block size):
under Numba's CUDA simulator in CI (small shapes, 2 warps per block), on the GPU with ONNX_LOWBIT_REAL_GPU=1 (the
session configuration too). Its session dispatch is tested in test_awq_sessions_cuda.py (scratch cases), test_awq_cuda.py (routing) and through
onnxruntime there and in test_nan_cuda.py."""
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


def _weights(k, n, g, seed):
    """Random AutoAWQ tensors (every nibble, zero point and scale drawn; Kp = K rounded up to G rows)."""
    rng = np.random.default_rng(seed)
    kp = -(-k // g) * g
    qw = rng.integers(-2 ** 31, 2 ** 31, (kp, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, (kp // g, n // 8), dtype=np.int64).astype(np.int32)
    sc = (rng.random((kp // g, n)) * 0.004 + 0.001).astype(np.float16)
    return qw, qz, sc


def _check(y, x, w, g, k, n, bias=None):
    ref = awq.matmul(x, *w, g, k, n, bias).astype(np.float64)
    y = y.astype(np.float64)
    # fp16 output: half an ulp of rounding plus the fp32 sums' error (the products are exact on the tensor cores)
    assert np.allclose(y, ref, rtol=2e-3, atol=2e-3 * np.max(np.abs(ref)))


# K, N, G, words per lane, unroll, groups per warp, bias: one split (direct output), K padded to the group with
# two splits (partials, counters), a warp whose second group is past the last one (clamped re-reads), partial
# column tiles (N = 24, 48: lanes clamped), unroll 4, 4 batches per warp
CASES = [(64, 32, 32, 2, 2, 1, True), (100, 16, 32, 1, 1, 1, False), (96, 24, 32, 1, 2, 2, True),
         (128, 48, 64, 2, 4, 1, False), (128, 32, 32, 2, 1, 2, True)]
GPU_CASES = [(4096, 11008, 128, 2, 4, None, True), (2048, 2048, 128, 1, 4, None, False),
             (688, 1024, 128, 1, 2, None, True), (8192, 2048, 128, 1, 4, 2, False),
             (4096, 11008, 128, 1, 2, 1, False), (2048, 6144, 64, 2, 4, 2, True)]


@pytest.mark.parametrize("K,N,G,wpl,unroll,gpw,hb", CASES + ([] if SIM else GPU_CASES))
def test_gemv1_vs_reference(K, N, G, wpl, unroll, gpw, hb):  # noqa: N803
    _cuda()
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    w = _weights(K, N, G, seed=K + N)
    rng = np.random.default_rng(K)
    x = (rng.standard_normal((1, K)) * 0.5).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float16) if hb else None
    # twice on the same scratch: the last block of each column tile must leave its counter at zero
    y = m1.run(x, w, None, bias, None, G, K, N, wpl=wpl, unroll=unroll, gpw=gpw, repeat=2)
    _check(y, x, w, G, K, N, bias)


# M rows (mr = 8: chunks of 8 rows, up to 16), K, N, G, words per lane, unroll, groups per warp, bias: M = 2 .. 8
# with one split and with several (partials [split, nw, M, N]), a partial last X tile, the 8-row kernel at M = 1;
# M = 9 .. 16 (two chunks) with one split, with several, and with a one-row second chunk
MCASES = [(3, 64, 32, 32, 1, 2, 1, True), (8, 96, 24, 32, 1, 2, 2, True), (5, 128, 48, 64, 2, 4, 1, False),
          (2, 100, 16, 32, 1, 1, 1, False), (1, 64, 32, 32, 2, 2, 1, True), (12, 64, 32, 32, 1, 2, 1, True),
          (16, 96, 24, 32, 1, 2, 2, False), (9, 100, 16, 32, 2, 1, 1, True)]
MGPU_CASES = [(4, 4096, 11008, 128, 1, 4, None, True), (8, 2048, 2048, 128, 1, 4, None, False),
              (2, 688, 1024, 128, 1, 2, None, True), (6, 4096, 11008, 128, 2, 4, None, False),
              (7, 8192, 2048, 128, 1, 4, 2, True), (16, 4096, 11008, 128, 1, 4, None, True),
              (11, 688, 1024, 128, 1, 2, None, False), (13, 8192, 2048, 128, 1, 4, 2, True)]


@pytest.mark.parametrize("M,K,N,G,wpl,unroll,gpw,hb", MCASES + ([] if SIM else MGPU_CASES))
def test_gemv8_vs_reference(M, K, N, G, wpl, unroll, gpw, hb):  # noqa: N803
    _cuda()
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    w = _weights(K, N, G, seed=K + N + M)
    rng = np.random.default_rng(K + M)
    x = (rng.standard_normal((M, K)) * 0.5).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float16) if hb else None
    y = m1.run(x, w, None, bias, None, G, K, N, wpl=wpl, unroll=unroll, gpw=gpw, repeat=2, mr=8)
    assert y.shape == (M, N)
    _check(y, x, w, G, K, N, bias)


@pytest.mark.parametrize("M,nan_row,inf_row", [(5, 1, 3), (12, 9, 3)])   # M = 12: one row in each chunk of 8
def test_gemv8_rows_stay_apart(M, nan_row, inf_row):  # noqa: N803
    """A NaN or Inf in one row of X reaches only that row's outputs (each row has its own S and B column); the
    other rows meet the reference."""
    _cuda()
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    K, N, G = 64, 16, 32  # noqa: N806
    w = _weights(K, N, G, seed=15)
    kw = {"wpl": 1, "unroll": 2} if SIM else {}
    x = np.random.default_rng(16).standard_normal((M, K)).astype(np.float16)
    x[nan_row, 37] = np.nan
    x[inf_row, 2] = np.inf
    y = m1.run(x, w, None, None, None, G, K, N, **kw).astype(np.float64)
    assert np.isnan(y[nan_row]).all() and not np.isfinite(y[inf_row]).all()
    ok = [r for r in range(M) if r not in (nan_row, inf_row)]
    assert np.isfinite(y[ok]).all()
    _check(y[ok].astype(np.float16), x[ok], w, G, K, N)


def test_gemv1_is_deterministic():
    """The K splits are added in split order by the last block of each tile: the same bits every launch."""
    _cuda()
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    K, N, G = (128, 16, 32) if SIM else (4096, 2048, 128)  # noqa: N806
    w = _weights(K, N, G, seed=3)
    x = np.random.default_rng(4).standard_normal((1, K)).astype(np.float16)
    kw = {"wpl": 1, "unroll": 2, "gpw": 1} if SIM else {}
    if SIM:
        assert m1.plan(K, N, G, 2, 4, 2, 1, 1)[2] == 2      # two splits under the simulator's 2-warp blocks
    ys = [m1.run(x, w, None, None, None, G, K, N, repeat=1 if SIM else 3, **kw) for _ in range(2)]
    assert np.array_equal(ys[0], ys[1])
    _check(ys[0], x, w, G, K, N)


def test_gemv1_nan_inf():
    """A NaN in x makes every output NaN, an Inf every output non-finite (as the CPU face: docs/reliability.md)."""
    _cuda()
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    K, N, G = 64, 16, 32  # noqa: N806
    w = _weights(K, N, G, seed=5)
    kw = {"wpl": 1, "unroll": 2} if SIM else {}
    for bad, check in ((np.nan, np.isnan), (np.inf, lambda v: ~np.isfinite(v))):
        x = np.random.default_rng(6).standard_normal((1, K)).astype(np.float16)  # (M > 1: test_gemv8_rows_...)
        x[0, 37] = bad
        y = m1.run(x, w, None, None, None, G, K, N, **kw)
        assert check(y.astype(np.float64)).all(), bad


def test_config_and_plan():
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    # what sessions take on 132 SMs: wpl 2 where the wpl 1 grid would not fit one wave, else wpl 1
    assert m1.config(4096, 11008, 128, 132) == (4, 4, None, 2)
    assert m1.config(2048, 2048, 128, 132) == (4, 4, None, 1)
    assert m1.config(8192, 2048, 128, 132)[3] == 1
    assert m1.config(4096, 11000, 128, 132) == (4, 4, None, 1)     # N % 16 != 0: only wpl 1 can load it
    assert m1.config(4096, 1024, 32, 132)[1] == 2                  # G = 32: 2 steps per group
    assert m1.config(4096, 1024, 16, 132)[1] == 1                  # G = 16: 1
    # the shapes the ops' ROUTES send here (fp16 X on tensor cores: tests/test_awq_cuda.py)
    assert m1.takes(4096, 128) and m1.takes(4096, 16)
    assert not m1.takes(4098, 128)                                 # K % 4: x is read 8 bytes at a time
    assert not m1.takes(4096, 8) and not m1.takes(4096, 40)        # no whole 16-row steps per group
    # plan: the fewest groups per warp whose grid fits one wave; splits cover every group
    assert m1.plan(4096, 11008, 128, 132, 3, 4, None, 2) == (344, 2, 4)
    assert m1.plan(2048, 2048, 128, 132, 4, 4, None, 1) == (128, 1, 4)
    assert m1.plan(688, 1024, 128, 132, 4, 4, None, 1) == (32, 1, 2)     # 6 groups (K padded): 2 splits
    assert m1.plan(128, 16, 128, 132, 4, 4, 3, 1) == (1, 1, 1)           # gpw capped at the groups
    assert m1.plan(4096, 11008, 128, 132, 4, 4, None, 1) == (516, 3, 3)  # two weights (wpl 1): 3 groups per warp
    assert m1.config(4096, 11008, 128, 132, nw=2) == (4, 4, None, 1)
    assert m1.config(4096, 11008, 128, 132, mr=8) == (4, 4, None, 1)     # up to 8 rows: wpl 1
    assert m1.ok(16, 4096, 11008, 128) and not m1.ok(17, 4096, 11008, 128)


# FusedFFNAWQ at M = 1 (two weights, SiLU(x W1 + b1) * (x W3 + b3)): K, N, G, unroll, groups per warp, biases
# (M rows: 1, or up to 16 with mr = 8)
FFN_CASES = [(1, 64, 32, 32, 2, 1, (True, True)), (1, 100, 16, 32, 1, 1, (False, True)),
             (1, 96, 24, 32, 2, 2, (True, False)), (4, 64, 32, 32, 2, 1, (True, True)),
             (7, 96, 24, 32, 2, 2, (False, True)), (14, 96, 24, 32, 2, 2, (True, True))]
FFN_GPU_CASES = [(1, 4096, 11008, 128, 4, None, (False, False)), (1, 2048, 8192, 128, 4, None, (True, True)),
                 (1, 688, 1024, 128, 2, None, (False, True)), (4, 4096, 11008, 128, 4, None, (True, False)),
                 (8, 2048, 8192, 128, 4, None, (False, False)), (16, 4096, 11008, 128, 4, None, (True, True)),
                 (10, 688, 1024, 128, 2, None, (False, True))]


@pytest.mark.parametrize("M,K,N,G,unroll,gpw,biases", FFN_CASES + ([] if SIM else FFN_GPU_CASES))
def test_gemv1_ffn_vs_reference(M, K, N, G, unroll, gpw, biases):  # noqa: N803
    _cuda()
    from test_ffn4_kernels import awq_weights, check_awq

    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    w1, w3 = awq_weights(K, N, G, seed=2)
    rng = np.random.default_rng(K + 1)
    x = (rng.standard_normal((M, K)) * 0.5).astype(np.float16)
    b1, b3 = (rng.standard_normal(N).astype(np.float16) if hb else None for hb in biases)
    y = m1.run(x, w1, w3, b1, b3, G, K, N, wpl=1, unroll=unroll, gpw=gpw, repeat=2)
    check_awq(y, x, w1, w3, G, K, N, b1, b3)


def test_host_runner_checks_inputs():
    """run checks shapes as a session does (the kernel reads all Kp rows of qweight), and refuses products the
    kernel cannot take, before any launch."""
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    from onnx_lowbit.custom_ops.runtime.kernels import KernelError
    K, N, G = 100, 16, 32  # noqa: N806
    qw, qz, sc = _weights(K, N, G, seed=9)
    x = np.ones((1, K), np.float16)
    with pytest.raises(KernelError, match="qweight"):
        m1.run(x, (qw[:K], qz, sc), None, None, None, G, K, N)   # K rows instead of Kp = 128
    with pytest.raises(KernelError, match="scales"):
        m1.run(x, (qw, qz, sc), (qw, qz, sc[:, :8]), None, None, G, K, N)
    with pytest.raises(ValueError, match="cannot take"):
        m1.run(x.astype(np.float32), (qw, qz, sc), None, None, None, G, K, N)
    with pytest.raises(ValueError, match="cannot take"):
        m1.run(x, (qw, qz, sc), None, None, None, G, K, N, unroll=4)     # 4 steps per batch need G % 64 == 0
    with pytest.raises(ValueError, match="cannot take"):
        m1.run(np.ones((17, K), np.float16), (qw, qz, sc), None, None, None, G, K, N)   # 17 rows: past 2 x 8
    with pytest.raises(ValueError, match="cannot take"):
        m1.run(np.ones((2, K), np.float16), (qw, qz, sc), None, None, None, G, K, N, mr=1)   # M = 1 kernel: 1 row

"""FusedFFN, CUDA face (custom_ops/ffn/fusedffn_cuda.py) against the float64 reference onnx_lowbit.ffn.swiglu_ref.

Runs under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1; small shapes, shrunk blocks: the decode kernel and
the tiled fallback kernel) or on a real GPU with ONNX_LOWBIT_REAL_GPU=1 (the same cases through the direct
launch path the bridge uses, plus the cuBLAS prefill path, LLaMA-size shapes and, where onnxruntime has the CUDA
execution provider, one-node sessions).

Tolerance, per output: with g = x.w1 + b1, u = x.w3 + b3 (float64), Sg = sum |x||w1| + |b1|, Su likewise and
gamma = (K + 8) 2^-23 (fp32 sums in any order; also covers the hi/lo split of a fp32 X for fp16 weights, whose
residual is <= 2^-22 |x|):
    |S - ref| <= 1.1 |u| gamma Sg + |SiLU(g)| gamma Su + 2^-11 |ref| (fp16 output rounding; 2^-24 for fp32)
(|SiLU'| <= 1.1); with fp16 GEMM outputs (option FP16_SCRATCH), + 2^-11 (1.1 |u| |x.w1| + |SiLU(g)| |x.w3|):
the products are rounded to fp16 before the activation (biases added after), as in the unfused graph. On top, every path with fp16 in it
must meet the issue's bar: max |S - ref| / max |ref| <= 1e-3.
"""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import ffn

SIM = bool(config.ENABLE_CUDASIM)
REAL_GPU = os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1"
F16, F32 = np.float16, np.float32


def _cuda():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    return fusedffn_cuda


def data(lead, k, n, xd, wd, b1=False, b3=False, seed=0):
    rng = np.random.default_rng(seed + 7 * k + n)
    x = (rng.standard_normal(lead + (k,)) + 0.2).astype(xd)
    scale = 1.0 / np.sqrt(max(k, 1))
    w1 = (rng.standard_normal((n, k)) * 2 * scale).astype(wd)
    w3 = (rng.standard_normal((n, k)) * scale).astype(wd)
    bias = lambda on: rng.standard_normal(n).astype(xd) if on else None  # noqa: E731
    return x, w1, w3, bias(b1), bias(b3)


def check(y, x, w1, w3, b1=None, b3=None, g16=False, tf32=False):
    """y against the float64 reference within a rounding-error bound; ``g16``: fp16 GEMM outputs; ``tf32``: the
    GEMMs may have run in TF32 (X and W rounded to 10-bit mantissas, fusedffn_cuda.TF32)."""
    n, k = w1.shape
    assert y.dtype == x.dtype and y.shape == x.shape[:-1] + (n,)
    if y.size == 0:
        return
    ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
    x64 = np.abs(x.astype(np.float64).reshape(-1, k))
    g = x.astype(np.float64).reshape(-1, k) @ w1.astype(np.float64).T + (0 if b1 is None else b1.astype(np.float64))
    u = x.astype(np.float64).reshape(-1, k) @ w3.astype(np.float64).T + (0 if b3 is None else b3.astype(np.float64))
    sg = x64 @ np.abs(w1.astype(np.float64)).T + (0 if b1 is None else np.abs(b1.astype(np.float64)))
    su = x64 @ np.abs(w3.astype(np.float64)).T + (0 if b3 is None else np.abs(b3.astype(np.float64)))
    gamma = (k + 8) * 2.0 ** -23 + (2.0 ** -9 if tf32 else 0.0)
    r = ref.reshape(-1, n)
    if g16:     # the cuBLAS path with FP16_SCRATCH rounds x.w1, x.w3 to fp16 (as the unfused graph)
        sg = sg + 2.0 ** -11 / gamma * np.abs(g - (0 if b1 is None else b1.astype(np.float64)))
        su = su + 2.0 ** -11 / gamma * np.abs(u - (0 if b3 is None else b3.astype(np.float64)))
    tol = 1.1 * np.abs(u) * gamma * sg + np.abs(ffn.silu(g)) * gamma * su + \
        (2.0 ** -11 if x.dtype == F16 else 2.0 ** -24) * np.abs(r) + 1e-30
    err = np.abs(y.reshape(-1, n).astype(np.float64) - r)
    assert np.all(err <= tol), f"max excess {np.max(err - tol):.3e} (max err {err.max():.3e})"
    if x.dtype == F16 or w1.dtype == F16:
        assert err.max() / np.abs(r).max() <= 1e-3


def tf32_gemm(path, wd):
    """Whether a call with this forced path (None: routed) may run fp32-input cuBLAS GEMMs in TF32: fp32 weights
    (fp32 X, or fp16 X widened) on the real GPU with fusedffn_cuda.TF32 on (the simulator has no cuBLAS)."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda as fc
    return not SIM and fc.TF32 and wd == F32 and path in (None, "gemm")


# (lead dims, K, N, X type, W type, B1, B3, path): every type variant, bias combination and decode bucket at least
# once (M > DECODE_MAX_M forced onto the decode kernel; auto picks the prefill path there); K = 520 (fp16) / 260 (fp32) gives 65 chunks per row: two-chunk steps and a single-chunk remainder with the
# simulator's 32-thread block; N = 9 with 2 rows per group and a grid of 2 blocks: a partial last group and
# several grid-stride steps.
CASES = [
    ((1,), 64, 9, F16, F16, True, True, None),
    ((3,), 520, 9, F16, F16, True, False, "decode"),          # bucket 4 (double-buffered), several steps per group
    ((9,), 264, 5, F32, F16, False, True, "decode"),          # bucket 16, 33 chunks: two steps for thread 0
    ((1, 1), 520, 5, F16, F16, False, False, None),
    ((2,), 260, 9, F32, F32, True, False, None),
    ((3,), 40, 7, F32, F16, False, True, "decode"),       # mixed: fp32 X, fp16 W
    ((1, 4), 32, 9, F16, F32, True, True, "decode"),      # fp16 X, fp32 W
    ((5,), 24, 3, F32, F32, False, False, "decode"),      # bucket 8
    ((2, 8), 16, 4, F16, F16, True, False, "decode"),     # M = 16, bucket 16
    ((), 48, 6, F32, F16, True, True, None),              # 1-D X
    ((17,), 24, 5, F16, F16, True, True, None),           # M > 16: prefill path
    ((2, 3, 3), 24, 11, F32, F16, False, True, None),     # 3-D X, M = 18
    ((6,), 13, 9, F16, F16, True, True, None),            # K not a multiple of the chunk: tiled
    ((3,), 30, 10, F32, F32, False, True, None),          # K % 4 != 0 (fp32 chunk of 4): tiled
    ((4,), 32, 17, F16, F32, True, False, "tiled"),       # forced tiled on a decode shape
    ((9,), 40, 20, F32, F32, True, True, "tiled"),
]


def case_ids(cases):
    """Test ids of (lead dims, K, N, X type, W type, B1, B3, path) cases."""
    return [f"{'x'.join(map(str, c[0])) or 'vec'}-K{c[1]}-N{c[2]}-{np.dtype(c[3]).name}-{np.dtype(c[4]).name}-"
            f"{int(c[5])}{int(c[6])}-{c[7] or 'auto'}" for c in cases]


@pytest.mark.parametrize("lead,K,N,xd,wd,hb1,hb3,path", CASES, ids=case_ids(CASES))
def test_cuda_vs_reference(lead, K, N, xd, wd, hb1, hb3, path):  # noqa: N803
    fc = _cuda()
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, hb1, hb3)
    check(fc.run_arrays(x, w1, w3, b1, b3, path=path), x, w1, w3, b1, b3)


@pytest.mark.parametrize("m,variant", [(1, {"db": True}), (2, {"db": True, "uj": 1}), (4, {"db": False}),
                                       (3, {"db": False, "cols": 2, "uj": 1}), (1, {"cols": 3, "uj": 3}),
                                       (4, {"db": True, "cols": 2, "uj": 1})])
def test_cuda_decode_variants(m, variant):
    """Each decode kernel option (double buffering, rows per group, chunks per step) in each bucket."""
    fc = _cuda()
    x, w1, w3, b1, b3 = data((m,), 520, 7, F16, F16, True, True, seed=m)
    check(fc.run_arrays(x, w1, w3, b1, b3, path="decode", decode_variant=variant), x, w1, w3, b1, b3)


def test_cuda_edge_shapes():
    fc = _cuda()
    for lead, k, n, xd, wd in [((0,), 16, 8, F16, F16), ((0, 3), 16, 8, F32, F16), ((2,), 16, 0, F32, F32)]:
        x, w1, w3, _, _ = data(lead, k, n, xd, wd)
        y = fc.run_arrays(x, w1, w3)
        assert y.shape == lead + (n,) and y.dtype == xd
    for path in (None, "tiled"):
        x, w1, w3, b1, b3 = data((3,), 24, 1, F16, F16, True, True)        # N = 1
        check(fc.run_arrays(x, w1, w3, b1, b3, path=path), x, w1, w3, b1, b3)
        x, w1, w3, b1, b3 = data((2,), 0, 5, F32, F32, True, True)         # K = 0: S = SiLU(B1) * B3
        y = fc.run_arrays(x, w1, w3, b1, b3, path=path)
        np.testing.assert_allclose(y, np.broadcast_to(ffn.silu(b1) * b3, (2, 5)), rtol=1e-6)
        x, w1, w3, _, _ = data((1,), 8, 3, F16, F32)                       # K = 8: one chunk (fp16) per row
        check(fc.run_arrays(x, w1, w3, path=path), x, w1, w3)


@pytest.mark.parametrize("path,xd,wd", [(None, F16, F16), ("tiled", F16, F16), ("tc", F16, F16), (None, F32, F16),
                                         ("tiled", F32, F16)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_nonfinite(path, xd, wd):
    """NaN/Inf propagate as in the unfused graph; fp16 outputs past 65504 become inf (every path; the
    tensor-core kernel fusedffn_tc_cuda takes fp16 X and W only)."""
    fc = _cuda()
    x, w1, w3, b1, b3 = data((4,), 16, 6, xd, wd, True, True, seed=3)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2, :] *= 300          # |g|, |u| ~ 1e3: S ~ 1e6 overflows fp16
    w1[4, 2] = np.nan       # column 4 NaN for every row
    y = fc.run_arrays(x, w1, w3, b1, b3, path=path).astype(np.float64)
    ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
    with np.errstate(over="ignore"):
        refc = ref.astype(xd).astype(np.float64)
    assert np.array_equal(np.isnan(y), np.isnan(refc))
    assert np.array_equal(np.isposinf(y), np.isposinf(refc)) and np.array_equal(np.isneginf(y), np.isneginf(refc))
    assert np.isnan(y[0]).all() and np.isnan(y[:, 4]).all()
    fin = np.isfinite(refc) & np.isfinite(y)
    assert fin[3].sum() == 5 and np.allclose(y[fin], refc[fin], rtol=2e-3, atol=1e-3)


def test_cuda_bad_inputs_name_the_input():
    fc = _cuda()
    from onnx_lowbit.custom_ops import KernelError
    x, w1, w3, b1, _ = data((2,), 16, 8, F32, F32, True)
    with pytest.raises(KernelError, match=r"input 0 'X' must have last dimension K=16"):
        fc.run_arrays(x[:, :15], w1, w3)
    with pytest.raises(KernelError, match=r"input 2 'W3' must have W1's shape \[N, K\] = \[8, 16\], got \[8, 15\]"):
        fc.run_arrays(x, w1, w3[:, :15])
    with pytest.raises(KernelError, match=r"input 1 'W1' must be 2-D"):
        fc.run_arrays(x, w1.reshape(-1), w3.reshape(-1))
    with pytest.raises(KernelError, match=r"input 3 'B1' must have shape \[N\] = \[8\], got \[7\]"):
        fc.run_arrays(x, w1, w3, b1[:7])
    with pytest.raises(KernelError, match=r"input 4 'B3' must have X's type"):
        fc.run_arrays(x, w1, w3, None, b1.astype(F16))
    with pytest.raises(KernelError, match=r"'W1' and 2 'W3' must both be float or both float16"):
        fc.run_arrays(x, w1, w3.astype(F16))
    with pytest.raises(KernelError, match=r"input 0 'X' must be float or float16"):
        fc.run_arrays(x.astype(np.float64), w1, w3)


# W1, W3 [K, N] (attribute weights_kn = 1): the K-major tensor-core kernel (fusedffn_kn_tc_cuda) at M = 2..16 with
# fp16 X and W, the K-major split-K decode kernel (fusedffn_kn_cuda) at other M <= 2, the tiled kernel otherwise
# under the simulator (cuBLAS on a GPU). N = 24 / 40 fp16 with the simulator's 64-thread block (32-column tiles x
# 2 K warps): several tiles and a partial last one; K = 37 / 300: partial steps and several splits.
KN_CASES = [
    ((1,), 300, 40, F16, F16, True, True, None),
    ((2,), 37, 24, F32, F16, False, True, None),
    ((1, 1), 64, 12, F16, F32, True, False, None),
    ((2,), 130, 16, F32, F32, True, True, None),
    ((), 48, 8, F16, F16, False, False, None),          # 1-D X
    ((1,), 40, 10, F16, F16, True, True, None),         # N % 8 != 0 (fp16): tiled
    ((3,), 40, 24, F16, F16, True, True, None),         # M = 3: tensor-core kernel, one 8-row tile
    ((2, 4), 72, 136, F16, F16, False, True, None),     # M = 8: tensor-core kernel, 3 feature tiles
    ((2, 5), 72, 136, F16, F16, False, True, "tc"),     # M = 10: 16-row tiles
    ((3,), 40, 24, F32, F16, True, True, None),         # mixed at M = 3: tiled here (cuBLAS on a GPU)
    ((2,), 40, 24, F32, F16, True, False, "tiled"),
]


@pytest.mark.parametrize("lead,K,N,xd,wd,hb1,hb3,path", KN_CASES, ids=case_ids(KN_CASES))
def test_cuda_kn_vs_reference(lead, K, N, xd, wd, hb1, hb3, path):  # noqa: N803
    fc = _cuda()
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, hb1, hb3, seed=11)
    y = fc.run_arrays(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, path=path, kn=True)
    # on a GPU, M >= 3 with fp16 X and W takes cuBLAS with fp16 GEMM outputs (KN_FP16_SCRATCH)
    m = int(np.prod(lead))
    check(y, x, w1, w3, b1, b3, not SIM and path is None and m > 2 and xd == wd == F16 and fc.KN_FP16_SCRATCH)


@pytest.mark.parametrize("variant", [{"db": True}, {"u": 2, "ks": 8}, {"cw": 2, "u": 1}])
def test_cuda_kn_decode_variants(variant):
    """The K-major decode kernel's options (double-buffered loads, rows per step, split size, column warps)."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_kn_cuda as knm
    _cuda()
    x, w1, w3, b1, b3 = data((2,), 45, 40, F16, F16, True, True, seed=4)
    y = knm.run_arrays(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, block=64, **variant)
    check(y, x, w1, w3, b1, b3)


@pytest.mark.parametrize("path", [None, "tiled"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_kn_nonfinite(path):
    """NaN/Inf on the K-major paths propagate as in the unfused graph (decode at M = 2 takes several splits)."""
    fc = _cuda()
    x, w1, w3, b1, b3 = data((2,), 40, 16, F16, F16, True, True, seed=3)
    x[0, 3] = np.nan
    x[1, :] *= 3000         # S overflows fp16
    w1[4, 2] = np.inf
    y = fc.run_arrays(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, path=path,
                      kn=True).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        refc = ffn.swiglu_ref(x, w1, w3, b1, b3).astype(F16).astype(np.float64)
    assert np.isnan(y[0]).all()
    assert np.array_equal(np.isnan(y), np.isnan(refc)) and np.array_equal(np.isinf(y), np.isinf(refc))
    fin = np.isfinite(refc)
    assert np.allclose(y[fin], refc[fin], rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("m,k,n,mt,kw,ring", [(5, 24, 8, 1, 1, 3), (9, 88, 72, 1, 3, 1), (20, 40, 64, 4, 2, 2),
                                               (11, 56, 136, 2, 3, 2)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_kn_tc_configs(m, k, n, mt, kw, ring):
    """The K-major tensor-core kernel's configurations (row tiles, warps, ring; partial last step, feature tile and
    row tile), NaN in X and in a weight column propagating as in the unfused graph."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_kn_tc_cuda as kntc
    _cuda()
    x, w1, w3, b1, b3 = data((m,), k, n, F16, F16, True, True, seed=m)
    y = kntc.run_arrays(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, mt=mt, kw=kw, ring=ring)
    check(y, x, w1, w3, b1, b3)
    x[1, 2] = np.nan
    w3[n - 1, k - 1] = np.nan
    y = kntc.run_arrays(x, np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T), b1, b3, mt=mt, kw=kw, ring=ring)
    assert np.isnan(y[1]).all() and np.isnan(y[:, n - 1]).all()
    assert np.isfinite(np.delete(np.delete(y, 1, 0), n - 1, 1)).all()


def test_kn_tc_configs_fit_static_shared_memory():
    """Every configuration sessions may launch compiles within 48 KiB of static shared memory (the simulator does
    not check it; ptxas refuses more)."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_kn_tc_cuda as kntc
    for _, (mt, kw, ring) in kntc.CONFIGS:
        smem_out = mt > 1 and kntc.red_bytes(mt, kw, True) <= kntc.SMEM_MAX
        assert kntc.red_bytes(mt, kw, smem_out) <= kntc.SMEM_MAX
    with pytest.raises(ValueError, match="bytes of shared memory"):
        kntc._make(4, 4, 1, smem_out=True)


def test_cuda_kn_bad_inputs():
    fc = _cuda()
    from onnx_lowbit.custom_ops import KernelError
    x, w1, w3, _, _ = data((1,), 16, 8, F16, F16)
    with pytest.raises(KernelError, match=r"input 0 'X' must have last dimension K=8 \(W1 is \[K, N\]"):
        fc.run_arrays(x, w1, w3, kn=True)      # [N, K] weights given as [K, N]
    with pytest.raises(KernelError, match=r"input 2 'W3' must have W1's shape \[K, N\]"):
        fc.run_arrays(x, w1.T, w3.T[:, :7], kn=True)

def test_plans():
    fc = _cuda()
    assert [fc.bucket(m) for m in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, None]
    # LLaMA gate/up decode: x of one row is 16 KiB of fp32 in shared memory; M = 8 would need 128 KiB
    assert fc.decode_ok(1, 4096, True) and fc.decode_ok(4, 4096, True, max_m=16)
    assert not fc.decode_ok(8, 4096, True, max_m=16)
    assert not fc.decode_ok(1, 4100, True) and fc.decode_ok(1, 4100, False) and not fc.decode_ok(1, 4096, True, False)
    assert not fc.decode_ok(17, 64, True, max_m=16) and not fc.decode_ok(fc.DECODE_MAX_M + 1, 64, True)
    # 11008 rows, 2 per group, 132 SMs x 4 blocks: 5504 groups in ceil(5504 / 528) = 11 steps -> 501 blocks
    assert fc.decode_grid(11008, 1, 132, 4) == 501 and fc.decode_grid(1, 1, 132, 4) == 1
    for n, mt, sms, occ in [(11008, 1, 132, 4), (4096, 4, 132, 3), (9, 1, 2, 1), (100000, 2, 132, 2)]:
        grid = fc.decode_grid(n, mt, sms, occ)
        groups = -(-n // fc.COLS[mt])
        steps = -(-groups // grid)
        assert grid <= sms * occ and (grid - 1) * steps < groups <= grid * steps    # balanced, none idle
    # prefill: one chunk while the scratch fits SCRATCH_MAX, else M split evenly into as few chunks as fit
    rows, conv, *_, (_, _, nbytes) = fc.prefill_plan(1000, 4096, 11008, x16=False, w16=True)
    assert (rows, conv) == (500, "split") and nbytes <= fc.SCRATCH_MAX     # 192 KiB per row: 2 chunks
    assert fc.prefill_plan(1024, 4096, 11008, x16=True, w16=True)[:2] == (1024, None)     # 90 MB: one chunk
    assert fc.prefill_plan(1000, 64, 64, x16=True, w16=False)[:2] == (1000, "widen")
    assert fc.prefill_plan(20, 64, 64, x16=True, w16=True)[:2] == (20, None)
    for m, k, n, x16, w16, g16 in [(5000, 4096, 11008, True, True, False), (777, 512, 3000, False, True, False),
                                   (3, 100, 5, False, False, False), (4096, 4096, 14336, True, True, True)]:
        rows, conv, *_, (xoff, soff, nbytes) = fc.prefill_plan(m, k, n, x16, w16, g16, scratch_max=1 << 22)
        chunks = -(-m // rows)
        assert rows * chunks >= m > rows * (chunks - 1) and (nbytes <= (1 << 22) + 512 or rows == 1)
        assert xoff >= (2 if conv == "split" else 1) * rows * 2 * n * (2 if g16 else 4) and soff >= xoff


@pytest.mark.parametrize("xd,wd,g16", [(F32, F16, False), (F16, F32, False), (F16, F16, False), (F16, F16, True),
                                       (F32, F32, False)])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_prefill_convert_and_activation_kernels(xd, wd, g16):
    """The cuBLAS path's own kernels (x widening / row-scaled hi-lo split, SiLU * mul over the GEMM scratch) with
    the two GEMMs emulated in numpy on exactly what cuBLAS would get (simulator and GPU). The split must keep
    fp32 accuracy for rows far outside fp16's range and let inf/NaN through."""
    fc = _cuda()
    from numba import cuda
    x, w1, w3, b1, b3 = data((6,), 40, 12, xd, wd, True, True, seed=11)
    if xd == F32:
        x[1] *= 1e6                   # |x| >> 65504
        x[2] *= 1e-30                 # tiny row
        x[3, 7] = np.inf
        x[4, :] = 0.0
    m, k, n = 6, 40, 12
    rows, conv, _, _, _ = fc.prefill_plan(m, k, n, xd == F16, wd == F16)
    splits = 2 if conv == "split" else 1
    blk = 32 if SIM else fc.ACT_BLOCK
    inv = np.ones(rows, np.float32)
    if conv == "split":
        dxo = cuda.device_array(2 * m * k, np.uint16)
        dinv = cuda.to_device(inv)
        fc._make_split(blk)[m, blk](cuda.to_device(x.reshape(-1).view(np.uint32)), dxo, dinv, m, k)
        xg, inv = dxo.copy_to_host().view(F16).reshape(2 * m, k), dinv.copy_to_host()
        big = np.abs(x[[0, 1, 2, 5]]).max(axis=1) / inv[[0, 1, 2, 5]]     # each row's largest value, scaled
        assert np.all((big >= 2.0 ** 14) & (big < 2.0 ** 15)) and inv[4] == 1.0
    elif conv == "widen":
        dxo = cuda.device_array(m * k, np.float32)
        fc._make_widen()[-(-m * k // blk), blk](cuda.to_device(x.reshape(-1).view(np.uint16)), dxo, m * k)
        xg = dxo.copy_to_host().reshape(m, k)
        assert np.array_equal(xg, x.astype(np.float32))
    else:
        xg = x
    with np.errstate(invalid="ignore", over="ignore"):
        g = np.concatenate([xg.astype(np.float64) @ w1.astype(np.float64).T,
                            xg.astype(np.float64) @ w3.astype(np.float64).T], axis=1).astype(np.float32)
    xb = np.uint16 if xd == F16 else np.float32
    dy = cuda.device_array(m * n, xb)
    if g16:                             # fp16 GEMM outputs (FP16_SCRATCH)
        g = g.astype(F16).view(np.uint16)
    fc._make_act(xd == F16, g16)[fc.act_grid(m, n, blk), blk](cuda.to_device(g.reshape(-1)), cuda.to_device(inv),
                                                    cuda.to_device(b1.view(xb)), cuda.to_device(b3.view(xb)), dy,
                                                    m, n, splits, 1, 1)
    y = dy.copy_to_host().view(xd).reshape(m, n)
    if xd == F32:
        fin = np.isfinite(x).all(axis=1)
        check(y[fin], x[fin], w1, w3, b1, b3, g16)
        ref = ffn.swiglu_ref(x[3:4], w1, w3, b1, b3)
        assert np.array_equal(np.isnan(y[3]), np.isnan(ref[0])) and np.array_equal(np.isinf(y[3]), np.isinf(ref[0]))
    else:
        check(y, x, w1, w3, b1, b3, g16)


# ------------------------------------------------------------------------------------------ real GPU only
GPU_CASES = [
    ((1,), 4096, 512, F16, F16, True, True),
    ((3,), 4096, 300, F32, F16, False, True),
    ((4,), 2048, 130, F32, F32, True, False),
    ((1, 2), 1024, 77, F16, F32, False, False),
    ((16,), 1024, 256, F16, F16, True, True),
    ((8,), 512, 100, F32, F16, True, True),
]


@pytest.mark.skipif(SIM, reason="real GPU only (decode kernel at full size)")
@pytest.mark.parametrize("lead,K,N,xd,wd,hb1,hb3", GPU_CASES)
def test_gpu_decode_large(lead, K, N, xd, wd, hb1, hb3):  # noqa: N803
    fc = _cuda()
    from onnx_lowbit.custom_ops.device import cublas
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, hb1, hb3, seed=5)
    for path in (None, "tiled") + (("gemm",) if cublas.load() is not None else ()):
        check(fc.run_arrays(x, w1, w3, b1, b3, path=path), x, w1, w3, b1, b3, tf32=tf32_gemm(path, wd))


@pytest.mark.skipif(SIM, reason="real GPU only")
def test_gpu_unaligned_weights_leave_the_decode_kernel():
    """Weights not 16-byte aligned (a view at +2 bytes): the decode kernel is not used, results stay right."""
    fc = _cuda()
    from numba import cuda
    x, w1, w3, b1, _ = data((2,), 256, 40, F16, F16, True)
    k, n = 256, 40
    buf1 = cuda.to_device(np.concatenate([np.zeros(1, F16), w1.reshape(-1)]).view(np.uint16))
    buf3 = cuda.to_device(np.concatenate([np.zeros(1, F16), w3.reshape(-1)]).view(np.uint16))
    dx, db1 = cuda.to_device(x.view(np.uint16)), cuda.to_device(b1.view(np.uint16))
    dy = cuda.device_array(2 * n, np.uint16)
    kern = fc.FusedFFNCudaKernel(spec=None, attrs={}, node_name="t", in_types=(10, 10), out_types=(10,))
    p = lambda a: a.device_ctypes_pointer.value  # noqa: E731
    from onnx_lowbit.custom_ops import KernelError
    with pytest.raises(KernelError, match="unaligned"):
        kern.run(0, 2, k, n, p(dx), p(buf1) + 2, p(buf3) + 2, p(db1), 0, p(dy), path="decode")
    kern.run(0, 2, k, n, p(dx), p(buf1) + 2, p(buf3) + 2, p(db1), 0, p(dy))
    cuda.synchronize()
    check(dy.copy_to_host().view(F16).reshape(2, n), x, w1, w3, b1)


@pytest.mark.skipif(SIM, reason="cuBLAS prefill path: real GPU only")
@pytest.mark.parametrize("m", [17, 64, 700])
@pytest.mark.parametrize("xd,wd", [(F16, F16), (F32, F32), (F32, F16), (F16, F32)])
def test_gpu_prefill(m, xd, wd, monkeypatch):
    """The cuBLAS path for every type pair; fp32-input GEMMs (fp32 W) in TF32 by default and strict fp32 with
    TF32 off (ONNX_LOWBIT_TF32=0), each within its own error bound."""
    fc = _cuda()
    from onnx_lowbit.custom_ops.device import cublas
    if cublas.load() is None:
        pytest.skip("no cuBLAS library found")
    x, w1, w3, b1, b3 = data((m,), 520, 200, xd, wd, True, m != 64, seed=m)
    tf32 = tf32_gemm("gemm", wd)
    check(fc.run_arrays(x, w1, w3, b1, b3, path="gemm"), x, w1, w3, b1, b3, tf32=tf32)
    check(fc.run_arrays(x, w1, w3, b1, b3), x, w1, w3, b1, b3, tf32=tf32)
    g16 = xd == F16 and wd == F16
    check(fc.run_arrays(x, w1, w3, b1, b3, path="gemm", fp16_scratch=True), x, w1, w3, b1, b3, g16, tf32=tf32)
    monkeypatch.setattr(fc, "TF32", False)
    check(fc.run_arrays(x, w1, w3, b1, b3, path="gemm"), x, w1, w3, b1, b3)
    if tf32 and xd == F32:  # the default really is TF32: strict fp32 is far more accurate (fp32 outputs)
        ref = ffn.swiglu_ref(x, w1, w3, b1, b3)
        e_strict = np.abs(fc.run_arrays(x, w1, w3, b1, b3, path="gemm") - ref).max()
        monkeypatch.setattr(fc, "TF32", True)
        assert np.abs(fc.run_arrays(x, w1, w3, b1, b3, path="gemm") - ref).max() > 4 * e_strict


@pytest.mark.skipif(SIM, reason="cuBLAS prefill path: real GPU only")
def test_gpu_prefill_takes_its_scratch_from_the_provider():
    """The cuBLAS path asks its scratch provider (onnxruntime's, through Context.scratch, in a session) once per
    call for exactly prefill_plan's bytes and keeps no buffer of its own; without a provider (onnxruntime < 1.18)
    prefill shapes run the tiled kernel."""
    fc = _cuda()
    from numba import cuda

    from onnx_lowbit.custom_ops import KernelError
    from onnx_lowbit.custom_ops.device import cublas
    if cublas.load() is None:
        pytest.skip("no cuBLAS library found")
    m, k, n = 40, 520, 200
    x, w1, w3, b1, b3 = data((m,), k, n, F16, F16, True, True, seed=9)
    dx, d1, d3, db1, db3 = (cuda.to_device(a.reshape(-1).view(np.uint16)) for a in (x, w1, w3, b1, b3))
    p = lambda a: a.device_ctypes_pointer.value  # noqa: E731
    kern = fc.FusedFFNCudaKernel(spec=None, attrs={}, node_name="t", in_types=(10, 10), out_types=(10,))
    asked, bufs = [], []

    def scratch(nbytes):
        asked.append(nbytes)
        bufs.append(cuda.device_array(nbytes, np.uint8))
        return p(bufs[-1])

    for provider in (scratch, False):
        dy = cuda.device_array(m * n, np.uint16)
        kern.run(0, m, k, n, p(dx), p(d1), p(d3), p(db1), p(db3), p(dy), scratch=provider)
        cuda.synchronize()
        check(dy.copy_to_host().view(F16).reshape(m, n), x, w1, w3, b1, b3)
    assert asked == [fc.prefill_plan(m, k, n, True, True)[4][2]] and kern._direct is None
    with pytest.raises(KernelError, match="scratch memory"):
        kern.run(0, m, k, n, p(dx), p(d1), p(d3), p(db1), p(db3), p(dy), path="gemm", scratch=False)


@pytest.mark.skipif(SIM, reason="real GPU only")
@pytest.mark.parametrize("lead,K,N,xd,wd", [((1,), 4096, 11008, F16, F16), ((2,), 4096, 512, F16, F16),
                                            ((1,), 3000, 776, F32, F16), ((2,), 1024, 300, F32, F32),
                                            ((1, 2), 9000, 264, F16, F32), ((1,), 520, 8, F16, F16)])
def test_gpu_kn(lead, K, N, xd, wd):  # noqa: N803
    """K-major weights on the GPU, every path (decode: several splits, the tile counters left at zero; cuBLAS with
    fp16 GEMM outputs for fp16 X and W, KN_FP16_SCRATCH, and with fp32 ones)."""
    fc = _cuda()
    from onnx_lowbit.custom_ops.device import cublas
    x, w1, w3, b1, b3 = data(lead, K, N, xd, wd, True, N != 512, seed=6)
    w1k, w3k = np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T)
    g16 = xd == F16 and wd == F16 and fc.KN_FP16_SCRATCH
    for path in (None, "decode", "tiled") + (("gemm",) if cublas.load() is not None else ()):
        check(fc.run_arrays(x, w1k, w3k, b1, b3, path=path, kn=True), x, w1, w3, b1, b3, g16 and path == "gemm",
              tf32=tf32_gemm(path, wd))
    for m in (3, 40):
        x, _, _, _, _ = data((m,), K, N, xd, wd, seed=m)
        check(fc.run_arrays(x, w1k, w3k, b1, b3, kn=True), x, w1, w3, b1, b3, g16, tf32=tf32_gemm(None, wd))
        check(fc.run_arrays(x, w1k, w3k, b1, b3, kn=True, fp16_scratch=False), x, w1, w3, b1, b3,
              tf32=tf32_gemm(None, wd))

@pytest.mark.skipif(SIM, reason="real GPU only")
@pytest.mark.parametrize("m", [2, 5, 8, 9, 12, 16, 17, 33])
def test_gpu_kn_tc(m):
    """The K-major tensor-core kernel on the GPU at every configuration it has (8, 16, 32-row tiles and past them),
    forced (path='tc') whatever M the routing gives it, with NaN in X and in a weight column."""
    fc = _cuda()
    k, n = 1032, 520                       # K: a partial last 16-row step; N: a partial 64-feature tile
    x, w1, w3, b1, b3 = data((m,), k, n, F16, F16, True, True, seed=40 + m)
    w1k, w3k = np.ascontiguousarray(w1.T), np.ascontiguousarray(w3.T)
    check(fc.run_arrays(x, w1k, w3k, b1, b3, path="tc", kn=True), x, w1, w3, b1, b3)
    x[m - 1, 3] = np.nan
    w3[n - 2, 7] = np.nan
    with np.errstate(invalid="ignore"):
        y = fc.run_arrays(x, w1k, np.ascontiguousarray(w3.T), b1, b3, path="tc", kn=True)
    assert np.isnan(y[m - 1]).all() and np.isnan(y[:, n - 2]).all()
    assert np.isfinite(np.delete(np.delete(y, m - 1, 0), n - 2, 1)).all()


def _ort_cuda():
    try:
        import onnxruntime as ort
    except ImportError:
        pytest.skip("onnxruntime not installed")
    if SIM or "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here (or the simulator is on)")
    return ort


def ffn_model(xd, wd, k, n, b1=False, b3=False, kn=False):
    from onnx import TensorProto, helper

    from onnx_lowbit import domain
    et = {np.dtype(F32): TensorProto.FLOAT, np.dtype(F16): TensorProto.FLOAT16}
    ins = [helper.make_tensor_value_info("X", et[np.dtype(xd)], ["B", "T", k]),
           helper.make_tensor_value_info("W1", et[np.dtype(wd)], [k, n] if kn else [n, k]),
           helper.make_tensor_value_info("W3", et[np.dtype(wd)], [k, n] if kn else [n, k])]
    names = ["X", "W1", "W3"]
    for on, nm in ((b1, "B1"), (b3, "B3")):
        if on:
            ins.append(helper.make_tensor_value_info(nm, et[np.dtype(xd)], [n]))
            names.append(nm)
        elif nm == "B1" and b3:
            names.append("")
    node = helper.make_node("FusedFFN", names, ["S"], domain=domain.DOMAIN, name="ffn0",
                            **({"weights_kn": 1} if kn else {}))
    g = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("S", et[np.dtype(xd)], ["B", "T", n])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


@pytest.mark.parametrize("xd,wd", [(F16, F16), (F32, F32), (F32, F16), (F16, F32)])
def test_ort_cuda_session(xd, wd):
    """One FusedFFN node in an onnxruntime CUDA session: decode (M = 1, 3) and prefill (M = 40) shapes."""
    ort = _ort_cuda()
    import onnx_lowbit
    so = ort.SessionOptions()
    onnx_lowbit.register(so)
    k, n = 256, 96
    sess = ort.InferenceSession(ffn_model(xd, wd, k, n, False, True).SerializeToString(), so,
                                providers=["CUDAExecutionProvider"])
    for lead in [(1, 1), (1, 3), (2, 20), (0, 2)]:
        x, w1, w3, _, b3 = data(lead, k, n, xd, wd, False, True, seed=sum(lead))
        y = sess.run(None, {"X": x, "W1": w1, "W3": w3, "B3": b3})[0]
        check(y, x, w1, w3, None, b3, tf32=tf32_gemm(None, wd))


@pytest.mark.parametrize("xd,wd", [(F16, F16), (F32, F16)])
def test_ort_cuda_session_kn(xd, wd):
    """FusedFFN with weights_kn = 1 in an onnxruntime CUDA session: decode (M = 1, 2: split-K with onnxruntime's
    scratch for the partials), cuBLAS (M = 3, 40), an empty batch."""
    ort = _ort_cuda()
    import onnx_lowbit
    so = ort.SessionOptions()
    onnx_lowbit.register(so)
    k, n = 2048, 96
    sess = ort.InferenceSession(ffn_model(xd, wd, k, n, True, True, kn=True).SerializeToString(), so,
                                providers=["CUDAExecutionProvider"])
    for lead in [(1, 1), (1, 2), (1, 3), (1, 12), (2, 20), (0, 2), (1, 1)]:
        x, w1, w3, b1, b3 = data(lead, k, n, xd, wd, True, True, seed=sum(lead))
        y = sess.run(None, {"X": x, "W1": np.ascontiguousarray(w1.T), "W3": np.ascontiguousarray(w3.T), "B1": b1,
                            "B3": b3})[0]
        from onnx_lowbit.custom_ops.ffn import fusedffn_cuda as fc
        check(y, x, w1, w3, b1, b3, xd == F16 and wd == F16 and fc.KN_FP16_SCRATCH and x.size > 2 * k,
              tf32=tf32_gemm(None, wd))


if REAL_GPU and SIM:  # pragma: no cover
    raise RuntimeError("ONNX_LOWBIT_REAL_GPU=1 but the CUDA simulator is on")

"""FusedFFN's tensor-core kernel for fp16 X and W at small M (custom_ops/ffn/fusedffn_tc_cuda.py) against the float64
reference, with test_ffn_cuda's per-output bound (fp32 sums in any order) and the issue's 1e-3 bar (NaN / Inf:
test_ffn_cuda.test_cuda_nonfinite, path 'tc').

Under Numba's CUDA simulator (small shapes, the kernel at its GPU block shapes) or on a real GPU with
ONNX_LOWBIT_REAL_GPU=1 (the same cases through the direct launch path, plus LLaMA-size shapes, session routing,
alignment fallback and determinism).
"""
import numpy as np
import pytest
from test_ffn_cuda import SIM, check, data


F16 = np.float16


def _tc():
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
    from onnx_lowbit.custom_ops.ffn import fusedffn_tc_cuda
    return fusedffn_tc_cuda


# (lead, K, N, B1, B3, (mt, kw, ring, mfast)): every configuration sessions launch, K not a multiple of the 32-column
# chunk (136: a chunk with one lane group past K; 8: warps 1.. of the block stream only zeros), N not a multiple of
# the 16-feature tile, M past one row chunk (several chunks, both block orders), one X tile partly filled.
CASES = [
    ((3,), 64, 16, True, True, (1, 4, 4, False)),
    ((5,), 136, 24, False, True, (1, 4, 4, False)),
    ((2, 6), 96, 40, True, False, (2, 2, 2, False)),
    ((20,), 72, 9, True, True, (2, 4, 2, True)),
    ((37,), 40, 33, False, False, (1, 2, 2, True)),
    ((37,), 40, 33, True, True, (2, 4, 1, False)),
    ((9,), 8, 16, True, True, (2, 4, 4, False)),
    ((4,), 264, 20, True, True, (4, 1, 2, False)),
    ((70,), 32, 17, True, False, (8, 2, 1, False)),
]


@pytest.mark.parametrize("lead,K,N,hb1,hb3,cfg", CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-K{c[1]}-N{c[2]}-{int(c[3])}{int(c[4])}-"
                              f"{'-'.join(map(str, c[5]))}" for c in CASES])
def test_tc_vs_reference(lead, K, N, hb1, hb3, cfg):  # noqa: N803
    tc = _tc()
    x, w1, w3, b1, b3 = data(lead, K, N, F16, F16, hb1, hb3, seed=K + N)
    mt, kw, ring, mfast = cfg
    check(tc.run_arrays(x, w1, w3, b1, b3, mt, kw, ring, None, mfast), x, w1, w3, b1, b3)


@pytest.mark.parametrize("m", [3, 11, 17])
def test_tc_through_the_op_dispatch(m):
    """fusedffn_cuda.run_arrays takes the tensor-core kernel at M in [TC_MIN_M, TC_MAX_M] with fp16 X and W (forced and
    auto) and gives the same result."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    tc = _tc()
    assert fusedffn_cuda.TC_MIN_M <= m <= fusedffn_cuda.TC_MAX_M
    x, w1, w3, b1, b3 = data((m,), 104, 24, F16, F16, True, True, seed=m)
    y = fusedffn_cuda.run_arrays(x, w1, w3, b1, b3, path="tc")
    check(y, x, w1, w3, b1, b3)
    assert np.array_equal(y, fusedffn_cuda.run_arrays(x, w1, w3, b1, b3))
    assert np.array_equal(y, tc.run_arrays(x, w1, w3, b1, b3, *tc.config(m)[:3], None, tc.config(m)[3]))


def test_tc_config_and_limits():
    tc = _tc()
    from onnx_lowbit.custom_ops import KernelError
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    rows = [r for r, _ in tc.CONFIGS]
    assert rows == sorted(rows) and rows[-1] == fusedffn_cuda.TC_MAX_M and fusedffn_cuda.TC_MIN_M == 3
    for m in range(1, 80):
        mt, kw, ring, mfast = tc.config(m)
        assert mt in tc.MT_BUCKETS and kw * 32 <= 1024 and 1 <= ring <= 4
        assert mfast or m <= 8 * mt or m > rows[-1]            # past one row chunk: the L2-friendly order
    assert tc.ok(True, True, 5, 8) and not tc.ok(True, True, 5, 12) and not tc.ok(False, True, 5, 8) \
        and not tc.ok(True, False, 5, 8) and not tc.ok(True, True, 5, 8, aligned=False)
    assert tc.chunks_per_warp(4096, 4, 2) == 32 and tc.chunks_per_warp(136, 4, 4) == 4 and \
        tc.chunks_per_warp(8, 4, 2) == 2
    assert tc.grid(37, 33, 2) == 3 * 3
    with pytest.raises(ValueError, match="ring must be 1..4"):
        tc._make(1, 4, 5)
    x, w1, w3, _, _ = data((4,), 12, 8, F16, F16)
    with pytest.raises(KernelError, match="K % 8"):
        tc.run_arrays(x, w1, w3)
    x, w1, w3, _, _ = data((4,), 16, 8, np.float32, F16)
    with pytest.raises(KernelError, match="K % 8"):
        tc.run_arrays(x, w1, w3)


# ------------------------------------------------------------------------------------------------ real GPU only
@pytest.mark.skipif(SIM, reason="real GPU only (LLaMA-size shapes)")
@pytest.mark.parametrize("m", [3, 8, 16, 24, 32])
def test_gpu_tc_large(m):
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    x, w1, w3, b1, b3 = data((m,), 4096, 1000, F16, F16, True, True, seed=m)
    y = fusedffn_cuda.run_arrays(x, w1, w3, b1, b3)          # routed to the tensor-core kernel
    check(y, x, w1, w3, b1, b3)
    assert np.array_equal(y, fusedffn_cuda.run_arrays(x, w1, w3, b1, b3, path="tc"))     # deterministic
    check(fusedffn_cuda.run_arrays(x, w1, w3, b1, b3, path="gemm"), x, w1, w3, b1, b3)


@pytest.mark.skipif(SIM, reason="real GPU only")
def test_gpu_unaligned_x_leaves_the_tc_kernel():
    """X not 16-byte aligned: the kernel object takes the cuBLAS path (auto) or refuses 'tc' (forced)."""
    from numba import cuda

    from onnx_lowbit.custom_ops import KernelError
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    m, k, n = 5, 256, 40
    x, w1, w3, b1, _ = data((m,), k, n, F16, F16, True)
    bx = cuda.to_device(np.concatenate([np.zeros(1, F16), x.reshape(-1)]).view(np.uint16))
    d1, d3, db1 = (cuda.to_device(a.reshape(-1).view(np.uint16)) for a in (w1, w3, b1))
    dy = cuda.device_array(m * n, np.uint16)
    kern = fusedffn_cuda.FusedFFNCudaKernel(spec=None, attrs={}, node_name="t", in_types=(10, 10), out_types=(10,))
    p = lambda a: a.device_ctypes_pointer.value  # noqa: E731
    with pytest.raises(KernelError, match="tensor-core kernel"):
        kern.run(0, m, k, n, p(bx) + 2, p(d1), p(d3), p(db1), 0, p(dy), path="tc")
    kern.run(0, m, k, n, p(bx) + 2, p(d1), p(d3), p(db1), 0, p(dy))
    cuda.synchronize()
    check(dy.copy_to_host().view(F16).reshape(m, n), x, w1, w3, b1)

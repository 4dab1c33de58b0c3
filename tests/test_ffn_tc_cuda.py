"""FusedFFN's tensor-core kernel for fp16 X and W at small M (custom_ops/ffn/fusedffn_tc_cuda.py) against the float64
reference, with test_ffn_cuda's per-output bound (fp32 sums in any order) and the issue's 1e-3 bar (NaN / Inf:
test_ffn_cuda.test_cuda_nonfinite, path 'tc'), through the op's kernel object (test_ffn_cuda.run_op).

Under Numba's CUDA simulator (small shapes, the kernel at its GPU block shapes) or on a real GPU with
ONNX_LOWBIT_REAL_GPU=1 (the same cases, plus LLaMA-size shapes, alignment fallback and determinism).
"""
import numpy as np
import pytest
from test_ffn_cuda import SIM, _cuda, check, data, run_op, served


F16 = np.float16


def _tc():
    _cuda()
    from onnx_lowbit.custom_ops.ffn import fusedffn_tc_cuda
    return fusedffn_tc_cuda


# (lead, K, N, B1, B3): every configuration sessions launch (M = 3..8, 9..16, 17..32) and M = 37 (forced past the
# routed M: several row chunks in the L2-friendly order), K not a multiple of the 32-column chunk (136: a chunk with
# one lane group past K; 8: warps 1.. of the block stream only zeros), N not a multiple of the 16-feature tile, one
# X tile partly filled.
CASES = [
    ((3,), 64, 16, True, True),
    ((5,), 136, 24, False, True),
    ((9,), 8, 16, True, True),
    ((2, 6), 96, 40, True, False),
    ((20,), 72, 9, True, True),
    ((4,), 264, 20, True, True),
    ((37,), 40, 33, False, False),
    ((37,), 40, 33, True, True),
]


@pytest.mark.parametrize("lead,K,N,hb1,hb3", CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-K{c[1]}-N{c[2]}-{int(c[3])}{int(c[4])}" for c in CASES])
def test_tc_vs_reference(lead, K, N, hb1, hb3):  # noqa: N803
    _tc()
    x, w1, w3, b1, b3 = data(lead, K, N, F16, F16, hb1, hb3, seed=K + N)
    m = int(np.prod(lead))
    assert served(F16, F16, m, K, N, path="tc") == "tc"
    y = run_op(x, w1, w3, b1, b3, path="tc")
    check(y, x, w1, w3, b1, b3)
    if m <= 32:     # routed here, not only forced
        assert served(F16, F16, m, K, N) == "tc" and np.array_equal(y, run_op(x, w1, w3, b1, b3))


def test_tc_config_and_limits():
    tc = _tc()
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda
    rows = [r for r, _ in tc.CONFIGS]
    assert rows == sorted(rows) and rows[-1] == fusedffn_cuda.TC_MAX_M and fusedffn_cuda.TC_MIN_M == 3
    for m in range(1, 80):
        mt, kw, ring, mfast = tc.config(m)
        assert kw * 32 <= 1024 and 1 <= ring <= 4
        assert mfast or m <= 8 * mt                 # past one row chunk: the L2-friendly order
    assert tc.ok(True, True, 5, 8) and not tc.ok(True, True, 5, 12) and not tc.ok(False, True, 5, 8) \
        and not tc.ok(True, False, 5, 8) and not tc.ok(True, True, 5, 8, aligned=False)
    assert tc.chunks_per_warp(4096, 4, 2) == 32 and tc.chunks_per_warp(136, 4, 4) == 4 and \
        tc.chunks_per_warp(8, 4, 2) == 2
    assert tc.grid(37, 33, 2) == 3 * 3
    with pytest.raises(ValueError, match="ring must be 1..4"):
        tc.make(1, 4, 5)
    assert served(F16, F16, 4, 12, 8) != "tc" and served(np.float32, F16, 4, 16, 8) != "tc"     # K % 8, fp32 X


# ------------------------------------------------------------------------------------------------ real GPU only
@pytest.mark.skipif(SIM, reason="real GPU only (LLaMA-size shapes)")
@pytest.mark.parametrize("m", [3, 8, 16, 24, 32])
def test_gpu_tc_large(m):
    x, w1, w3, b1, b3 = data((m,), 4096, 1000, F16, F16, True, True, seed=m)
    assert served(F16, F16, m, 4096, 1000) == "tc"
    y = run_op(x, w1, w3, b1, b3)
    check(y, x, w1, w3, b1, b3)
    assert np.array_equal(y, run_op(x, w1, w3, b1, b3, path="tc"))     # deterministic
    check(run_op(x, w1, w3, b1, b3, path="gemm"), x, w1, w3, b1, b3)


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

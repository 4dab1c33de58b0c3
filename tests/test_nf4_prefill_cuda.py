"""MatMulNF4's prefill route (custom_ops/nf4/prefill_cuda: W^T dequantised into fp16 scratch by DequantNF4's
transposed kernel, then device/prefill's cuBLAS GEMM, op T; a bias added in fp32 by an elementwise kernel), through
the kernel object as a session node calls it (tests/helpers.direct_run). Under Numba's CUDA simulator cuBLAS is the
stand-in of test_ffn4_prefill_cuda (``blas``); on a GPU (ONNX_LOWBIT_REAL_GPU=1) the real cuBLAS.

Bar: max |Y - ref| / max |ref| <= 2^-10 against nf4.matmul (fp32 weights, float64 sums, one rounding): the fp16
weights are within 2^-12 of them, as FusedFFNNF4's prefill route (test_ffn4_prefill_cuda)."""
import numpy as np
import pytest

from onnx_lowbit import nf4
from test_ffn4_prefill_cuda import SIM, _P, blas  # noqa: F401 - blas is a fixture
from test_nf4_kernels import _quantized

F16 = np.float16
CASES = [  # M, K, N, block size, quant type, bias
    (17, 64, 16, 32, "nf4", True),
    (24, 96, 24, 64, "fp4", False),
    (40, 576, 40, 32, "int4", True),     # onnxruntime-genai's products through the int4 code
    (33, 688, 8, 64, "nf4", False),      # blocks straddle rows of W^T
]


def _run(M, K, N, bs, qt, bias, x=None):  # noqa: N803
    from helpers import direct_run
    q, am = _quantized(K, N, bs, qt, seed=K + N)
    x = (np.random.default_rng(M).standard_normal((M, K)) * 0.5).astype(F16) if x is None else x
    b = np.random.default_rng(K).standard_normal(N).astype(F16) if bias else None
    routed = []

    def setup(kern):
        from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
        from onnx_lowbit.custom_ops.runtime.routing import route
        routed.append(route(mc.ROUTES, kern.case(M)).kernel)
    y = direct_run("MatMulNF4", {"quant_type": qt, "block_size": bs, "K": K, "N": N},
                   [x, q, am] + ([b] if bias else []), [((M, N), F16)], setup=setup)[0]
    return y, routed, (x, q, am, b)


def check(y, x, q, am, qt, bs, K, N, b):  # noqa: N803
    assert y.dtype == F16 and y.shape == x.shape[:-1] + (N,)
    ref = nf4.matmul(x, q, am, qt, bs, K, N, b).astype(np.float64)
    err = np.max(np.abs(y.astype(np.float64) - ref)) / max(float(np.max(np.abs(ref))), 1e-12)
    assert err <= 2.0 ** -10, err


@pytest.mark.parametrize("M,K,N,bs,qt,bias", CASES, ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-{c[4]}-b{int(c[5])}" for c in CASES])
def test_prefill_route(blas, M, K, N, bs, qt, bias):  # noqa: N803
    y, routed, (x, q, am, b) = _run(M, K, N, bs, qt, bias)
    assert routed == ["prefill"]
    if blas is not None:        # one GEMM, op T on the [N, K] fp16 weight; fp16 Y, or fp32 G with a bias
        assert blas.calls == [(1, 0, N, M, K, K, K, N, 2, 2, 0 if bias else 2)]
    check(y, x, q, am, qt, bs, K, N, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_prefill_nonfinite_rows(blas):
    """NaN / Inf in a row of A: every output of that row is non-finite, the other rows meet the bar."""
    M, K, N, bs = 20, 64, 16, 32  # noqa: N806
    x = (np.random.default_rng(4).standard_normal((M, K))).astype(F16)
    x[0, 3], x[1, 5], x[2, 0] = np.nan, np.inf, -np.inf
    y, routed, (_, q, am, b) = _run(M, K, N, bs, "nf4", True, x=x)
    assert routed == ["prefill"]
    assert (~np.isfinite(y[:3].astype(np.float32))).all() and np.isfinite(y[3:]).all()
    check(y[3:], x[3:], q, am, "nf4", bs, K, N, b)


@pytest.mark.skipif(not SIM, reason="kernel objects built under the simulator (no compilation)")
def test_routes(blas):
    """fp16 A from M = 17 takes ``prefill`` where cuBLAS and scratch exist; without either, with fp32 A, and at
    M <= 16 the rows that served before."""
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda as mc
    from onnx_lowbit.custom_ops.runtime.routing import route
    for dtype in (F16, np.float32):
        t = 10 if dtype == F16 else 1
        k = mc.MatMulNF4CudaKernel(spec=domain.OPS["MatMulNF4"], node_name="t", in_types=(t,), out_types=(t,),
                                   attrs={"quant_type": "nf4", "block_size": 64, "K": 256, "N": 64})
        assert k.blas
        for m in (1, 16, 17, 40, 128):
            for scratch in (True, False):
                got = route(mc.ROUTES, k.case(m, scratch=scratch)).kernel
                if dtype == F16 and m >= 17 and scratch:
                    assert got == "prefill", (m, scratch)
                else:
                    assert got != "prefill" and (m <= 16 or got == "generic"), (dtype, m, scratch, got)
        k.blas = False
        assert route(mc.ROUTES, k.case(40)).kernel == "generic"


# ------------------------------------------------------------------------------------------ GPU sessions
@pytest.mark.parametrize("m,bias", [(17, True), (128, False)])
def test_gpu_session_prefill_is_replayed_natively(m, bias):
    """GPU (ONNX_LOWBIT_REAL_GPU=1): a one-node session at M = 17 and 128 takes the prefill route; the first run
    records it, the next four replay it from C (no Python call), one scratch buffer of the route's size per run;
    the same bits every run, within the bar."""
    from helpers import assert_replayed_natively, cuda_binding, lowbit_session, ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.nf4 import prefill_cuda
    from test_nf4_kernels import matmul_model
    k, n, bs, qt = 576, 960, 32, "int4"
    q, am = _quantized(k, n, bs, qt, seed=5)
    b = np.random.default_rng(n).standard_normal(n).astype(F16) if bias else None
    sess = lowbit_session(matmul_model((1, m), k, n, bs, qt, F16, bias, q, am, b), ["CUDAExecutionProvider"])
    x = (np.random.default_rng(m).standard_normal((1, m, k)) * 0.5).astype(F16)
    io, _, y = cuda_binding(sess, x, "a", "y", (1, m, n))
    out = assert_replayed_natively(sess, io, y, prefill_cuda.scratch_bytes(m, k, n, bias)[1])
    check(out.reshape(m, n), x.reshape(m, k), q, am, qt, bs, k, n, b)

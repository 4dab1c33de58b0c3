"""MatMulAWQ's prefill route (custom_ops/awq/prefill_cuda: W dequantised into fp16 scratch by DequantAWQ's kernel,
then one cublasGemmEx; a bias added in fp32 by an elementwise kernel), through the kernel object as a session node
calls it (tests/helpers.direct_run). Under Numba's CUDA simulator cuBLAS is the stand-in of test_ffn4_prefill_cuda
(``blas``: cublasGemmEx's arithmetic on host memory); on a GPU (ONNX_LOWBIT_REAL_GPU=1) the real cuBLAS.

Bar: max |Y - ref| / max |ref| <= 2^-10 against awq.matmul (the op's reference: the fp16 weights DequantAWQ writes,
float64 sums, one rounding), the bar of FusedFFNAWQ's cuBLAS prefill route (test_ffn4_prefill_cuda): on the H200 an
elementwise bound of one fp16 rounding plus K 2^-24 sum |x| |w| was exceeded by 4e-5 at K = 256 with a bias (cuBLAS's
tensor-core accumulation is not IEEE summation)."""
import numpy as np
import pytest
from test_awq_kernels import activations, weights

from onnx_lowbit import awq
from test_ffn4_prefill_cuda import SIM, _P, blas  # noqa: F401 - blas is a fixture

F16 = np.float16
CASES = [  # M, K, N, group size, bias
    (17, 64, 16, 32, True),
    (24, 100, 24, 32, False),   # K padded to a multiple of the group
    (40, 96, 16, 16, False),
    (19, 70, 8, 7, True),       # odd group size
    (64, 256, 64, 128, True),
]


def check(y, x, qw, qz, sc, G, K, N, b):  # noqa: N803
    assert y.dtype == F16 and y.shape == x.shape[:-1] + (N,)
    ref = awq.matmul(x, qw, qz, sc, G, K, N, b).astype(np.float64)
    err = np.max(np.abs(y.astype(np.float64) - ref)) / max(float(np.max(np.abs(ref))), 1e-12)
    assert err <= 2.0 ** -10, err


def _run(M, K, N, G, bias, x=None):  # noqa: N803
    from helpers import direct_run
    qw, qz, sc = weights(K, N, G, seed=3)
    x = activations((M, K), F16, seed=M) if x is None else x
    b = np.random.default_rng(K).standard_normal(N).astype(F16) if bias else None
    launched = []

    def setup(kern):
        for name, fn in list(kern.launch.items()):
            kern.launch[name] = lambda *a, fn=fn: (launched.append(a[0]), fn(*a))
    inputs = [x, qw, qz, sc] + ([b] if bias else [])
    y = direct_run("MatMulAWQ", {"group_size": G, "K": K, "N": N}, inputs, [((M, N), F16)], setup=setup)[0]
    return y, launched, (x, qw, qz, sc, b)


@pytest.mark.parametrize("M,K,N,G,bias", CASES, ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}-b{int(c[4])}" for c in CASES])
def test_prefill_route(blas, M, K, N, G, bias):  # noqa: N803
    y, launched, (x, qw, qz, sc, b) = _run(M, K, N, G, bias)
    assert launched == ["prefill"]
    if blas is not None:        # one GEMM, op N on the [K, N] fp16 weight; fp16 Y, or fp32 G with a bias
        assert blas.calls == [(0, 0, N, M, K, N, K, N, 2, 2, 0 if bias else 2)]
    check(y, x, qw, qz, sc, G, K, N, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_nonfinite_rows(blas, bias):
    """NaN / Inf in a row of X: every output of that row is non-finite, the other rows meet the bars."""
    M, K, N, G = 20, 64, 16, 32  # noqa: N806
    x = activations((M, K), F16, seed=4)
    x[0, 3], x[1, 5], x[2, 0] = np.nan, np.inf, -np.inf
    y, launched, (_, qw, qz, sc, b) = _run(M, K, N, G, bias, x=x)
    assert launched == ["prefill"]
    assert (~np.isfinite(y[:3].astype(np.float32))).all() and np.isfinite(y[3:]).all()
    check(y[3:], x[3:], qw, qz, sc, G, K, N, b)


@pytest.mark.skipif(not SIM, reason="kernel objects built under the simulator (no compilation)")
def test_routes(blas):
    """fp16 X from M = 17 takes ``prefill`` where cuBLAS and scratch exist; without either, with fp32 X, and at
    M <= 16 the rows that served before."""
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.awq import matmulawq_cuda as mc
    from onnx_lowbit.custom_ops.runtime.routing import route
    x, ws = _P(1 << 20), [(_P(1 << 21), _P(1 << 22), _P(1 << 23))]
    for dtype in (F16, np.float32):
        t = 10 if dtype == F16 else 1
        k = mc.MatMulAWQCudaKernel(spec=domain.OPS["MatMulAWQ"], node_name="t", in_types=(t,), out_types=(t,),
                                   attrs={"group_size": 32, "K": 256, "N": 64})
        assert k.blas
        for m in (1, 16, 17, 40, 128):
            for scratch in (True, False):
                got = route(k.ROUTES, k.case(m, x, ws, scratch)).kernel
                if dtype == F16 and m >= 17 and scratch:
                    assert got == "prefill", (m, scratch)
                else:
                    assert got != "prefill" and (m <= 16 or got == "generic"), (dtype, m, scratch, got)
        k.blas = False
        assert route(k.ROUTES, k.case(40, x, ws, True)).kernel == "generic"


# ------------------------------------------------------------------------------------------ GPU sessions
def _session(m, bias, k=2048, n=1024, g=32, graph=False):
    """A one-node MatMulAWQ session (fp16 A [1, m, k], weights and bias as initializers) and its operands."""
    from helpers import lowbit_session
    from test_awq_kernels import awq_model
    qw, qz, sc = weights(k, n, g, seed=5)
    b = np.random.default_rng(n).standard_normal(n).astype(F16) if bias else None
    init = {"qweight": qw, "qzeros": qz, "scales": sc} | ({"bias": b} if bias else {})
    model = awq_model("MatMulAWQ", k, n, g, a_dtype=F16, lead=("B", "T"), bias=bias, initializers=init)
    eps = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"] if graph else \
        ["CUDAExecutionProvider"]
    return lowbit_session(model, eps), (qw, qz, sc, b, g, k, n)


def _binding(sess, x, n):
    from helpers import cuda_binding
    return cuda_binding(sess, x, "A", "Y", x.shape[:-1] + (n,))


@pytest.mark.parametrize("m,bias", [(17, True), (128, False)])
def test_gpu_session_prefill_is_replayed_natively(m, bias):
    """GPU (ONNX_LOWBIT_REAL_GPU=1): a one-node session at M = 17 and 128 takes the prefill route; the first run
    records it, the next four replay it from C (no Python call), each run takes one scratch buffer of the route's
    size from onnxruntime's allocator and gives it back; the same bits every run, within the bar."""
    from helpers import assert_replayed_natively, ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.awq import prefill_cuda
    sess, (qw, qz, sc, b, g, k, n) = _session(m, bias)
    x = activations((1, m, k), F16, seed=m)
    io, _, y = _binding(sess, x, n)
    out = assert_replayed_natively(sess, io, y, prefill_cuda.scratch_bytes(m, k, n, bias)[1])
    check(out.reshape(m, n), x.reshape(m, k), qw, qz, sc, g, k, n, b)


def test_gpu_prefill_in_a_cuda_graph():
    """GPU: enable_cuda_graph at M = 64 with a bias: the captured graph gives, for new input contents, the same bits
    as a session without graphs; its replays reach neither Python nor the shim."""
    from helpers import ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.runtime import bridge
    m = 64
    graph, (_, _, _, _, _, k, n) = _session(m, True, graph=True)
    ref, _ = _session(m, True)
    io, xv, y = _binding(graph, activations((1, m, k), F16), n)
    for seed in range(6):   # the first runs record and capture, the others replay the graph
        xs = np.random.default_rng(seed).standard_normal((1, m, k)).astype(F16)
        xv.update_inplace(xs)
        before, counts = bridge.stats["python_computes"], bridge.scratch_counts()
        graph.run_with_iobinding(io)
        got = y.numpy()
        if seed >= 3:
            assert bridge.stats["python_computes"] == before and bridge.scratch_counts()["taken"] == counts["taken"]
        assert np.array_equal(got, ref.run(None, {"A": xs})[0]), seed

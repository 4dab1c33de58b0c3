"""The prefill route of FusedFFNAWQ and FusedFFNNF4 (custom_ops/ffn/fusedffn4_prefill_cuda: the weights dequantised
into fp16 scratch by the dequant ops' kernels, then FusedFFN's cuBLAS path), through the kernel objects as session
nodes call them (tests/helpers.direct_run, runtime/plans.compute_and_record).

Under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) there is no cuBLAS: ``blas`` installs a stand-in library
whose cublasGemmEx does what cuBLAS does with the arguments it is given (column-major operands, op N / T, leading
dimensions, fp16 / fp32 operand and output types; float64 sums rounded once to the output type) on the simulator's
memory (host memory), behind the real ``cublas.Handle.gemm_rows``; the dequant and SiLU * mul kernels run as they
are. On a GPU (ONNX_LOWBIT_REAL_GPU=1) the same tests run the real cuBLAS, plus one-node onnxruntime CUDA sessions:
native replay and CUDA graphs.

Bars (max |S - ref| / max |ref|): against the reference on the fp16 weights the route multiplies (AWQ: the op's
own reference, onnx_lowbit.ffn.swiglu_awq_ref; NF4: its fp32 weights rounded to fp16) 2^-10 (fp32 sums, one fp16
rounding of S); against the op's reference 1e-3 (the issue's bar: AWQ on exact (q - z) * s, NF4 on fp32 weights).
"""
import ctypes

import numpy as np
import pytest
from numba import config
from test_ffn4_kernels import _check_nonfinite, _data, _rel, _specials, _tol, awq_exact_t, awq_weights, nf4_weights

from onnx_lowbit import ffn
from onnx_lowbit.custom_ops.runtime import plans

SIM = bool(config.ENABLE_CUDASIM)
F16 = np.float16
_p, _i = ctypes.c_void_p, ctypes.c_int
GEMM_FN = ctypes.CFUNCTYPE(_i, _p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i, _i, _p, _p, _i, _i, _i, _i)
_NP = {0: np.float32, 2: np.float16}      # cudaDataType_t R_32F, R_16F


def _matrix(ptr, dtype, rows, cols, ld):
    """A column-major rows x cols matrix with leading dimension ``ld`` at host address ``ptr`` (a writable view)."""
    it = np.dtype(dtype).itemsize
    buf = np.frombuffer((ctypes.c_char * ((ld * (cols - 1) + rows) * it)).from_address(ptr), dtype)
    return np.lib.stride_tricks.as_strided(buf, (rows, cols), (it, ld * it))


class _EmulatedBlas:
    """cublasGemmEx on host memory: C = alpha op(A) op(B) + beta C, column-major (what cuBLAS computes with these
    arguments); beta = 0 never reads C. ``calls``: (transa, transb, m, n, k, lda, ldb, ldc, A, B, C types)."""

    def __init__(self):
        self.calls = []

        def gemm(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, compute, algo):
            al, be = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
            self.calls.append((ta, tb, m, n, k, lda, ldb, ldc, at, bt, ct))
            opa = _matrix(a, _NP[at], m, k, lda) if ta == 0 else _matrix(a, _NP[at], k, m, lda).T
            opb = _matrix(b, _NP[bt], k, n, ldb) if tb == 0 else _matrix(b, _NP[bt], n, k, ldb).T
            with np.errstate(all="ignore"):
                r = al * (opa.astype(np.float64) @ opb.astype(np.float64))
                cm = _matrix(c, _NP[ct], m, n, ldc)
                if be != 0.0:
                    r = r + be * cm.astype(np.float64)
                cm[...] = r.astype(_NP[ct])
            return 0
        self.cublasGemmEx = GEMM_FN(gemm)


@pytest.fixture
def blas(monkeypatch):
    """cuBLAS for the kernel objects made in the test: the emulated one under the simulator (returned), the real one
    on a GPU (None; skipped without a GPU or a cuBLAS library)."""
    from onnx_lowbit.custom_ops.device import cublas
    if not SIM:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and the CUDA simulator is off")
        if cublas.load() is None:
            pytest.skip("no cuBLAS library found (the prefill route is not taken)")
        return None
    emu = _EmulatedBlas()
    h = cublas.Handle.__new__(cublas.Handle)
    h.lib, h.h, h.stream = emu, ctypes.c_void_p(0x7777), 0
    h._one, h._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    h._gemm_addr = ctypes.cast(emu.cublasGemmEx, ctypes.c_void_p).value
    monkeypatch.setattr(cublas, "load", lambda: emu)
    monkeypatch.setattr(cublas, "handle_for", lambda stream: h)
    return emu


def _awq(m, k, n, g, biases, seed=5):
    w1, w3 = awq_weights(k, n, g, seed=seed)
    x, b1, b3 = _data((m,), k, n, F16, biases, seed)
    return x, w1, w3, b1, b3


def _nf4(m, k, n, bs, biases, qt="nf4", seed=6):
    ws = nf4_weights(k, n, bs, qt, seed=seed)
    x, b1, b3 = _data((m,), k, n, F16, biases, seed)
    return x, [a.reshape(-1) if i % 2 == 0 else a.reshape(-1).astype(np.float32) for i, a in enumerate(ws)], b1, b3


def _run(op, attrs, inputs, m, n):
    """``op`` through helpers.direct_run: (S, the kernels the kernel object launched, by routing name)."""
    from helpers import direct_run
    launched = []

    def setup(kern):
        if op == "FusedFFNAWQ":
            for name, fn in list(kern.launch.items()):
                kern.launch[name] = lambda *a, fn=fn: (launched.append(a[0]), fn(*a))
        else:
            orig = kern._prefill
            kern._prefill = lambda *a: (launched.append("prefill"), orig(*a))

    while inputs[-1] is None:
        inputs = inputs[:-1]
    return direct_run(op, attrs, inputs, [((m, n), F16)], setup=setup)[0], launched


def _awq_refs(x, w1, w3, g, k, n, b1, b3):
    """(the reference on the route's fp16 weights, the reference on the exact weights)."""
    return (ffn.swiglu_awq_ref(x, *w1, *w3, g, k, n, b1, b3),
            ffn.swiglu_ref(x, awq_exact_t(w1, g, k), awq_exact_t(w3, g, k), b1, b3))


def _nf4_refs(x, ws, qt, bs, k, n, b1, b3):
    w16 = [ffn.nf4_weight_t(ws[i], ws[i + 1], qt, bs, k, n).astype(F16) for i in (0, 2)]
    return ffn.swiglu_ref(x, *w16, b1, b3), ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)


AWQ_CASES = [  # M, K, N, group size, (B1, B3)
    (17, 64, 16, 32, (True, True)),
    (24, 100, 24, 32, (False, True)),    # K padded to a multiple of the group
    (40, 96, 16, 16, (False, False)),
    (19, 70, 8, 7, (True, False)),       # odd group size
]


@pytest.mark.parametrize("M,K,N,G,biases", AWQ_CASES, ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-G{c[3]}" for c in AWQ_CASES])
def test_awq_prefill_route(blas, M, K, N, G, biases):  # noqa: N803
    x, w1, w3, b1, b3 = _awq(M, K, N, G, biases)
    s, launched = _run("FusedFFNAWQ", {"group_size": G, "K": K, "N": N}, [x, *w1, *w3, b1, b3], M, N)
    assert launched == ["prefill"]
    if blas is not None:            # two GEMMs op N on the [K, N] weights, fp16 in, fp16 G [M, 2N] out
        assert blas.calls == [(0, 0, N, M, K, N, K, 2 * N, 2, 2, 2)] * 2
    want, exact = _awq_refs(x, w1, w3, G, K, N, b1, b3)
    assert _rel(s, want) <= _tol(F16) and _rel(s, exact) <= 1e-3


NF4_CASES = [  # M, K, N, block size, quant type, (B1, B3)
    (17, 64, 16, 32, "nf4", (True, True)),
    (33, 96, 24, 64, "fp4", (False, True)),
    (20, 40, 8, 32, "nf4", (True, False)),   # K % 16 != 0 (blocks straddle rows)
]


@pytest.mark.parametrize("M,K,N,bs,qt,biases", NF4_CASES, ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-{c[4]}" for c in NF4_CASES])
def test_nf4_prefill_route(blas, M, K, N, bs, qt, biases):  # noqa: N803
    x, ws, b1, b3 = _nf4(M, K, N, bs, biases, qt)
    s, launched = _run("FusedFFNNF4", {"quant_type": qt, "block_size": bs, "K": K, "N": N}, [x, *ws, b1, b3], M, N)
    assert launched == ["prefill"]
    if blas is not None:            # two GEMMs op T on the [N, K] weights
        assert blas.calls == [(1, 0, N, M, K, K, K, 2 * N, 2, 2, 2)] * 2
    want, ref = _nf4_refs(x, ws, qt, bs, K, N, b1, b3)
    assert _rel(s, want) <= _tol(F16) and _rel(s, ref) <= 1e-3


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("op", ["FusedFFNAWQ", "FusedFFNNF4"])
def test_prefill_nonfinite_x(blas, op):
    """NaN / Inf in a row of X make that row's outputs non-finite exactly where the reference's are; other rows as
    above."""
    m, k, n = 18, 64, 16
    if op == "FusedFFNAWQ":
        x, w1, w3, b1, b3 = _awq(m, k, n, 32, (True, False), seed=9)
        x = _specials(x)
        s, launched = _run(op, {"group_size": 32, "K": k, "N": n}, [x, *w1, *w3, b1, b3], m, n)
        ref = _awq_refs(x, w1, w3, 32, k, n, b1, b3)[0]
    else:
        x, ws, b1, b3 = _nf4(m, k, n, 32, (False, True), seed=9)
        x = _specials(x)
        s, launched = _run(op, {"quant_type": "nf4", "block_size": 32, "K": k, "N": n}, [x, *ws, b1, b3], m, n)
        ref = _nf4_refs(x, ws, "nf4", 32, k, n, b1, b3)[0]
    assert launched == ["prefill"]
    _check_nonfinite(s, ref, F16)


# ------------------------------------------------------------------------------------------ routing
def _awq_kernel(dtype, k=256, n=64, g=32):
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.ffn import fusedffnawq_cuda
    t = 10 if dtype == F16 else 1
    return fusedffnawq_cuda.FusedFFNAWQCudaKernel(spec=domain.OPS["FusedFFNAWQ"], node_name="t", in_types=(t,),
                                                  out_types=(t,), attrs={"group_size": g, "K": k, "N": n})


class _P:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.mark.skipif(not SIM, reason="kernel objects built under the simulator (no compilation)")
def test_routes_send_fp16_prefill_to_the_new_route(blas, monkeypatch):
    """FusedFFNAWQ and FusedFFNNF4: fp16 X from M = 17 takes ``prefill`` where cuBLAS and scratch exist; without
    either, with fp32 X, and at M <= 16 the rows that served before."""
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda as nc
    from onnx_lowbit.custom_ops.runtime.routing import route
    x, ws = _P(1 << 20), [(_P(1 << 21), _P(1 << 22), _P(1 << 23))] * 2
    for dtype in (F16, np.float32):
        ka = _awq_kernel(dtype)
        kn = nc.FusedFFNNF4CudaKernel(spec=None, node_name="t", in_types=(10 if dtype == F16 else 1,),
                                      out_types=(10 if dtype == F16 else 1,),
                                      attrs={"quant_type": "nf4", "block_size": 64, "K": 256, "N": 64})
        assert ka.blas and kn.blas and ("prefill" in kn.prepared) == (dtype == F16)
        for m in (1, 16, 17, 40, 128):
            for scratch in (True, False):
                a = route(ka.ROUTES, ka.case(m, x, ws, scratch)).kernel
                b = route(nc.ROUTES, kn.case(m, scratch=scratch)).kernel
                if dtype == F16 and m >= 17 and scratch:
                    assert a == b == "prefill", (m, scratch)
                else:
                    assert a != "prefill" and b != "prefill", (dtype, m, scratch)
                    assert m <= 16 or a == b == "generic"
        ka.blas = kn.blas = False           # no cuBLAS library: the generic kernels
        assert route(ka.ROUTES, ka.case(40, x, ws, True)).kernel == "generic"
        assert route(nc.ROUTES, kn.case(40, scratch=True)).kernel == "generic"


# ------------------------------------------------------------------------------------------ native plans
class _Ctx:
    """bridge.Context's stand-in over host memory (the simulator's device memory): scratch NaN-filled, outputs and
    scratch reported to the recorder as Context does."""
    has_scratch, stream, recorder = True, 7, None

    def __init__(self):
        self.keep, self.asked = [], []

    def _buf(self, nbytes, fill):
        b = np.full(max(nbytes, 1) + 256, fill, np.uint8)
        self.keep.append(b)
        return -(-b.ctypes.data // 256) * 256

    def output(self, index, shape):
        ptr = self._buf(int(np.prod(shape)) * 2, 0)
        if self.recorder is not None:
            self.recorder.output(index, tuple(shape), ptr)
        self.out = (ptr, shape)
        return ptr

    def scratch(self, nbytes):
        self.asked.append(nbytes)
        ptr = self._buf(nbytes, 0xFF)
        if self.recorder is not None:
            self.recorder.scratch(ptr, nbytes)
        return ptr


def _tensor(a):
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    et = {np.dtype(np.float32): 1, np.dtype(F16): 10, np.dtype(np.int32): 6, np.dtype(np.uint8): 2}[a.dtype]
    return Tensor(a.ctypes.data, et, a.shape)


def _plan_case(op, m, k, n):
    """(arrays, attrs, the reference on the route's fp16 weights) of a recorded-plan case (biases on, group 32)."""
    if op == "FusedFFNAWQ":
        x, w1, w3, b1, b3 = _awq(m, k, n, 32, (True, True), seed=3)
        return [x, *w1, *w3, b1, b3], {"group_size": 32, "K": k, "N": n}, _awq_refs(x, w1, w3, 32, k, n, b1, b3)[0]
    x, ws, b1, b3 = _nf4(m, k, n, 32, (True, True), seed=3)
    return ([x, *ws, b1, b3], {"quant_type": "nf4", "block_size": 32, "K": k, "N": n},
            _nf4_refs(x, ws, "nf4", 32, k, n, b1, b3)[0])


def _record(op, arrays, attrs):
    """(plan, ctx) of one call of a fresh kernel object recorded by runtime/plans.compute_and_record."""
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.runtime.abi import LbPlan
    from onnx_lowbit.custom_ops.runtime.kernels import kernel_class
    kern = kernel_class(op, "CUDAExecutionProvider")(spec=domain.OPS[op], attrs=attrs, node_name="t",
                                                     in_types=(10,), out_types=(10,))
    ctx, plan = _Ctx(), LbPlan()
    plans.compute_and_record(kern, ctx, [_tensor(a) for a in arrays], plan)
    return plan, ctx


def _kinds(plan):
    return [plan.steps[i].kind for i in range(plan.n_steps)]


def _patches(plan, i):
    st = plan.steps[i]
    return {(st.patch_kind[j], st.patch_index[j], st.patch_off[j]) for j in range(st.n_patch)}


def _output(ctx):
    ptr, shape = ctx.out
    return np.frombuffer((ctypes.c_char * (int(np.prod(shape)) * 2)).from_address(ptr), F16).reshape(shape)


@pytest.mark.skipif(not SIM, reason="kernel objects over host memory: simulator only (GPU: the session tests)")
@pytest.mark.parametrize("op", ["FusedFFNAWQ", "FusedFFNNF4"])
def test_prefill_plan_records_every_step(blas, op):
    """A recorded call (runtime/plans.compute_and_record): one scratch buffer of the route's size, taken once; the
    steps dequant W1, GEMM, dequant W3, GEMM, SiLU * mul in that order (all rows in one chunk: both weights
    dequantised into the one weight buffer at offset 0, each right before its GEMM); the dequant outputs and the
    GEMMs' weights and G patched as offsets into the call's scratch, X as input 0, S as output 0 (so a replay runs
    on its own buffers); the result meets the reference on NaN-filled scratch."""
    from onnx_lowbit.custom_ops.ffn import fusedffn4_prefill_cuda as p4
    m, k, n = 20, 64, 16
    arrays, attrs, want = _plan_case(op, m, k, n)
    plan, ctx = _record(op, arrays, attrs)
    w3off, goff, total = p4.scratch_layout(m, k, n)
    assert w3off == 0 and plan.valid and ctx.asked == [total] and plan.scratch == total
    assert _kinds(plan) == [plans.LAUNCH, plans.GEMM, plans.LAUNCH, plans.GEMM, plans.LAUNCH]
    for i in (0, 2):                                        # each dequant writes its weight into the one buffer
        assert (plans.SCRATCH, 0, 0) in _patches(plan, i)
        assert not any(kind == plans.OUTPUT for kind, _, _ in _patches(plan, i))
    for i, goff_i in ((1, goff), (3, goff + 2 * n)):        # fp16 G [M, 2N]: W3's GEMM writes from column N
        assert _patches(plan, i) == {(plans.SCRATCH, 0, 0), (plans.INPUT, 0, 0), (plans.SCRATCH, 0, goff_i)}
    assert (plans.SCRATCH, 0, goff) in _patches(plan, 4) and (plans.OUTPUT, 0, 0) in _patches(plan, 4)
    assert _rel(_output(ctx), want) <= _tol(F16)


@pytest.mark.skipif(not SIM, reason="kernel objects over host memory: simulator only (GPU: the session tests)")
@pytest.mark.parametrize("op", ["FusedFFNAWQ", "FusedFFNNF4"])
def test_prefill_plan_several_chunks(blas, op, monkeypatch):
    """Rows past one chunk (SCRATCH_MAX made small: 3 chunks of 7 rows): W1 and W3 dequantised first into two
    buffers, then per chunk GEMM, GEMM, SiLU * mul reading both; the result meets the reference."""
    from onnx_lowbit.custom_ops.ffn import fusedffn4_prefill_cuda as p4
    from onnx_lowbit.custom_ops.ffn import fusedffn_prefill_cuda as pre
    m, k, n = 21, 64, 16
    monkeypatch.setattr(pre, "SCRATCH_MAX", 7 * 4 * n)             # fp16 G: 4N bytes per row
    arrays, attrs, want = _plan_case(op, m, k, n)
    plan, ctx = _record(op, arrays, attrs)
    w3off, goff, total = p4.scratch_layout(m, k, n)
    assert w3off > 0 and plan.valid and ctx.asked == [total]
    assert _kinds(plan) == [plans.LAUNCH, plans.LAUNCH] + [plans.GEMM, plans.GEMM, plans.LAUNCH] * 3
    assert (plans.SCRATCH, 0, 0) in _patches(plan, 0) and (plans.SCRATCH, 0, w3off) in _patches(plan, 1)
    for c in range(3):
        assert (plans.SCRATCH, 0, 0) in _patches(plan, 2 + 3 * c)
        assert (plans.SCRATCH, 0, w3off) in _patches(plan, 3 + 3 * c)
    assert _rel(_output(ctx), want) <= _tol(F16)


@pytest.mark.skipif(not SIM, reason="simulator only (GPU: test_gpu_nf4_unaligned_q)")
def test_nf4_prefill_unaligned_q_takes_the_byte_kernel(blas, monkeypatch):
    """Q1 / Q3 one byte past alignment: DequantNF4's routing picks its byte kernel (LEGACY, 'rows') for the
    dequantisation instead of the vector one; the result is the same."""
    from test_nf4_kernels import call_op
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cuda as dq
    used, real = [], dq.launch_transposed
    monkeypatch.setattr(dq, "launch_transposed", lambda lau, var, *a: (used.append(var), real(lau, var, *a)))
    m, k, n, bs = 17, 64, 16, 32
    x, ws, b1, b3 = _nf4(m, k, n, bs, (True, True), seed=4)
    attrs = {"quant_type": "nf4", "block_size": bs, "K": k, "N": n}
    for off, epv in ((0, dq.DEFAULT["float16"].epv), (1, dq.LEGACY.epv)):
        used.clear()
        s, kern = call_op("FusedFFNNF4", attrs, [x, *ws, b1, b3], (m, n), F16, offsets=[0, off, 0, off, 0, 0, 0])
        assert [v.epv for v in used] == [epv, epv]
        want = _nf4_refs(x, ws, "nf4", bs, k, n, b1, b3)[0]
        assert _rel(s, want) <= _tol(F16), off


# ------------------------------------------------------------------------------------------ real GPU: sessions
def _session_case(op, m, k=2048, n=1024):
    """(model, x, the reference on the route's fp16 weights, the op's reference): a one-node session of ``op`` with
    X [1, m, k] fp16 and both biases (AWQ: group 32, genai's int4 block; NF4: block 64)."""
    from test_ffn4_kernels import awq_model, nf4_model
    if op == "FusedFFNAWQ":
        x, w1, w3, b1, b3 = _awq(m, k, n, 32, (True, True), seed=m)
        model = awq_model((1, m), k, n, 32, F16, w1, w3, b1, b3)
        refs = _awq_refs(x, w1, w3, 32, k, n, b1, b3)
    else:
        ws = nf4_weights(k, n, 64, "nf4", seed=m)
        x, b1, b3 = _data((m,), k, n, F16, (True, True), m)
        model = nf4_model((1, m), k, n, 64, "nf4", F16, ws, b1, b3)
        refs = _nf4_refs(x, ws, "nf4", 64, k, n, b1, b3)
    return model, x.reshape(1, m, k), *refs


def _binding(sess, x, out_shape):
    from helpers import cuda_binding
    return cuda_binding(sess, x, "x", "s", out_shape)


@pytest.mark.parametrize("m", [17, 128])
@pytest.mark.parametrize("op", ["FusedFFNAWQ", "FusedFFNNF4"])
def test_gpu_session_prefill_is_replayed_natively(op, m):
    """GPU (ONNX_LOWBIT_REAL_GPU=1): a one-node session at M = 17 and 128 (fp16 X, K = 2048, N = 1024) takes the
    prefill route; the first run records it, the next four replay it from C (no Python call), every run takes one
    scratch buffer of the route's size from onnxruntime's allocator and gives it back; the outputs are the same bits
    every time and meet the references."""
    from helpers import assert_replayed_natively, lowbit_session, ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.ffn import fusedffn4_prefill_cuda as p4
    model, x, want, ref = _session_case(op, m)
    k, n = x.shape[-1], want.shape[-1]
    sess = lowbit_session(model, ["CUDAExecutionProvider"])
    io, _, y = _binding(sess, x, (1, m, n))
    s = assert_replayed_natively(sess, io, y, p4.scratch_layout(m, k, n)[2]).reshape(m, n)
    assert _rel(s, want) <= _tol(F16) and _rel(s, ref) <= 1e-3


@pytest.mark.parametrize("op", ["FusedFFNAWQ", "FusedFFNNF4"])
def test_gpu_prefill_in_a_cuda_graph(op):
    """GPU: enable_cuda_graph at M = 64: the captured graph (the native replay inside the capture) gives, for new
    input contents, the same bits as a session without graphs; its replays reach neither Python nor the shim."""
    from helpers import lowbit_session, ort_cuda_or_skip
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.runtime import bridge
    m = 64
    model, x, _, _ = _session_case(op, m)
    n = model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value
    ref = lowbit_session(model, ["CUDAExecutionProvider"])
    graph = lowbit_session(model, [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"])
    io, xv, y = _binding(graph, x, (1, m, n))
    for seed in range(6):   # the first runs record and capture, the others replay the graph
        xs = np.random.default_rng(seed).standard_normal(x.shape).astype(F16)
        xv.update_inplace(xs)
        before, counts = bridge.stats["python_computes"], bridge.scratch_counts()
        graph.run_with_iobinding(io)
        got = y.numpy()
        if seed >= 3:
            assert bridge.stats["python_computes"] == before and bridge.scratch_counts()["taken"] == counts["taken"]
        assert np.array_equal(got, ref.run(None, {"x": xs})[0]), seed

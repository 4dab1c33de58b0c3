"""The NF4/FP4 tensor-core decode kernel (custom_ops/nf4/nf4tc_cuda.py: MatMulNF4 nw=1, FusedFFNNF4 nw=2) against
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
    from onnx_lowbit.custom_ops.nf4 import nf4tc_cuda
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


CASES = [  # m, k, n, block size, type, biases, warps, row chunks of 8 per block (None: the default, 2 from M = 9)
    # (simulator: keep M * N small; batches of CPL = 2 chunks of 64)
    (1, 128, 40, 64, "nf4", (True, True), 2, None),      # 3 tiles, the last partial
    (1, 384, 40, 64, "nf4", (True, True), 2, None),      # 6 chunks: 2 warps x 2 batches of 2, the last partial
    (3, 192, 16, 128, "fp4", (False, True), 2, None),    # 3 chunks over 2 warps: the second warp's batch half past K
    (3, 192, 16, 128, "fp4", (False, True), 1, None),    # one warp, a batch half past K
    (9, 64, 20, 64, "nf4", (True, False), 1, 1),         # two row chunks in two blocks (the second partial)
    (9, 64, 20, 64, "nf4", (True, False), 1, None),      # both in one block (the second one row)
    (16, 192, 40, 64, "nf4", (False, True), 2, None),    # both whole, 3 tiles, 3 chunks of K over 2 warps
    (1, 256, 16, 4096, "nf4", (False, False), 2, None),  # absmax blocks straddle rows
]


@pytest.mark.parametrize("m,k,n,bs,qt,biases,warps,rc", CASES)
def test_tc_kernel_vs_reference(m, k, n, bs, qt, biases, warps, rc):
    tc = _mod()
    ws, x, b1, b3 = _case(m, k, n, bs, qt, biases, 7)
    code = nf4.code(qt)
    s = tc.run(x, *ws, code, bs, k, n, b1, b3, warps=warps, sms=1 if SIM else None, rc=rc)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    assert s.shape == ref.shape and _rel(s, ref) <= 2.0 ** -10
    y = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, warps=warps, sms=1 if SIM else None, rc=rc)
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


@pytest.mark.parametrize("m,k,n,bs,rc,bias", [
    (2, 128, 40, 64, None, True),      # halves of 20 rows: a partial tile in each, the second half's bias
    (9, 192, 36, 64, None, False),     # both row chunks in one block, halves of 18 rows
    (11, 64, 16, 64, 1, True),         # row chunks in two blocks, halves of one partial tile each
    (1, 256, 32, 4096, None, True),    # absmax blocks straddle rows (16 per block), each half whole blocks
])
def test_tc_halves_same_bits_as_one_weight(m, k, n, bs, rc, bias):
    """MatMulNF4 through the two-weight kernel on its weight's two halves of rows (``halves``: W1 = rows 0 .. N/2-1,
    W3 = the rest, written to columns n and N/2 + n) gives the same bits as the one-weight kernel (each column's sums
    run in the same order), within 2^-10 of the reference; use_halves takes even N with whole absmax blocks."""
    tc = _mod()
    ws, x, b1, _ = _case(m, k, n, bs, "nf4", (bias, False), 9)
    code = nf4.code("nf4")
    kw = dict(warps=2 if SIM else None, sms=1 if SIM else None, rc=rc)
    one = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, halves=False, **kw)
    two = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, halves=True, **kw)
    assert np.array_equal(one.view(np.uint16), two.view(np.uint16))
    assert _rel(two, _mm_ref(x, ws[0], ws[1], "nf4", bs, k, n, b1)) <= 2.0 ** -10
    assert tc.use_halves(n, k, bs) and not tc.use_halves(n + 1, k, bs)
    assert not tc.use_halves(2, 256, 4096)   # a block over both halves
    x[m - 1, 3] = np.inf             # a non-finite row stays in its row, in both halves
    y = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, halves=True, **kw)
    assert not np.isfinite(y[m - 1]).all() and np.isfinite(y[:m - 1]).all()


@pytest.mark.parametrize("m,n,bias", [(8, 40, True), (9, 41, True), (10, 36, False), (3, 40, True)])
def test_matmulnf4_session_call_on_halves(m, n, bias, monkeypatch):
    """MatMulNF4's CUDA kernel object (as a session calls it; the simulator's launches) on the tensor-core path
    (tensor cores granted, 2 warps per block): from HALVES_MIN_M rows with an even N its one launch takes the
    weight's two halves as W1 / W3, and the recorded native plan patches the second halves' pointers as offsets into
    the packed weight, the absmax and the bias (so a replay with other buffers stays right); the output is the
    one-weight kernel's, bit for bit."""
    if not SIM:
        pytest.skip("stand-in launches over host memory: simulator only")
    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.device import host
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda, nf4tc_cuda as tc
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.runtime.abi import LbPlan
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.runtime.routing import route

    k, bs = 128, 64
    ws, x, b1, _ = _case(m, k, n, bs, "nf4", (bias, False), 12)
    ref = tc.run(x, ws[0], ws[1], None, None, nf4.code("nf4"), bs, k, n, b1, halves=False, warps=2, sms=1)
    monkeypatch.setattr(host, "tensor_cores", lambda simulated=False: True)
    monkeypatch.setattr(tc, "WARPS", 2)         # fewer simulated threads
    monkeypatch.setattr(tc, "RC2_WARPS", 2)
    kern = matmulnf4_cuda.MatMulNF4CudaKernel(spec=domain.OPS["MatMulNF4"], node_name="t",
                                               in_types=(10, 2, 1) + ((10,) if bias else ()), out_types=(10,),
                                               attrs={"quant_type": "nf4", "block_size": bs, "K": k, "N": n})
    halves = tc.use_halves(n, k, bs) and m >= tc.HALVES_MIN_M
    name = route(matmulnf4_cuda.ROUTES, kern.case(m)).kernel
    assert name == f"nf4tc.{'halves.' if halves else ''}rc{2 if m >= tc.RC2_MIN_M else 1}"
    out = np.zeros(m * n, np.float16)

    class Ctx:
        stream, recorder, has_scratch = 7, None, False

        def output(self, index, shape):
            assert tuple(shape) == (m, n)
            if self.recorder is not None:
                self.recorder.output(index, tuple(shape), out.ctypes.data)
            return out.ctypes.data

    arrays = [np.ascontiguousarray(a) for a in [x, ws[0], ws[1]] + ([b1] if bias else [])]
    inputs = [Tensor(a.ctypes.data, et, a.shape) for a, et in zip(arrays, (10, 2, 1, 10))]
    plan = LbPlan()
    plans.compute_and_record(kern, Ctx(), inputs, plan)
    assert plan.valid and plan.n_steps == 1
    assert np.array_equal(out.reshape(m, n).view(np.uint16), ref.view(np.uint16))
    st = plan.steps[0]
    patches = {(st.patch_kind[j], st.patch_index[j], st.patch_off[j]) for j in range(st.n_patch)}
    nh = n // 2
    if halves:      # W3 = bytes nh K / 2 on of the weight, its absmax and bias nh elements on
        assert {(plans.INPUT, 1, nh * k // 2), (plans.INPUT, 2, 4 * nh * k // bs)} <= patches
        assert ((plans.INPUT, 3, 2 * nh) in patches) == bias
    else:
        assert not any(off for kind, _, off in patches if kind == plans.INPUT)
    assert (plans.OUTPUT, 0, 0) in patches

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


CASES = [  # m, k, n, block size, type, biases, warps, chunks per batch, row chunks of 8 per block (None: the
    # default, 2 from M = 9) (simulator: keep M * N small)
    (1, 128, 40, 64, "nf4", (True, True), 2, 1, None),      # 3 tiles, the last partial
    (1, 384, 40, 64, "nf4", (True, True), 2, 2, None),      # 6 chunks: 2 warps x 2 batches of 2, the last partial
    (3, 192, 16, 128, "fp4", (False, True), 2, 1, None),    # 3 chunks over 2 warps: one warp idles on its second
    (3, 192, 16, 128, "fp4", (False, True), 1, 2, None),    # one warp, a batch half past K
    (9, 64, 20, 64, "nf4", (True, False), 1, 2, 1),         # two row chunks in two blocks (the second partial)
    (9, 64, 20, 64, "nf4", (True, False), 1, 2, None),      # both in one block (the second one row)
    (16, 192, 40, 64, "nf4", (False, True), 2, 1, None),    # both whole, 3 tiles, 3 chunks of K over 2 warps
    (1, 256, 16, 4096, "nf4", (False, False), 2, 2, None),  # absmax blocks straddle rows
]


@pytest.mark.parametrize("m,k,n,bs,qt,biases,warps,cpl,rc", CASES)
def test_tc_kernel_vs_reference(m, k, n, bs, qt, biases, warps, cpl, rc):
    tc = _mod()
    ws, x, b1, b3 = _case(m, k, n, bs, qt, biases, 7)
    code = nf4.code(qt)
    s = tc.run(x, *ws, code, bs, k, n, b1, b3, warps=warps, sms=1 if SIM else None, cpl=cpl, rc=rc)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    assert s.shape == ref.shape and _rel(s, ref) <= 2.0 ** -10
    y = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, warps=warps, sms=1 if SIM else None, cpl=cpl, rc=rc)
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
def test_tc_halves_same_bits_as_one_weight(m, k, n, bs, rc, bias, monkeypatch):
    """MatMulNF4 through the two-weight kernel on its weight's two halves of rows (``halves``: W1 = rows 0 .. N/2-1,
    W3 = the rest, written to columns n and N/2 + n) gives the same bits as the one-weight kernel (each column's sums
    run in the same order), within 2^-10 of the reference, and is the default when HALVES is set and N is even."""
    tc = _mod()
    ws, x, b1, _ = _case(m, k, n, bs, "nf4", (bias, False), 9)
    code = nf4.code("nf4")
    kw = dict(warps=2 if SIM else None, sms=1 if SIM else None, rc=rc)
    one = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, halves=False, **kw)
    two = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, halves=True, **kw)
    assert np.array_equal(one.view(np.uint16), two.view(np.uint16))
    assert _rel(two, _mm_ref(x, ws[0], ws[1], "nf4", bs, k, n, b1)) <= 2.0 ** -10
    monkeypatch.setattr(tc, "HALVES", True)
    assert tc.use_halves(n, k, bs) and not tc.use_halves(n + 1, k, bs) and tc.SessionKernels(1, n, 1, k, bs).halves
    assert tc.use_halves(n, k, bs, tc.HALVES_MIN_M) and not tc.use_halves(n, k, bs, tc.HALVES_MIN_M - 1)
    assert not tc.SessionKernels(2, n, 1, k, bs).halves and not tc.use_halves(2, 256, 4096)   # a block over both
    x[m - 1, 3] = np.inf             # a non-finite row stays in its row, in both halves
    y = tc.run(x, ws[0], ws[1], None, None, code, bs, k, n, b1, halves=True, **kw)
    assert not np.isfinite(y[m - 1]).all() and np.isfinite(y[:m - 1]).all()


@pytest.mark.parametrize("halves,m,n,bias", [(True, 8, 40, True), (False, 9, 40, True), (True, 10, 36, False),
                                             (True, 3, 40, True)])
def test_matmulnf4_session_call_on_halves(halves, m, n, bias, monkeypatch):
    """MatMulNF4's CUDA kernel object (as a session calls it, simulator stand-ins for the launches) on the
    tensor-core path: with HALVES, from HALVES_MIN_M rows, its one launch takes the weight's two halves as W1 / W3,
    and the recorded native plan patches the second halves' pointers as offsets into the packed weight, the absmax
    and the bias (so a replay with other buffers stays right); the output is the one-weight kernel's, bit for
    bit."""
    if not SIM:
        pytest.skip("stand-in launches over host memory: simulator only")
    from types import SimpleNamespace

    from onnx_lowbit import domain
    from onnx_lowbit.custom_ops.device import launch as cuda_launch
    from onnx_lowbit.custom_ops.nf4 import matmulnf4_cuda
    from onnx_lowbit.custom_ops.runtime import plans
    from onnx_lowbit.custom_ops.nf4 import nf4tc_cuda as tc
    from onnx_lowbit.custom_ops.runtime.abi import LbPlan
    from onnx_lowbit.custom_ops.runtime.bridge import Tensor
    from onnx_lowbit.custom_ops.device.launch import SimLauncher

    class Sim(SimLauncher):
        def blocks_per_sm(self, block, shmem=None):
            return 2

        def launch(self, grid, block, stream, *args, shmem=None):
            super().launch(grid, block, stream, *args, shmem=tc.TAB_BYTES)

    keep = []

    def to_device(a):
        a = np.ascontiguousarray(a)
        keep.append(a)
        return SimpleNamespace(keep=a, device_ctypes_pointer=SimpleNamespace(value=a.ctypes.data))

    k, bs = 128, 64
    ws, x, b1, _ = _case(m, k, n, bs, "nf4", (bias, False), 12)
    ref = tc.run(x, ws[0], ws[1], None, None, nf4.code("nf4"), bs, k, n, b1, halves=False, warps=2, sms=1)
    monkeypatch.setattr(tc, "HALVES", halves)
    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_launch, "sm_count", lambda device: 1)
    monkeypatch.setattr(matmulnf4_cuda, "tc_device", lambda: True)
    monkeypatch.setattr(matmulnf4_cuda, "_launcher", lambda *a, **kw: None)
    monkeypatch.setattr(matmulnf4_cuda.cuda, "to_device", to_device)
    monkeypatch.setattr(tc, "geometry", lambda rc, g=tc.geometry: (2, g(rc)[1]))     # 2 simulated warps
    monkeypatch.setattr(tc, "launcher", lambda nw, warps, max_registers, cpl, rc, halves=False: Sim(
        tc.make(nw, warps, None, cpl, rc, halves), tc.sig(), empty=0))
    kern = matmulnf4_cuda.MatMulNF4CudaKernel(spec=domain.OPS["MatMulNF4"], node_name="t",
                                               in_types=(10, 2, 1) + ((10,) if bias else ()), out_types=(10,),
                                               attrs={"quant_type": "nf4", "block_size": bs, "K": k, "N": n})
    assert kern.tc is not None and kern.tc.halves == halves
    halves = halves and m >= tc.HALVES_MIN_M
    out = np.zeros(m * n, np.float16)

    class Ctx:
        stream, recorder = 7, None

        def output(self, index, shape):
            assert tuple(shape) == (m, n)
            if self.recorder is not None:
                self.recorder.output(index, tuple(shape), out.ctypes.data)
            return out.ctypes.data

    arrays = [x, ws[0], ws[1]] + ([b1] if bias else [])
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

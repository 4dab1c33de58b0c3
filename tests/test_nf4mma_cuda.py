"""The balanced NF4/FP4 tensor-core GEMV (custom_ops/nf4/nf4mma_cuda.py: FusedFFNNF4's two weights) against
onnx_lowbit's float64 reference, under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, small shapes) or on a real
GPU (ONNX_LOWBIT_REAL_GPU=1). Bar: max |s - ref| / max |ref| <= 2^-9 (the SwiGLU product compounds two 2^-10
errors; 1.04e-3 on one case here, the same bits as nf4tc_cuda's): fp16 X and output, code values rounded to fp16
inside. The grids are chosen so that tiles are finished inside one block, across two blocks and across
several (the per-tile counters, which every launch must leave at zero: ``run`` asserts it). Non-finite X: only
that row is non-finite."""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import ffn, nf4
from test_nf4tc_cuda import _case, _rel

SIM = bool(config.ENABLE_CUDASIM)


def _mod():
    if not SIM and not os.environ.get("ONNX_LOWBIT_REAL_GPU"):
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 or a GPU (ONNX_LOWBIT_REAL_GPU=1)")
    from onnx_lowbit.custom_ops.nf4 import nf4mma_cuda
    return nf4mma_cuda


CASES = [  # m, k, n, block size, type, biases, warps, blocks (None: the plan's); the kernel has slots for 4 rows
    (1, 256, 40, 64, "nf4", (True, True), 2, 4),      # 6 units in 4 blocks: two tiles shared by two blocks
    (1, 256, 40, 64, "nf4", (True, True), 2, 1),      # one block: every tile finished in the block
    (1, 256, 40, 64, "nf4", (False, False), 2, 6),    # one unit per block: every tile shared
    (1, 384, 24, 64, "nf4", (True, False), 2, 2),     # a tile over 3 units: warps idle on the last step
    (1, 512, 16, 64, "fp4", (False, True), 2, 3),     # one tile shared by 3 blocks (counter counts to 3)
    (3, 256, 20, 128, "fp4", (False, True), 2, 3),    # M = 3, last tile partial
    (4, 128, 16, 64, "nf4", (True, True), 1, 1),      # M = 4, one warp, one unit
    (2, 256, 16, 4096, "nf4", (False, False), 2, 2),  # absmax blocks straddle rows
    (1, 256, 40, 64, "nf4", (True, True), 2, None),   # the plan's grid
]


@pytest.mark.parametrize("m,k,n,bs,qt,biases,warps,blocks", CASES)
def test_mma_kernel_vs_reference(m, k, n, bs, qt, biases, warps, blocks):
    mma = _mod()
    ws, x, b1, b3 = _case(m, k, n, bs, qt, biases, 7)
    s = mma.run(x, *ws, nf4.code(qt), bs, k, n, b1, b3, warps=warps, sms=1 if SIM else None, blocks=blocks)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    assert s.shape == ref.shape and _rel(s, ref) <= 2.0 ** -9


def test_mma_kernel_repeat_and_nonfinite_rows():
    """Launches in a row reuse the counters (left at zero) and give the same bits; a NaN in X row 1 makes that
    row, and only it, NaN."""
    mma = _mod()
    ws, x, _, _ = _case(3, 256, 24, 64, "nf4", (False, False), 8)
    x[1, 5] = np.nan
    kw = dict(warps=2, sms=1 if SIM else None, blocks=3)
    s = mma.run(x, *ws, nf4.code("nf4"), 64, 256, 24, **kw)
    s2 = mma.run(x, *ws, nf4.code("nf4"), 64, 256, 24, repeat=2, **kw)
    assert np.array_equal(s.view(np.uint16), s2.view(np.uint16))
    ref = ffn.swiglu_nf4_ref(x, *ws, "nf4", 64, 256, 24, None, None)
    assert np.isnan(s[1]).all() and np.isfinite(s[[0, 2]]).all()
    assert _rel(s[[0, 2]], ref[[0, 2]]) <= 2.0 ** -9


def test_mma_plan():
    mma = _mod()
    assert mma.ok(True, 4, 4096, 11008, 64) and not mma.ok(True, 5, 4096, 11008, 64)
    assert not mma.ok(True, 1, 4032, 11008, 64) and not mma.ok(True, 1, 4096, 11008, 32)
    assert not mma.ok(False, 1, 4096, 11008, 64) and not mma.ok(True, 4, 8192, 1024, 64)   # M * K > 16384
    # one wave at LLaMA-7B's gate/up; more blocks where a range would touch more than TLMAX tiles
    assert mma.plan_blocks(4096, 11008, 132, 2) == 264
    b = mma.plan_blocks(128, 65536, 2, 1)
    assert -(-mma.units(128, 65536) // b) <= (mma.TLMAX - 1) * 1 + 1
    assert mma.plan_blocks(128, 16, 132, 2) == 1


@pytest.mark.parametrize("m", [3, 4])
def test_fusedffnnf4_session_routes_mma(m, monkeypatch):
    """A FusedFFNNF4 node in an onnxruntime CUDA session at M = 3, 4 (fp16) runs this kernel (fusedffnnf4_cuda
    MMA_M; MMA_MIN_KN lowered so that a small weight takes it): outputs against the reference, the same bits on a
    second run (counters left at zero), and the kernel object has it planned."""
    from helpers import lowbit_session, ort_cuda_or_skip
    from test_ffn4_kernels import nf4_model, nf4_weights
    ort_cuda_or_skip()
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda
    monkeypatch.setattr(fusedffnnf4_cuda, "MMA_MIN_KN", 0)
    k, n, bs = 512, 72, 64
    ws = nf4_weights(k, n, bs, "nf4", seed=4)
    rng = np.random.default_rng(m)
    x = (rng.standard_normal((m, k)) + 0.2).astype(np.float16)
    b1 = rng.standard_normal(n).astype(np.float16)
    b3 = rng.standard_normal(n).astype(np.float16)
    sess = lowbit_session(nf4_model((m,), k, n, bs, "nf4", np.float16, ws, b1, b3), ["CUDAExecutionProvider"])
    s1 = sess.run(None, {"x": x})[0]
    s2 = sess.run(None, {"x": x})[0]
    assert np.array_equal(s1.view(np.uint16), s2.view(np.uint16))
    assert _rel(s1, ffn.swiglu_nf4_ref(x, *ws, "nf4", bs, k, n, b1, b3)) <= 2.0 ** -9
    from onnx_lowbit.custom_ops.nf4 import nf4mma_cuda
    assert m in fusedffnnf4_cuda.MMA_M
    assert nf4mma_cuda.WARPS in nf4mma_cuda._launchers

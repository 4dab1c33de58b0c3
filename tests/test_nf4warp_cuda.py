"""The warp-column NF4/FP4 decode kernel (custom_ops/nf4/nf4warp_cuda.py: FusedFFNNF4 at M = 1, 2, fp16 X,
K % 1024 == 0) under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, small grids) or on a real GPU
(ONNX_LOWBIT_REAL_GPU=1).

It does the same fp16 arithmetic as the block decode kernel's packed-fp16 mode with chains of 4 (fusedffnnf4_cuda
h2=4, wide), only the fp32 sums over K are taken in another order, so the SwiGLU face is checked against that kernel
tightly (2^-10 of the largest output: at most an fp16 rounding step apart) and both faces against the
float64 references with the packed-fp16 decode's bar (4 * 2^-10 here: X with a mean and sums with cancellation,
where both kernels measure 2.3e-3 .. 3.1e-3 on such cases against 2.3e-4 for the fp32 decode). The block kernel
runs through FusedFFNNF4's kernel object with the warp-column routes off and WIDE_MIN_K lowered."""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import ffn, nf4
from test_ffn4_kernels import _data, _nf4_setting, _rel, nf4_cuda_call, nf4_weights

SIM = bool(config.ENABLE_CUDASIM)
TOL = 2.0 ** -10


def _block(fc, monkeypatch, x, ws, qt, bs, k, n, b1, b3):
    """FusedFFNNF4's block kernel with chains of 4 and 16 bytes per thread and row (decode.mt*.wide)."""
    with monkeypatch.context() as mp:
        _nf4_setting(fc, mp, "block+wide")
        s, name = nf4_cuda_call(x, ws, qt, bs, k, n, b1, b3)
    assert "wide" in name
    return s


def _mods():
    if not SIM and not os.environ.get("ONNX_LOWBIT_REAL_GPU"):
        pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 or a GPU (ONNX_LOWBIT_REAL_GPU=1)")
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda
    from onnx_lowbit.custom_ops.nf4 import nf4warp_cuda
    return nf4warp_cuda, fusedffnnf4_cuda


CASES = [  # k, n, block size, type, biases, warps per block, blocks (None: one wave), warps per column (split)
    (1024, 7, 64, "nf4", (True, True), 2, 2, 1),       # 4 warps: ranges of 1 and 2 columns
    (2048, 5, 32, "fp4", (False, True), 2, 1, 1),      # 2 chunks, absmax blocks of 32, 3 columns per warp
    (1024, 3, 128, "nf4", (False, False), 2, 2, 1),    # more warps than columns: an empty range
    (3072, 4, 4096, "nf4", (True, False), 1, 2, 1),    # absmax blocks straddle rows; 3 chunks
    (2048, 7, 64, "nf4", (True, True), 4, 1, 2),       # pairs of warps on halves of K: 2 pairs, 3-4 columns each
    (4096, 3, 32, "fp4", (False, True), 2, 2, 2),      # 2 pairs on 3 columns (an empty range), 2 chunks a half
]
GPU_CASES = [
    (2048, 8192, 64, "nf4", (True, True), 8, None, 1),
    (4096, 11008, 64, "nf4", (True, True), 4, None, 1),
    (4096, 11008, 64, "nf4", (True, True), 8, None, 2),
    (5120, 1000, 64, "fp4", (False, True), 8, None, 1),
    (8192, 300, 64, "fp4", (False, True), 12, None, 2),
    (1024, 77, 256, "nf4", (True, False), 6, None, 1),
]


@pytest.mark.parametrize("k,n,bs,qt,biases,warps,blocks,split", CASES + ([] if SIM else GPU_CASES))
def test_warpcols_swiglu(k, n, bs, qt, biases, warps, blocks, split, monkeypatch):
    wc, fc = _mods()
    ws = nf4_weights(k, n, bs, qt, seed=k + 3 * n)
    x, b1, b3 = _data((1,), k, n, np.float16, biases, 3)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    s = wc.run_arrays(x, *ws, qt, bs, k, n, b1, b3, warps=warps, blocks=blocks, split=split)
    assert s.shape == (1, n) and s.dtype == np.float16
    blk = _block(fc, monkeypatch, x, ws, qt, bs, k, n, b1, b3)
    assert _rel(s, blk) <= TOL, _rel(s, blk)
    assert _rel(s, ref) <= 4 * TOL, _rel(s, ref)


TWO_ROWS = [  # k, n, block size, type, biases, warps per block, blocks, split
    (2048, 24, 64, "nf4", (True, True), 2, 2, 1),
    (2048, 21, 32, "fp4", (False, True), 4, 1, 2),
] + ([] if SIM else [(2048, 8192, 64, "nf4", (True, True), 8, None, 2), (4096, 11008, 64, "nf4", (False, False), 8,
                                                                          None, 2)])


@pytest.mark.parametrize("k,n,bs,qt,biases,warps,blocks,split", TWO_ROWS)
def test_warpcols_swiglu_two_rows(k, n, bs, qt, biases, warps, blocks, split, monkeypatch):
    """M = 2 (mt=2: each weight byte's table entry serves both rows), rows of different magnitude (each its own
    power-of-two scale): each row against the block kernel and the reference, against its own largest output."""
    wc, fc = _mods()
    ws = nf4_weights(k, n, bs, qt, seed=k + n)
    x, b1, b3 = _data((2,), k, n, np.float16, biases, 5)
    x[1] *= np.float16(0.01)
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    s = wc.run_arrays(x, *ws, qt, bs, k, n, b1, b3, warps=warps, blocks=blocks, split=split)
    assert s.shape == (2, n)
    blk = _block(fc, monkeypatch, x, ws, qt, bs, k, n, b1, b3)
    for r in range(2):
        assert _rel(s[r], blk[r]) <= TOL, (r, _rel(s[r], blk[r]))
        assert _rel(s[r], ref[r]) <= 4 * TOL, (r, _rel(s[r], ref[r]))


@pytest.mark.parametrize("scale", [2.0 ** -20, 1.0, 30000.0])
def test_warpcols_x_range(scale):
    """X's power-of-two scale (every warp reduces the row's max itself): tiny rows keep their precision, rows near
    fp16's largest value do not overflow the fp16 chains."""
    wc, _ = _mods()
    k, n, bs, qt = 1024, 6, 64, "nf4"
    q1, am1, q3, am3 = nf4_weights(k, n, bs, qt, seed=5)
    am1, am3 = (np.float32(1 / (16 * scale)) * a for a in (am1, am3))
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, k)) * scale / 4
    x[0, 700] = scale                                   # one outlier (in a later lane and chunk) sets the scale
    x = x.astype(np.float16)
    ws = (q1, am1.astype(np.float32), q3, am3.astype(np.float32))
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, None, None)
    s = wc.run_arrays(x, *ws, qt, bs, k, n, blocks=1, warps=2)
    assert np.isfinite(ref).all() and np.isfinite(s).all()
    assert _rel(s, ref) <= 2 * TOL


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_warpcols_nonfinite_x(bad):
    """A NaN or Inf anywhere in X makes every output non-finite, as in the reference."""
    wc, _ = _mods()
    k, n, bs, qt = 1024, 4, 64, "nf4"
    ws = nf4_weights(k, n, bs, qt, seed=8)
    x, b1, b3 = _data((1,), k, n, np.float16, (True, True), 4)
    x[0, 1000] = bad
    ref = ffn.swiglu_nf4_ref(x, *ws, qt, bs, k, n, b1, b3)
    s = wc.run_arrays(x, *ws, qt, bs, k, n, b1, b3, blocks=1, warps=2)
    assert not np.isfinite(ref).any() and not np.isfinite(s).any()


def test_warpcols_refuses_other_shapes():
    wc, _ = _mods()
    ws = nf4_weights(1000, 4, 64, "nf4")
    x = np.ones((1, 1000), np.float16)
    with pytest.raises(ValueError, match="K % 1024"):
        wc.run_arrays(x, *ws, "nf4", 64, 1000, 4)
    assert not wc.ok(3, 1024, True) and wc.ok(2, 1024, True)
    assert not wc.ok(1, 1024, False) and not wc.ok(1, 6144, True) and wc.ok(1, 4096, True)
    assert wc.ok(1, 8192, True, split=2) and not wc.ok(1, 3072, True, split=2)


@pytest.mark.parametrize("threads", [32, 96, 128])
def test_h2_table_build_store_widths_agree(threads):
    """half2.h2_table_src's 16-byte stores (sts4, the default) build the same 32-copy table as 4-byte stores, for
    block sizes that do and do not divide the 256 entries, from the host table and from the 16 code values."""
    _mods()
    if not SIM:
        pytest.skip("simulator only: the 64 KiB table exceeds static shared memory (on a GPU the kernels' tests, "
                    "whose results depend on every entry, cover the build)")
    from numba import cuda, uint32

    from onnx_lowbit.custom_ops.awq import dequantawq_cuda
    from onnx_lowbit.custom_ops.device import half2
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda
    code = nf4.code("nf4").astype(np.float32)
    out = {}
    for from_codes in (False, True):
        lut = half2.code_with_scale(code) if from_codes else fusedffnnf4_cuda.lut_for(code, False, h2=True)
        for vec in (False, True):
            src = ["def build(lut, dst):", "    tab = cuda.shared.array(16384, uint32)",
                   "    tid = uint32(cuda.threadIdx.x)", "    nthreads = uint32(cuda.blockDim.x)",
                   *half2.h2_table_src(from_codes, vec), "    cuda.syncthreads()", "    w = tid",
                   "    while w < uint32(16384):", "        dst[w] = tab[w]", "        w = uint32(w + nthreads)"]
            ns = {"cuda": cuda, "uint32": uint32, "pack_h2": dequantawq_cuda.pack_h2, "sts4": half2.sts4,
                  **{f"U{v}": np.uint32(v) for v in (0, 1, 4, 15, 31, 256)}}
            exec("\n".join(src), ns)  # noqa: S102 - generated from constants only
            dst = cuda.device_array(16384, np.uint32)
            cuda.jit(ns["build"])[1, threads](cuda.to_device(lut), dst)
            out[vec] = dst.copy_to_host().reshape(256, 64)[:, :32]      # copies 32..63 of each entry are unused
        assert np.array_equal(out[True], out[False])
        ent = out[True][:, 0]
        assert np.all(out[True] == ent[:, None])                        # every lane copy holds the entry
        if not from_codes:
            assert np.array_equal(ent, lut[:256])

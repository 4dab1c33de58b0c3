"""FPLUT CUDA kernel against the numpy reference. In CI it runs under Numba's CUDA simulator (small shapes,
NUMBA_ENABLE_CUDASIM=1 set by tests/run.sh); with ONNX_LOWBIT_REAL_GPU=1 on a GPU machine the same tests run on
the device through the direct-launch path (and with larger shapes)."""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import fplut, halfbits

from helpers import SEED, seed_table

SIM = bool(config.ENABLE_CUDASIM)
if not SIM:
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no GPU and the CUDA simulator is off", allow_module_level=True)

from onnx_lowbit.custom_ops.fplut import fplut_cuda  # noqa: E402

SIZES = [1, 3, 4, 5, 31, 257] + ([] if SIM else [65536 * 3 + 1, 1 << 22])


def _cases():
    t = seed_table()
    rng = np.random.default_rng(7)
    allx = halfbits.all_fp16()
    for n in SIZES:
        x16 = allx[rng.integers(0, 65536, n)]
        x32 = (rng.standard_normal(n) * 8).astype(np.float32)
        x32[: min(n, 4)] = np.array([np.nan, np.inf, -np.inf, 1e30], np.float32)[: min(n, 4)]
        yield n, "fp16", x16, False
        yield n, "fp32", x32, False
        yield n, "bf16", halfbits.f32_to_bf16_bits(x32), True
    del t


@pytest.mark.parametrize("n,kind,x,bf16", list(_cases()), ids=lambda v: str(v) if isinstance(v, (int, str)) else "")
def test_kernel_matches_reference(n, kind, x, bf16):
    t = seed_table()
    y = fplut_cuda.run_arrays(x, t.cut_points, t.values, bf16=bf16, block=32 if SIM else fplut_cuda.BLOCK)
    ref = fplut.apply(x, SEED, t.values, bf16=bf16)
    assert np.array_equal(y.view(np.uint8), ref.view(np.uint8))


@pytest.mark.skipif(SIM, reason="exhaustive fp16 sweep only on a real GPU (the simulator is too slow)")
def test_exhaustive_fp16_on_gpu():
    t = seed_table()
    x = halfbits.all_fp16().copy()
    y = fplut_cuda.run_arrays(x, t.cut_points, t.values)
    assert np.array_equal(y.view(np.uint16), fplut.apply(x, SEED, t.values).view(np.uint16))


def test_multi_block_grid_stride():
    """More words than one pass of the grid covers: exercises the pipelined loop and the tail together."""
    t = seed_table()
    n = 4 * 32 * 2 * fplut_cuda.UNROLL * 3 + 3 if SIM else (1 << 24) + 3
    x = (np.random.default_rng(3).standard_normal(n) * 4).astype(np.float16)
    y = fplut_cuda.run_arrays(x, t.cut_points, t.values, sms=2 if SIM else None, block=32 if SIM else fplut_cuda.BLOCK)
    assert np.array_equal(y.view(np.uint16), fplut.apply(x, SEED, t.values).view(np.uint16))


if os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1" and SIM:  # pragma: no cover
    raise RuntimeError("ONNX_LOWBIT_REAL_GPU=1 but the CUDA simulator is on")

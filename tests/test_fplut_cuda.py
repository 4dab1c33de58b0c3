"""FPLUT CUDA kernel against the numpy reference, called as a session node calls it (runtime.direct.call: the
kernel object's compute, its ROUTES and launches). In CI it runs under Numba's CUDA simulator (small shapes,
NUMBA_ENABLE_CUDASIM=1 set by tests/run.sh); with ONNX_LOWBIT_REAL_GPU=1 on a GPU machine the same tests run on
the device (and with larger shapes)."""
import os

import numpy as np
import pytest
from numba import config

from onnx_lowbit import fplut, halfbits

from helpers import SEED, direct_run, seed_table

SIM = bool(config.ENABLE_CUDASIM)
if not SIM:
    from numba import cuda
    if not cuda.is_available():
        pytest.skip("no GPU and the CUDA simulator is off", allow_module_level=True)

from onnx_lowbit.custom_ops.fplut import fplut_cuda  # noqa: E402
from onnx_lowbit.custom_ops.runtime import direct, routing  # noqa: E402

SIZES = [1, 3, 4, 5, 31, 257] + ([] if SIM else [65536 * 3 + 1, 1 << 22])


def run(x, table, bf16=False, sms=None):
    """FPLUT on host array ``x`` (bf16: uint16 bits read as bfloat16) through direct.call."""
    attrs = {"function": "silu", "cut_points": list(table.cut_points), "table": table.values.astype(np.float32)}
    setup = None if sms is None else (lambda k: setattr(k, "sms", sms))
    out = (x.shape, x.dtype, 16) if bf16 else (x.shape, x.dtype)
    (y,) = direct_run("FPLUT", attrs, [direct.typed(x, 16) if bf16 else x], [out], setup=setup)
    return y


def _cases():
    rng = np.random.default_rng(7)
    allx = halfbits.all_fp16()
    for n in SIZES:
        x16 = allx[rng.integers(0, 65536, n)]
        x32 = (rng.standard_normal(n) * 8).astype(np.float32)
        x32[: min(n, 4)] = np.array([np.nan, np.inf, -np.inf, 1e30], np.float32)[: min(n, 4)]
        yield n, "fp16", x16, False
        yield n, "fp32", x32, False
        yield n, "bf16", halfbits.f32_to_bf16_bits(x32), True


@pytest.mark.parametrize("n,kind,x,bf16", list(_cases()), ids=lambda v: str(v) if isinstance(v, (int, str)) else "")
def test_kernel_matches_reference(n, kind, x, bf16):
    t = seed_table()
    y = run(x, t, bf16)
    ref = fplut.apply(x, SEED, t.values, bf16=bf16)
    assert np.array_equal(y.view(np.uint8), ref.view(np.uint8))


@pytest.mark.skipif(SIM, reason="exhaustive fp16 sweep only on a real GPU (the simulator is too slow)")
def test_exhaustive_fp16_on_gpu():
    t = seed_table()
    x = halfbits.all_fp16().copy()
    y = run(x, t)
    assert np.array_equal(y.view(np.uint16), fplut.apply(x, SEED, t.values).view(np.uint16))


def test_multi_block_grid_stride():
    """More words than one pass of the grid covers: exercises the pipelined loop and the tail together."""
    t = seed_table()
    n = 4 * fplut_cuda.BLOCK * 2 * fplut_cuda.UNROLL * 3 + 3 if SIM else (1 << 24) + 3
    x = (np.random.default_rng(3).standard_normal(n) * 4).astype(np.float16)
    assert fplut_cuda.grid_for(n, 4, 2) == 2 or not SIM                     # two blocks, each striding
    y = run(x, t, sms=2 if SIM else None)
    assert np.array_equal(y.view(np.uint16), fplut.apply(x, SEED, t.values).view(np.uint16))


def test_routes():
    """The table read from the old code: the 16-bit kernel for fp16 and bf16 X, the fp32 kernel for fp32 X; every
    kernel it names has a launcher."""
    name = lambda elem: routing.route(fplut_cuda.ROUTES, fplut_cuda.case(elem, 1000)).kernel  # noqa: E731
    assert (name(10), name(16), name(1)) == ("fplut16", "fplut16", "fplut32")
    assert routing.kernels(fplut_cuda.ROUTES) == ["fplut16", "fplut32"] == list(fplut_cuda.KERNELS)
    for k in routing.kernels(fplut_cuda.ROUTES):
        assert fplut_cuda.launcher(k) is fplut_cuda.launcher(k)


if os.environ.get("ONNX_LOWBIT_REAL_GPU") == "1" and SIM:  # pragma: no cover
    raise RuntimeError("ONNX_LOWBIT_REAL_GPU=1 but the CUDA simulator is on")

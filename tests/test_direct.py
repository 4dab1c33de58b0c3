"""custom_ops.runtime.direct: a CUDA kernel object called as a session node calls it (for benchmarks).

On the CPU: element types from __cuda_array_interface__, the op variant the bridge would bind, the context's output
and scratch. On the GPU machine (ONNX_LOWBIT_REAL_GPU=1): MatMulNF4 at M = 1, 2, 5 and FusedFFNNF4 at M = 1 through
``direct.call`` against the references, and the launch it takes at M = 2 is the two-row decode sessions take."""
import os

import numpy as np
import pytest

from onnx_lowbit import nf4
from onnx_lowbit.custom_ops.runtime import direct


class _Dev:
    """A stand-in device array: only __cuda_array_interface__."""

    def __init__(self, dtype, shape, ptr=4096):
        self.__cuda_array_interface__ = {"data": (ptr, False), "typestr": np.dtype(dtype).str,
                                         "shape": tuple(shape), "version": 3}


def test_describe_types():
    assert direct.describe(_Dev(np.float16, (2, 8), 64)) == (64, 10, (2, 8))
    assert direct.describe(_Dev(np.uint8, (5,)))[1] == 2
    assert direct.describe(_Dev(np.int32, (3, 1)))[1] == 6
    with pytest.raises(TypeError, match="complex64"):
        direct.describe(_Dev(np.complex64, (1,)))


def test_kernel_binds_the_variant(monkeypatch):
    made = []

    class K:
        def __init__(self, **kw):
            made.append(kw)
    monkeypatch.setattr(direct, "kernel_class", lambda op, face: K)
    attrs = {"quant_type": "nf4", "block_size": 64, "K": 64, "N": 8}
    direct.kernel("MatMulNF4", attrs, [_Dev(np.float16, (1, 64)), _Dev(np.uint8, (256,)), _Dev(np.float32, (8,))],
                  [_Dev(np.float16, (1, 8))])
    assert made[-1]["in_types"] == (10, 2, 1, 10) and made[-1]["out_types"] == (10,)
    direct.kernel("MatMulNF4", attrs, [_Dev(np.float32, (1, 64)), _Dev(np.uint8, (256,)), _Dev(np.float32, (8,))],
                  [_Dev(np.float32, (1, 8))])
    assert made[-1]["in_types"] == (1, 2, 1, 1)
    with pytest.raises(TypeError, match="no variant"):
        direct.kernel("MatMulNF4", attrs, [_Dev(np.float16, (1, 64)), _Dev(np.int32, (64,)), _Dev(np.float32, (8,))],
                      [_Dev(np.float16, (1, 8))])


def test_context_output_and_stream():
    ctx = direct.Context(lambda: 7, [_Dev(np.float16, (2, 3), 512)])
    assert ctx.stream == 7 and ctx.output_count() == 1
    assert ctx.output(0, (1, 2, 3)) == 512
    with pytest.raises(ValueError, match="output 0"):
        ctx.output(0, (2, 4))
    assert ctx.scratch(0) == 0


def _gpu():
    if os.environ.get("ONNX_LOWBIT_REAL_GPU") != "1":
        pytest.skip("GPU machine only (ONNX_LOWBIT_REAL_GPU=1)")
    from numba import config
    if config.ENABLE_CUDASIM:
        pytest.skip("raw-pointer launches do not run under the simulator")
    from numba import cuda
    return cuda


@pytest.mark.parametrize("m", [1, 2, 5])
def test_matmulnf4_call_on_gpu(m):
    cuda = _gpu()
    k, n, bs = 4096, 96, 64
    rng = np.random.default_rng(m)
    q, am = nf4.quantize(rng.standard_normal((k, n)).astype(np.float32), "nf4", bs)
    a = rng.standard_normal((m, k)).astype(np.float16)
    dev = [cuda.to_device(v) for v in (a, q.reshape(-1), am.reshape(-1).astype(np.float32))]
    y = cuda.device_array((m, n), np.float16)
    run = direct.call("MatMulNF4", {"quant_type": "nf4", "block_size": bs, "K": k, "N": n}, dev, [y], 0)
    run()
    cuda.synchronize()
    ref = nf4.matmul(a, q, am, "nf4", bs, k, n, None).astype(np.float64)
    got = y.copy_to_host().astype(np.float64)
    assert np.max(np.abs(got - ref)) <= 2e-3 * np.max(np.abs(ref))
    if m == 2:      # the launch sessions take at M = 2 (K = 4096, fp16): the two-row decode
        from onnx_lowbit.custom_ops.nf4.matmulnf4_cuda import ROUTES
        from onnx_lowbit.custom_ops.runtime.routing import route
        assert route(ROUTES, run.kernel.case(m)).kernel == "m2"


def test_fusedffnnf4_call_on_gpu():
    cuda = _gpu()
    from onnx_lowbit import ffn
    k, n, bs = 4096, 64, 64
    rng = np.random.default_rng(3)
    w = [nf4.quantize(rng.standard_normal((k, n)).astype(np.float32), "nf4", bs) for _ in range(2)]
    x = rng.standard_normal((1, k)).astype(np.float16)
    dev = [cuda.to_device(x)] + [cuda.to_device(v.reshape(-1).astype(np.float32) if v.dtype != np.uint8 else
                                                v.reshape(-1)) for pair in w for v in pair]
    s = cuda.device_array((1, n), np.float16)
    run = direct.call("FusedFFNNF4", {"quant_type": "nf4", "block_size": bs, "K": k, "N": n}, dev, [s], 0)
    run()
    cuda.synchronize()
    ref = ffn.swiglu_nf4_ref(x, *w[0], *w[1], "nf4", bs, k, n)
    got = s.copy_to_host().astype(np.float64)
    assert np.max(np.abs(got - ref)) <= 2e-3 * np.max(np.abs(ref))

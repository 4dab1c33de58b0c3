"""device/jit.variant: the CPU kernels compiled both serial and parallel=True keep their compiled code in separate
Numba cache files (Numba's cache keys neither by the options, numba/numba#6845: a later process would load one
variant's code for both; QuantGRU's serial recurrence then ran the parallel code, ~20 us more per call)."""
import numpy as np
import pytest
from numba import njit, prange

from onnx_lowbit.custom_ops.device.jit import variant


def _index(disp):
    """The file name of a Numba dispatcher's cache index (named after its function's qualname)."""
    return disp._cache._cache_file._index_name


def _sum_sq(x):
    s = 0.0
    for i in prange(x.shape[0]):
        s += x[i] * x[i]
    return s


def test_variant_is_the_same_function_under_another_name():
    serial, parallel = variant(_sum_sq, "serial"), variant(_sum_sq, "parallel")
    assert serial.__name__ == "_sum_sq__serial" and parallel.__qualname__ == "_sum_sq__parallel"
    assert serial.__module__ == _sum_sq.__module__ and serial.__doc__ == _sum_sq.__doc__
    x = np.arange(10.0)
    assert serial(x) == parallel(x) == _sum_sq(x) == 285.0
    assert _sum_sq.__name__ == "_sum_sq"                    # the original untouched
    js, jp = njit(cache=True)(serial), njit(parallel=True, cache=True)(parallel)
    assert js(x) == jp(x) == 285.0
    assert _index(js) != _index(jp)


def _pairs():
    from onnx_lowbit.custom_ops.attention import kvattention_cpu, rmsnorm_cpu, rotary_cpu, rotarykv_cpu
    from onnx_lowbit.custom_ops.awq import dequantawq_cpu
    from onnx_lowbit.custom_ops.gru import quantgru_steps as q
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cpu
    yield "quantgru input_proj", q.input_proj, q.input_proj_parallel
    yield "quantgru recurrence", q.recurrence, q.recurrence_parallel
    yield "quantgru proj_packed", q.proj_packed, q.proj_packed_parallel
    yield "quantgru recurrence_packed", q.recurrence_packed, q.recurrence_packed_parallel
    yield "quantgru recurrence_direct", q.recurrence_direct, q.recurrence_direct_parallel
    yield "kvattention", *kvattention_cpu.KERNELS
    yield "dequantnf4 rows", dequantnf4_cpu.rows_serial, dequantnf4_cpu.dequant_rows
    yield "dequantnf4 cols", dequantnf4_cpu.cols_serial, dequantnf4_cpu.dequant_t
    yield "dequantawq rows", dequantawq_cpu.rows_serial, dequantawq_cpu.dequant_rows_f16bits
    for mod in (rotary_cpu, rotarykv_cpu, rmsnorm_cpu):
        fn = lambda x: x  # noqa: E731 - any plain function: _compile's naming is what is checked
        yield mod.__name__, mod._compile(fn, False), mod._compile(fn, True)


@pytest.mark.parametrize("name,serial,parallel", list(_pairs()), ids=lambda v: v if isinstance(v, str) else "")
def test_serial_and_parallel_kernels_have_their_own_cache_files(name, serial, parallel):
    assert not serial.targetoptions.get("parallel") and parallel.targetoptions.get("parallel"), name
    assert _index(serial) != _index(parallel), name

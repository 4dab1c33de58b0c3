"""cuda_launch.Launcher's occupancy query, against a stand-in driver (no GPU needed): the kernel is opted in to
its dynamic shared memory before the driver is asked (without it the answer above 48 KiB is 0: FusedFFNNF4 once
planned 1 block per SM instead of 3 that way), and the query takes the CUfunction of a CUkernel handle."""
import ctypes

import pytest

from onnx_lowbit.custom_ops.device import launch as cuda_launch
from onnx_lowbit.custom_ops.device.launch import Launcher


class FakeDriver:
    def __init__(self, kernel_is_function=False):
        self.calls = []
        self.kernel_is_function = kernel_is_function

    def cuKernelSetAttribute(self, attr, value, handle, device):  # noqa: N802
        self.calls.append(("opt-in", value, handle.value, device))
        return 0

    def cuKernelGetFunction(self, out, handle):  # noqa: N802
        if self.kernel_is_function:
            return 1                      # CUDA_ERROR_INVALID_VALUE: the handle is a CUfunction already
        out._obj.value = handle.value + 1
        return 0

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, n, func, block, shmem):  # noqa: N802
        self.calls.append(("query", func.value, block, shmem))
        n._obj.value = 3 if ("opt-in", 64 * 1024, 0x1000, 0) in self.calls else 0
        return 0


def _launcher(dynamic_shared):
    lau = object.__new__(Launcher)           # no compiled kernel needed for the query
    lau.handle, lau.dynamic_shared, lau._configured = ctypes.c_void_p(0x1000), dynamic_shared, set()
    return lau


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_launch, "libcuda", lambda: fake)
    monkeypatch.setattr(cuda_launch, "current_device", lambda: 0)
    return fake


def test_blocks_per_sm_opts_in_first_and_asks_with_the_launchers_shared_memory(driver):
    lau = _launcher(64 * 1024)
    assert lau.blocks_per_sm(128) == 3
    assert driver.calls == [("opt-in", 65536, 0x1000, 0), ("query", 0x1001, 128, 65536)]
    assert lau.blocks_per_sm(256, 1024) == 3                  # opted in once per device; shmem as given
    assert driver.calls[2:] == [("query", 0x1001, 256, 1024)]


def test_blocks_per_sm_below_48k_needs_no_opt_in_and_takes_a_cufunction_as_is(driver):
    driver.kernel_is_function = True
    lau = _launcher(16 * 1024)
    assert lau.blocks_per_sm(64, 0) == 0                      # the stand-in answers 0 without the 64 KiB opt-in
    assert driver.calls == [("query", 0x1000, 64, 0)]


def test_arg_turns_device_arrays_into_pointer_and_size():
    """cuda_launch.arg (the host runners' launch arguments): a device array -> (pointer, (size,)); scalars and ready
    (pointer, shape) pairs unchanged."""
    from types import SimpleNamespace

    from onnx_lowbit.custom_ops.device.launch import arg
    dev = SimpleNamespace(device_ctypes_pointer=SimpleNamespace(value=0x7F00_0000_1000), size=96)
    assert arg(dev) == (0x7F00_0000_1000, (96,))
    assert arg(7) == 7 and arg((0x1000, (3,))) == (0x1000, (3,))

"""Host side of launching the AWQ kernels, on a GPU or under Numba's CUDA simulator: the SM count, whether the GPU
has the tensor-core instructions the kernels use, and the launcher of a compiled kernel.

Under the simulator (tests, CI) the kernel objects run as sessions run them, through device/launch.SimLauncher
over host memory, planned for SIM_SMS SMs with SIM_BLOCKS_PER_SM resident blocks each, and with tensor cores (the
simulator emulates mma.sync: device/mma.py). Both answers would belong in device/ (SimLauncher has no occupancy
query, device/target.tc_device no simulator answer); they live here until the device layer's owner takes them.
"""
from __future__ import annotations

from ..device import launch as cuda_launch
from ..device.launch import Launcher, SimLauncher
from ..device.target import SIM, tc_device

SIM_SMS = 2                 # what the simulator plans for: small grids (a Python thread per CUDA thread)
SIM_BLOCKS_PER_SM = 4


def _sim_blocks_per_sm(block, shmem=None):
    return SIM_BLOCKS_PER_SM


def launcher_for(fn, signature):
    """The launcher of the Numba kernel ``fn`` for ``signature`` (compiled now on a GPU); ``.dispatcher`` is ``fn``
    (benchmarks read its registers). Under the simulator a SimLauncher, strict (a null or empty argument is an
    empty array: a kernel that reads one fails), given the occupancy query the AWQ plans ask for."""
    if SIM:
        lau = SimLauncher(fn, signature, empty=0)
        lau.blocks_per_sm = _sim_blocks_per_sm
    else:
        lau = Launcher(fn, signature)
    lau.dispatcher = fn
    return lau


def sm_count():
    """The current device's SM count (SIM_SMS under the simulator)."""
    return SIM_SMS if SIM else cuda_launch.sm_count(cuda_launch.current_device())


def has_tc():
    """Whether the current device has mma.sync m16n8k16 (compute capability >= 8.0; the simulator emulates it)."""
    return True if SIM else tc_device()

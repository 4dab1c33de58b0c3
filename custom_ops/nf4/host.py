"""Host-side helpers the NF4 kernel classes (MatMulNF4, FusedFFNNF4) share, on the GPU and under Numba's CUDA
simulator alike, so that tests call the ops' kernel objects (runtime/direct.py) under the simulator as sessions call
them on a GPU: launchers (``launcher``: device/launch.Launcher, or under the simulator a SimLauncher that answers
a fixed occupancy), small device tables (``Table``), the SM count, whether the GPU has the tensor-core
instructions, and the alignment of a call's buffers.

Kept in nf4/ (not device/) for now: device/launch.SimLauncher has no ``blocks_per_sm`` and the simulator's device
arrays have no ``device_ctypes_pointer``; what this module adds could move there."""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..device import launch as cuda_launch, target
from ..device.launch import Launcher, SimLauncher
from ..device.target import SIM

SIM_SMS = 2     # SMs the kernel classes plan for under the simulator


class _SimLauncher(SimLauncher):
    """SimLauncher with the Launcher's ``blocks_per_sm`` (a fixed answer: the simulator has no occupancy)."""

    def __init__(self, fn, signature, dynamic_shared, sim_blocks):
        super().__init__(fn, signature)
        self.dynamic_shared, self.sim_blocks = dynamic_shared, sim_blocks

    def blocks_per_sm(self, block, shmem=None):
        return self.sim_blocks

    def launch(self, grid, block, stream, *args, shmem=None):
        super().launch(grid, block, stream, *args, shmem=self.dynamic_shared if shmem is None else shmem)


def launcher(fn, signature, dynamic_shared=0, sim_blocks=1):
    """A direct-launch wrapper of kernel ``fn`` (``.dispatcher``: fn); under the simulator a SimLauncher whose
    ``blocks_per_sm`` answers ``sim_blocks``."""
    lau = _SimLauncher(fn, signature, dynamic_shared, sim_blocks) if SIM else \
        Launcher(fn, signature, dynamic_shared=dynamic_shared)
    lau.dispatcher = fn
    return lau


class Table:
    """A read-only array the kernel object keeps on the device for its lifetime (code values, decode tables):
    ``arg`` is the (pointer, (size,)) pair launches take. Under the simulator the host array itself."""

    def __init__(self, host):
        host = np.ascontiguousarray(host)
        if SIM:
            self._keep, ptr = host, host.ctypes.data
        else:
            self._keep = cuda.to_device(host)
            ptr = self._keep.device_ctypes_pointer.value
        self.ptr, self.size = ptr, host.size
        self.arg = (ptr, (host.size,))


def sm_count():
    """SMs of the current device (SIM_SMS under the simulator)."""
    return SIM_SMS if SIM else cuda_launch.sm_count(cuda_launch.current_device())


def tc_device():
    """Whether the GPU has mma.sync m16n8k16 (compute capability >= 8.0); never under the simulator."""
    return not SIM and target.tc_device()


def alignment(*ptrs, cap=16):
    """The largest power of two up to ``cap`` that divides every pointer (0 counts as aligned)."""
    a = cap
    for p in ptrs:
        while a > 1 and p % a:
            a //= 2
    return a

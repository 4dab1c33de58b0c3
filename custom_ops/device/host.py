"""Host side of launching a family's kernels, on a GPU or under Numba's CUDA simulator alike, so that tests call an
op's kernel object (runtime/direct.py) under the simulator as sessions call it on a GPU.

- ``launcher``: device/launch.Launcher on a GPU; under the simulator a SimLauncher that also answers the
  occupancy query (``blocks_per_sm``: a fixed number, the simulator has no occupancy) and applies the kernel's
  dynamic shared memory.
- ``Table``: a read-only array a kernel object keeps on the device for its lifetime (code values, decode tables).
- ``sm_count``: the current device's SMs (SIM_SMS under the simulator: small grids, a Python thread per CUDA thread).
- ``tensor_cores``: whether the GPU has mma.sync m16n8k16 (compute capability >= 8.0); under the simulator the
  caller's answer (device/mma.py emulates the instruction, but a family may route its tensor-core kernels off there).
- ``alignment``: the largest power of two that divides a call's pointers.

Used by the NF4 and AWQ families (nf4/, awq/, ffn/fusedffn{nf4,awq}_cuda.py).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import launch as cuda_launch, target
from .launch import Launcher, SimLauncher
from .target import SIM

SIM_SMS = 2     # SMs the kernel objects plan for under the simulator


class _SimLauncher(SimLauncher):
    """SimLauncher with the Launcher's ``blocks_per_sm`` (a fixed answer) and a default dynamic shared size."""

    def __init__(self, fn, signature, dynamic_shared, sim_blocks, empty):
        super().__init__(fn, signature, empty=empty)
        self.dynamic_shared, self.sim_blocks = dynamic_shared, sim_blocks

    def blocks_per_sm(self, block, shmem=None):
        return self.sim_blocks

    def launch(self, grid, block, stream, *args, shmem=None, pdl=True):
        super().launch(grid, block, stream, *args, shmem=self.dynamic_shared if shmem is None else shmem)


def launcher(fn, signature, dynamic_shared=0, sim_blocks=1, sim_empty=1, pdl=False):
    """A direct-launch wrapper of kernel ``fn`` (``.dispatcher``: fn, benchmarks read its registers). Under the
    simulator a SimLauncher whose ``blocks_per_sm`` answers ``sim_blocks``; ``sim_empty``: what a null pointer or an
    empty array becomes there (SimLauncher's ``empty``: 0 is strict, a kernel that reads it fails). ``pdl``: the
    kernel keeps device/pdl.py's contract (Launcher's ``pdl``; nothing under the simulator)."""
    if SIM:
        lau = _SimLauncher(fn, signature, dynamic_shared, sim_blocks, sim_empty)
    else:
        lau = Launcher(fn, signature, dynamic_shared=dynamic_shared, pdl=pdl)
    lau.dispatcher = fn
    return lau


class Table:
    """A read-only array the kernel object keeps on the device for its lifetime: ``arg`` is the (pointer, (size,))
    pair launches take. Under the simulator the host array itself."""

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


def tensor_cores(simulated=False):
    """Whether the GPU has mma.sync m16n8k16 (compute capability >= 8.0); ``simulated`` under the simulator."""
    return simulated if SIM else target.tc_device()


def alignment(*ptrs, cap=16):
    """The largest power of two up to ``cap`` that divides every pointer (0 counts as aligned)."""
    a = cap
    for p in ptrs:
        while a > 1 and p % a:
            a //= 2
    return a

"""Constants of the AWQ tensor-core decode (the nibbles as exact fp16 subnormals fed to mma.sync, matmulawq1_cuda):
the PRMT selectors (TC_SEL), the nibble masks of a packed half2 (LO16, HI16), fp16 ones (ONES16) and the powers of
two that undo the subnormal scaling; and the host side of launching the AWQ kernels (device/host with the AWQ
answers under the simulator)."""
from __future__ import annotations

import numpy as np

from ..device import host

LO16 = np.uint32(0x000F000F)
HI16 = np.uint32(0x00F000F0)
ONES16 = np.uint32(0x3C003C00)
TC_SEL = tuple(np.uint32(b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)) for b in range(4))
F2P24, F2P20 = np.float32(2.0 ** 24), np.float32(2.0 ** 20)

SIM_BLOCKS_PER_SM = 4       # the occupancy the AWQ plans assume under the simulator (device/host.launcher)


def launcher_for(fn, signature):
    """The launcher of an AWQ kernel (device/host.launcher): under the simulator strict (a null or empty argument is
    an empty array: a kernel that reads one fails) and answering SIM_BLOCKS_PER_SM blocks per SM."""
    return host.launcher(fn, signature, sim_blocks=SIM_BLOCKS_PER_SM, sim_empty=0)


def has_tc():
    """Tensor cores for the AWQ GEMV: on GPUs with compute capability >= 8.0, and under the simulator (device/mma.py
    emulates mma.sync there, so the kernel objects route as on an H100)."""
    return host.tensor_cores(simulated=True)

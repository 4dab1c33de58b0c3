"""Activations shared by the fused FFN kernels: fp32 ``silu`` (SiLU(z) = z / (1 + exp(-z))), GPU and CUDA-simulator
versions. (The tensor-core and 4-bit decode kernels use device/mma.py's ``silu``.)"""
from __future__ import annotations

import math as _m

import numpy as np
from numba import float32

from .target import SIM, device

F1 = np.float32(1.0)

if SIM:
    def silu(z):
        z = np.float32(z)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.float32(z / (F1 + np.exp(-z)))
else:
    @device
    def silu(z):
        return z / (float32(1.0) + _m.exp(-z))

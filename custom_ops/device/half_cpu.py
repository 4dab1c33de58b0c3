"""fp16 / bf16 conversions for the Numba CPU kernels (Numba has no float16 arithmetic on the CPU): the integer
round-to-nearest-even bit code of onnx_lowbit.halfbits compiled inline, plus value-level helpers for kernels that
compute in fp32 registers over float16 arrays held as uint16 bits."""
from __future__ import annotations

import numpy as np
from numba import njit

from onnx_lowbit import halfbits

f32_to_f16 = njit(inline="always")(halfbits.f32bits_to_f16bits)     # fp32 bits -> fp16 bits (RNE)
f16_to_f32 = njit(inline="always")(halfbits.f16bits_to_f32bits)     # fp16 bits -> fp32 bits (exact)
f32_to_bf16 = njit(inline="always")(halfbits.f32bits_to_bf16bits)   # fp32 bits -> bf16 bits (RNE)


@njit(inline="always")
def h2f(h):
    """fp16 bits -> float32 value."""
    return np.uint32(f16_to_f32(h)).view(np.float32)


@njit(inline="always")
def f2h(v):
    """float32 value -> fp16 bits (RNE)."""
    return np.uint16(f32_to_f16(np.float32(v).view(np.uint32)))

"""fp16 / bf16 conversions for the Numba CPU kernels (branch-free ones that LLVM vectorises at the end: f16_index,
f32_bits, widen_f16) (Numba has no float16 arithmetic on the CPU): the integer
round-to-nearest-even bit code of onnx_lowbit.halfbits compiled inline, plus value-level helpers for kernels that
compute in fp32 registers over float16 arrays held as uint16 bits."""
from __future__ import annotations

import numpy as np
from numba import njit

from onnx_lowbit import halfbits

f32_to_f16 = njit(inline="always")(halfbits.f32bits_to_f16bits)     # fp32 bits -> fp16 bits (RNE)
f16_to_f32 = njit(inline="always")(halfbits.f16bits_to_f32bits)     # fp16 bits -> fp32 bits (exact)
f32_to_bf16 = njit(inline="always")(halfbits.f32bits_to_bf16bits)   # fp32 bits -> bf16 bits (RNE)
_P112 = np.float32(2.0 ** 112)
_M110 = np.float32(2.0 ** -110)


@njit(inline="always")
def h2f(h):
    """fp16 bits -> float32 value."""
    return np.uint32(f16_to_f32(h)).view(np.float32)


@njit(inline="always")
def f2h(v):
    """float32 value -> fp16 bits (RNE)."""
    return np.uint16(f32_to_f16(np.float32(v).view(np.uint32)))


@njit(inline="always")
def f16_index(w, v):
    """fp16 bit pattern (RNE) of the float32 ``v`` whose bits are ``w`` (uint32); NaN -> 0x7E00 | sign (the map
    sends every NaN to the same NaN). Branch-free: the scaled sum rounds the mantissa in the FPU."""
    base = (abs(v) * _P112) * _M110
    shl1 = np.uint32(w + w)
    bias = shl1 & np.uint32(0xFF000000)
    if bias < np.uint32(0x71000000):
        bias = np.uint32(0x71000000)
    base = np.uint32((bias >> np.uint32(1)) + np.uint32(0x07800000)).view(np.float32) + base
    bits = np.float32(base).view(np.uint32)
    nonsign = ((bits >> np.uint32(13)) & np.uint32(0x7C00)) + (bits & np.uint32(0x0FFF))
    if shl1 > np.uint32(0xFF000000):
        nonsign = np.uint32(0x7E00)
    return np.uint32(((w & np.uint32(0x80000000)) >> np.uint32(16)) | nonsign)


@njit(inline="always")
def f32_bits(h):
    """float32 bit pattern of the fp16 pattern ``h`` (exact for all 65,536, NaN payloads kept), branch-free."""
    h = np.uint32(h)
    mag = np.uint32((h & np.uint32(0x7FFF)) << np.uint32(13))
    bits = np.float32(mag.view(np.float32) * _P112).view(np.uint32)
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
        bits = np.uint32(0x7F800000) | mag
    return np.uint32(bits | ((h & np.uint32(0x8000)) << np.uint32(16)))


@njit(cache=True, nogil=True, boundscheck=False)
def widen_f16(h, out):
    """out[i] = float32 bits of the fp16 bits h[i] (1-D C arrays, uint16 -> uint32), vectorised (f32_bits): 7x
    faster than numpy's float16 -> float32 cast (MatMulAWQ's scales, each call)."""
    for i in range(h.size):
        out[i] = f32_bits(h[i])

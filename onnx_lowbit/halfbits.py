"""Bit-level float16 / bfloat16 helpers shared by the numpy reference and the kernels.

numpy has no bfloat16, so bf16 tensors travel as uint16 bit patterns everywhere in this package.
The scalar functions at the bottom are plain Python on integers so that both Numba targets (CPU ``njit`` and
``cuda.jit(device=True)``) can compile the very same code.
"""
from __future__ import annotations

import numpy as np

FP16_MAX = 65504.0


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even; NaN stays NaN (quiet)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    return np.where(nan, ((u >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16), rounded)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def all_fp16() -> np.ndarray:
    """All 65,536 float16 values in bit-pattern order (NaN and Inf included)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)


def finite_fp16() -> np.ndarray:
    """The 63,488 finite float16 values (both zeros), in bit-pattern order."""
    x = all_fp16()
    return x[np.isfinite(x)]


def is_fp16_exact(values) -> bool:
    v = np.asarray(values, dtype=np.float64)
    return bool(np.all(np.isfinite(v)) and np.array_equal(v.astype(np.float16).astype(np.float64), v))


def ulp_distance_fp16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in fp16 units in the last place between two fp16 arrays (monotone integer mapping)."""
    def key(h):
        bits = np.asarray(h, dtype=np.float16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(key(a) - key(b))


# ---- scalar bit conversions (compiled by Numba for CPU and CUDA; semantics = IEEE round to nearest even) ----

def f32bits_to_f16bits(u):
    """uint32 float32 bit pattern -> uint16 float16 bit pattern (RNE, overflow -> Inf, NaN -> quiet NaN)."""
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a >= 0x7F800000:  # Inf or NaN
        if a > 0x7F800000:
            return sign | 0x7E00 | ((a >> 13) & 0x1FF)
        return sign | 0x7C00
    if a >= 0x477FF000:  # rounds to >= 65520 -> Inf
        return sign | 0x7C00
    if a >= 0x38800000:  # normal fp16 range (>= 2^-14)
        m = a + 0xFFF + ((a >> 13) & 1)  # round to nearest even at bit 13
        return sign | (((m >> 13) - (112 << 10)) & 0xFFFF)
    if a < 0x33000000:  # < 2^-25: rounds to zero
        return sign
    # subnormal fp16: value = mant * 2^-24
    e = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    shift = 126 - e  # 14..24 ; result = mant >> (shift) with RNE
    half = 1 << (shift - 1)
    rem = mant & ((1 << shift) - 1)
    r = mant >> shift
    if rem > half or (rem == half and (r & 1) == 1):
        r += 1
    return sign | r


def f16bits_to_f32bits(h):
    """uint16 float16 bit pattern -> uint32 float32 bit pattern (exact)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return sign | 0x7F800000 | (m << 13)
    if e == 0:
        if m == 0:
            return sign
        # normalise the subnormal
        e2 = 113
        while (m & 0x400) == 0:
            m <<= 1
            e2 -= 1
        return sign | (e2 << 23) | ((m & 0x3FF) << 13)
    return sign | ((e + 112) << 23) | (m << 13)


def f32bits_to_bf16bits(u):
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u >> 16) | 0x40) & 0xFFFF
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

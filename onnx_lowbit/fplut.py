"""FPLUT reference semantics (numpy), exactly as the seed design (shared/seeds/fplut-lookup-table.md).

A table has 11 fp16 cut points c0 < ... < c10 and 259 fp16 values:
  interval 0   [c0, c1): 1 segment          table[0]                      = f(c0)
  interval i   [ci, ci+1), i=1..8: 32 segments table[1+32(i-1)+k], k=0..31 = f(ci + k (ci+1 - ci)/32)
  interval 9   [c9, c10]: 1 segment          table[257] = f(c9), table[258] = f(c10)
Evaluation of x (fp32, fp16 or bf16):
  1. x is clamped to [c0, c10] and rounded to fp16 (NaN stays NaN);
  2. i = the interval holding x (compares in fp32), p = (x - c_i) * s_i in fp32, with
     s_i = fp32(n_i / (c_{i+1} - c_i)), n_i = 32 for inner intervals and 1 for the outer ones;
  3. j = clamp(floor(p), 0, len_i), j+ = min(j + 1, len_i), a = clamp(p - j, 0, 1);
  4. y = (T[j+] - T[j]) * a + T[j], each operation rounded to fp32 (no fused multiply-add);
  5. x <= c0 gives T[0], x >= c10 gives T[258]; y is clamped to +-65504, rounded to fp16, and cast to the
     input dtype (fp16 -> bf16 rounds to nearest even).
Because step 1 maps every input onto one of the 65,536 fp16 values, the whole function is a map
fp16 -> fp16: ``expand_table`` tabulates it once and the kernels evaluate that map (bit-exact by construction).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import halfbits
from .unary import evaluate

N_CUTS = 11
N_VALUES = 259
SEGMENTS = np.array([1] + [32] * 8 + [1], dtype=np.int64)          # segments per interval
STARTS = np.array([0] + [1 + 32 * (i - 1) for i in range(1, 9)] + [257], dtype=np.int64)


class TableError(ValueError):
    """A cut-point list or table that FPLUT cannot use."""


def validate(cut_points, values=None) -> None:
    c = np.asarray(cut_points, dtype=np.float64)
    if c.shape != (N_CUTS,):
        raise TableError(f"cut_points must hold {N_CUTS} values, got {c.size}")
    if not halfbits.is_fp16_exact(c):
        raise TableError("cut_points must be finite fp16-representable values")
    if not np.all(np.diff(c) > 0):
        raise TableError(f"cut_points must be strictly increasing, got {c.tolist()}")
    if values is not None:
        v = np.asarray(values, dtype=np.float64)
        if v.shape != (N_VALUES,):
            raise TableError(f"table must hold {N_VALUES} values, got {v.size}")
        if not np.all(np.isfinite(v)) or not halfbits.is_fp16_exact(v):
            raise TableError("table values must be finite fp16-representable values")


def sample_points(cut_points) -> np.ndarray:
    """The 259 x positions (float64) at which the table samples f."""
    c = np.asarray(cut_points, dtype=np.float64)
    pts = [c[0]]
    for i in range(1, 9):
        pts.extend(c[i] + k * (c[i + 1] - c[i]) / 32.0 for k in range(32))
    pts += [c[9], c[10]]
    return np.array(pts, dtype=np.float64)


def build_values(function: str, cut_points) -> np.ndarray:
    """The fp16 table for ``function`` at ``cut_points`` (f evaluated in float64, rounded once)."""
    validate(cut_points)
    y = evaluate(function, sample_points(cut_points))
    return np.clip(y, -halfbits.FP16_MAX, halfbits.FP16_MAX).astype(np.float16)


def scales(cut_points) -> np.ndarray:
    c = np.asarray(cut_points, dtype=np.float64)
    return (SEGMENTS.astype(np.float64) / np.diff(c)).astype(np.float32)


def evaluate_fp16(x16: np.ndarray, cut_points, values) -> np.ndarray:
    """Steps 1-5 on fp16 inputs; returns fp16."""
    c64 = np.asarray(cut_points, dtype=np.float64)
    c32 = c64.astype(np.float32)
    t = np.asarray(values, dtype=np.float16).astype(np.float32)
    s = scales(c64)
    x = np.asarray(x16, dtype=np.float16).astype(np.float32)
    nan = np.isnan(x)
    x = np.clip(np.where(nan, np.float32(0), x), c32[0], c32[-1])
    i = np.clip(np.searchsorted(c32, x, side="right") - 1, 0, 9)
    p = (x - c32[i]).astype(np.float32) * s[i]
    ln = SEGMENTS[i]
    j = np.minimum(np.maximum(np.floor(p), 0), ln).astype(np.int64)
    jp = np.minimum(j + 1, ln)
    a = np.clip(p - j.astype(np.float32), np.float32(0), np.float32(1)).astype(np.float32)
    y1 = t[STARTS[i] + j]
    y2 = t[STARTS[i] + jp]
    y = ((y2 - y1).astype(np.float32) * a).astype(np.float32) + y1
    y = np.where(x <= c32[0], t[0], y)
    y = np.where(x >= c32[-1], t[-1], y)
    y = np.clip(y, np.float32(-halfbits.FP16_MAX), np.float32(halfbits.FP16_MAX)).astype(np.float16)
    return np.where(nan, np.float16(np.nan), y)


def expand_table(cut_points, values) -> np.ndarray:
    """The complete fp16->fp16 map as 65,536 uint16 output bit patterns indexed by the input bit pattern."""
    validate(cut_points, values)
    return evaluate_fp16(halfbits.all_fp16(), cut_points, values).view(np.uint16).copy()


def apply(x: np.ndarray, cut_points, values, *, bf16: bool = False) -> np.ndarray:
    """Reference FPLUT on a float32 / float16 array, or on bf16 bit patterns (uint16) with ``bf16=True``.

    The result has the input's dtype (uint16 bf16 bits for bf16)."""
    x = np.asarray(x)
    if bf16:
        with np.errstate(over="ignore"):
            x16 = halfbits.bf16_bits_to_f32(x).astype(np.float16)
    elif x.dtype == np.float16:
        x16 = x
    elif x.dtype == np.float32:
        with np.errstate(over="ignore"):
            x16 = x.astype(np.float16)  # RNE; +-Inf beyond the range clamps below like every out-of-range value
    else:
        raise TypeError(f"FPLUT takes float32, float16 or bfloat16, got {x.dtype}")
    y16 = evaluate_fp16(x16, cut_points, values)
    if bf16:
        return halfbits.f32_to_bf16_bits(y16.astype(np.float32))
    return y16.astype(x.dtype)


@dataclass(frozen=True)
class Table:
    """A named FPLUT table: the function it approximates, its cut points and fp16 values."""
    function: str
    cut_points: tuple
    values: np.ndarray = field(repr=False, compare=False)

    def __post_init__(self):
        validate(self.cut_points, self.values)

    @classmethod
    def build(cls, function: str, cut_points) -> "Table":
        return cls(function, tuple(float(c) for c in cut_points), build_values(function, cut_points))

    def __call__(self, x, *, bf16=False):
        return apply(x, self.cut_points, self.values, bf16=bf16)


def error_stats(function: str, cut_points, values=None) -> dict:
    """Exhaustive error figures over all 63,488 finite fp16 inputs, against f in float64."""
    if values is None:
        values = build_values(function, cut_points)
    x = halfbits.finite_fp16()
    y = evaluate_fp16(x, cut_points, values)
    ref = evaluate(function, x)
    ref16 = np.clip(ref, -halfbits.FP16_MAX, halfbits.FP16_MAX).astype(np.float16)
    ae = np.abs(y.astype(np.float64) - ref)
    finite = np.isfinite(ref)
    ae = np.where(finite, ae, 0.0)
    re = ae / np.maximum(np.abs(np.where(finite, ref, 1.0)), 2.0 ** -14)
    ulp = halfbits.ulp_distance_fp16(y, ref16)
    return {
        "max_abs": float(ae.max()),
        "max_rel": float(re.max()),
        "exact_pct": float(np.mean(y == ref16) * 100),
        "within_1ulp_pct": float(np.mean(ulp <= 1) * 100),
        "argmax_rel": float(x[int(np.argmax(re))]),
    }


def node_attributes(table: Table) -> dict:
    """The FPLUT node attributes (see onnx_lowbit.domain.FPLUT) that carry ``table``."""
    return {"function": table.function, "cut_points": [float(c) for c in table.cut_points],
            "table": table.values.astype(np.float32).tolist()}

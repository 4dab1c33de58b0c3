"""AWQ int4 weights in AutoAWQ's GEMM layout: numpy reference semantics of MatMulAWQ / DequantAWQ, round-to-nearest
quantisation and the activation-aware scale search.

Layout (AutoAWQ ``WQLinear_GEMM``; verified against AutoAWQ 0.2.9 by tests/test_awq_format.py). W is the ONNX MatMul
weight [K, N] (= the nn.Linear weight transposed); G = group_size; Kp = ceil(K / G) * G:
  * qweight int32 [Kp, N/8]: int32 c of row k holds the eight 4-bit codes of columns 8c .. 8c+7; bits 4i..4i+3
    (i = 0 is the least significant nibble) hold column 8c + PACK_ORDER[i], PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    (so column 8c + j sits in nibble UNPACK_ORDER[j], UNPACK_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]);
  * qzeros int32 [Kp/G, N/8]: the 4-bit zero points of each group, packed the same way;
  * scales float16 [Kp/G, N];
  * W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]: the small integer times the fp16 scale, rounded once to fp16
    (exactly AutoAWQ's ``dequantize_gemm``: unpack_awq + reverse_awq_order + (q - z) * s).
  * K not a multiple of G: the weight is zero-padded to Kp rows before quantisation (the padded rows take part in
    their group's min/max, exactly as if the padded matrix had been quantised, and always dequantise to 0);
    ``dequantize`` / ``matmul`` take the real K and drop the padded rows. N must be a multiple of 8.

Quantisation (AutoAWQ's ``pseudo_quantize_tensor`` with zero_point=True, w_bit=4), per group of G rows and column:
  scale = max(max - min, 1e-5) / 15, zero = clamp(-round(min / scale), 0, 15), q = clamp(round(w / scale) + zero,
  0, 15) (round half to even, like torch.round). AutoAWQ runs this in the model's dtype. For a float16 W we do
  the same fp16 arithmetic (each operation rounded to fp16: identical scales, zero points and codes); for a
  float32 W the arithmetic is float32 and the scale is rounded to fp16 FIRST, so the zero points and codes are
  computed with the very scale that is stored (AutoAWQ on an fp32 model would round its scales only when packing).

Activation-aware scaling (AWQ paper, AutoAWQ's ``_search_best_scale`` / ``_compute_best_scale``): per input channel
k, x_mean[k] = mean |x[:, k]| over the calibration rows; for alpha = i / grid, i = 0 .. grid-1:
  s = max(x_mean ** alpha, 1e-4); s = s / sqrt(max(s) * min(s)); (inf / NaN -> 1)
  error(alpha) = mean((x @ W - x @ (Q(W * s) / s)) ** 2) with Q = quantise + dequantise (the rows of W scaled by s);
the alpha with the lowest error wins (alpha = 0 gives s = 1, i.e. plain RTN). With held-out rows (rows the search
did not see) the winner is kept only when it beats RTN on them too, else RTN. The stored weight is Q(W * s); the
activation must then be multiplied by 1 / s along K: y = (x * (1 / s)) @ dequant. ``quantize_awq`` returns that
``act_scale = 1 / s``; fold it into the op that produces x (AutoAWQ divides the preceding LayerNorm/RMSNorm
weight and bias, or the preceding Linear's output rows, by s) or insert a Mul by act_scale before MatMulAWQ.

``matmul`` (the MatMulAWQ reference): W dequantised to fp16 exactly as above, Y = A @ W (+ bias) accumulated in
float64, rounded once to A's dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import matmul_ref

BITS = 4
PACK = 32 // BITS  # values per int32
MAX_Q = 2 ** BITS - 1
PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = np.arange(0, 32, BITS, dtype=np.uint32)


def _positive_int(name, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def padded_rows(K: int, group_size: int) -> int:
    """Kp = ceil(K / group_size) * group_size: the rows qweight carries."""
    return -(-int(K) // int(group_size)) * int(group_size)


# ---------------------------------------------------------------------------------------------------------------
# int4 packing


def pack_int4(values: np.ndarray) -> np.ndarray:
    """[R, C] integers in 0..15 (C a multiple of 8) -> int32 [R, C/8] in AutoAWQ's nibble order."""
    v = np.asarray(values)
    if v.ndim != 2 or v.shape[1] % PACK:
        raise ValueError(f"values to pack must be 2-D with a multiple of {PACK} columns, got shape {v.shape}")
    if not np.issubdtype(v.dtype, np.integer) and not (np.all(np.isfinite(v)) and np.array_equal(v, np.round(v))):
        raise ValueError("values to pack must be integers")
    if v.size and (v.min() < 0 or v.max() > MAX_Q):
        raise ValueError(f"values to pack must lie in 0..{MAX_Q}, got {v.min()}..{v.max()}")
    u = v.astype(np.uint32).reshape(v.shape[0], -1, PACK)[:, :, list(PACK_ORDER)]
    packed = np.bitwise_or.reduce(u << _SHIFTS, axis=2) if u.shape[1] else np.zeros(u.shape[:2], np.uint32)
    return np.ascontiguousarray(packed.astype(np.uint32)).view(np.int32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """int32 [R, C/8] -> uint8 [R, C] codes in natural column order."""
    p = np.asarray(packed)
    if p.dtype != np.int32 or p.ndim != 2:
        raise ValueError(f"packed codes must be a 2-D int32 array, got {p.dtype} with shape {p.shape}")
    nib = ((np.ascontiguousarray(p).view(np.uint32)[:, :, None] >> _SHIFTS) & np.uint32(MAX_Q)).astype(np.uint8)
    return np.ascontiguousarray(nib[:, :, list(UNPACK_ORDER)].reshape(p.shape[0], -1))


def pack(intweight: np.ndarray, zeros: np.ndarray, scales: np.ndarray):
    """(q [Kp, N], z [Kp/G, N], s [Kp/G, N]) -> (qweight int32 [Kp, N/8], qzeros int32 [Kp/G, N/8], scales fp16)."""
    q = np.asarray(intweight)
    z = np.asarray(zeros)
    s = np.asarray(scales)
    if q.ndim != 2 or z.ndim != 2 or s.ndim != 2:
        raise ValueError("intweight, zeros and scales must be 2-D")
    if z.shape != s.shape or z.shape[1] != q.shape[1]:
        raise ValueError(f"zeros {z.shape} and scales {s.shape} must both be [groups, N] with N = {q.shape[1]}")
    if z.shape[0] == 0 or q.shape[0] % z.shape[0]:
        raise ValueError(f"intweight rows ({q.shape[0]}) must be a multiple of the group count ({z.shape[0]})")
    return pack_int4(q), pack_int4(z), s.astype(np.float16)


def unpack(qweight: np.ndarray, qzeros: np.ndarray):
    """(qweight, qzeros) -> (q uint8 [Kp, N], z uint8 [Kp/G, N])."""
    return unpack_int4(qweight), unpack_int4(qzeros)


# ---------------------------------------------------------------------------------------------------------------
# dequantise / matmul


def validate(qweight, qzeros, scales, group_size: int, K: int, N: int) -> int:
    """Check one AWQ weight's tensors against (group_size, K, N); returns Kp."""
    G = _positive_int("group_size", group_size)
    K = _positive_int("K", K)
    N = _positive_int("N", N)
    if N % PACK:
        raise ValueError(f"N must be a multiple of {PACK}, got {N}")
    Kp = padded_rows(K, G)
    for name, arr, dtype, shape in (("qweight", qweight, np.int32, (Kp, N // PACK)),
                                    ("qzeros", qzeros, np.int32, (Kp // G, N // PACK)),
                                    ("scales", scales, np.float16, (Kp // G, N))):
        a = np.asarray(arr)
        if a.dtype != dtype:
            raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape} for K={K} (padded to {Kp}), N={N}, "
                             f"group_size={G}; got {a.shape}")
    return Kp


def dequantize(qweight, qzeros, scales, group_size: int, K: int, N: int) -> np.ndarray:
    """W[K, N] float16 = (q - z) * s, identical to AutoAWQ's dequantize_gemm (padded rows dropped)."""
    validate(qweight, qzeros, scales, group_size, K, N)
    q, z = unpack(qweight, qzeros)
    G = int(group_size)
    diff = q.astype(np.int16) - np.repeat(z, G, axis=0).astype(np.int16)
    s = np.repeat(np.asarray(scales).astype(np.float32), G, axis=0)
    w = (diff.astype(np.float32) * s).astype(np.float16)  # exact float32 product, one rounding to fp16
    return np.ascontiguousarray(w[:int(K)])


def matmul(a: np.ndarray, qweight, qzeros, scales, group_size: int, K: int, N: int, bias=None) -> np.ndarray:
    """MatMulAWQ reference: Y[..., N] = A[..., K] @ W (+ bias); W as ``dequantize`` gives it (fp16 values), sums in
    float64, one rounding to A's dtype (float32 or float16)."""
    return matmul_ref.matmul(a, K, N, bias, lambda: dequantize(qweight, qzeros, scales, group_size, K, N))


# ---------------------------------------------------------------------------------------------------------------
# round-to-nearest quantisation


def _check_weight(w) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [K, N], got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"weight must be a float array, got {w.dtype}")
    if w.shape[1] % PACK or w.shape[0] == 0:
        raise ValueError(f"weight must be [K, N] with K > 0 and N a multiple of {PACK}, got shape {w.shape}")
    w = w.astype(np.float16 if w.dtype == np.float16 else np.float32)
    if not np.all(np.isfinite(w)):
        raise ValueError("weight holds NaN or Inf")
    return w


def rtn_codes(w: np.ndarray, group_size: int = 128):
    """Round-to-nearest codes of W[K, N] (zero-padded to Kp rows): (q uint8 [Kp, N], z uint8 [Kp/G, N],
    s float16 [Kp/G, N]).

    A float16 W is processed with AutoAWQ's fp16 arithmetic (every operation computed in float32 and rounded to
    fp16, as torch does for half tensors), which reproduces its pseudo_quantize_tensor exactly; any other float
    dtype is processed in float32 with the scale rounded to fp16 before the zero points and codes."""
    w = _check_weight(w)
    G = _positive_int("group_size", group_size)
    K, N = w.shape
    Kp = padded_rows(K, G)
    if Kp != K:
        w = np.concatenate([w, np.zeros((Kp - K, N), w.dtype)], axis=0)
    g = w.reshape(Kp // G, G, N)
    hi = g.max(axis=1).astype(np.float32)
    lo = g.min(axis=1).astype(np.float32)
    g = g.astype(np.float32)
    half = w.dtype == np.float16
    with np.errstate(over="ignore"):
        span = np.maximum(hi - lo, np.float32(1e-5))
        if half:
            span = np.maximum(span.astype(np.float16), np.float16(1e-5)).astype(np.float32)
        s16 = (span / np.float32(MAX_Q)).astype(np.float16)
    if not np.all(np.isfinite(s16)):
        raise ValueError("a group's range overflows the fp16 scale (|weights| too large)")
    s = s16.astype(np.float32)
    with np.errstate(over="ignore"):
        r_lo = lo / s
        r_w = g / s[:, None, :]
        if half:
            r_lo, r_w = r_lo.astype(np.float16), r_w.astype(np.float16)
    z = np.clip(-np.round(r_lo.astype(np.float32)), 0, MAX_Q)
    q = np.clip(np.round(r_w.astype(np.float32)) + z[:, None, :], 0, MAX_Q)
    return q.reshape(Kp, N).astype(np.uint8), z.astype(np.uint8), s16


def quantize_rtn(w: np.ndarray, group_size: int = 128):
    """Asymmetric 4-bit round-to-nearest quantisation of W[K, N] -> (qweight, qzeros, scales)."""
    return pack(*rtn_codes(w, group_size))


def fake_quantize(w: np.ndarray, group_size: int = 128) -> np.ndarray:
    """dequantize(quantize_rtn(W)) as float32 [K, N] (the fp16 values), without packing."""
    q, z, s16 = rtn_codes(w, group_size)
    G = int(group_size)
    diff = q.astype(np.float32) - np.repeat(z, G, axis=0).astype(np.float32)
    return (diff * np.repeat(s16.astype(np.float32), G, axis=0)).astype(np.float16)[:w.shape[0]].astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# activation-aware scale search


class ScaleSearch(NamedTuple):
    scales: np.ndarray   # s float32 [K]: the weight rows are multiplied by s, the activation by 1 / s
    alpha: float         # the chosen exponent (0: s = 1, plain RTN)
    err_rtn: float       # calibration output MSE of plain RTN (alpha = 0) on the rows searched
    err_awq: float       # calibration output MSE with the grid's best s on the rows searched (<= err_rtn)
    holdout_rtn: float | None = None   # output MSE of RTN on the held-out rows (None: none given)
    holdout_awq: float | None = None   # ... of the grid's best s on them; the search keeps RTN when this is larger


class AWQWeight(NamedTuple):
    qweight: np.ndarray    # int32 [Kp, N/8]: Q(W * s)
    qzeros: np.ndarray     # int32 [Kp/G, N/8]
    scales: np.ndarray     # float16 [Kp/G, N]
    act_scale: np.ndarray  # float32 [K] = 1 / s: multiply the activation (along K) by it before MatMulAWQ


def _check_calib(x, K) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 2 or x.shape[-1] != K:
        raise ValueError(f"x_calib must be [M, K] (K={K}), got shape {x.shape}")
    x = x.reshape(-1, K).astype(np.float64)
    if x.shape[0] == 0 or not np.all(np.isfinite(x)):
        raise ValueError("x_calib must hold at least one row of finite values")
    return x


def _candidate_scales(x_mean: np.ndarray, alpha: float, w_mean: np.ndarray | None = None) -> np.ndarray:
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if w_mean is None:
            s = np.maximum(x_mean ** alpha, np.float32(1e-4)).astype(np.float32)
        else:  # AutoAWQ's duo_scaling
            s = np.maximum(x_mean ** alpha / (w_mean ** (1 - alpha) + np.float32(1e-4)), np.float32(1e-4))
            s = s.astype(np.float32)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
    s[~np.isfinite(s)] = 1.0
    return s


def _output_mse(x: np.ndarray, ref: np.ndarray, w: np.ndarray, s: np.ndarray, G: int) -> float:
    wq = fake_quantize(w * s[:, None], G).astype(np.float64) / s.astype(np.float64)[:, None]
    return float(np.mean((ref - x @ wq) ** 2))


def search_scales(w: np.ndarray, x_calib: np.ndarray, group_size: int = 128, grid: int = 20,
                  duo_scaling: bool = False, x_holdout: np.ndarray | None = None) -> ScaleSearch:
    """Grid search of the per-input-channel scale s = mean|x| ** alpha (normalised by sqrt(max(s) * min(s)))
    over alpha in {0, 1/grid, ..., (grid-1)/grid}, minimising the calibration output error of Q(W * s) / s.
    alpha = 0 is plain round-to-nearest (s = 1), so the pick is never worse than RTN on ``x_calib``.

    ``x_holdout`` (rows the search does not see): the grid's best s is kept only when its output error on these
    rows is not larger than RTN's; otherwise the result is RTN (alpha 0, s = 1): scales fitted to some rows that
    do not carry over to others (a text unlike the deployment's) are not used.

    duo_scaling=True uses AutoAWQ's default variant s = mean|x| ** alpha / (w_mean ** (1 - alpha) + 1e-4), w_mean
    being the per-input-channel mean of |W| normalised by each group's max |W|; the default (False) is the
    paper's s = mean|x| ** alpha."""
    w = _check_weight(w)
    K, N = w.shape
    G = _positive_int("group_size", group_size)
    grid = _positive_int("grid", grid)
    x = _check_calib(x_calib, K)
    x_mean = np.mean(np.abs(x), axis=0).astype(np.float32)
    w_mean = None
    if duo_scaling:
        Kp = padded_rows(K, G)
        wp = np.concatenate([w, np.zeros((Kp - K, N), np.float32)]) if Kp != K else w
        g = np.abs(wp).reshape(Kp // G, G, N)
        w_mean = (g / (g.max(axis=1, keepdims=True) + np.float32(1e-6))).reshape(Kp, N)[:K].mean(axis=1)
        w_mean = w_mean.astype(np.float32)
    ref = x @ w.astype(np.float64)
    ones = np.ones(K, np.float32)
    err_rtn = _output_mse(x, ref, w, ones, G)
    best = (ones, 0.0, err_rtn)
    for i in range(grid):
        alpha = i / grid
        s = _candidate_scales(x_mean, alpha, w_mean)
        if i == 0 and w_mean is None:
            continue  # s = 1: RTN, measured above
        err = _output_mse(x, ref, w, s, G)
        if err < best[2]:
            best = (s, alpha, err)
    h_rtn = h_awq = None
    if x_holdout is not None:
        xh = _check_calib(x_holdout, K)
        ref_h = xh @ w.astype(np.float64)
        h_rtn = _output_mse(xh, ref_h, w, ones, G)
        h_awq = h_rtn if best[0] is ones else _output_mse(xh, ref_h, w, best[0], G)
        if h_awq > h_rtn:
            return ScaleSearch(ones, 0.0, float(err_rtn), float(best[2]), float(h_rtn), float(h_awq))
    return ScaleSearch(best[0], float(best[1]), float(err_rtn), float(best[2]), h_rtn, h_awq)


def split_holdout(x: np.ndarray, fraction: float = 0.25, min_rows: int = 8):
    """(rows to search on, held-out rows): the last ``fraction`` of the rows (the end of the calibration data:
    its last samples or tokens) held out; (x, None) below ``min_rows`` rows."""
    x = np.asarray(x)
    n = x.shape[0]
    if n < min_rows:
        return x, None
    cut = n - max(1, int(round(n * fraction)))
    return x[:cut], x[cut:]


def quantize_awq(w: np.ndarray, x_calib: np.ndarray, group_size: int = 128, grid: int = 20,
                 duo_scaling: bool = False, x_holdout: np.ndarray | None = None) -> AWQWeight:
    """AWQ: search s, then quantise W * s (rows scaled). Returns (qweight, qzeros, scales, act_scale = 1 / s);
    y = (x * act_scale) @ dequantize(qweight, qzeros, scales) approximates x @ W."""
    w = _check_weight(w)
    found = search_scales(w, x_calib, group_size, grid, duo_scaling, x_holdout)
    qweight, qzeros, scales = quantize_rtn(w * found.scales[:, None], group_size)
    return AWQWeight(qweight, qzeros, scales, (np.float32(1.0) / found.scales).astype(np.float32))

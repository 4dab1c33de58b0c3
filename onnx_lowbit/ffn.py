"""Fused SwiGLU FFN (gate/up half of a gated feed-forward block): numpy reference semantics of FusedFFN,
FusedFFNNF4 and FusedFFNAWQ.

    S[..., N] = SiLU(X W1^T + B1) * (X W3^T + B3),   SiLU(z) = z * sigmoid(z)

W1 (gate) and W3 (up) are [N, K]: one row per output feature, i.e. the ONNX MatMul weight [K, N] transposed
(the nn.Linear weight). FusedFFN's attribute weights_kn=1 (``kn=True`` here) takes them as [K, N] instead, the
MatMul weights as they are: S = SiLU(X W1 + B1) * (X W3 + B3). The down projection is not part of the op.

The reference computes everything in float64 and RETURNS float64 (no rounding to X's type), so tests can compare
any kernel (fp32 accumulation, output in X's type) against it with an explicit tolerance. Kernels accumulate in
fp32 and compute SiLU in fp32; their output has X's type.

Non-finite values propagate as in the unfused graph (MatMul, Sigmoid, Mul, Mul): SiLU(+inf) = +inf,
SiLU(-inf) = -inf * 0 = NaN, NaN anywhere in a row of X or a weight row gives NaN in the affected outputs.
"""
from __future__ import annotations

import numpy as np

from . import awq, matmul_ref, nf4, nf4_int8

FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float16))


def silu(z: np.ndarray) -> np.ndarray:
    """z * sigmoid(z) in z's dtype, written as z / (1 + exp(-z)) with overflow silenced:
    exp(-z) = inf for very negative z gives -0.0 (the limit), +inf gives +inf, -inf gives NaN (= -inf * 0 of the
    unfused graph x * Sigmoid(x))."""
    z = np.asarray(z)
    with np.errstate(over="ignore", invalid="ignore"):
        s = 1.0 / (1.0 + np.exp(-z))
        return z * s


def parse_kn(attrs: dict) -> bool:
    """FusedFFN's optional attribute 'weights_kn': 0 (default, W1/W3 [N, K]) or 1 (W1/W3 [K, N]). Raises
    ValueError for any other value (the kernels turn it into their KernelError)."""
    v = attrs.get("weights_kn", 0)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v not in (0, 1):
        raise ValueError(f"attribute 'weights_kn' must be 0 (W1, W3 [N, K]) or 1 (W1, W3 [K, N]), got {v!r}")
    return bool(v)


def check(x, w1t, w3t, b1=None, b3=None, *, kn=False):
    """Validate shapes/dtypes; returns (x, w1t, w3t, b1, b3) as arrays and (K, N). Weights [N, K], or [K, N] with
    ``kn``. Raises ValueError."""
    x = np.asarray(x)
    w1t, w3t = np.asarray(w1t), np.asarray(w3t)
    layout = "[K, N]" if kn else "[N, K]"
    if x.dtype not in FLOAT_TYPES:
        raise ValueError(f"X must be float32 or float16, got {x.dtype}")
    for name, w in (("W1", w1t), ("W3", w3t)):
        if w.ndim != 2:
            raise ValueError(f"{name} must be 2-D {layout}, got shape {w.shape}")
        if not np.issubdtype(w.dtype, np.floating):
            raise ValueError(f"{name} must be a float array, got {w.dtype}")
    if w1t.shape != w3t.shape:
        raise ValueError(f"W1 {w1t.shape} and W3 {w3t.shape} must have the same shape {layout}")
    k, n = w1t.shape if kn else w1t.shape[::-1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"X's last dimension must be K={k} (W1 is {layout} = {list(w1t.shape)}), got shape {x.shape}")
    out = []
    for name, b in (("B1", b1), ("B3", b3)):
        if b is not None:
            b = np.asarray(b)
            if b.shape != (n,):
                raise ValueError(f"{name} must have shape ({n},), got {b.shape}")
        out.append(b)
    return x, w1t, w3t, out[0], out[1], (k, n)


def swiglu_ref(x, w1t, w3t, b1=None, b3=None, *, kn=False) -> np.ndarray:
    """S = SiLU(x @ w1t.T + b1) * (x @ w3t.T + b3) in float64 (returned as float64, shape x.shape[:-1] + (N,));
    with ``kn`` the weights are [K, N]: S = SiLU(x @ w1 + b1) * (x @ w3 + b3)."""
    x, w1t, w3t, b1, b3, (k, n) = check(x, w1t, w3t, b1, b3, kn=kn)
    x64 = x.astype(np.float64).reshape(-1, k)
    w1 = w1t.astype(np.float64) if kn else w1t.astype(np.float64).T
    w3 = w3t.astype(np.float64) if kn else w3t.astype(np.float64).T
    with np.errstate(over="ignore", invalid="ignore"):
        g = x64 @ w1
        u = x64 @ w3
        if b1 is not None:
            g = g + b1.astype(np.float64)
        if b3 is not None:
            u = u + b3.astype(np.float64)
        s = silu(g) * u
    return s.reshape(x.shape[:-1] + (n,))


def swiglu(x, w1t, w3t, b1=None, b3=None, *, kn=False) -> np.ndarray:
    """swiglu_ref rounded once to X's dtype (the op's output type)."""
    with np.errstate(over="ignore"):
        return swiglu_ref(x, w1t, w3t, b1, b3, kn=kn).astype(np.asarray(x).dtype)


def nf4_weight_t(packed, absmax, quant_type: str, block_size: int, K: int, N: int) -> np.ndarray:
    """The [N, K] float32 weight of one NF4/FP4-stored MatMul weight (MatMulNF4's storage)."""
    return np.ascontiguousarray(nf4.dequantize(packed, absmax, quant_type, block_size, K, N, np.float32).T)


def awq_weight_t(qweight, qzeros, scales, group_size: int, K: int, N: int) -> np.ndarray:
    """The [N, K] float16 weight of one AWQ-stored MatMul weight (MatMulAWQ's storage; W rounded to fp16 as
    awq.dequantize gives it)."""
    return np.ascontiguousarray(awq.dequantize(qweight, qzeros, scales, group_size, K, N).T)


def swiglu_nf4_ref(x, q1, absmax1, q3, absmax3, quant_type: str, block_size: int, K: int, N: int,
                   b1=None, b3=None, accuracy_level: int = 0) -> np.ndarray:
    """FusedFFNNF4 reference (float64): W1, W3 dequantised to float32 as nf4.dequantize does; with
    ``accuracy_level`` 4 (and K % 32 == 0) both products are nf4_int8's (X quantised to int8), unrounded."""
    if nf4_int8.check_level(accuracy_level) != nf4_int8.INT8 or nf4_int8.int8_group(K, block_size) is None:
        return swiglu_ref(x, nf4_weight_t(q1, absmax1, quant_type, block_size, K, N),
                          nf4_weight_t(q3, absmax3, quant_type, block_size, K, N), b1, b3)
    g = nf4_int8.product64(x, q1, absmax1, quant_type, block_size, K, N)
    u = nf4_int8.product64(x, q3, absmax3, quant_type, block_size, K, N)
    with np.errstate(over="ignore", invalid="ignore"):
        return silu(matmul_ref.add_bias(g, N, b1)) * matmul_ref.add_bias(u, N, b3)


def swiglu_awq_ref(x, qweight1, qzeros1, scales1, qweight3, qzeros3, scales3, group_size: int, K: int, N: int,
                   b1=None, b3=None) -> np.ndarray:
    """FusedFFNAWQ reference (float64): W1, W3 dequantised as awq.dequantize does (fp16 values)."""
    return swiglu_ref(x, awq_weight_t(qweight1, qzeros1, scales1, group_size, K, N),
                      awq_weight_t(qweight3, qzeros3, scales3, group_size, K, N), b1, b3)

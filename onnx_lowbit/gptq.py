"""Error-compensating rounding of 4-bit weights (GPTQ, Frantar et al. 2022) for the two grids of this library:
AWQ's int4 groups (scales and zero points per group of G rows along K, AutoAWQ's layout, onnx_lowbit.awq) and
NF4 / FP4 (absmax per block of bitsandbytes' layout, onnx_lowbit.nf4). Numpy reference, core layer.

With W the [K, N] MatMul weight and X [rows, K] calibration activations, the output error of a rounded W_hat is
||X (W - W_hat)||^2 = tr((W - W_hat)^T H (W - W_hat)), H = X^T X. GPTQ rounds W one row k (input channel) at a time
and moves each row's rounding error onto the rows not yet rounded, in the proportions that minimise that error:
with U the upper Cholesky factor of H^-1 (H damped by ``damp`` x mean(diag H) on the diagonal; channels that are
always 0 get H[k, k] = 1),

    e = (W[k] - Q(W[k])) / U[k, k];   W[k+1:] -= U[k, k+1:]^T e

in blocks of rows (the "lazy batch" form: the update of the rows past a block is one product per block).
A group's parameters (AWQ: scale and zero point from the group's min / max; NF4: the block's absmax) are fixed
from the current, already updated values of its rows when its first row is reached, then every row of the group is
rounded on them: the result lies exactly on the format's grid and is stored in the format's usual tensors, so the
kernels run it unchanged.

Grids: ``gptq_awq`` (any K: the last group is zero-padded as AutoAWQ's layout pads it) and ``gptq_nf4`` (blocks of
bitsandbytes' flat [N, K] layout lie inside one column of W when K is a multiple of the block size: that is
required, ``ValueError`` otherwise). Rows are processed in their natural order (no activation ordering: it would
permute rows across groups).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import awq, nf4

DEFAULT_DAMP = 0.01
BLOCK_ROWS = 128


def hessian(x: np.ndarray) -> np.ndarray:
    """H = X^T X / rows (float64 [K, K]) of calibration activations X [..., K]."""
    x = np.asarray(x)
    if x.ndim < 2 or x.shape[0] == 0:
        raise ValueError(f"calibration activations must be [rows, K] with at least one row, got shape {x.shape}")
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("calibration activations hold NaN or Inf")
    return (x.T @ x) / x.shape[0]


def inverse_cholesky(h: np.ndarray, damp: float = DEFAULT_DAMP) -> np.ndarray:
    """U, the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1; zero channels get H[k, k] = 1. The
    damping is raised tenfold (up to 4 times) when H is still not positive definite."""
    h = np.array(h, np.float64)
    k = h.shape[0]
    if h.ndim != 2 or h.shape[1] != k:
        raise ValueError(f"H must be square, got shape {h.shape}")
    if not 0 <= damp < 1e3:
        raise ValueError(f"damp must be a small non-negative fraction, got {damp!r}")
    diag = np.diag(h).copy()
    dead = diag <= 0
    h[dead, dead] = 1.0
    mean = float(np.mean(np.diag(h)))
    rev = slice(None, None, -1)
    for attempt in range(5):
        hd = h + np.eye(k) * (damp * 10 ** attempt) * mean
        try:
            # with J the reversal of the channel order and J H J = L L^T: H = R R^T with R = J L J upper, so
            # H^-1 = R^-T R^-1 and U = R^-1 = J L^-1 J (one factorisation and one inverse)
            lo = np.linalg.cholesky(hd[rev, rev])
            u = np.linalg.inv(lo)[rev, rev]
            return np.triu(u)
        except np.linalg.LinAlgError:
            if damp == 0:
                damp = 1e-6
    raise ValueError("H is not positive definite even with 1000x the damping (calibration activations degenerate)")


def _run(w: np.ndarray, u: np.ndarray, group: int, fit, round_rows):
    """The GPTQ loop over rows of W [K, N] (float64 copy updated in place). ``fit(rows [r, N], g)`` fixes group g's
    parameters from its current rows; ``round_rows(row [N], g) -> (values float64 [N], codes uint8 [N])``.
    Returns (W_hat [K, N] float64, codes [K, N] uint8)."""
    w = np.array(w, np.float64)
    k_rows, n = w.shape
    block = group * max(1, BLOCK_ROWS // group)
    w_hat = np.empty_like(w)
    codes = np.empty((k_rows, n), np.uint8)
    for b0 in range(0, k_rows, block):
        b1 = min(k_rows, b0 + block)
        wb = w[b0:b1]
        err = np.empty((b1 - b0, n))
        for i in range(b1 - b0):
            k = b0 + i
            if k % group == 0:
                fit(wb[i:i + group], k // group)
            v, c = round_rows(wb[i], k // group)
            w_hat[k], codes[k] = v, c
            e = (wb[i] - v) / u[k, k]
            err[i] = e
            if i + 1 < b1 - b0:
                wb[i + 1:] -= np.outer(u[k, k + 1:b1], e)
        if b1 < k_rows:
            w[b1:] -= u[b0:b1, b1:].T @ err
    return w_hat, codes


class AWQCodes(NamedTuple):
    q: np.ndarray        # uint8 [Kp, N] codes (rows past K: the zero point, dequantised to 0)
    z: np.ndarray        # uint8 [Kp/G, N] zero points
    s: np.ndarray        # float16 [Kp/G, N] scales
    w_hat: np.ndarray    # float32 [K, N]: the dequantised weight, exactly what MatMulAWQ computes with


def gptq_awq(w: np.ndarray, h: np.ndarray, group_size: int = 128, damp: float = DEFAULT_DAMP,
             u: np.ndarray | None = None) -> AWQCodes:
    """GPTQ rounding of W [K, N] (N a multiple of 8) onto AWQ's asymmetric int4 groups; each group's scale and zero
    point as ``awq.rtn_codes`` computes them (float32 arithmetic, the scale rounded to fp16 first), from the
    group's rows as they stand when it is reached. ``awq.pack(q, z, s)`` gives qweight, qzeros, scales. ``u``:
    ``inverse_cholesky(h, damp)`` when already computed (products reading one input share it)."""
    w = awq._check_weight(w).astype(np.float32)
    k_rows, n = w.shape
    G = awq._positive_int("group_size", group_size)
    u = inverse_cholesky(h, damp) if u is None else u
    if u.shape[0] != k_rows:
        raise ValueError(f"H is [{u.shape[0]}, {u.shape[0]}], the weight has K = {k_rows}")
    groups = awq.padded_rows(k_rows, G) // G
    z = np.empty((groups, n), np.uint8)
    s16 = np.empty((groups, n), np.float16)

    def fit(rows, g):
        _, z[g], s16[g] = awq.rtn_codes(rows.astype(np.float32), G)

    def round_rows(row, g):
        s = s16[g].astype(np.float32)
        zf = z[g].astype(np.float32)
        q = np.clip(np.round(row.astype(np.float32) / s) + zf, 0, awq.MAX_Q)
        return ((q - zf) * s).astype(np.float16).astype(np.float64), q.astype(np.uint8)

    w_hat, codes = _run(w, u, G, fit, round_rows)
    kp = groups * G
    if kp != k_rows:   # AutoAWQ's padded rows: code = the group's zero point, value 0
        codes = np.concatenate([codes, np.repeat(z[-1:], kp - k_rows, axis=0)])
    return AWQCodes(codes, z, s16, w_hat.astype(np.float32))


class NF4Codes(NamedTuple):
    packed: np.ndarray   # uint8 [ceil(N*K/2)]: bitsandbytes' bytes (W^T flat, high nibble first)
    absmax: np.ndarray   # float32 [N*K/block_size]
    w_hat: np.ndarray    # float32 [K, N]: code[index] * absmax, what MatMulNF4 computes with


def gptq_nf4(w: np.ndarray, h: np.ndarray, quant_type: str = "nf4", block_size: int = 64,
             damp: float = DEFAULT_DAMP, u: np.ndarray | None = None) -> NF4Codes:
    """GPTQ rounding of W [K, N] onto bitsandbytes' NF4 / FP4 blocks (K a multiple of ``block_size``, so each block
    is ``block_size`` consecutive rows of one column): a block's absmax is the max |value| of its rows when its first
    row is reached; later values are scaled by it and clamped to [-1, 1] as ``nf4.quantize`` does."""
    nf4._check_quant_type(quant_type)
    bs = nf4.check_block_size(block_size)
    w = np.asarray(w)
    if w.ndim != 2 or not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"weight must be a 2-D float array [K, N], got {w.dtype} {w.shape}")
    k_rows, n = w.shape
    if k_rows % bs:
        raise ValueError(f"GPTQ for {quant_type} needs K ({k_rows}) to be a multiple of block_size ({bs}): "
                         "otherwise bitsandbytes' blocks run across columns")
    if not np.all(np.isfinite(w)):
        raise ValueError("weight holds NaN or Inf")
    u = inverse_cholesky(h, damp) if u is None else u
    if u.shape[0] != k_rows:
        raise ValueError(f"H is [{u.shape[0]}, {u.shape[0]}], the weight has K = {k_rows}")
    table = nf4.code(quant_type)
    absmax = np.empty((k_rows // bs, n), np.float32)
    recip = np.empty((k_rows // bs, n), np.float32)

    def fit(rows, g):
        am = np.max(np.abs(rows.astype(np.float32)), axis=0)
        absmax[g] = am
        recip[g] = np.float32(1.0) / np.maximum(am, np.float32(1e-38))

    def round_rows(row, g):
        scaled = np.clip(row.astype(np.float32) * recip[g], -1.0, 1.0)
        idx = nf4.nearest_indices(scaled, quant_type)
        return (table[idx] * absmax[g]).astype(np.float64), idx

    w_hat, codes = _run(w.astype(np.float32), u, bs, fit, round_rows)
    packed = nf4.pack_indices(codes.T.reshape(-1), quant_type)
    return NF4Codes(packed, np.ascontiguousarray(absmax.T).reshape(-1), w_hat.astype(np.float32))


def output_mse(x: np.ndarray, w: np.ndarray, w_hat: np.ndarray) -> float:
    """mean((X W - X W_hat)^2) over rows and outputs."""
    x = np.asarray(x, np.float64).reshape(-1, np.shape(w)[0])
    d = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    return float(np.mean((x @ d) ** 2))

"""Scaled dot-product attention over a KV cache (reference semantics of the KVAttention op).

    Q [B, Hq, S, D], K [B, Hkv, T, D], V [B, Hkv, T, D]   (Hq a multiple of Hkv; query head h reads kv head
                                                          h // (Hq / Hkv), as transformers' repeat_kv expands it)
    A = T(Q K^T)                       scores: fp32 dot products, rounded to T
    A = T(A * scale)  or  T(A / scale)  (attribute ``divide``)
    A = T(A + mask)                    mask optional, T, broadcasts to [B, Hq, S, T]
    P = T(softmax(A))                  over the last axis, in fp32 from the T values
    O = T(P V)                         [B, Hq, S, D], fp32 accumulation

This is what LLaMA-family exports (eager attention) spell as MatMul(Q, Transpose(K)), Mul or Div by a constant,
Add of the mask, Softmax, MatMul with V (and, for grouped-query attention, Unsqueeze + Expand + Reshape of K and
V), with the roundings those separate ops make in T. The products' accumulation order is not fixed (the kernels
and onnxruntime's GEMMs differ), so results agree to within those fp32 sums, not bit for bit; the reference sums in
float64. A row whose scores are all -inf gives NaN, as Softmax does; no keys (T = 0) give zeros.
"""
from __future__ import annotations

import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class KVAttentionError(ValueError):
    """Shapes or types the op does not accept."""


def dims(q_shape, k_shape, v_shape, mask_shape=None):
    """(B, Hq, S, D, Hkv, T) of a valid call, else KVAttentionError naming the problem."""
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise KVAttentionError(f"Q and K must be rank 4 ([B, H, S, D] / [B, Hkv, T, D]), got shapes {list(q_shape)} "
                             f"and {list(k_shape)}")
    b, hq, s, d = (int(v) for v in q_shape)
    kb, hkv, t, kd = (int(v) for v in k_shape)
    if kb != b or kd != d:
        raise KVAttentionError(f"K must be [B, Hkv, T, D] with Q's B = {b} and D = {d}, got {list(k_shape)}")
    if hkv < 1 or hq % hkv:
        raise KVAttentionError(f"Q's heads ({hq}) must be a multiple of K's ({hkv})")
    if [int(v) for v in v_shape] != [b, hkv, t, d]:
        raise KVAttentionError(f"V must have K's shape {list(k_shape)}, got {list(v_shape)}")
    if mask_shape is not None:
        if len(mask_shape) > 4 or any(int(m) not in (1, x) for m, x in zip(tuple(mask_shape)[::-1], (t, s, hq, b))):
            raise KVAttentionError(f"mask of shape {list(mask_shape)} does not broadcast to [B, Hq, S, T] = "
                                 f"[{b}, {hq}, {s}, {t}]")
    return b, hq, s, d, hkv, t


def check(q, k, v, mask=None):
    dt = np.dtype(q.dtype)
    if dt not in DTYPES:
        raise KVAttentionError(f"Q must be float or float16, got {dt}")
    for name, a in (("K", k), ("V", v), ("mask", mask)):
        if a is not None and np.dtype(a.dtype) != dt:
            raise KVAttentionError(f"{name} must have Q's type {dt}, got {np.dtype(a.dtype)}")
    return dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)


def scale_value(scale, dtype):
    """The scale as the graph's constant holds it: rounded to T."""
    return np.asarray(scale, np.float32).astype(dtype)


def apply(q, k, v, mask=None, scale=1.0, divide=False):
    """O in Q's type."""
    q, k, v = (np.asarray(a) for a in (q, k, v))
    mask = None if mask is None else np.asarray(mask)
    b, hq, s, d, hkv, t = check(q, k, v, mask)
    dt = q.dtype
    if t == 0:      # no keys: P V sums nothing
        return np.zeros(q.shape, dt)
    rep = hq // hkv
    kk = np.repeat(k, rep, axis=1).astype(np.float64)
    vv = np.repeat(v, rep, axis=1).astype(np.float64)
    with np.errstate(all="ignore"):
        a = (q.astype(np.float64) @ kk.transpose(0, 1, 3, 2)).astype(np.float32).astype(dt)
        sc = scale_value(scale, dt)
        a = (a / sc if divide else a * sc).astype(dt)
        if mask is not None:
            a = (a + mask).astype(dt)
        af = a.astype(np.float32)
        e = np.exp(af - af.max(axis=-1, keepdims=True))
        p = (e / e.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(dt)
        return (p.astype(np.float64) @ vv).astype(np.float32).astype(dt)

"""The attention prologue of a decode step (reference semantics of the RotaryKV op).

From the packed q/k/v projection QKV [B, S, (Hq + 2 Hkv) * D] (heads of q, then of k, then of v; each head's D
values contiguous, as a merged q/k/v MatMul writes them), with cos / sin broadcasting to [B, 1, S, D] and the KV
cache past_key / past_value [B, Hkv, P, D]:

    q, k, v       = the three parts of QKV, each reshaped to [B, S, H, D] and transposed to [B, H, S, D]
    Q             = Rotary(q, cos, sin)                        [B, Hq, S, D]
    present_key   = concat(past_key, Rotary(k, cos, sin), axis 2)   [B, Hkv, P + S, D]
    present_value = concat(past_value, v, axis 2)                   [B, Hkv, P + S, D]

Rotary is onnx_lowbit.rotary's (each product and the sum rounded to T, bit for bit the unfused ops); the copies
are exact. This is what LLaMA-family exports compute between the q/k/v projection and the attention scores:
Split, three Reshapes and Transposes, two rotary embeddings and two cache Concats, one op here. P may be 0; without
a cache (past_key and past_value both absent, e.g. a prompt-only export) present_key = Rotary(k) and present_value
= v, in [B, Hkv, S, D].
"""
from __future__ import annotations

import numpy as np

from . import rotary

DTYPES = rotary.DTYPES


class RotaryKVError(ValueError):
    """Shapes, types or attributes the op does not accept."""


def dims(qkv_shape, cos_shape, sin_shape, pk_shape, pv_shape, num_heads, kv_num_heads):
    """(B, S, D, P) of a valid call, else RotaryKVError naming the problem; pk_shape and pv_shape both None: no
    cache (P = 0)."""
    hq, hkv = int(num_heads), int(kv_num_heads)
    if hq < 1 or hkv < 1:
        raise RotaryKVError(f"num_heads and kv_num_heads must be >= 1, got {hq} and {hkv}")
    if len(qkv_shape) != 3:
        raise RotaryKVError(f"QKV must be [B, S, (num_heads + 2 kv_num_heads) * D], got shape {list(qkv_shape)}")
    b, s, w = (int(v) for v in qkv_shape)
    parts = hq + 2 * hkv
    if w % parts or (w // parts) % 2 or w == 0:
        raise RotaryKVError(f"QKV's last axis ({w}) must be (num_heads + 2 kv_num_heads) = {parts} times an even "
                            f"head size D")
    d = w // parts
    if (pk_shape is None) != (pv_shape is None):
        raise RotaryKVError("past_key and past_value must both be given or both be absent")
    if pk_shape is None:
        pk_shape = pv_shape = (b, hkv, 0, d)
    if len(pk_shape) != 4 or [int(v) for v in pk_shape[:2]] != [b, hkv] or int(pk_shape[3]) != d:
        raise RotaryKVError(f"past_key must be [B, kv_num_heads, P, D] = [{b}, {hkv}, P, {d}], got {list(pk_shape)}")
    if [int(v) for v in pv_shape] != [int(v) for v in pk_shape]:
        raise RotaryKVError(f"past_value must have past_key's shape {list(pk_shape)}, got {list(pv_shape)}")
    for name, sh in (("cos", cos_shape), ("sin", sin_shape)):
        if len(sh) > 4 or any(int(c) not in (1, t) for c, t in zip(tuple(sh)[::-1], (d, s, 1, b))):
            raise RotaryKVError(f"{name} of shape {list(sh)} does not broadcast to [B, 1, S, D] = [{b}, 1, {s}, {d}]")
    return b, s, d, int(pk_shape[2])


def check(qkv, cos, sin, past_key, past_value, num_heads, kv_num_heads):
    """dims() for arrays, after the type checks: every input float or float16, all of one type."""
    dt = np.dtype(qkv.dtype)
    if dt not in DTYPES:
        raise RotaryKVError(f"QKV must be float or float16, got {dt}")
    for name, a in (("cos", cos), ("sin", sin), ("past_key", past_key), ("past_value", past_value)):
        if a is not None and np.dtype(a.dtype) != dt:
            raise RotaryKVError(f"{name} must have QKV's type {dt}, got {np.dtype(a.dtype)}")
    shape = lambda a: None if a is None else a.shape  # noqa: E731
    return dims(qkv.shape, cos.shape, sin.shape, shape(past_key), shape(past_value), num_heads, kv_num_heads)


def heads(qkv: np.ndarray, num_heads: int, kv_num_heads: int):
    """q [B, Hq, S, D], k and v [B, Hkv, S, D]: QKV's parts as the unfused graph's Reshape + Transpose make them."""
    b, s, w = qkv.shape
    x = qkv.reshape(b, s, num_heads + 2 * kv_num_heads, -1).transpose(0, 2, 1, 3)
    return x[:, :num_heads], x[:, num_heads:num_heads + kv_num_heads], x[:, num_heads + kv_num_heads:]


def apply(qkv, cos, sin, past_key, past_value, num_heads, kv_num_heads):
    """(Q, present_key, present_value) in QKV's type; past_key = past_value = None: no cache."""
    qkv, cos, sin = (np.asarray(a) for a in (qkv, cos, sin))
    past_key, past_value = (None if a is None else np.asarray(a) for a in (past_key, past_value))
    b, s_, d, _ = check(qkv, cos, sin, past_key, past_value, num_heads, kv_num_heads)
    if past_key is None:
        past_key = past_value = np.zeros((b, kv_num_heads, 0, d), qkv.dtype)
    q, k, v = heads(qkv, num_heads, kv_num_heads)
    pad = lambda a: a.reshape((1,) * (4 - a.ndim) + a.shape)  # noqa: E731 - [.., S, D] -> rank 4, head axis 1
    c, s = pad(cos), pad(sin)
    q_rot = rotary.apply(np.ascontiguousarray(q), c, s)
    k_rot = rotary.apply(np.ascontiguousarray(k), c, s)
    return (q_rot, np.concatenate([past_key, k_rot], axis=2).astype(qkv.dtype, copy=False),
            np.concatenate([past_value, v], axis=2).astype(qkv.dtype, copy=False))

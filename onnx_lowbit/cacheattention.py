"""Attention over a KV cache with the rotary embedding and the cache append in one op (reference semantics of the
CacheAttention op): what onnxruntime's GroupQueryAttention computes for the models onnxruntime-genai's builder
writes (packed q/k/v, rotary on, no local window, no softcap).

    QKV [B, S, (Hq + 2 Hkv) D]      one row per new token: the Hq query heads, then Hkv key and Hkv value heads
    past_key, past_value [B, Hkv, P, D]
    seqlens_k [B] int32             each batch row's total length minus one (genai: the attention mask's sum - 1)
    cos_cache, sin_cache [M, D / 2] the rotary tables by position

For batch row b, with T_b = seqlens_k[b] + 1 keys in all, the new tokens' positions are ``pos_s = s`` when T_b <= S
(the row's first prompt; a shorter row is right-padded) and ``pos_s = T_b - S + s`` otherwise. This is what
GroupQueryAttention computes from its total_sequence_length input (first prompt: total_sequence_length == S), read
from the rows' lengths instead, so the op needs no host-side input (onnxruntime computes that one on the CPU, and a
node fed from the CPU keeps genai's session out of CUDA graphs). Rotary is the half rotation (x1 = x[:D/2], x2 =
x[D/2:]; x1 cos - x2 sin, x2 cos + x1 sin at pos_s) in fp32 from T values, rounded once to T, for q and k. The
rotated k and v of each new token are written into the present cache at pos_s; present holds past at every other
position. Then

    O[b, s, h] = T( sum_t p_t V[b, h // (Hq / Hkv), t] ),  p = softmax_t( scale * q_rot[b, s, h] . K[b, kv, t] )

over the keys t <= min(pos_s, T_b - 1), scores and sums in fp32 (the kernels' summation orders differ: results agree
within those fp32 sums, not bit for bit). scale 0 means 1 / sqrt(D).

The present cache: with ``share_buffer`` = 1 (genai's past_present_share_buffer: past and present are one buffer of
the maximum length, bound to both) present has past's shape [B, Hkv, P, D] and the new tokens are written at their
positions in it; with 0 present is [B, Hkv, P + S, D]: past, then the new tokens."""
from __future__ import annotations

import math

import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class CacheAttentionError(ValueError):
    """Shapes, types or values the op does not accept."""


def dims(qkv_shape, past_shape, cos_shape, num_heads, kv_num_heads, share_buffer):
    """(B, S, D, P, L) of a valid call (L: the present cache's length), else CacheAttentionError naming the problem."""
    hq, hkv = int(num_heads), int(kv_num_heads)
    if hq < 1 or hkv < 1 or hq % hkv:
        raise CacheAttentionError(f"num_heads ({hq}) must be a positive multiple of kv_num_heads ({hkv})")
    if len(qkv_shape) != 3:
        raise CacheAttentionError(f"QKV must be [B, S, (num_heads + 2 kv_num_heads) * D], got shape {list(qkv_shape)}")
    b, s, w = (int(v) for v in qkv_shape)
    if w % (hq + 2 * hkv) or w == 0:
        raise CacheAttentionError(f"QKV's last axis ({w}) is not (num_heads + 2 kv_num_heads) = {hq + 2 * hkv} "
                                  "times the head size")
    d = w // (hq + 2 * hkv)
    if d % 2:
        raise CacheAttentionError(f"the head size must be even (half rotation), got {d}")
    if len(past_shape) != 4 or [int(v) for v in past_shape[:2]] != [b, hkv] or int(past_shape[3]) != d:
        raise CacheAttentionError(f"past_key / past_value must be [B, kv_num_heads, P, D] = [{b}, {hkv}, P, {d}], got "
                                  f"{list(past_shape)}")
    p = int(past_shape[2])
    if len(cos_shape) != 2 or int(cos_shape[1]) != d // 2:
        raise CacheAttentionError(f"cos_cache / sin_cache must be [max positions, D / 2 = {d // 2}], got "
                                  f"{list(cos_shape)}")
    return b, s, d, p, (p if share_buffer else p + s)


def check(qkv, past_key, past_value, seqlens_k, cos, sin, num_heads, kv_num_heads, share_buffer):
    dt = np.dtype(qkv.dtype)
    if dt not in DTYPES:
        raise CacheAttentionError(f"QKV must be float or float16, got {dt}")
    for name, a in (("past_key", past_key), ("past_value", past_value), ("cos_cache", cos), ("sin_cache", sin)):
        if np.dtype(a.dtype) != dt:
            raise CacheAttentionError(f"{name} must have QKV's type {dt}, got {np.dtype(a.dtype)}")
    if past_value.shape != past_key.shape:
        raise CacheAttentionError(f"past_value must have past_key's shape {list(past_key.shape)}, got "
                                  f"{list(past_value.shape)}")
    if cos.shape != sin.shape:
        raise CacheAttentionError(f"sin_cache must have cos_cache's shape {list(cos.shape)}, got {list(sin.shape)}")
    out = dims(qkv.shape, past_key.shape, cos.shape, num_heads, kv_num_heads, share_buffer)
    b = out[0]
    if np.dtype(seqlens_k.dtype) != np.int32 or seqlens_k.shape != (b,):
        raise CacheAttentionError(f"seqlens_k must be int32 of shape [B] = [{b}], got {np.dtype(seqlens_k.dtype)} of "
                                  f"shape {list(seqlens_k.shape)}")
    return out


def positions(seqlens_k, s):
    """[B, S] int64: the position of each new token (a row's first prompt, T_b <= S: 0..S-1; else T_b - S + s)."""
    t = np.asarray(seqlens_k, np.int64).reshape(-1, 1) + 1
    ar = np.arange(s, dtype=np.int64)[None, :]
    return np.where(t <= s, ar, t - s + ar)


def check_values(seqlens_k, s, length, max_pos):
    """CacheAttentionError if a batch row's length or a position does not fit (the CUDA kernel writes NaN rows)."""
    t = np.asarray(seqlens_k, np.int64).reshape(-1) + 1
    pos = positions(seqlens_k, s)
    if t.size and (t.min() < 1 or t.max() > length):
        raise CacheAttentionError(f"seqlens_k + 1 must be in [1, {length}] (the present cache's length), got "
                                  f"{t.min()}..{t.max()}")
    if pos.size and (pos.min() < 0 or pos.max() >= min(length, max_pos)):
        raise CacheAttentionError(f"new tokens' positions {pos.min()}..{pos.max()} must lie in [0, "
                                  f"{min(length, max_pos)}) (the present cache and the rotary tables)")


def rotate(x, c, s_):
    """Half rotation of x [..., D] (T) by cos / sin [..., D / 2] (T): fp32, one rounding to T."""
    h = x.shape[-1] // 2
    xf, cf, sf = x.astype(np.float32), c.astype(np.float32), s_.astype(np.float32)
    x1, x2 = xf[..., :h], xf[..., h:]
    return np.concatenate([x1 * cf - x2 * sf, x2 * cf + x1 * sf], axis=-1).astype(x.dtype)


def scale_of(scale, d):
    return np.float32(scale) if float(scale) != 0.0 else np.float32(1.0 / math.sqrt(d))


def apply(qkv, past_key, past_value, seqlens_k, cos, sin, num_heads, kv_num_heads, scale=0.0, share_buffer=0):
    """(O [B, S, Hq D], present_key, present_value) in QKV's type."""
    qkv, past_key, past_value, cos, sin = (np.asarray(a) for a in (qkv, past_key, past_value, cos, sin))
    seqlens_k = np.asarray(seqlens_k)
    b, s, d, p, length = check(qkv, past_key, past_value, seqlens_k, cos, sin, num_heads, kv_num_heads, share_buffer)
    hq, hkv = int(num_heads), int(kv_num_heads)
    check_values(seqlens_k, s, length, cos.shape[0])
    dt = qkv.dtype
    pk = np.zeros((b, hkv, length, d), dt)
    pv = np.zeros((b, hkv, length, d), dt)
    pk[:, :, :p], pv[:, :, :p] = past_key, past_value
    x = qkv.reshape(b, s, hq + 2 * hkv, d)
    pos = positions(seqlens_k, s)
    c, sn = cos[pos][:, :, None, :], sin[pos][:, :, None, :]       # [B, S, 1, D/2]
    q = rotate(x[:, :, :hq], c, sn)
    k = rotate(x[:, :, hq:hq + hkv], c, sn)
    v = x[:, :, hq + hkv:]
    for bi in range(b):
        for si in range(s):
            pk[bi, :, pos[bi, si]] = k[bi, si]
            pv[bi, :, pos[bi, si]] = v[bi, si]
    sc = scale_of(scale, d)
    out = np.zeros((b, s, hq, d), np.float32)
    tb = seqlens_k.astype(np.int64).reshape(-1) + 1
    g = hq // hkv
    with np.errstate(all="ignore"):
        for bi in range(b):
            for si in range(s):
                n = int(min(pos[bi, si] + 1, tb[bi]))
                for h in range(hq):
                    kk = pk[bi, h // g, :n].astype(np.float32)
                    a = (kk @ q[bi, si, h].astype(np.float32)).astype(np.float32) * sc
                    e = np.exp(a - a.max())
                    out[bi, si, h] = (e / e.sum()) @ pv[bi, h // g, :n].astype(np.float32)
    return out.reshape(b, s, hq * d).astype(dt), pk, pv

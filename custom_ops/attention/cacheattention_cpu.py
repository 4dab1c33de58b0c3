"""CacheAttention, CPU face (onnx_lowbit.cacheattention): rotary on the new tokens' q and k, the present cache written,
then softmax(scale q K^T) V per query row, in two Numba passes.

Values are widened to fp32 (fp16 exactly). ``_rotate``: one new token's q and k heads rotated at its position in
fp32 and rounded to T (fp16: to fp16 precision, kept as fp32), k and v written into the present cache (fp32 copy of
it, narrowed to T at the end: every value in it is a T value, so that is exact; only the positions the rows read,
and with one past / present buffer only the new tokens' are written back). ``_attend``: one (b, s, h) query
row per iteration (parallel over rows from PARALLEL_MIN score elements): fp32 dot products over the row's keys,
softmax in fp32, fp32 sums of p_t V[t] (vectorised over the head's dims: sums in another order than the
reference's). The present cache starts as a copy of past unless onnxruntime handed the
kernel one buffer for both (genai's shared past / present).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from onnx_lowbit import cacheattention as ca

from ..device.jit import njit_variant
from ..runtime.kernels import Kernel, KernelError
from .rotary_cpu import r16

PARALLEL_MIN = 1 << 14      # score elements from which query rows run in parallel


@njit(inline="always")
def _rnd(v, f16):
    return r16(np.float32(v)) if f16 else np.float32(v)


@njit(cache=True, nogil=True, boundscheck=False)
def _rotate(x, pos, cos, sin, q, kc, vc, b_, s_, hq, hkv, d, length, f16):
    """x: QKV [B*S*(Hq+2Hkv)*D] fp32; q: rotated queries [B*S*Hq*D]; kc / vc: present caches [B*Hkv*L*D] fp32."""
    half = d // 2
    w = (hq + 2 * hkv) * d
    for r in range(b_ * s_):
        b = r // s_
        p = pos[r]
        cb = p * half
        xb = r * w
        for h in range(hq + hkv):
            hb = xb + h * d
            if h < hq:
                ob = (r * hq + h) * d
                dst = q
            else:
                ob = ((b * hkv + h - hq) * length + p) * d
                dst = kc
            for i in range(half):
                x1, x2 = x[hb + i], x[hb + half + i]
                c, s = cos[cb + i], sin[cb + i]
                dst[ob + i] = _rnd(x1 * c - x2 * s, f16)
                dst[ob + half + i] = _rnd(x2 * c + x1 * s, f16)
        for h in range(hkv):
            vb = xb + (hq + hkv + h) * d
            ob = ((b * hkv + h) * length + p) * d
            for i in range(d):
                vc[ob + i] = x[vb + i]


def _attend(q, kc, vc, pos, tb, o, b_, s_, hq, hkv, d, length, sc):
    g = hq // hkv
    du = np.uint64(d)
    for r in prange(b_ * s_ * hq):
        b = r // (s_ * hq)
        si = (r // hq) % s_
        h = r % hq
        n = min(pos[b * s_ + si] + 1, tb[b])
        kb = np.uint64((b * hkv + h // g) * length * d)    # unsigned indices: no negative-index wraparound, so
        qb = np.uint64(r * d)                               # LLVM vectorises the loops over the head's dims
        a = np.empty(max(n, 1), np.float32)
        mx = np.float32(-np.inf)
        for j in range(n):
            jb = kb + np.uint64(j) * du
            acc = np.float32(0.0)
            for x in range(d):
                acc += q[qb + np.uint64(x)] * kc[jb + np.uint64(x)]
            a[j] = acc * sc
            mx = max(mx, a[j])
        tot = np.float32(0.0)
        for j in range(n):
            a[j] = np.float32(math.exp(a[j] - mx))
            tot += a[j]
        for x in range(d):
            o[qb + np.uint64(x)] = 0.0
        for j in range(n):
            pj = a[j] / tot
            jb = kb + np.uint64(j) * du
            for x in range(d):
                o[qb + np.uint64(x)] += pj * vc[jb + np.uint64(x)]


# fastmath "reassoc" only (sums in another order, vectorised; no contraction, no finite-math assumptions): at 9 / 3
# heads, D = 64, two threads: 200 keys 130 -> 58 us, 1000 keys 505 -> 161 us, a 128-token prompt 4.9 -> 0.73 ms
KERNELS = tuple(njit_variant(_attend, par, cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})
                for par in (False, True))


def run(qkv, past_key, past_value, seqlens_k, cos, sin, num_heads, kv_num_heads, scale=0.0, share_buffer=0, out=None,
        present_key=None, present_value=None, checked=None):
    """The CPU kernel on numpy arrays: (O, present_key, present_value), into the given arrays (contiguous, the
    op's shapes and QKV's type) or new ones. A present array that is past's own buffer is written in place, at the
    new tokens' positions only. ``checked``: the call's (B, S, D, P, L) where the caller has validated it.

    fp32: present is the working cache (past copied into it unless it is past's buffer; the new tokens' k, v
    rotated straight into it). fp16: an fp32 working cache of the first max(T_b) positions only (the keys any row
    reads): with genai's max-length buffers a decode step costs O(tokens so far), not O(buffer)."""
    if checked is None:
        checked = ca.check(qkv, past_key, past_value, seqlens_k, cos, sin, num_heads, kv_num_heads, share_buffer)
        ca.check_values(seqlens_k, checked[1], checked[4], cos.shape[0])
    b, s, d, p, length = checked
    hq, hkv, dt = int(num_heads), int(kv_num_heads), qkv.dtype
    out = np.empty((b, s, hq * d), dt) if out is None else out
    present_key = np.empty((b, hkv, length, d), dt) if present_key is None else present_key
    present_value = np.empty((b, hkv, length, d), dt) if present_value is None else present_value
    if qkv.size == 0:
        return out, present_key, present_value
    pos = ca.positions(seqlens_k, s).reshape(-1)
    tb = np.asarray(seqlens_k, np.int64).reshape(-1) + 1
    f32 = lambda a: np.ascontiguousarray(a, np.float32).reshape(-1)  # noqa: E731
    n = min(length, max(int(tb.max()), int(pos.max()) + 1))  # positions any row reads or writes: [0, n)
    q = np.empty(b * s * hq * d, np.float32)
    fn = KERNELS[1] if b * s * hq * n >= PARALLEL_MIN else KERNELS[0]
    if dt == np.float32 and all(a.flags.c_contiguous for a in (out, present_key, present_value)):
        # fp32: present itself is the working cache (past copied in unless it is past's own buffer)
        for past, dst in ((past_key, present_key), (past_value, present_value)):
            if not np.shares_memory(dst, past):
                dst[:, :, :p] = past
                dst[:, :, p:] = 0
        kc, vc = present_key.reshape(-1), present_value.reshape(-1)
        _rotate(f32(qkv), pos, f32(cos), f32(sin), q, kc, vc, b, s, hq, hkv, d, length, False)
        fn(q, kc, vc, pos, tb, out.reshape(-1), b, s, hq, hkv, d, length, ca.scale_of(scale, d))
        return out, present_key, present_value
    kc, vc = (np.empty((b, hkv, n, d), np.float32) for _ in range(2))
    kc[:, :, :p], vc[:, :, :p] = past_key[:, :, :n], past_value[:, :, :n]   # read before present is written
    kc[:, :, p:], vc[:, :, p:] = 0, 0
    _rotate(f32(qkv), pos, f32(cos), f32(sin), q, kc.reshape(-1), vc.reshape(-1), b, s, hq, hkv, d, n,
            dt == np.float16)
    o = np.empty(q.size, np.float32)
    fn(q, kc.reshape(-1), vc.reshape(-1), pos, tb, o, b, s, hq, hkv, d, n, ca.scale_of(scale, d))
    out[...] = o.reshape(out.shape)
    bi = np.repeat(np.arange(b), s)                         # (row, position) of each new token
    for src, past, dst in ((kc, past_key, present_key), (vc, past_value, present_value)):
        if np.shares_memory(dst, past):                     # one buffer: only the new tokens' positions
            dst[bi, :, pos] = src[bi, :, pos]
        else:
            dst[:, :, :n] = src
            dst[:, :, n:p] = past[:, :, n:]
            dst[:, :, max(n, p):] = 0
    return out, present_key, present_value


class CacheAttentionKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.hq, self.hkv = int(self.attrs["num_heads"]), int(self.attrs["kv_num_heads"])
        self.scale = float(self.attrs.get("scale", 0.0))
        self.share = int(self.attrs.get("share_buffer", 0))
        if self.hq < 1 or self.hkv < 1 or self.hq % self.hkv:
            raise KernelError(f"num_heads ({self.hq}) must be a positive multiple of kv_num_heads ({self.hkv})")

    def compute(self, ctx, inputs):
        a = [self.check_input(inputs, i).numpy() for i in range(6)]
        try:
            b, s, d, p, length = ca.check(*a, self.hq, self.hkv, self.share)
            ca.check_values(a[3], s, length, a[4].shape[0])
        except ca.CacheAttentionError as e:
            raise KernelError(str(e)) from None
        dt = a[0].dtype
        o = ctx.output_numpy(0, (b, s, self.hq * d), dt)
        pk = ctx.output_numpy(1, (b, self.hkv, length, d), dt)
        pv = ctx.output_numpy(2, (b, self.hkv, length, d), dt)
        run(*a, self.hq, self.hkv, self.scale, self.share, o, pk, pv, checked=(b, s, d, p, length))


KERNEL = CacheAttentionKernel

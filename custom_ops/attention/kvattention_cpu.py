"""KVAttention, CPU face: O = T(softmax(T(T(T(Q K^T) * scale) + mask)) V) (onnx_lowbit.kvattention), one Numba pass.

Inputs are widened to fp32 (fp16 exactly), one query row (b, h, s) per iteration (parallel over rows): T scores
as fp32 dot products, each rounded to T where the unfused ops round (``f16``: to fp16 precision, kept as fp32),
softmax in fp32, then O's row as fp32 sums of P[t] V[t, :], rounded to T on the way out. Query head h reads kv
head h // (Hq / Hkv); the mask through its strides over [B, Hq, S, T] (0 on broadcast axes).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from onnx_lowbit import kvattention, rotary

from ..device.jit import njit_variant
from ..runtime.kernels import Kernel, KernelError
from .rotary_cpu import r16

PARALLEL_MIN = 1 << 14      # score elements (B Hq S T) from which rows run in parallel


@njit(inline="always")
def _rnd(v, f16):
    return r16(np.float32(v)) if f16 else np.float32(v)


def _attn(q, k, v, m, has_m, mst, o, b_, hq, s_, d, hkv, t, scale, divide, f16):
    rep = hq // hkv
    for r in prange(b_ * hq * s_):
        b = r // (hq * s_)
        h = (r // s_) % hq
        si = r % s_
        qb = r * d
        kb = (b * hkv + h // rep) * t * d
        mb = b * mst[0] + h * mst[1] + si * mst[2]
        a = np.empty(t, np.float32)
        mx = np.float32(-np.inf)
        for j in range(t):
            acc = np.float32(0.0)
            for x in range(d):
                acc += q[qb + x] * k[kb + j * d + x]
            sc = _rnd(acc, f16)
            sc = _rnd(sc / scale if divide else sc * scale, f16)
            if has_m:
                sc = _rnd(sc + m[mb + j * mst[3]], f16)
            a[j] = sc
            mx = max(mx, sc)
        tot = np.float32(0.0)
        for j in range(t):
            a[j] = np.float32(math.exp(a[j] - mx))
            tot += a[j]
        for j in range(t):
            a[j] = _rnd(a[j] / tot, f16)
        ob = r * d
        for x in range(d):
            o[ob + x] = 0.0
        for j in range(t):
            for x in range(d):
                o[ob + x] += a[j] * v[kb + j * d + x]


KERNELS = tuple(njit_variant(_attn, par, cache=True, nogil=True, boundscheck=False) for par in (False, True))


def run(q, k, v, mask=None, scale=1.0, divide=False, out=None):
    """The CPU kernel on numpy arrays, into ``out`` (contiguous, Q's shape and type) or a new array."""
    b, hq, s, d, hkv, t = kvattention.check(q, k, v, mask)
    out = np.empty(q.shape, q.dtype) if out is None else out
    if q.size == 0:
        return out
    f16 = q.dtype == np.float16
    f32 = lambda a: np.ascontiguousarray(a, np.float32).reshape(-1)  # noqa: E731
    o = np.empty(q.size, np.float32)
    m = f32(mask) if mask is not None else np.zeros(1, np.float32)
    mst = np.asarray(rotary._strides(mask.shape, 4) if mask is not None else [0, 0, 0, 0], np.int64)
    sc = np.float32(kvattention.scale_value(scale, q.dtype))
    fn = KERNELS[1] if b * hq * s * t >= PARALLEL_MIN else KERNELS[0]
    fn(f32(q), f32(k), f32(v), m, mask is not None, mst, o, b, hq, s, d, hkv, t, sc, bool(divide), f16)
    out[...] = o.reshape(q.shape)      # rounded to T (fp16: nearest even)
    return out


class KVAttentionKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.scale = float(self.attrs.get("scale", 1.0))
        self.divide = bool(self.attrs.get("divide", 0))

    def compute(self, ctx, inputs):
        q, k, v = (self.check_input(inputs, i).numpy() for i in range(3))
        m = inputs[3].numpy() if len(inputs) > 3 and inputs[3] is not None else None
        try:
            kvattention.check(q, k, v, m)
        except kvattention.KVAttentionError as e:
            raise KernelError(str(e)) from None
        run(q, k, v, m, self.scale, self.divide, ctx.output_numpy(0, q.shape, q.dtype))


KERNEL = KVAttentionKernel

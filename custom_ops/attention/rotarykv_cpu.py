"""RotaryKV, CPU face: Q, present_key, present_value from the packed QKV and the cache (onnx_lowbit.rotarykv).

One Numba pass over the rotated rows: row (b, head, s) of q or k is read straight from QKV (offset (b S + s) W +
head D, W = (Hq + 2 Hkv) D) and written rotated into Q [B, Hq, S, D] or into present_key [B, Hkv, P + S, D] at
position P + s, with the Rotary op's rounding (rotary_cpu: fp16 products and sum each rounded to fp16, fp32 without
fused multiply-adds), so the result equals the unfused graph bit for bit. cos / sin are read through their strides
over [B, 1, S, D] (0 on broadcast axes). The past rows and v are copied by numpy (plain memory copies).
"""
from __future__ import annotations

import numpy as np
from numba import prange

from onnx_lowbit import rotary, rotarykv

from ..device.half_cpu import f2h, h2f
from ..device.jit import njit_variant
from ..runtime.kernels import Kernel, KernelError
from .rotary_cpu import PARALLEL_MIN, r16


def _rows16(qkv, c, s, q, k, dims, cst, sst):
    b_, s_, d, p, hq, hkv = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]
    w, t, h = (hq + 2 * hkv) * d, p + s_, d // 2
    for r in prange(b_ * (hq + hkv) * s_):
        b = r // ((hq + hkv) * s_)
        hd = (r // s_) % (hq + hkv)
        si = r % s_
        xb = (b * s_ + si) * w + hd * d
        cb = b * cst[0] + si * cst[1]
        sb = b * sst[0] + si * sst[1]
        dst = q if hd < hq else k
        ob = ((b * hq + hd) * s_ + si) * d if hd < hq else ((b * hkv + hd - hq) * t + p + si) * d
        for j in range(h):
            x1 = h2f(qkv[xb + j])
            x2 = h2f(qkv[xb + j + h])
            dst[ob + j] = f2h(r16(x1 * h2f(c[cb + j * cst[2]])) + r16(-x2 * h2f(s[sb + j * sst[2]])))
            dst[ob + j + h] = f2h(r16(x2 * h2f(c[cb + (j + h) * cst[2]])) + r16(x1 * h2f(s[sb + (j + h) * sst[2]])))


def _rows32(qkv, c, s, q, k, dims, cst, sst):
    b_, s_, d, p, hq, hkv = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]
    w, t, h = (hq + 2 * hkv) * d, p + s_, d // 2
    for r in prange(b_ * (hq + hkv) * s_):
        b = r // ((hq + hkv) * s_)
        hd = (r // s_) % (hq + hkv)
        si = r % s_
        xb = (b * s_ + si) * w + hd * d
        cb = b * cst[0] + si * cst[1]
        sb = b * sst[0] + si * sst[1]
        dst = q if hd < hq else k
        ob = ((b * hq + hd) * s_ + si) * d if hd < hq else ((b * hkv + hd - hq) * t + p + si) * d
        for j in range(h):
            x1 = qkv[xb + j]
            x2 = qkv[xb + j + h]
            dst[ob + j] = x1 * c[cb + j * cst[2]] + (-x2) * s[sb + j * sst[2]]
            dst[ob + j + h] = x2 * c[cb + (j + h) * cst[2]] + x1 * s[sb + (j + h) * sst[2]]


def _compile(fn, parallel):
    return njit_variant(fn, parallel, cache=True, nogil=True, boundscheck=False)


# element type -> (serial, parallel, storage dtype)
KERNELS = {10: (_compile(_rows16, False), _compile(_rows16, True), np.uint16),
           1: (_compile(_rows32, False), _compile(_rows32, True), np.float32)}


def strides(shape):
    """Element strides of cos / sin over the B, S and D axes of [B, 1, S, D] (0 where broadcast)."""
    st = rotary._strides(shape, 4)
    return np.asarray([st[0], st[2], st[3]], np.int64)


def run(qkv, cos, sin, past_key, past_value, num_heads, kv_num_heads, outs=None):
    """The CPU kernel on numpy arrays: (Q, present_key, present_value), into ``outs`` (three contiguous arrays of
    the output shapes) or new arrays. past_key = past_value = None: no cache."""
    b, s, d, p = rotarykv.check(qkv, cos, sin, past_key, past_value, num_heads, kv_num_heads)
    hq, hkv = int(num_heads), int(kv_num_heads)
    if outs is None:
        outs = (np.empty((b, hq, s, d), qkv.dtype), np.empty((b, hkv, p + s, d), qkv.dtype),
                np.empty((b, hkv, p + s, d), qkv.dtype))
    q, pk, pv = outs
    if p:
        pk[:, :, :p] = past_key
        pv[:, :, :p] = past_value
    if qkv.size:
        pv[:, :, p:] = qkv.reshape(b, s, hq + 2 * hkv, d)[:, :, hq + hkv:].transpose(0, 2, 1, 3)
        serial, parallel, st = KERNELS[10 if qkv.dtype == np.float16 else 1]
        flat = lambda a: np.ascontiguousarray(a).reshape(-1).view(st)  # noqa: E731
        fn = parallel if qkv.size >= PARALLEL_MIN else serial
        fn(flat(qkv), flat(cos), flat(sin), q.reshape(-1).view(st), pk.reshape(-1).view(st),
           np.asarray([b, s, d, p, hq, hkv], np.int64), strides(cos.shape), strides(sin.shape))
    return q, pk, pv


class RotaryKVKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.hq, self.hkv = int(self.attrs["num_heads"]), int(self.attrs["kv_num_heads"])

    def compute(self, ctx, inputs):
        a = [self.check_input(inputs, i).numpy() for i in range(3)]
        past = [inputs[i].numpy() if len(inputs) > i and inputs[i] is not None else None for i in (3, 4)]
        try:
            b, s, d, p = rotarykv.check(*a, *past, self.hq, self.hkv)
        except rotarykv.RotaryKVError as e:
            raise KernelError(str(e)) from None
        dt = a[0].dtype
        outs = (ctx.output_numpy(0, (b, self.hq, s, d), dt), ctx.output_numpy(1, (b, self.hkv, p + s, d), dt),
                ctx.output_numpy(2, (b, self.hkv, p + s, d), dt))
        run(*a, *past, self.hq, self.hkv, outs)


KERNEL = RotaryKVKernel

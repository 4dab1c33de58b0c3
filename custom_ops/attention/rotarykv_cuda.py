"""RotaryKV, CUDA face: Q, present_key, present_value from the packed QKV and the cache (onnx_lowbit.rotarykv) in
one launch.

One flat grid-stride index space of four runs of work items, in this order:
  1. past_key  -> present_key  rows 0..P-1 of each (b, head) slab: copy units of VW elements
  2. past_value -> present_value, the same
  3. the rotated rows: one thread per pair (j, j + D/2) of row (b, s, head) of q or k, read straight from QKV
     and written to Q or to present_key at position P + s (rotary_cuda's arithmetic: fp16 products and sum each
     rounded to fp16, fp32 products and sum with round-to-nearest intrinsics: bit for bit the unfused graph)
  4. v's new rows -> present_value at position P + s: copy units of VW elements
Copy units are 8 bytes (the tensors viewed as uint64: VW = 4 fp16 or 2 fp32 elements) when D is a multiple of VW
and every pointer is 8-byte aligned, else single elements. Index division goes through float64 reciprocals
(arith.divmod_). In a LLaMA decode step this replaces a Split, two Rotary launches and two KV-cache Concats
per layer (Reshape / Transpose cost no kernel there) by one launch.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from onnx_lowbit import rotarykv

from ..device import host
from ..device.arith import add, divmod_, mul
from ..device.fp16 import r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16, ld32, st16, st32
from ..device.target import SIM
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, route
from .common_cuda import unit_routes, unit_variant
from .rotarykv_cpu import strides

BLOCK = 256
GRID_PER_SM = 8


def _make(f16):
    ld, st, rnd = (ld16, st16, r16) if f16 else (ld32, st32, same)

    @cuda.jit
    def kernel(qkv, c, s, q, pko, cpk, cpv, cpko, cpvo, cqkv, s_, d, p, hq, hkv, pslab, tslab, du, c0, c2, cl,
               s0, s2, sl, n1, n3, n4, i_pslab, i_h, i_hh, i_s, i_du, i_hkv):
        # pslab / tslab: copy units per (b, head) slab of the past / present; du: copy units per row
        h = d >> 1
        t = p + s_
        w = (hq + 2 * hkv) * d
        total = 2 * n1 + n3 + n4
        i = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        step = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
        while i < total:
            if i < 2 * n1:                                  # 1, 2: past rows
                u = i - n1 if i >= n1 else i
                slab, r = divmod_(u, pslab, i_pslab)
                if i >= n1:
                    cpvo[slab * tslab + r] = cpv[u]
                else:
                    cpko[slab * tslab + r] = cpk[u]
            elif i < 2 * n1 + n3:                           # 3: rotated pairs of q and k
                row, j = divmod_(i - 2 * n1, h, i_h)
                bs, hd = divmod_(row, hq + hkv, i_hh)
                b, si = divmod_(bs, s_, i_s)
                xb = bs * w + hd * d
                cb = b * c0 + si * c2
                sb = b * s0 + si * s2
                x1 = ld(qkv, xb + j)
                x2 = ld(qkv, xb + j + h)
                y1 = add(rnd(mul(x1, ld(c, cb + j * cl))), rnd(mul(-x2, ld(s, sb + j * sl))))
                y2 = add(rnd(mul(x2, ld(c, cb + (j + h) * cl))), rnd(mul(x1, ld(s, sb + (j + h) * sl))))
                if hd < hq:
                    ob = ((b * hq + hd) * s_ + si) * d
                    st(q, ob + j, y1)
                    st(q, ob + j + h, y2)
                else:
                    ob = ((b * hkv + hd - hq) * t + p + si) * d
                    st(pko, ob + j, y1)
                    st(pko, ob + j + h, y2)
            else:                                           # 4: v's new rows
                rr, k = divmod_(i - 2 * n1 - n3, du, i_du)
                bs, hv = divmod_(rr, hkv, i_hkv)
                b, si = divmod_(bs, s_, i_s)
                cpvo[((b * hkv + hv) * t + p + si) * du + k] = cqkv[(bs * (hq + 2 * hkv) + hq + hkv + hv) * du + k]
            i += step

    return kernel


# Which kernel serves which call (routing.py): per element type, 8-byte copy units where D and every pointer allow
# (``aligned``; onnxruntime's buffers always are, D a multiple of 4 fp16 / 2 fp32 elements), else element copies.
# Case: K = D, aligned = every given pointer 8-byte aligned.
ROUTES = unit_routes("rotarykv", "every pointer",
                     "docs/lab-log.md, 2026-11-25 (session 17): the decode step with RotaryKV")
KERNELS = {10: _make(True), 1: _make(False)}     # one function per element type; the copy unit is its signature's
STORAGE = {10: np.uint16, 1: np.float32}
DTYPES = {10: "float16", 1: "float32"}


def _signature(elem, wide):
    a, cp = Array(STORAGE[elem]), Array(np.uint64 if wide else STORAGE[elem])
    return [a] * 5 + [cp] * 5 + ["int64"] * 17 + ["float64"] * 6


variant = unit_variant      # ROUTES kernel name -> (element type, wide)


_launchers = {}


def launcher(name):
    """The direct-launch wrapper of ROUTES kernel ``name`` (compiled once per process); under the simulator
    launch.SimLauncher."""
    if name not in _launchers:
        elem, wide = variant(name)
        _launchers[name] = (SimLauncher if SIM else Launcher)(KERNELS[elem], _signature(elem, wide))
    return _launchers[name]


def _recip(v):
    return 1.0 / v if v else 1.0


def launch(elem, stream, sms, shapes, ptrs, hq, hkv):
    """The kernel object's launch for QKV / cos / sin / past_key / past_value of ``shapes`` (the pasts None: no
    cache) at device pointers ``ptrs`` (qkv, cos, sin, past_key, past_value, Q, present_key, present_value; 0 for
    absent pasts): the routing Case (element type, M = B S, K = D, the pointers' alignment), the kernel ROUTES
    names, one launch; nothing when every output is empty. Raises rotarykv.RotaryKVError for shapes the op does
    not take."""
    qs, cs, ss, pks, pvs = shapes
    b, s, d, p = rotarykv.dims(qs, cs, ss, pks, pvs, hq, hkv)
    name = route(ROUTES, Case(DTYPES[elem], b * s, d, aligned=all(x % 8 == 0 for x in ptrs if x))).kernel
    wide = variant(name)[1]
    isz = 2 if elem == 10 else 4
    vw = 8 // isz if wide else 1
    n1, n3, n4 = b * hkv * p * d // vw, b * (hq + hkv) * s * (d // 2), b * hkv * s * d // vw
    total = 2 * n1 + n3 + n4
    if total == 0:
        return
    t = p + s
    esz = [b * s * (hq + 2 * hkv) * d, int(np.prod(cs, dtype=np.int64)), int(np.prod(ss, dtype=np.int64)),
           b * hq * s * d, b * hkv * t * d]
    csz = [b * hkv * p * d // vw] * 2 + [b * hkv * t * d // vw] * 2 + [esz[0] // vw]
    qkv, cos, sin, pk, pv, qo, pko, pvo = ptrs
    arrays = [(x, (n,)) for x, n in zip((qkv, cos, sin, qo, pko), esz)]
    arrays += [(x, (n,)) for x, n in zip((pk, pv, pko, pvo, qkv), csz)]
    cst, sst = strides(cs), strides(ss)
    recips = [_recip(v) for v in (p * d // vw, d // 2, hq + hkv, s, d // vw, hkv)]
    grid = max(1, min(-(-total // BLOCK), sms * GRID_PER_SM))
    launcher(name).launch(grid, BLOCK, stream, *arrays, s, d, p, hq, hkv, p * d // vw, t * d // vw, d // vw,
                          *cst, *sst, n1, n3, n4, *recips)


class RotaryKVCudaKernel(Kernel):
    """Per call: validates the shapes, allocates the three outputs, one launch (``launch``); ``sms`` sets the grid
    (tests lower it to reach the grid-stride loop on small tensors)."""
    native_plans = True  # one launch whose parameters depend only on the input shapes and alignments; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        self.hq, self.hkv = int(self.attrs["num_heads"]), int(self.attrs["kv_num_heads"])
        self.sms = host.sm_count()

    def compute(self, ctx, inputs):
        x, c, s = (self.check_input(inputs, i) for i in range(3))
        pk, pv = (inputs[i] if len(inputs) > i else None for i in (3, 4))
        shapes = (x.shape, c.shape, s.shape, None if pk is None else pk.shape, None if pv is None else pv.shape)
        try:
            b, sl, d, p = rotarykv.dims(*shapes, self.hq, self.hkv)
        except rotarykv.RotaryKVError as e:
            raise KernelError(str(e)) from None
        outs = [ctx.output(0, (b, self.hq, sl, d)), ctx.output(1, (b, self.hkv, p + sl, d)),
                ctx.output(2, (b, self.hkv, p + sl, d))]
        ptrs = [x.ptr, c.ptr, s.ptr, 0 if pk is None else pk.ptr, 0 if pv is None else pv.ptr] + outs
        launch(self.elem, ctx.stream, self.sms, shapes, ptrs, self.hq, self.hkv)


KERNEL = RotaryKVCudaKernel

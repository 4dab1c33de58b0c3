"""KVAttention, CUDA face: O = T(softmax(T(T(T(Q K^T) * scale) + mask)) V) (onnx_lowbit.kvattention) in one launch.

One block of NT threads per query row (b, h, s); query head h reads kv head h // (Hq / Hkv). Dynamic shared
memory holds the row of Q (fp32), the row's T scores and a reduction area, so T is limited by shared memory
(max_keys(): ~56K keys at D = 128 on the H100; longer caches get a clear error, the CPU face has no limit; above
48 KiB, ~10K keys at D = 128, the launch opts in to the device's shared memory limit).
  1. scores: C = ceil(D / (CU units)) threads per key, each summing the products of CU consecutive units of the key
     row (a unit: 4 fp16 or 2 fp32 elements read as one 8-byte word when D and the pointers allow, else one
     element; the CU loads of a thread are unrolled, so they are in flight together), NT / C keys per round; the
     C partials of a key are added in a fixed order, rounded to T, scaled (fmul_rn / fp32 division, rounded to T)
     and the mask added (fadd_rn, rounded to T), as the separate ops round them.
  2. softmax over the T scores in fp32: each thread's (max, sum of exponentials) over its keys, combined in one
     tree reduction in shared memory; each probability exp(s - max) / sum rounded to T.
  3. O: G = NT / (D units) groups of keys; a thread accumulates one unit column of V over its group's keys (four
     keys per step, loads in flight together), the G partials of a column are added in a fixed order and rounded
     to T on the store.
The sums run in fp32 in another order than the reference's float64 (results agree within those sums; not bit for
bit). A row with a NaN score gives NaN (the max skips it, its exponential does not); a row of -inf scores gives
NaN, as Softmax does. Only shared-memory reductions (no warp shuffles), so the kernel runs under Numba's
simulator as it runs on the GPU. In a LLaMA decode step this replaces, per layer, the two attention GEMVs, the
score scaling, the mask Add, the Softmax (and its Casts) and the K / V repeats of grouped-query attention.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from onnx_lowbit import kvattention, rotary

from ..device import launch as cuda_launch
from ..device.arith import add, divmod_, mul
from ..device.fp16 import as_f32, h2f, r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16, ld32, st16, st32
from ..device.target import SIM, device
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, route
from .common_cuda import unit_routes, unit_variant

NT = 64 if SIM else 512     # threads per block (a power of two: tree reductions; 1024 did not launch with the first
#                             kernel's 76 registers); fewer in the simulator: speed
CU = 8                      # units per thread per key in the scores (unrolled)
SHARED_MAX = 227 * 1024     # the most dynamic shared memory a block may have on Hopper (the simulator's limit; on a
#                             GPU: the device's opt-in limit, cuda_launch.shared_optin)
SHARED_PLAIN = 48 * 1024    # what every GPU gives a block without an opt-in
M16, S16, S32, S48 = np.uint64(0xFFFF), np.uint64(16), np.uint64(32), np.uint64(48)


def _unit_ops(f16, wide):
    """(dot, axpy): dot(a, i, sm, e) = sum over unit i of a of sm[e + k] * a_k; axpy(a, i, p, acc): acc[k] += p a_k."""
    if wide and f16:
        @device
        def dot(a, i, sm, e):
            w = a[i]
            return ((sm[e] * h2f(w & M16) + sm[e + 1] * h2f((w >> S16) & M16))
                    + (sm[e + 2] * h2f((w >> S32) & M16) + sm[e + 3] * h2f(w >> S48)))

        @device
        def axpy(a, i, p, acc):
            w = a[i]
            acc[0] += p * h2f(w & M16)
            acc[1] += p * h2f((w >> S16) & M16)
            acc[2] += p * h2f((w >> S32) & M16)
            acc[3] += p * h2f(w >> S48)
    elif wide:
        @device
        def dot(a, i, sm, e):
            w = a[i]
            return sm[e] * as_f32(w & np.uint64(0xFFFFFFFF)) + sm[e + 1] * as_f32(w >> S32)

        @device
        def axpy(a, i, p, acc):
            w = a[i]
            acc[0] += p * as_f32(w & np.uint64(0xFFFFFFFF))
            acc[1] += p * as_f32(w >> S32)
    else:
        ld = ld16 if f16 else ld32

        @device
        def dot(a, i, sm, e):
            return sm[e] * ld(a, i)

        @device
        def axpy(a, i, p, acc):
            acc[0] += p * ld(a, i)
    return dot, axpy


def unit_width(f16, wide):
    return (4 if f16 else 2) if wide else 1


def _make(f16, wide):
    ld, st, rnd = (ld16, st16, r16) if f16 else (ld32, st32, same)
    dot, axpy = _unit_ops(f16, wide)
    vw = unit_width(f16, wide)
    neg_inf = float32(-np.inf)

    @cuda.jit
    def kernel(q, kk, vv, m, o, hq, s_, d, hkv, t_, cw, c_, g_, has_m, m0, m1, m2, m3, divide, rep, scale, i_s,
               i_hq, i_rep, i_c, i_cw):
        # cw: units per key row (D / vw); c_: threads per key in the scores; g_: key groups in P V; rep = Hq / Hkv;
        # i_*: float64 reciprocals of s_, hq, rep, c_, cw (divisions through arith.divmod_: a 64-bit integer
        # division, and so a range() with a step, costs ~80 instructions, which dominated the first kernel)
        sm = cuda.shared.array(0, float32)      # [0, d): Q's row; [d, d + t_): scores; [d + t_, ...): reductions
        red = d + t_
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x
        bh, si = divmod_(row, s_, i_s)
        b, h = divmod_(bh, hq, i_hq)
        kvb = (b * hkv + divmod_(h, rep, i_rep)[0]) * t_          # the row's first key
        mb = b * m0 + h * m1 + si * m2
        scl = float32(scale)
        x = tid
        while x < d:
            sm[x] = ld(q, row * d + x)
            x += NT
        cuda.syncthreads()

        # 1. scores
        kl, cc = divmod_(tid, c_, i_c)
        kr = divmod_(NT, c_, i_c)[0]   # keys per round
        u0 = cc * CU
        t0 = 0
        while t0 < t_:
            tk = t0 + kl
            part = float32(0.0)
            if kl < kr and tk < t_:
                base = (kvb + tk) * cw
                for u in range(CU):
                    if u0 + u < cw:
                        part += dot(kk, base + u0 + u, sm, (u0 + u) * vw)
            sm[red + tid] = part
            cuda.syncthreads()
            if tid < kr and t0 + tid < t_:
                acc = float32(0.0)
                for c in range(c_):
                    acc += sm[red + tid * c_ + c]
                v = rnd(acc)
                v = rnd(v / scl) if divide else rnd(mul(v, scl))
                if has_m:
                    v = rnd(add(v, ld(m, mb + (t0 + tid) * m3)))
                sm[d + t0 + tid] = v
            cuda.syncthreads()
            t0 += kr

        # 2. softmax: each thread's max m and sum l = sum exp(s - m) over its keys, combined pairwise in a tree
        # ((m, l) with (m', l'): max, l e^(m - max) + l' e^(m' - max)); a NaN score makes l NaN (the max skips it),
        # a row of -inf scores keeps m = -inf, l = 0 and gives NaN, as Softmax does
        mx = neg_inf
        j = tid
        while j < t_:
            v = sm[d + j]
            mx = v if v > mx else mx
            j += NT
        tot = float32(0.0)
        j = tid
        while j < t_:
            v = sm[d + j]
            if mx != neg_inf:
                tot += math.exp(v - mx)
            elif v != neg_inf:
                tot += v        # NaN (all other scores of this thread are -inf: they add 0)
            j += NT
        sm[red + tid] = mx
        sm[red + NT + tid] = tot
        cuda.syncthreads()
        n = NT // 2
        while n > 0:
            if tid < n:
                xa, xb = sm[red + tid], sm[red + tid + n]
                la, lb = sm[red + NT + tid], sm[red + NT + tid + n]
                if xb > xa:
                    sm[red + tid] = xb
                    sm[red + NT + tid] = lb + la * math.exp(xa - xb)
                elif xa > xb:
                    sm[red + NT + tid] = la + lb * math.exp(xb - xa)
                else:
                    sm[red + NT + tid] = la + lb
            cuda.syncthreads()
            n //= 2
        mx = sm[red]
        tot = sm[red + NT]
        j = tid
        while j < t_:
            sm[d + j] = rnd(math.exp(sm[d + j] - mx) / tot)
            j += NT
        cuda.syncthreads()

        # 3. O = P V
        acc = cuda.local.array(4, float32)
        idx = tid
        while idx < cw * g_:
            gi, u = divmod_(idx, cw, i_cw)
            for k in range(vw):
                acc[k] = float32(0.0)
            base = kvb * cw + u
            j = gi
            while j + 3 * g_ < t_:
                p0, p1, p2, p3 = sm[d + j], sm[d + j + g_], sm[d + j + 2 * g_], sm[d + j + 3 * g_]
                axpy(vv, base + j * cw, p0, acc)
                axpy(vv, base + (j + g_) * cw, p1, acc)
                axpy(vv, base + (j + 2 * g_) * cw, p2, acc)
                axpy(vv, base + (j + 3 * g_) * cw, p3, acc)
                j += 4 * g_
            while j < t_:
                axpy(vv, base + j * cw, sm[d + j], acc)
                j += g_
            for k in range(vw):
                sm[red + gi * d + u * vw + k] = acc[k]
            idx += NT
        cuda.syncthreads()
        x = tid
        while x < d:
            acc0 = float32(0.0)
            for gi in range(g_):
                acc0 += sm[red + gi * d + x]
            st(o, row * d + x, acc0)
            x += NT

    return kernel


KERNELS = {}
STORAGE = {10: np.uint16, 1: np.float32}


def kernel_for(elem, wide):
    key = (elem, wide)
    if key not in KERNELS:
        KERNELS[key] = _make(elem == 10, wide)
    return KERNELS[key]


def _signature(elem, wide):
    a, kv = Array(STORAGE[elem]), Array(np.uint64 if wide else STORAGE[elem])
    return [a, kv, kv, a, a] + ["int64"] * 15 + ["float64"] * 6


# Which kernel serves which call (routing.py): per element type, 8-byte units where D and the K / V pointers allow
# (``aligned``; onnxruntime's buffers always are), else element units. Case: M = query rows, K = D, N = keys (T).
ROUTES = unit_routes("kvattention", "K, V",
                     "BENCHMARKS.md, Kernels: Rotary, RotaryKV, KVAttention, RMSNorm (H100 2026-11-25)")
DTYPES = {10: "float16", 1: "float32"}


variant = unit_variant      # ROUTES kernel name -> (element type, wide)


_launchers = {}


def launcher(elem, wide, big=0):
    """The direct-launch wrapper for fp16 (10) or fp32 (1), 8-byte (``wide``) or element units (compiled once per
    process); under the simulator launch.SimLauncher. ``big``: the bytes of dynamic shared memory the kernel
    is opted in to (launches needing more than SHARED_PLAIN), 0: up to SHARED_PLAIN without an opt-in."""
    key = (elem, wide, big)
    if key not in _launchers:
        fn, sig = kernel_for(elem, wide), _signature(elem, wide)
        _launchers[key] = SimLauncher(fn, sig) if SIM else Launcher(fn, sig, dynamic_shared=big)
    return _launchers[key]


_limits = {}


def shared_limit():
    """The most dynamic shared memory a launch may have here: SHARED_MAX under the simulator, else the current
    device's opt-in limit (asked once per device)."""
    if SIM:
        return SHARED_MAX
    dev = cuda_launch.current_device()
    if dev not in _limits:
        _limits[dev] = cuda_launch.shared_optin(dev)
    return _limits[dev]


def geometry(d, t, vw):
    """(cw, c, g, shared bytes) of a row with head size ``d``, ``t`` keys and ``vw`` elements per unit."""
    cw = d // vw
    c = -(-cw // CU)
    g = max(1, NT // cw)
    return cw, c, g, 4 * (d + t + max(2 * NT, g * d))


def max_keys(d, elem=10, limit=SHARED_MAX):
    """The most keys (T) the kernel takes at head size ``d`` with ``limit`` bytes of shared memory (default:
    Hopper's)."""
    vw = unit_width(elem == 10, True) if d % unit_width(elem == 10, True) == 0 else 1
    cw, c, g, _ = geometry(d, 0, vw)
    return limit // 4 - d - max(2 * NT, g * d)


def launch(elem, stream, shapes, ptrs, scale, divide):
    """The kernel object's launch for Q / K / V / mask of ``shapes`` (mask None: absent) at device pointers ``ptrs``
    (q, k, v, mask or 0, o): the routing Case (element type, M = query rows, K = D, N = T, K / V alignment), the
    kernel ROUTES names, one launch; nothing when O is empty. Raises kvattention.KVAttentionError for shapes the op or this kernel does not
    take."""
    qs, ks, vs, ms = shapes
    b, hq, s, d, hkv, t = kvattention.dims(qs, ks, vs, ms)
    rows = b * hq * s
    if rows == 0 or d == 0:
        return
    wvw = unit_width(elem == 10, True)
    q, k, v, m, o = ptrs
    wide = variant(route(ROUTES, Case(DTYPES[elem], rows, d, t, aligned=k % 8 == 0 and v % 8 == 0)).kernel)[1]
    vw = wvw if wide else 1
    cw, c, g, shmem = geometry(d, t, vw)
    limit = shared_limit() if shmem > SHARED_PLAIN else SHARED_PLAIN
    if c > NT or shmem > limit:
        raise kvattention.KVAttentionError(
            f"KVAttention on CUDA takes at most {max_keys(d, elem, limit)} keys (T) at head size D = {d} on this GPU "
            f"(shared memory); got T = {t}" if c <= NT else
            f"KVAttention on CUDA takes head sizes up to {NT * CU * vw}, got D = {d}")
    mst = rotary._strides(ms, 4) if ms is not None else [0, 0, 0, 0]
    mn = int(np.prod(ms, dtype=np.int64)) if ms is not None else 0
    kvn = b * hkv * t * d // vw
    arrays = [(q, (rows * d,)), (k, (kvn,)), (v, (kvn,)), (m, (mn,)), (o, (rows * d,))]
    sc = float(kvattention.scale_value(scale, np.float16 if elem == 10 else np.float32))
    rep = hq // hkv
    lau = launcher(elem, wide, limit if shmem > SHARED_PLAIN else 0)
    lau.launch(rows, NT, stream, *arrays, hq, s, d, hkv, t, cw, c, g, int(ms is not None), *[int(x) for x in mst],
               int(bool(divide)), rep, sc, *[1.0 / x for x in (s, hq, rep, c, cw)], shmem=shmem)


class KVAttentionCudaKernel(Kernel):
    """Per call: validates the shapes, one launch (``launch``)."""
    native_plans = True  # one launch whose parameters depend only on the input shapes and alignments; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        self.scale = float(self.attrs.get("scale", 1.0))
        self.divide = bool(self.attrs.get("divide", 0))

    def compute(self, ctx, inputs):
        q, k, v = (self.check_input(inputs, i) for i in range(3))
        m = inputs[3] if len(inputs) > 3 else None
        shapes = (q.shape, k.shape, v.shape, None if m is None else m.shape)
        try:
            kvattention.dims(*shapes)
        except kvattention.KVAttentionError as e:
            raise KernelError(str(e)) from None
        o = ctx.output(0, q.shape)
        try:
            launch(self.elem, ctx.stream, shapes, [q.ptr, k.ptr, v.ptr, 0 if m is None else m.ptr, o], self.scale,
                   self.divide)
        except kvattention.KVAttentionError as e:
            raise KernelError(str(e)) from None


KERNEL = KVAttentionCudaKernel

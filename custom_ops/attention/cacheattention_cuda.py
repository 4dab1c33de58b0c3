"""CacheAttention, CUDA face (onnx_lowbit.cacheattention): rotary, the cache append and the attention of every query
row in one launch (onnxruntime's GroupQueryAttention takes four kernels per decode step: a memset, the sequence
lengths, rotary + append, the attention).

Decode (rows B S Hq <= SPLIT_ROWS) takes one launch: the warp kernel (``_make_decode``, head sizes a multiple of 32:
each lane d / 32 dims, G keys per warp step, scores by warp shuffles, the warps meeting once in shared memory), or for
other head sizes the first kernel in mode FUSED; a prompt two launches of the first kernel: APPEND (steps 1-2), then
PRESENT (steps 3-4 reading every key from present: each key rotated once, not once per query row that reads it).
The first kernel (``_make``): one block of NT threads per (query row, key split); a query row is (b, s, h). A block:
  1. copies its share of past into present, element by element over the whole grid, when onnxruntime gave the node
     two buffers (compared on the device: with genai's shared past / present buffer nothing is copied); positions
     that the new tokens take are left to them;
  2. if it is split 0 of a row whose head h is the first of its kv group, writes its new token's rotated k and its
     v into present at the token's position;
  3. rotates its q row into shared memory, then walks its split's keys CH at a time: scores (NT / CH threads per
     key, each a slice of the head's dims, summed in a fixed order), a running max and sum of exponentials, and the
     exp-weighted sums of V rows (one dim per thread). Keys the call appends (at or after the row's first new
     position) are read from QKV and rotated on the fly, older keys from past, so no block reads what another
     writes;
  4. with one split it writes O; with several, its partial (m, l, acc) to scratch, and the last block of the row
     (device/splitk.arrive_last: a per-row counter, reset by that block) combines them in split order.
Positions come from seqlens_k on the device, so the launch depends only on shapes (a
native plan replays it; CUDA graphs capture it). Sums in fp32 in another order than the reference's (results agree
within those sums). Head sizes up to NT * DPT (256).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, uint32

from onnx_lowbit import cacheattention as ca

from ..device import splitk
from ..device.arith import add, divmod_, mul
from ..device.fp16 import r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import ld16, ld32, st16, st32
from ..device.target import SIM, device
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route

NT = 128                # threads per block
CH = 32                 # keys per step of a block (NT / CH threads per key in the scores)
DPT = 2                 # head dims per thread in V's sums: D <= NT * DPT
QMAX = NT * DPT        # the rotated q row in shared memory
NCH_MAX = 64            # most splits of a row's keys
SPLIT_ROWS = 256        # rows (B S Hq) up to which a row's keys are split over blocks (decode); more rows: one block
COUNTERS = 4096         # per-row split counters of a kernel object (rows <= SPLIT_ROWS use them)
STORAGE = {10: np.uint16, 1: np.float32}
DTYPES = {10: "float16", 1: "float32"}
NINF = float32(-np.inf)
NAN = float32(np.nan)
FULL = np.uint32(0xFFFFFFFF)

if SIM:
    def addr(a):
        """The address of a (simulator) device array's data."""
        return int(a._ary.ctypes.data) if hasattr(a, "_ary") else int(a.ctypes.data)
else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def addr(typingctx, a):
        """The device address of an array argument's data (uint64)."""
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            return builder.ptrtoint(data, ir.IntType(64))
        return types.uint64(a), codegen


FUSED, APPEND, PRESENT = 0, 1, 2   # kernel modes: all steps in one launch (decode); steps 1-2 only; step 3-4 only,
#                                   every key read from present (the prompt's two launches)


def _make(f16, d, mode):
    """The kernel for fp16 (else fp32), head size ``d`` (a constant: the loops over a key's dims and a step's keys
    unroll, so their loads are in flight together) and ``mode``."""
    ld, st, rnd = (ld16, st16, r16) if f16 else (ld32, st32, same)
    cpk = NT // CH
    dp = (d + cpk - 1) // cpk           # dims per thread in the scores
    ndt = (d + NT - 1) // NT            # dims per thread in V's sums (<= DPT)
    half = d // 2

    @device
    def rot(x, base, j, cs, sn, cb):
        """Element j of the half-rotated head at x[base:base + d] (cos / sin row at cb), rounded to T; each product
        and the sum rounded to fp32 (no FMA contraction: the reference's roundings)."""
        if j < half:
            return rnd(add(mul(ld(x, base + j), ld(cs, cb + j)), -mul(ld(x, base + j + half), ld(sn, cb + j))))
        i = j - half
        return rnd(add(mul(ld(x, base + j), ld(cs, cb + i)), mul(ld(x, base + i), ld(sn, cb + i))))

    @cuda.jit
    def kernel(qkv, pk, pv, seql, cs, sn, out, ok, ov, part, cnt, b_, s_, hq, hkv, p, length, nch, kpc, mpos, scale):
        qs = cuda.shared.array(QMAX, float32)
        red = cuda.shared.array(NT, float32)
        ps = cuda.shared.array(CH, float32)
        flag = cuda.shared.array(1, uint32)
        acc = cuda.local.array(DPT, float32)
        vbuf = cuda.local.array(CH, float32)
        t = cuda.threadIdx.x
        blk = cuda.blockIdx.x
        w = (hq + 2 * hkv) * d
        g = hq // hkv
        # 1. past -> present where they are two buffers (all blocks, grid-stride), new positions left out
        if mode != PRESENT and addr(pk) != addr(ok):
            n_el = int64(b_) * hkv * p * d
            i = int64(blk) * NT + t
            stride = int64(cuda.gridDim.x) * NT
            while i < n_el:
                bi = i // (int64(hkv) * p * d)
                pos_t = (i // d) % p
                tb = int64(seql[bi]) + 1
                lo = int64(0) if tb <= s_ else tb - s_
                hi = int64(s_) if tb <= s_ else tb
                if pos_t < lo or pos_t >= hi:
                    e = ((i // (int64(p) * d)) * length + pos_t) * d + i % d
                    ok[e] = pk[i]
                    ov[e] = pv[i]
                i += stride
        row = blk // nch
        c = blk % nch
        bi = row // (s_ * hq)
        si = (row // hq) % s_
        h = row % hq
        kh = h // g
        tb = int64(seql[bi]) + 1
        first = tb <= s_                        # the row's first prompt
        pos = int64(si) if first else tb - s_ + si
        n = min(pos + 1, tb)
        lo_new = int64(0) if first else tb - s_
        xrow = (int64(bi) * s_ + si) * w
        if tb < 1 or tb > length or pos < 0 or pos >= mpos:     # values the op does not take: NaN, no writes
            if c == 0 and mode != APPEND:
                for j in range(t, d, NT):
                    st(out, int64(row) * d + j, NAN)
            return
        # 2. the new token's k and v into present (split 0 of the group's first head)
        if mode != PRESENT and c == 0 and h % g == 0:
            ob = ((int64(bi) * hkv + kh) * length + pos) * d
            for j in range(t, d, NT):
                st(ok, ob + j, rot(qkv, xrow + (hq + kh) * d, j, cs, sn, pos * half))
                st(ov, ob + j, ld(qkv, xrow + (hq + hkv + kh) * d + j))
        if mode == APPEND:
            return
        k0 = int64(c) * kpc
        k1 = min(k0 + kpc, n)
        if k0 >= k1:
            return
        # 3. q rotated into shared memory; the split's keys CH at a time (old keys from past, or all from present)
        srck = ok if mode == PRESENT else pk
        srcv = ov if mode == PRESENT else pv
        kst = int64(length) if mode == PRESENT else int64(p)
        for j in range(t, d, NT):
            qs[j] = rot(qkv, xrow + h * d, j, cs, sn, pos * half)
        cuda.syncthreads()
        kk = t // cpk
        j0 = (t % cpk) * dp
        m_run = NINF
        l_run = float32(0.0)
        for q_ in range(DPT):
            acc[q_] = float32(0.0)
        kvb = (int64(bi) * hkv + kh) * kst
        kb = k0
        while kb < k1:
            key = kb + kk
            part_s = float32(0.0)
            if key < k1:
                if mode == FUSED and key >= lo_new:
                    xb = (int64(bi) * s_ + key - lo_new) * w + (hq + kh) * d
                    for jj in range(dp):
                        if j0 + jj < d:
                            part_s += qs[j0 + jj] * rot(qkv, xb, j0 + jj, cs, sn, key * half)
                else:
                    pb = (kvb + key) * d + j0
                    for jj in range(dp):
                        if j0 + jj < d:
                            part_s += qs[j0 + jj] * ld(srck, pb + jj)
            red[t] = part_s
            cuda.syncthreads()
            if t < CH:
                sc = float32(0.0)
                for i in range(cpk):
                    sc += red[t * cpk + i]
                ps[t] = sc * scale if kb + t < k1 else NINF
            cuda.syncthreads()
            m_new = m_run
            for i in range(CH):
                m_new = max(m_new, ps[i])
            cuda.syncthreads()
            if t < CH:
                ps[t] = math.exp(ps[t] - m_new) if kb + t < k1 else float32(0.0)
            cuda.syncthreads()
            corr = math.exp(m_run - m_new) if m_run != NINF else float32(0.0)
            lsum = float32(0.0)
            for i in range(CH):
                lsum += ps[i]
            l_run = l_run * corr + lsum
            for q_ in range(ndt):
                j = t + q_ * NT
                if j < d:
                    for i in range(CH):             # the step's V loads first, all in flight, then the sums
                        key2 = kb + i
                        v = float32(0.0)
                        if key2 < k1:
                            if mode == FUSED and key2 >= lo_new:
                                v = ld(qkv, (int64(bi) * s_ + key2 - lo_new) * w + (hq + hkv + kh) * d + j)
                            else:
                                v = ld(srcv, (kvb + key2) * d + j)
                        vbuf[i] = v
                    a = acc[q_] * corr
                    for i in range(CH):
                        a += ps[i] * vbuf[i]
                    acc[q_] = a
            m_run = m_new
            cuda.syncthreads()
            kb += CH
        # 4. O, or this split's partial and the row's last block combining them
        ob = int64(row) * d
        if nch == 1:
            for q_ in range(ndt):
                j = t + q_ * NT
                if j < d:
                    st(out, ob + j, acc[q_] / l_run)
            return
        stride = d + 2
        pb = (int64(row) * nch + c) * stride
        for q_ in range(ndt):
            j = t + q_ * NT
            if j < d:
                part[pb + j] = acc[q_]
        if t == 0:
            part[pb + d] = m_run
            part[pb + d + 1] = l_run
        nact = (n + kpc - 1) // kpc
        if splitk.arrive_last(cnt, row, nact, flag, t == 0):
            base = int64(row) * nch * stride
            mx = NINF
            for c2 in range(nact):
                mx = max(mx, part[base + c2 * stride + d])
            ltot = float32(0.0)
            for c2 in range(nact):
                ltot += part[base + c2 * stride + d + 1] * math.exp(part[base + c2 * stride + d] - mx)
            for q_ in range(ndt):
                j = t + q_ * NT
                if j < d:
                    a = float32(0.0)
                    for c2 in range(nact):
                        a += part[base + c2 * stride + j] * math.exp(part[base + c2 * stride + d] - mx)
                    st(out, ob + j, a / ltot)
            if t == 0:
                cnt[row] = uint32(0)

    return kernel


NW = NT // 32           # warps per block
G = 8                   # keys per warp step of the decode kernel (their K and V loads in flight together)
DMAX = 256              # largest head size of the decode kernel (shared memory for the warps' sums)
WACC = NW * DMAX
RED = NT if SIM else 1  # the simulator's warp sums go through shared memory

if SIM:
    def _allsum(v, red, t):
        """The warp's sum in every lane (simulator: through shared memory; every thread of the block calls it)."""
        red[t] = v
        cuda.syncthreads()
        w0 = (t // 32) * 32
        s = float32(0.0)
        for i in range(32):
            s = float32(s + red[w0 + i])
        cuda.syncthreads()
        return s
else:
    @device
    def _allsum(v, red, t):
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL, v, off)
        return v


def _make_decode(f16, d):
    """The decode kernel (route cacheattention.warps): head size ``d`` a multiple of 32, each lane d / 32 dims; a warp
    takes G keys per step (their K / V loads issued together, scores by warp shuffles, a running max and sum in
    registers), the block's warps meet once in shared memory; then as the FUSED kernel: O, or the split's partial
    and the row's last block combining them. Indices from the block number by float reciprocals (arith.divmod_):
    64-bit divisions on the critical path cost the first kernel microseconds."""
    ld, st, rnd = (ld16, st16, r16) if f16 else (ld32, st32, same)
    dpl = d // 32
    gdpl = G * dpl
    half = d // 2

    @device
    def rot(x, base, j, cs, sn, cb):
        if j < half:
            return rnd(add(mul(ld(x, base + j), ld(cs, cb + j)), -mul(ld(x, base + j + half), ld(sn, cb + j))))
        i = j - half
        return rnd(add(mul(ld(x, base + j), ld(cs, cb + i)), mul(ld(x, base + i), ld(sn, cb + i))))

    @cuda.jit
    def kernel(qkv, pk, pv, seql, cs, sn, out, ok, ov, part, cnt, b_, s_, hq, hkv, p, length, nch, kpc, mpos, scale,
               g, inv_nch, inv_hq, inv_s, inv_g):
        red = cuda.shared.array(RED, float32)
        wm = cuda.shared.array(NW, float32)
        wl = cuda.shared.array(NW, float32)
        wacc = cuda.shared.array(WACC, float32)
        flag = cuda.shared.array(1, uint32)
        qv = cuda.local.array(dpl, float32)
        acc = cuda.local.array(dpl, float32)
        kbuf = cuda.local.array(gdpl, float32)
        vbuf = cuda.local.array(gdpl, float32)
        sc = cuda.local.array(G, float32)
        t = cuda.threadIdx.x
        lane = t % 32
        warp = t // 32
        blk = int64(cuda.blockIdx.x)
        w = (hq + 2 * hkv) * d
        # past -> present where they are two buffers (as the FUSED kernel)
        if addr(pk) != addr(ok):
            n_el = int64(b_) * hkv * p * d
            i = blk * NT + t
            stride = int64(cuda.gridDim.x) * NT
            while i < n_el:
                bi = i // (int64(hkv) * p * d)
                pos_t = (i // d) % p
                tb = int64(seql[bi]) + 1
                lo = int64(0) if tb <= s_ else tb - s_
                hi = int64(s_) if tb <= s_ else tb
                if pos_t < lo or pos_t >= hi:
                    e = ((i // (int64(p) * d)) * length + pos_t) * d + i % d
                    ok[e] = pk[i]
                    ov[e] = pv[i]
                i += stride
        row, c = divmod_(blk, nch, inv_nch)
        bs, h = divmod_(row, hq, inv_hq)
        bi, si = divmod_(bs, s_, inv_s)
        kh, hr = divmod_(h, g, inv_g)
        tb = int64(seql[bi]) + 1
        first = tb <= s_
        pos = si if first else tb - s_ + si
        n = min(pos + 1, tb)
        lo_new = int64(0) if first else tb - s_
        xrow = (bi * s_ + si) * w
        if tb < 1 or tb > length or pos < 0 or pos >= mpos:
            if c == 0:
                for j in range(t, d, NT):
                    st(out, row * d + j, NAN)
            return
        if c == 0 and hr == 0:
            ob = ((bi * hkv + kh) * length + pos) * d
            for j in range(t, d, NT):
                st(ok, ob + j, rot(qkv, xrow + (hq + kh) * d, j, cs, sn, pos * half))
                st(ov, ob + j, ld(qkv, xrow + (hq + hkv + kh) * d + j))
        k0 = c * kpc
        k1 = min(k0 + kpc, n)
        if k0 >= k1:
            return
        j0 = lane * dpl
        for i in range(dpl):
            qv[i] = rot(qkv, xrow + h * d, j0 + i, cs, sn, pos * half)
            acc[i] = float32(0.0)
        m_run = NINF
        l_run = float32(0.0)
        kvb = (bi * hkv + kh) * p
        nit = (k1 - k0 + NW * G - 1) // (NW * G)
        for it in range(nit):
            kb = k0 + (it * NW + warp) * G
            for gk in range(G):                     # the G keys' K and V rows: loads first
                key = kb + gk
                for i in range(dpl):
                    kx = float32(0.0)
                    vx = float32(0.0)
                    if key < k1:
                        if key >= lo_new:
                            xb = (bi * s_ + key - lo_new) * w
                            kx = rot(qkv, xb + (hq + kh) * d, j0 + i, cs, sn, key * half)
                            vx = ld(qkv, xb + (hq + hkv + kh) * d + j0 + i)
                        else:
                            e = (kvb + key) * d + j0 + i
                            kx = ld(pk, e)
                            vx = ld(pv, e)
                    kbuf[gk * dpl + i] = kx
                    vbuf[gk * dpl + i] = vx
            m_new = m_run
            for gk in range(G):
                dot = float32(0.0)
                for i in range(dpl):
                    dot += qv[i] * kbuf[gk * dpl + i]
                dot = _allsum(dot, red, t)
                sc[gk] = dot * scale if kb + gk < k1 else NINF
                m_new = max(m_new, sc[gk])
            if m_new != NINF:
                corr = math.exp(m_run - m_new) if m_run != NINF else float32(0.0)
                l_run = l_run * corr
                for i in range(dpl):
                    acc[i] = acc[i] * corr
                for gk in range(G):
                    pr = math.exp(sc[gk] - m_new) if kb + gk < k1 else float32(0.0)
                    l_run += pr
                    for i in range(dpl):
                        acc[i] += pr * vbuf[gk * dpl + i]
                m_run = m_new
        # the warps' (max, sum, acc) meet in shared memory
        if lane == 0:
            wm[warp] = m_run
            wl[warp] = l_run
        for i in range(dpl):
            wacc[warp * d + j0 + i] = acc[i]
        cuda.syncthreads()
        mx = NINF
        for w2 in range(NW):
            mx = max(mx, wm[w2])
        lb = float32(0.0)
        for w2 in range(NW):
            if wm[w2] != NINF:
                lb += wl[w2] * math.exp(wm[w2] - mx)
        ob = row * d
        stride = d + 2
        pb = (row * nch + c) * stride
        for j in range(t, d, NT):
            a = float32(0.0)
            for w2 in range(NW):
                if wm[w2] != NINF:
                    a += wacc[w2 * d + j] * math.exp(wm[w2] - mx)
            if nch == 1:
                st(out, ob + j, a / lb)
            else:
                part[pb + j] = a
        if nch == 1:
            return
        if t == 0:
            part[pb + d] = mx
            part[pb + d + 1] = lb
        nact = (n + kpc - 1) // kpc
        if splitk.arrive_last(cnt, row, nact, flag, t == 0):
            base = row * nch * stride
            mt = NINF
            for c2 in range(nact):
                mt = max(mt, part[base + c2 * stride + d])
            ltot = float32(0.0)
            for c2 in range(nact):
                ltot += part[base + c2 * stride + d + 1] * math.exp(part[base + c2 * stride + d] - mt)
            for j in range(t, d, NT):
                a = float32(0.0)
                for c2 in range(nact):
                    a += part[base + c2 * stride + j] * math.exp(part[base + c2 * stride + d] - mt)
                st(out, ob + j, a / ltot)
            if t == 0:
                cnt[row] = uint32(0)

    return kernel


def _signature(elem, warps=False):
    a = Array(STORAGE[elem])
    return ([a, a, a, Array(np.int32), a, a, a, a, a, Array(np.float32), Array(np.uint32)]
            + ["int64"] * 9 + ["float32"] + (["int64"] + ["float64"] * 4 if warps else []))


# Which kernel serves which call (routing.py). Case: M = query rows (B S Hq), K = D, N = present length.
ROUTES = (
    Route("cacheattention.warps", f"rows (B S Hq) <= SPLIT_ROWS, D a multiple of 32 up to {DMAX}: each row's keys "
          "split over up to NCH_MAX blocks, G keys per warp step, combined by the row's last block",
          lambda c: c.m <= SPLIT_ROWS and c.k % 32 == 0 and c.k <= DMAX,
          "BENCHMARKS.md, CacheAttention in genai's loop (ncu, H200 2026-11-30, 16 heads, D = 128, a 2048-position "
          "cache: 28.7-29.3 us against the first kernel's 33.9-34.8 at 201 keys, 46.1-46.9 / 42.7-46.8 at 1001)"),
    Route("cacheattention.split", "other head sizes at rows <= SPLIT_ROWS: the first kernel, one block per (row, "
          "split), block barriers per CH keys", lambda c: c.m <= SPLIT_ROWS,
          "correctness fallback (D not a multiple of 32); as the decode kernel in genai's loop it took 27 us per "
          "launch (BENCHMARKS.md, CacheAttention in genai's loop)"),
    Route("cacheattention.rows", "more rows (prefill): the append, then one block per row over all its keys in "
          "present", always,
          "BENCHMARKS.md, same section (prompt 1024: 12.3x slower than GroupQueryAttention)"),
)
_launchers = {}


WARPS = -1              # launcher mode of the decode kernel (route cacheattention.warps)


def launcher(elem, d, mode):
    """The direct-launch wrapper of the kernel for fp16 (10) or fp32 (1), head size ``d`` and ``mode`` (FUSED, APPEND,
    PRESENT, or WARPS: the decode kernel), compiled once per process; under the simulator launch.SimLauncher."""
    key = (elem, d, mode)
    if key not in _launchers:
        fn = _make_decode(elem == 10, d) if mode == WARPS else _make(elem == 10, d, mode)
        _launchers[key] = (SimLauncher if SIM else Launcher)(fn, _signature(elem, mode == WARPS))
    return _launchers[key]


def splits(rows, length, name):
    """(nch, kpc): blocks per row and keys per block."""
    steps = max(1, -(-length // CH))
    if name == "cacheattention.rows":
        return 1, steps * CH
    per = -(-steps // NCH_MAX)
    kpc = per * CH
    return -(-length // kpc), kpc


class CacheAttentionCudaKernel(Kernel):
    """Per call: validates the shapes, then the routed launches (decode: one; a prompt: append, then attention); the
    per-row split counters (device/splitk.ScratchPool, per stream) live with the kernel object."""
    native_plans = True  # launches whose parameters depend only on the input shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.elem = self.in_types[0]
        self.hq, self.hkv = int(self.attrs["num_heads"]), int(self.attrs["kv_num_heads"])
        self.scale = float(self.attrs.get("scale", 0.0))
        self.share = int(self.attrs.get("share_buffer", 0))
        if self.hq < 1 or self.hkv < 1 or self.hq % self.hkv:
            raise KernelError(f"num_heads ({self.hq}) must be a positive multiple of kv_num_heads ({self.hkv})")
        self.pool = splitk.ScratchPool(1, COUNTERS)

    def compute(self, ctx, inputs):
        qkv, pk, pv, sl, cs, sn = (self.check_input(inputs, i) for i in range(6))
        try:
            b, s, d, p, length = ca.dims(qkv.shape, pk.shape, cs.shape, self.hq, self.hkv, self.share)
            if tuple(pv.shape) != tuple(pk.shape) or tuple(sn.shape) != tuple(cs.shape):
                raise ca.CacheAttentionError("past_value must have past_key's shape and sin_cache cos_cache's")
            if tuple(sl.shape) != (b,):
                raise ca.CacheAttentionError(f"seqlens_k must be [B] = [{b}], got {list(sl.shape)}")
            if d > NT * DPT:
                raise ca.CacheAttentionError(f"CacheAttention on CUDA takes head sizes up to {NT * DPT}, got {d}")
        except ca.CacheAttentionError as e:
            raise KernelError(str(e)) from None
        o = ctx.output(0, (b, s, self.hq * d))
        okp = ctx.output(1, (b, self.hkv, length, d))
        ovp = ctx.output(2, (b, self.hkv, length, d))
        rows = b * s * self.hq
        if rows == 0 or length == 0:
            return
        name = route(ROUTES, Case(DTYPES[self.elem], rows, d, length)).kernel
        nch, kpc = splits(rows, length, name)
        floats = rows * nch * (d + 2) if nch > 1 else 0
        part = self.pool.partials(ctx, floats)
        cnt = self.pool.counters(ctx.stream)
        nx, nkv, nkvp = b * s * (self.hq + 2 * self.hkv) * d, b * self.hkv * p * d, b * self.hkv * length * d
        nc = int(np.prod(cs.shape))
        sc = float(ca.scale_of(self.scale, d))
        args = ((qkv.ptr, (nx,)), (pk.ptr, (nkv,)), (pv.ptr, (nkv,)), (sl.ptr, (b,)), (cs.ptr, (nc,)), (sn.ptr, (nc,)),
                (o, (rows * d,)), (okp, (nkvp,)), (ovp, (nkvp,)), part, cnt, b, s, self.hq, self.hkv, p, length, nch,
                kpc, cs.shape[0], sc)
        # decode: one launch; a prompt: the append, then the attention over present (a prompt's keys rotated once,
        # not once per query row that reads them)
        if name == "cacheattention.warps":
            g = self.hq // self.hkv
            launcher(self.elem, d, WARPS).launch(rows * nch, NT, ctx.stream, *args, g, 1.0 / nch, 1.0 / self.hq,
                                                 1.0 / s, 1.0 / g)
            return
        for mode in ((FUSED,) if name == "cacheattention.split" else (APPEND, PRESENT)):
            launcher(self.elem, d, mode).launch(rows * nch, NT, ctx.stream, *args)


KERNEL = CacheAttentionCudaKernel

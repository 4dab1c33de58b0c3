"""CacheAttention, CUDA face (onnx_lowbit.cacheattention): rotary, the cache append and the attention of every query
row in one launch (onnxruntime's GroupQueryAttention takes four kernels per decode step: a memset, the sequence
lengths, rotary + append, the attention).

Decode (rows B S Hq <= SPLIT_ROWS) takes one launch: the warp kernel (``_make_decode``, where a K / V row is D / 8
(fp16) or D / 4 (fp32) 16-byte chunks, a power of two up to 32: a chunk per lane, G loads per lane in flight, scores
by shuffles, each row's keys split evenly over NSPLIT blocks), or for other head sizes the first kernel in mode FUSED.
A prompt takes two launches: fp16 head sizes a multiple of 16 (aligned buffers) the tensor-core route's append and
attention (cacheattention_tc_cuda.py), others APPEND (steps 1-2 of the first kernel), then the first kernel in mode
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

from ..device import host, pdl, splitk
from ..device.arith import add, divmod_, mul
from ..device.fp16 import r16, same
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import LOAD, addr, ld16, ld32, make_ld4, st16, st32, w16, w32
from ..device.target import SIM, device, tc_device
from ..runtime.kernels import Kernel, KernelError
from ..runtime.routing import Case, Route, always, route
from . import cacheattention_tc_cuda as tc

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

PRE = 16                # splits of a row whose partials the combining block loads first (the decode's NSPLIT)
RED = NT * 10 if SIM else 1  # the simulator's warp exchanges go through shared memory (NT x max(G, 8 + 2))

if SIM:
    def _warp_reduce(v, red, t, is_max):
        """The warp's sum (or max) in every lane (simulator: through shared memory; every thread of the block calls
        it)."""
        red[t] = v
        cuda.syncthreads()
        w0 = (t // 32) * 32
        s = NINF if is_max else float32(0.0)
        for i in range(32):
            s = max(s, red[w0 + i]) if is_max else float32(s + red[w0 + i])
        cuda.syncthreads()
        return s

    def _allsum(v, red, t):
        return _warp_reduce(v, red, t, False)

    def _allmax(v, red, t):
        return _warp_reduce(v, red, t, True)
else:
    @device
    def _allsum(v, red, t):
        """The warp's sum in every lane (butterfly shuffles: every lane the same bits)."""
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL, v, off)
        return v

    @device
    def _allmax(v, red, t):
        """The warp's max in every lane."""
        for off in (16, 8, 4, 2, 1):
            v = max(v, cuda.shfl_xor_sync(FULL, v, off))
        return v


def _rotation(f16, half):
    """rot(x, base, j, cs, sn, cb): element j of the half-rotated head at x[base:base + 2 half] (cos / sin row at
    cb), rounded to T; each product and the sum rounded to fp32 (no FMA contraction: the reference's roundings)."""
    ld, rnd = (ld16, r16) if f16 else (ld32, same)

    @device
    def rot(x, base, j, cs, sn, cb):
        if j < half:
            return rnd(add(mul(ld(x, base + j), ld(cs, cb + j)), -mul(ld(x, base + j + half), ld(sn, cb + j))))
        i = j - half
        return rnd(add(mul(ld(x, base + j), ld(cs, cb + i)), mul(ld(x, base + i), ld(sn, cb + i))))
    return rot


def _shared_steps(f16):
    """The steps both CUDA kernels take alike: ``copy_past`` (past into present, grid-stride over every block, the
    positions the call's new tokens take left out) and ``combine`` (the row's last block: its splits' partials
    (acc[d], max, sum) summed in split order into O, the row's counter reset)."""
    st = st16 if f16 else st32

    @device
    def copy_past(pk, pv, ok, ov, seql, b_, s_, hkv, p, length, d, blk, t):
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

    @device
    def combine(part, cnt, out, row, nch, nact, d, t, red, ws):
        """The row's last block: its ``nact`` (<= 64) partials in one pass: every warp reads the splits' maxima and
        sums (lane i splits i and i + 32) and reduces them by shuffles, warp 0 leaves each split's weight
        exp(m_c - max) in ``ws`` (shared, NCH_MAX), then each thread sums its dims over the splits in split order,
        8 loads in flight at a time. (One load per step made this a chain of ~3 nact L2 round trips: most of the
        decode kernel's time.) The first PRE splits' values of the thread's first dim are loaded together with the
        maxima and sums, so the decode's 16 splits take one round trip, not two (H200, ncu at 192 / 1088 keys: 9.8 /
        12.2 against 10.1 / 12.5-12.8 us; genai's loop 0.615-0.617 / 0.658-0.659 against 0.623 / 0.664 ms per
        token)."""
        stride = d + 2
        base = row * nch * stride
        pre = cuda.local.array(PRE, float32)
        for i in range(PRE):            # unrolled: registers, every load in flight with the maxima's
            pre[i] = part[base + i * stride + t] if i < nact and t < d else float32(0.0)
        lane = t % 32
        c0 = lane
        c1 = lane + 32
        m0 = part[base + c0 * stride + d] if c0 < nact else NINF
        m1 = part[base + c1 * stride + d] if c1 < nact else NINF
        l0 = part[base + c0 * stride + d + 1] if c0 < nact else float32(0.0)
        l1 = part[base + c1 * stride + d + 1] if c1 < nact else float32(0.0)
        mt = _allmax(max(m0, m1), red, t)
        w0 = math.exp(m0 - mt) if m0 != NINF else float32(0.0)
        w1 = math.exp(m1 - mt) if m1 != NINF else float32(0.0)
        ltot = _allsum(l0 * w0 + l1 * w1, red, t)
        if t < 32:
            ws[c0] = w0
            ws[c1] = w1
        cuda.syncthreads()
        for q_ in range(DPT):
            j = t + q_ * NT
            if j >= d:
                break
            a = float32(0.0)
            c2 = 0
            if q_ == 0:                     # the splits loaded first, in split order
                for i in range(PRE):
                    if i < nact:
                        a += pre[i] * ws[i]
                c2 = min(nact, PRE)
            while c2 + 8 <= nact:           # 8 independent loads, then the adds in split order
                b = base + c2 * stride + j
                v0 = part[b]
                v1 = part[b + stride]
                v2 = part[b + 2 * stride]
                v3 = part[b + 3 * stride]
                v4 = part[b + 4 * stride]
                v5 = part[b + 5 * stride]
                v6 = part[b + 6 * stride]
                v7 = part[b + 7 * stride]
                a += v0 * ws[c2]
                a += v1 * ws[c2 + 1]
                a += v2 * ws[c2 + 2]
                a += v3 * ws[c2 + 3]
                a += v4 * ws[c2 + 4]
                a += v5 * ws[c2 + 5]
                a += v6 * ws[c2 + 6]
                a += v7 * ws[c2 + 7]
                c2 += 8
            while c2 < nact:
                a += part[base + c2 * stride + j] * ws[c2]
                c2 += 1
            st(out, row * d + j, a / ltot)
        if t == 0:
            cnt[row] = uint32(0)
    return copy_past, combine


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

    rot = _rotation(f16, half)
    copy_past, combine = _shared_steps(f16)

    @cuda.jit
    def kernel(qkv, pk, pv, seql, cs, sn, out, ok, ov, part, cnt, b_, s_, hq, hkv, p, length, nch, kpc, mpos, scale):
        qs = cuda.shared.array(QMAX, float32)
        red = cuda.shared.array(NT, float32)
        ps = cuda.shared.array(CH, float32)
        flag = cuda.shared.array(1, uint32)
        ws = cuda.shared.array(NCH_MAX, float32)
        acc = cuda.local.array(DPT, float32)
        vbuf = cuda.local.array(CH, float32)
        t = cuda.threadIdx.x
        blk = cuda.blockIdx.x
        w = (hq + 2 * hkv) * d
        g = hq // hkv
        # 1. past -> present where they are two buffers (all blocks, grid-stride), new positions left out
        if mode != PRESENT and addr(pk) != addr(ok):
            copy_past(pk, pv, ok, ov, seql, b_, s_, hkv, p, length, d, int64(blk), t)
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
            combine(part, cnt, out, int64(row), nch, nact, d, t, red, ws)

    return kernel


NW = NT // 32           # warps per block
G = 4                   # 16-byte K and V loads per lane in flight per step of the decode kernel
NSPLIT = 2 if SIM else 16  # blocks per query row of the decode kernel, whatever the length: each n / NSPLIT keys
DMAX = 256              # largest head size of the decode kernel (shared memory for the warps' sums)
WACC = NW * DMAX


def lanes_per_key(elem, d):
    """Lanes of a warp that share one key in the decode kernel (each a 16-byte chunk of its K and V rows: 8 fp16 or
    4 fp32 dims), or 0 where that is not a power of two up to 32 or a chunk would straddle the rotation's halves
    (the head size then goes to the first kernel)."""
    ne = 8 if elem == 10 else 4
    lpk = d // ne
    return lpk if d % (2 * ne) == 0 and 0 < lpk <= 32 and lpk & (lpk - 1) == 0 and d <= DMAX else 0


def _make_decode(f16, d):
    """The decode kernel (route cacheattention.warps): a key's K and V rows are read by LPK lanes, one 16-byte
    chunk each (fp16: 8 dims, so D = 128 takes 16 lanes and a warp reads 2 keys per load), G loads per lane in
    flight per step; scores summed over the key's lanes by shuffles; each key group of the warp keeps its running
    max, sum and weighted V, the groups then the warps meet (shuffles, then shared memory), then as the FUSED
    kernel: O, or the split's partial and the row's last block combining them. The keys the call appends are read
    from QKV and rotated (a short loop after the cache's). Every load that needs only the row's positions goes
    out together before the first one is waited on (q's rotation words, the first appended key's K and V words,
    the cache's first K / V step, that one issued before griddepcontrol.wait: the cache is never written by the
    kernel before), so a block's chain is one round trip shorter per group, and each later step's K / V loads go
    out before the step before it is summed (one round trip less per step past the first; at 1088 keys 12.9
    against 13.5 us under ncu, genai's loop after 1024 tokens 0.664 against 0.679 ms per token); the appended key and
    value are stored into present after the block's arrival (no block of the launch reads them from there).
    Indices from the block number by float reciprocals (arith.divmod_)."""
    ld, st, rnd = (ld16, st16, r16) if f16 else (ld32, st32, same)
    ne = 8 if f16 else 4            # dims per lane (one 16-byte chunk)
    lpk = lanes_per_key(10 if f16 else 1, d)
    kpw = 32 // lpk                 # keys per warp load
    span = G * kpw                  # keys per warp step
    gw = G * 4                      # the step's words per lane (K and V each)
    half = d // 2
    ld4 = make_ld4(LOAD)

    rot = _rotation(f16, half)
    copy_past, combine = _shared_steps(f16)

    if SIM:
        # the simulator: the warp's exchanges through shared memory, each in one pair of barriers (every thread
        # of the block calls them); sums in lane order
        def key_sums(sc, red, t):
            for gl in range(G):
                red[t * G + gl] = sc[gl]
            cuda.syncthreads()
            b0 = (t // lpk) * lpk
            for gl in range(G):
                v = float32(0.0)
                for i in range(lpk):
                    v = float32(v + red[(b0 + i) * G + gl])
                sc[gl] = v
            cuda.syncthreads()

        def merge_groups(m, l_, acc, red, t):
            st_ = ne + 2
            red[t * st_] = m
            red[t * st_ + 1] = l_
            for i in range(ne):
                red[t * st_ + 2 + i] = acc[i]
            cuda.syncthreads()
            w0 = (t // 32) * 32 + t % lpk
            mm = NINF
            for k in range(kpw):
                mm = max(mm, red[(w0 + k * lpk) * st_])
            lt = float32(0.0)
            for i in range(ne):
                acc[i] = float32(0.0)
            for k in range(kpw):
                b_ = (w0 + k * lpk) * st_
                f = math.exp(red[b_] - mm) if red[b_] != NINF else float32(0.0)
                lt += red[b_ + 1] * f
                for i in range(ne):
                    acc[i] += red[b_ + 2 + i] * f
            cuda.syncthreads()
            return mm, lt
    else:
        @device
        def key_sums(sc, red, t):
            """Each of the G scores summed over the lanes that share its key (butterfly shuffles)."""
            for gl in range(G):
                v = sc[gl]
                for off in (16, 8, 4, 2, 1):
                    if off < lpk:
                        v += cuda.shfl_xor_sync(FULL, v, off)
                sc[gl] = v

        @device
        def merge_groups(m, l_, acc, red, t):
            """The running (max, sum, acc) of the warp's key groups merged (shuffles between the lanes that hold the
            same dims): (max, sum) returned, acc updated, the same in every group."""
            for off in (1, 2, 4, 8, 16):
                if off >= lpk:
                    mo = cuda.shfl_xor_sync(FULL, m, off)
                    lo = cuda.shfl_xor_sync(FULL, l_, off)
                    mm = max(m, mo)
                    fa = math.exp(m - mm) if m != NINF else float32(0.0)
                    fb = math.exp(mo - mm) if mo != NINF else float32(0.0)
                    l_ = l_ * fa + lo * fb
                    for i in range(ne):
                        ao = cuda.shfl_xor_sync(FULL, acc[i], off)
                        acc[i] = acc[i] * fa + ao * fb
                    m = mm
            return m, l_

    elem = w16 if f16 else w32          # dim e of the chunk held by words[i .. i + 4)

    @device
    def load(words, i, a, ch):
        """words[i .. i + 4) = chunk ch of a (one 16-byte load)."""
        w0, w1, w2, w3 = ld4(a, ch)
        words[i] = w0
        words[i + 1] = w1
        words[i + 2] = w2
        words[i + 3] = w3

    @device
    def kv_load(pk, pv, kw, vw, kb, kend, cb):
        """A step's cache keys and values (the warp's G loads of keys kb + gl * kpw below kend; zeros past it)."""
        for gl in range(G):
            key = kb + gl * kpw
            if key < kend:
                ch = cb + key * lpk
                k_0, k_1, k_2, k_3 = ld4(pk, ch)
                v_0, v_1, v_2, v_3 = ld4(pv, ch)
            else:
                k_0 = k_1 = k_2 = k_3 = v_0 = v_1 = v_2 = v_3 = uint32(0)
            kw[gl * 4] = k_0
            kw[gl * 4 + 1] = k_1
            kw[gl * 4 + 2] = k_2
            kw[gl * 4 + 3] = k_3
            vw[gl * 4] = v_0
            vw[gl * 4 + 1] = v_1
            vw[gl * 4 + 2] = v_2
            vw[gl * 4 + 3] = v_3

    @device
    def rot_load(x, xb, j0, cs, sn, pos, rw):
        """The four 16-byte loads rot_math rotates (the lane's chunk of the head at x[xb:xb + d], its partner
        half's, the cos and sin chunks at ``pos``) into rw[0 .. 16), issued apart from their use."""
        lo = j0 < half
        pj = j0 + half if lo else j0 - half
        load(rw, 0, x, (xb + j0) // ne)
        load(rw, 4, x, (xb + pj) // ne)
        cb = (pos * half + min(j0, pj)) // ne
        load(rw, 8, cs, cb)
        load(rw, 12, sn, cb)

    @device
    def key_load(qkv, xb, hq, hkv, kh, j0, cs, sn, key, rw, rv):
        """An appended key's words (QKV's row at xb): its K chunk's rotation words into rw, its V chunk into rv."""
        rot_load(qkv, xb + (hq + kh) * d, j0, cs, sn, key, rw)
        load(rv, 0, qkv, (xb + (hq + hkv + kh) * d + j0) // ne)

    @device
    def rot_math(j0, rw, dst):
        """dst[0 .. ne) = dims j0 .. j0 + ne rotated from rot_load's words (as _rotation: the same roundings)."""
        lo = j0 < half
        for e in range(ne):
            a = mul(elem(rw, 0, e), elem(rw, 8, e))
            b = mul(elem(rw, 4, e), elem(rw, 12, e))
            dst[e] = rnd(add(a, -b) if lo else add(a, b))

    @device
    def append(qkv, ok, ov, cs, sn, bi, kh, hq, hkv, length, pos, xrow, t):
        """The call's new key (rotated) and value into present at ``pos`` (one thread per dim)."""
        ob = ((bi * hkv + kh) * length + pos) * d
        for q_ in range(DMAX // NT):
            j = t + q_ * NT
            if j < d:
                st(ok, ob + j, rot(qkv, xrow + (hq + kh) * d, j, cs, sn, pos * half))
                st(ov, ob + j, ld(qkv, xrow + (hq + hkv + kh) * d + j))

    @cuda.jit
    def kernel(qkv, pk, pv, seql, cs, sn, out, ok, ov, part, cnt, b_, s_, hq, hkv, p, length, nch, kpc, mpos, scale,
               g, inv_nch, inv_hq, inv_s, inv_g):
        red = cuda.shared.array(RED, float32)
        wm = cuda.shared.array(NW, float32)
        wl = cuda.shared.array(NW, float32)
        wacc = cuda.shared.array(WACC, float32)
        flag = cuda.shared.array(1, uint32)
        ws = cuda.shared.array(NCH_MAX, float32)
        qv = cuda.local.array(ne, float32)
        acc = cuda.local.array(ne, float32)
        kw = cuda.local.array(gw, uint32)
        vw = cuda.local.array(gw, uint32)
        kw2 = cuda.local.array(gw, uint32)
        vw2 = cuda.local.array(gw, uint32)
        sc = cuda.local.array(G, float32)
        rq = cuda.local.array(16, uint32)
        rw = cuda.local.array(16, uint32)
        rv = cuda.local.array(4, uint32)
        kx = cuda.local.array(ne, float32)
        t = cuda.threadIdx.x
        lane = t % 32
        warp = t // 32
        grp = lane // lpk               # the lane's key within a warp load
        j0 = (lane % lpk) * ne          # its dims
        blk = int64(cuda.blockIdx.x)
        w = (hq + 2 * hkv) * d
        row, c = divmod_(blk, nch, inv_nch)
        bs, h = divmod_(row, hq, inv_hq)
        bi, si = divmod_(bs, s_, inv_s)
        kh, hr = divmod_(h, g, inv_g)
        # seqlens_k before the wait (its round trip overlaps the kernel before): the kernels that let a dependent
        # start early are ours, each waits for the one before it first, and none writes an int32 tensor, so
        # whatever wrote seqlens_k has finished when this launch begins
        tb = int64(seql[bi]) + 1
        first = tb <= s_
        pos = si if first else tb - s_ + si
        n = min(pos + 1, tb)
        lo_new = int64(0) if first else tb - s_
        bad = tb < 1 or tb > length or pos < 0 or pos >= mpos
        k0 = divmod_(c * n, nch, inv_nch)[0]        # the row's n keys split evenly over its nch blocks (a block
        k1 = divmod_((c + 1) * n, nch, inv_nch)[0]  # with none still arrives, with an empty partial)
        kend = k0 if bad else min(k1, lo_new)       # the cache's keys (those the call appends come from QKV)
        cb = (bi * hkv + kh) * p * lpk + j0 // ne   # chunk of key 0's K row for this lane
        # the cache's first K / V step before the wait too: past's keys were written by earlier launches (or are
        # the session's input), never by the kernel before, which has let this one start only after its own wait
        kv_load(pk, pv, kw, vw, k0 + warp * span + grp, kend, cb)
        pdl.wait()          # everything below may read what the kernel before wrote (device/pdl.py)
        pdl.trigger()
        # past -> present where they are two buffers (as the FUSED kernel)
        if addr(pk) != addr(ok):
            copy_past(pk, pv, ok, ov, seql, b_, s_, hkv, p, length, d, blk, t)
        xrow = (bi * s_ + si) * w
        if bad:
            if c == 0:
                for q_ in range(DMAX // NT):
                    j = t + q_ * NT
                    if j < d:
                        st(out, row * d + j, NAN)
            return
        # every load that needs only the positions goes out at once, before the first waits on one: q's rotation
        # words, the first appended key's (its K words rotated, its V chunk); the cache's first K / V step is in
        # flight since before the wait
        rot_load(qkv, xrow + h * d, j0, cs, sn, pos, rq)
        k2 = max(k0, lo_new)
        key0 = k2 + warp * kpw + grp
        if key0 < k1:
            key_load(qkv, (bi * s_ + key0 - lo_new) * w, hq, hkv, kh, j0, cs, sn, key0, rw, rv)
        qdone = False
        for i in range(ne):
            acc[i] = float32(0.0)
        m_run = NINF
        l_run = float32(0.0)
        # the cache's keys: 16-byte loads, G per lane (the first step's loaded above, each later step's while the
        # step before it is summed), then the scores and the running sums
        nit = (kend - k0 + NW * span - 1) // (NW * span) if kend > k0 else int64(0)
        for it in range(nit):
            kb = k0 + (it * NW + warp) * span + grp
            if it + 1 < nit:        # the next step's loads in flight while this one's sums run
                kv_load(pk, pv, kw2, vw2, kb + NW * span, kend, cb)
            if not qdone:       # q rotated once its words and the first K / V step's are in flight
                rot_math(j0, rq, qv)
                qdone = True
            for gl in range(G):
                dot = float32(0.0)
                for i in range(ne):
                    dot += qv[i] * elem(kw, gl * 4, i)
                sc[gl] = dot
            key_sums(sc, red, t)
            m_new = m_run
            for gl in range(G):
                sc[gl] = sc[gl] * scale if kb + gl * kpw < kend else NINF
                m_new = max(m_new, sc[gl])
            if m_new != NINF:
                corr = math.exp(m_run - m_new) if m_run != NINF else float32(0.0)
                l_run = l_run * corr
                for i in range(ne):
                    acc[i] = acc[i] * corr
                for gl in range(G):
                    pr = math.exp(sc[gl] - m_new) if sc[gl] != NINF else float32(0.0)
                    l_run += pr
                    for i in range(ne):
                        acc[i] += pr * elem(vw, gl * 4, i)
                m_run = m_new
            for i in range(gw):
                kw[i] = kw2[i]
                vw[i] = vw2[i]
        if not qdone:
            rot_math(j0, rq, qv)
        # the keys the call appends (decode: one): from QKV, rotated (the first one's words loaded above)
        nit = (k1 - k2 + NW * kpw - 1) // (NW * kpw) if k1 > k2 else int64(0)
        for it in range(nit):
            key = k2 + (it * NW + warp) * kpw + grp
            ok_ = key < k1
            xb = (bi * s_ + key - lo_new) * w
            dot = float32(0.0)
            if ok_:
                if it > 0:
                    key_load(qkv, xb, hq, hkv, kh, j0, cs, sn, key, rw, rv)
                rot_math(j0, rw, kx)
                for i in range(ne):
                    dot += qv[i] * kx[i]
            sc[0] = dot
            for gl in range(1, G):
                sc[gl] = float32(0.0)
            key_sums(sc, red, t)
            sk = sc[0] * scale if ok_ else NINF
            m_new = max(m_run, sk)
            if m_new != NINF:
                corr = math.exp(m_run - m_new) if m_run != NINF else float32(0.0)
                pr = math.exp(sk - m_new) if ok_ else float32(0.0)
                l_run = l_run * corr + pr
                for i in range(ne):
                    vx = elem(rv, 0, i) if ok_ else float32(0.0)
                    acc[i] = acc[i] * corr + pr * vx
                m_run = m_new
        # the warp's key groups meet (lanes of the same dims), then the warps in shared memory
        m_run, l_run = merge_groups(m_run, l_run, acc, red, t)
        if lane == 0:
            wm[warp] = m_run
            wl[warp] = l_run
        if grp == 0:
            for i in range(ne):
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
        for q_ in range(DMAX // NT):
            j = t + q_ * NT
            if j >= d:
                break
            a = float32(0.0)
            for w2 in range(NW):
                if wm[w2] != NINF:
                    a += wacc[w2 * d + j] * math.exp(wm[w2] - mx)
            if nch == 1:
                st(out, ob + j, a / lb)
            else:
                part[pb + j] = a
        if nch > 1:
            if t == 0:
                part[pb + d] = mx
                part[pb + d + 1] = lb
            if splitk.arrive_last(cnt, row, nch, flag, t == 0):
                combine(part, cnt, out, row, nch, nch, d, t, red, ws)
        # the new key and value into present last, off the path to the row's combine: no block of this launch
        # reads them there (the keys the call appends are read from QKV above)
        if c == 0 and hr == 0:
            append(qkv, ok, ov, cs, sn, bi, kh, hq, hkv, length, pos, xrow, t)

    return kernel


def _signature(elem, warps=False):
    a = Array(STORAGE[elem])
    return ([a, a, a, Array(np.int32), a, a, a, a, a, Array(np.float32), Array(np.uint32)]
            + ["int64"] * 9 + ["float32"] + (["int64"] + ["float64"] * 4 if warps else []))


# Which kernel serves which call (routing.py). Case: M = query rows (B S Hq), K = D, N = present length.
ROUTES = (
    Route("cacheattention.warps", f"rows (B S Hq) <= SPLIT_ROWS, D / (8 fp16 or 4 fp32 dims) a power of two up to "
          f"32 lanes, D <= {DMAX}, D / 2 a multiple of those dims, QKV, past and the tables 16-byte aligned: each "
          "row's keys split evenly over NSPLIT blocks, 16-byte loads, G per lane in flight, combined by the row's "
          "last block",
          lambda c: c.m <= SPLIT_ROWS and c.aligned and lanes_per_key(10 if c.dtype == "float16" else 1, c.k) > 0,
          "BENCHMARKS.md, CacheAttention in genai's loop (H200 2026-11-30, 16 heads, D = 128, a 2048-position "
          "cache; ncu, warm: 7.5 us at 201 keys, 8.9 at 1025 since its loads go out together (8.0 / 10.1-10.3 "
          "before), against the first kernel's 20.4-22.1 at 201; genai's loop: 8.1 us per launch before that, "
          "GroupQueryAttention's four kernels 12.0 us per layer; 2026-12-01, ncu flushing caches: 10.4 / 12.9 us at "
          "192 / 1088 keys with the cache loads a step ahead, 13.5 at 1088 one step at a time; 16 blocks per row and "
          "G = 4 beat 8 or 32 blocks and G = 8)"),
    Route("cacheattention.split", "other head sizes (or unaligned buffers) at rows <= SPLIT_ROWS: the first kernel, "
          "one block per (row, split), block barriers per CH keys", lambda c: c.m <= SPLIT_ROWS,
          "correctness fallback (head sizes the warp kernel does not take); as the decode kernel in genai's loop "
          "it took 27 us per launch (BENCHMARKS.md, CacheAttention in genai's loop)"),
    Route("cacheattention.tc", f"more rows (prefill), fp16, D a multiple of 16 up to {tc.TCD}, tensor cores, "
          "buffers 16-byte aligned: the append, then tiles of 64 query rows x 32 keys on mma.sync (P in fp16), the "
          "heaviest query tiles' blocks first, every other round of SM-count blocks turned back",
          lambda c: c.m > SPLIT_ROWS and c.dtype == "float16" and c.tc and c.aligned and tc.fits(c.k),
          "benchmarks/cacheattention_gpu.py --prompt N (H200 2026-11-30, 16 heads, D = 128, ncu): append + attention "
          "4 + 13 us at 128 tokens, 6 + 55 us at 1024 (72 before the tiles' block order), against the rows route's "
          "9 + 103 us / 50 us + 4.67 ms"),
    Route("cacheattention.rows", "more rows (prefill): the append, then one block per row over all its keys in "
          "present", always,
          "fallback (fp32, head sizes the tensor-core route does not take); fp16 prompts before the tc route: 81 "
          "against 6.5 ms for genai's whole prefill at 1024 tokens (BENCHMARKS.md, CacheAttention in genai's loop)"),
)
_launchers = {}


WARPS = -1              # launcher mode of the decode kernel (route cacheattention.warps)


def launcher(elem, d, mode):
    """The direct-launch wrapper of the kernel for fp16 (10) or fp32 (1), head size ``d`` and ``mode`` (FUSED, APPEND,
    PRESENT, or WARPS: the decode kernel), compiled once per process; under the simulator launch.SimLauncher."""
    key = (elem, d, mode)
    if key not in _launchers:
        fn = _make_decode(elem == 10, d) if mode == WARPS else _make(elem == 10, d, mode)
        sig = _signature(elem, mode == WARPS)
        # the decode kernel waits for the kernel before it after reading only seqlens_k (device/pdl.py), so it may
        # start early
        _launchers[key] = SimLauncher(fn, sig) if SIM else Launcher(fn, sig, pdl=mode == WARPS)
    return _launchers[key]


def splits(rows, length, name):
    """(nch, kpc): blocks per row and keys per block (the decode kernel: NSPLIT blocks sharing the row's keys as
    the device finds them, kpc unused)."""
    if name == "cacheattention.warps":
        return NSPLIT, 0
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
        self.tc = SIM or tc_device()
        self.sms = host.sm_count()              # the tensor-core prompt kernel's rounds of blocks

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
        name = route(ROUTES, Case(DTYPES[self.elem], rows, d, length, tc=self.tc,
                                  aligned=all(x.ptr % 16 == 0 for x in (qkv, pk, pv, cs, sn)))).kernel
        nx, nkv, nkvp = b * s * (self.hq + 2 * self.hkv) * d, b * self.hkv * p * d, b * self.hkv * length * d
        nc = int(np.prod(cs.shape))
        sc = float(ca.scale_of(self.scale, d))
        x_, past_k, past_v = (qkv.ptr, (nx,)), (pk.ptr, (nkv,)), (pv.ptr, (nkv,))
        lens, cos_, sin_ = (sl.ptr, (b,)), (cs.ptr, (nc,)), (sn.ptr, (nc,))
        out_, pres_k, pres_v = (o, (rows * d,)), (okp, (nkvp,)), (ovp, (nkvp,))
        if name == "cacheattention.tc":         # its own append (16-byte chunks), then the tensor-core kernel
            tc.launch(ctx.stream, (x_, past_k, past_v, pres_k, pres_v, lens, cos_, sin_, out_), b, s, self.hq,
                      self.hkv, d, p, length, cs.shape[0], sc, self.sms)
            return
        nch, kpc = splits(rows, length, name)
        floats = rows * nch * (d + 2) if nch > 1 else 0
        part = self.pool.partials(ctx, floats)
        cnt = self.pool.counters(ctx.stream)
        args = (x_, past_k, past_v, lens, cos_, sin_, out_, pres_k, pres_v, part, cnt, b, s, self.hq, self.hkv, p,
                length, nch, kpc, cs.shape[0], sc)
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

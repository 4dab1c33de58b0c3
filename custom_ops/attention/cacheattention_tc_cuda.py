"""CacheAttention's prompts on tensor cores (route cacheattention.tc of cacheattention_cuda.py): fp16, head sizes a
multiple of 16 up to TCD, buffers 16-byte aligned. Two launches:

``append`` (one thread per (token, kv head, pair of 16-byte chunks)): past into present where they are two buffers,
then the prompt's keys rotated (``rot_pair``) and its values into present, 16-byte loads and stores
(the first kernel's APPEND mode does this per element, with 64-bit index division per thread: 50 us against 6-7 at
1024 tokens, 16 heads, D = 128 on the H200).

``kernel``: one block of NT threads per (batch row, query head, tile of QT query rows); each warp owns 16 rows:
  1. the block's q rows rotated (``rot_pair``: 16-byte loads of a chunk of each half and of the tables, fp32,
     rounded to fp16 as the reference rounds them) into shared memory, each warp's A fragments (m16n8k16) read from
     there once into registers;
  2. present's keys in tiles of KT, fetched into registers one tile ahead (16-byte loads in flight while the tile
     before is computed), then K row-major and V transposed into shared memory (V's pairs of keys packed per word
     so that a B fragment is one 32-bit shared load), then per warp S = q K^T (mma), the causal / length mask, the
     running row max and sum (fp32; the four lanes of a row meet by shuffles), P rounded to fp16 as the A fragments
     of P V (mma into fp32 accumulators);
  3. O = acc / sum, rounded to fp16.
P is rounded to fp16 before the product with V (as onnxruntime's flash attention does): O agrees with the reference
within fp16 rounding of the weights, not within the fp32 sums' order alone. As in flash attention, a non-finite value
in V at key j also reaches the rows of j's 32-key tile that precede j (their weight 0 times it is NaN); the
reference leaves those rows finite. The buffer past a block's longest row is never read (it may hold anything).
Rows whose batch row's length is out of range, or whose position is past the rotary tables, are NaN (as the other
CacheAttention kernels write them).
Shared-memory indices are unsigned (Numba wraps signed ones around: a compare and a select per access). A block's
tiles run one after another and a query tile's work grows with its position (causal), while an SM's two resident
blocks share its throughput: the blocks are ordered heaviest tile first, and each round of SM-count blocks after
the first turns back, so that the SM that took the heaviest tile takes the lightest next (this assumes the hardware
hands the first two rounds out in the same SM order, as the times below imply). H200, 1024 tokens, 16 heads,
D = 128: 55 us against 64 heaviest-first only and 72-73 with the tiles in head order; query tiles' keys split over
blocks and combined (flash-decoding style) measured slower (69-84 us): the SMs are busy, not waiting
(docs/lab-log.md).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from ..device.arith import add, mul
from ..device.fp16 import pack_h2
from ..device.launch import Array, Launcher, SimLauncher
from ..device.memory import LOAD, addr, make_ld4, make_st, st16, w16
from ..device.mma import mma
from ..device.target import SIM, device

NT = 128                # threads per block: 4 warps of 16 query rows
QT = 64                 # query rows per block
KT = 32                 # keys per tile
TCD = 128               # largest head size
QW = QT * (TCD + 8) // 2    # q rows in shared memory, uint32 words (rows padded by 8 halves: no bank conflicts)
KW = KT * (TCD + 8) // 2    # the K tile
VW = TCD * (KT + 8) // 2    # the V tile, transposed (dims x keys)
KREG = (KT * TCD // 8 + NT - 1) // NT * 4       # a thread's words of the next K tile (registers)
VREG = (KT // 2 * TCD // 8 + NT - 1) // NT * 8  # and of the next V tile
QF = TCD // 16 * 4      # a thread's q A fragments (registers)
SCR = NT * 6 if SIM else 1  # the simulator's mma scratch
RED = NT if SIM else 1      # the simulator's quad exchanges
NINF = float32(-np.inf)
NAN = float32(np.nan)
FULL = np.uint32(0xFFFFFFFF)
M16 = np.uint32(0xFFFF)

if SIM:
    def _xor(v, off, red, t):
        """The value of lane (lane ^ off) (simulator: through shared memory; every thread of the block calls it)."""
        red[t] = v
        cuda.syncthreads()
        r = red[t ^ off]
        cuda.syncthreads()
        return r
else:
    @device
    def _xor(v, off, red, t):
        return cuda.shfl_xor_sync(FULL, v, off)


def _make_rot_pair():
    """rot_pair(x, xc, cs, sn, cc, rw, lo_w, hi_w): chunk c of a head's first half (x's 16-byte chunk xc) and of its
    second half (chunk xc + hc) rotated with the tables' chunk cc (cos, sin), as cacheattention_cuda._rotation
    rotates them (fp32 products and sum, no FMA contraction, rounded to fp16): lo_w, hi_w = the two halves' 8
    rotated dims as 4 words each; rw: 16 words of scratch (the four 16-byte loads)."""
    ld4 = make_ld4(LOAD)

    @device
    def rot_pair(x, xc, hc, cs, sn, cc, rw, lo_w, hi_w):
        rw[0], rw[1], rw[2], rw[3] = ld4(x, xc)
        rw[4], rw[5], rw[6], rw[7] = ld4(x, xc + hc)
        rw[8], rw[9], rw[10], rw[11] = ld4(cs, cc)
        rw[12], rw[13], rw[14], rw[15] = ld4(sn, cc)
        for m in range(4):
            e = 2 * m
            a0 = add(mul(w16(rw, 0, e), w16(rw, 8, e)), -mul(w16(rw, 4, e), w16(rw, 12, e)))
            a1 = add(mul(w16(rw, 0, e + 1), w16(rw, 8, e + 1)), -mul(w16(rw, 4, e + 1), w16(rw, 12, e + 1)))
            b0 = add(mul(w16(rw, 4, e), w16(rw, 8, e)), mul(w16(rw, 0, e), w16(rw, 12, e)))
            b1 = add(mul(w16(rw, 4, e + 1), w16(rw, 8, e + 1)), mul(w16(rw, 0, e + 1), w16(rw, 12, e + 1)))
            lo_w[m] = pack_h2(a0, a1)
            hi_w[m] = pack_h2(b0, b1)
    return rot_pair


rot_pair = _make_rot_pair()


def fits(d):
    """Whether the tensor-core prompt kernel takes head size ``d`` (fp16)."""
    return d % 16 == 0 and 16 <= d <= TCD


def _make(d):
    """The kernel for head size ``d`` (a constant: its fragment loops unroll)."""
    nks = d // 16               # k-steps of q K^T
    nnt = d // 8                # n-tiles of P V
    qs = (d + 8) // 2           # shared row strides in words
    vs = (KT + 8) // 2
    half = d // 2
    cpr = d // 8                # 16-byte chunks per K / V row
    kit = (KT * cpr + NT - 1) // NT         # K-tile chunks per thread
    vit = (KT // 2 * cpr + NT - 1) // NT    # V-tile chunk pairs per thread
    hc = cpr // 2               # chunks per half
    qit = (QT * hc + NT - 1) // NT          # q rotation chunk pairs per thread
    assert kit * 4 <= KREG and vit * 8 <= VREG
    noa = nnt * 4
    ld4 = make_ld4(LOAD)

    @device
    def lo16(w):
        return w & M16

    @device
    def hi16(w):
        return (w >> uint32(16)) & M16

    @device
    def fetch(ok, ov, kvc, key0, kmax, t, kreg, vreg):
        """The thread's share of the K / V tile from key0 into registers (16-byte loads; keys from kmax, the most
        any row of the block reads, are 0: the buffer's positions past the row's length are never read, whatever
        they hold, since a masked key's weight 0 times a NaN there would still be NaN):
        K chunks (key, chunk) = divmod(e, cpr); V chunk pairs (keys 2 kp and 2 kp + 1, chunk): (chunk, kp) =
        divmod(e, KT / 2), the key pair fastest across lanes so that the transposed stores meet no bank twice."""
        for it in range(kit):
            e = t + it * NT
            w0 = w1 = w2 = w3 = uint32(0)
            if e < KT * cpr and key0 + e // cpr < kmax:
                w0, w1, w2, w3 = ld4(ok, kvc + (key0 + e // cpr) * cpr + e % cpr)
            kreg[it * 4] = w0
            kreg[it * 4 + 1] = w1
            kreg[it * 4 + 2] = w2
            kreg[it * 4 + 3] = w3
        for it in range(vit):
            e = t + it * NT
            k2 = key0 + 2 * (e % (KT // 2))
            a0 = a1 = a2 = a3 = uint32(0)
            b0 = b1 = b2 = b3 = uint32(0)
            if e < KT // 2 * cpr and k2 < kmax:
                a0, a1, a2, a3 = ld4(ov, kvc + k2 * cpr + e // (KT // 2))
            if e < KT // 2 * cpr and k2 + 1 < kmax:
                b0, b1, b2, b3 = ld4(ov, kvc + (k2 + 1) * cpr + e // (KT // 2))
            vreg[it * 8] = a0
            vreg[it * 8 + 1] = a1
            vreg[it * 8 + 2] = a2
            vreg[it * 8 + 3] = a3
            vreg[it * 8 + 4] = b0
            vreg[it * 8 + 5] = b1
            vreg[it * 8 + 6] = b2
            vreg[it * 8 + 7] = b3

    @cuda.jit
    def kernel(qkv, ok, ov, seql, cs, sn, out, b_, s_, hq, hkv, length, mpos, scale, ntq, nsm):
        qsh = cuda.shared.array(QW, uint32)
        ksh = cuda.shared.array(KW, uint32)
        vsh = cuda.shared.array(VW, uint32)
        scr = cuda.shared.array(SCR, uint32)
        red = cuda.shared.array(RED, float32)
        qf = cuda.local.array(QF, uint32)
        kreg = cuda.local.array(KREG, uint32)
        vreg = cuda.local.array(VREG, uint32)
        rw = cuda.local.array(16, uint32)
        lo_w = cuda.local.array(4, uint32)
        hi_w = cuda.local.array(4, uint32)
        sacc = cuda.local.array(16, float32)
        oacc = cuda.local.array(noa, float32)
        t = cuda.threadIdx.x
        lane = t % 32
        warp = t // 32
        g = lane >> 2
        tq = lane & 3
        kbase = uint64(g * qs + tq)                 # unsigned shared indices: Numba wraps signed ones around
        vbase = uint64(g * vs + tq)
        # the block's tile: the heaviest tiles (the last query rows) first, each round of nsm blocks after the first the
        # other way round, so that the SM that took a heavy tile takes a light one next
        blk = int64(cuda.blockIdx.x)
        nblk = int64(b_) * hq * ntq
        w = blk // nsm
        k = blk if w % 2 == 0 else w * nsm + min(nsm, nblk - w * nsm) - 1 - blk % nsm
        bh = k % (int64(b_) * hq)
        qt = ntq - 1 - k // (int64(b_) * hq)
        h = bh % hq
        bi = bh // hq
        kh = h // (hq // hkv)
        tb = int64(seql[bi]) + 1
        ok_b = tb >= 1 and tb <= length
        base = int64(0) if tb <= s_ else tb - s_        # position of query s: base + s
        s0 = qt * QT
        # 1. the tile's q rows rotated into shared memory: one (row, chunk pair) per thread and step, 16-byte loads
        for it in range(qit):
            e = t + it * NT
            if e < QT * hc:
                r = e // hc
                c = e % hc
                si = s0 + r
                for m in range(4):
                    lo_w[m] = uint32(0)
                    hi_w[m] = uint32(0)
                if si < s_ and ok_b and base + si < mpos:
                    rot_pair(qkv, ((bi * s_ + si) * (hq + 2 * hkv) + h) * cpr + c, hc, cs, sn,
                             (base + si) * hc + c, rw, lo_w, hi_w)
                qb = uint64(r * qs + 4 * c)
                for m in range(4):
                    qsh[qb + uint64(m)] = lo_w[m]
                    qsh[qb + uint64(half // 2 + m)] = hi_w[m]
        cuda.syncthreads()
        r0 = warp * 16
        for ks in range(nks):
            qf[ks * 4] = qsh[(r0 + g) * qs + ks * 8 + tq]
            qf[ks * 4 + 1] = qsh[(r0 + g + 8) * qs + ks * 8 + tq]
            qf[ks * 4 + 2] = qsh[(r0 + g) * qs + ks * 8 + 4 + tq]
            qf[ks * 4 + 3] = qsh[(r0 + g + 8) * qs + ks * 8 + 4 + tq]
        # the thread's two rows (g and g + 8 of the warp's 16): how many keys each sees
        sa = s0 + r0 + g
        sb = sa + 8
        na = min(base + sa + 1, tb) if sa < s_ and ok_b else int64(0)
        nb = min(base + sb + 1, tb) if sb < s_ and ok_b else int64(0)
        kmax = min(base + min(s0 + QT, s_), tb) if ok_b else int64(0)
        ntiles = (kmax + KT - 1) // KT
        ma = NINF
        mb = NINF
        la = float32(0.0)
        lb = float32(0.0)
        for i in range(noa):
            oacc[i] = float32(0.0)
        kvc = (bi * hkv + kh) * length * cpr        # chunk of key 0's row
        if ntiles > 0:
            fetch(ok, ov, kvc, 0, kmax, t, kreg, vreg)
        for tile in range(ntiles):
            key0 = tile * KT
            cuda.syncthreads()                      # the previous tile's readers are done
            # 2. the tile fetched into registers -> shared memory: K row-major, V transposed (pairs of keys per
            # word); then the next tile's loads are issued, in flight while this one is computed
            for it in range(kit):
                e = t + it * NT
                if e < KT * cpr:
                    kb = uint64((e // cpr) * qs + (e % cpr) * 4)
                    for m in range(4):
                        ksh[kb + uint64(m)] = kreg[it * 4 + m]
            for it in range(vit):
                e = t + it * NT
                if e < KT // 2 * cpr:
                    vb = uint64((e // (KT // 2)) * 8 * vs + e % (KT // 2))
                    for m in range(4):
                        lo = vreg[it * 8 + m]
                        hi = vreg[it * 8 + 4 + m]
                        vsh[vb + uint64(2 * m * vs)] = lo16(lo) | (lo16(hi) << uint32(16))
                        vsh[vb + uint64((2 * m + 1) * vs)] = hi16(lo) | (hi16(hi) << uint32(16))
            cuda.syncthreads()
            if tile + 1 < ntiles:
                fetch(ok, ov, kvc, key0 + KT, kmax, t, kreg, vreg)
            # S = q K^T: 4 n-tiles of 8 keys
            for nt in range(4):
                c0 = c1 = c2 = c3 = float32(0.0)
                kb = kbase + uint64(nt * 8 * qs)
                for ks in range(nks):
                    c0, c1, c2, c3 = mma(qf[ks * 4], qf[ks * 4 + 1], qf[ks * 4 + 2], qf[ks * 4 + 3],
                                         ksh[kb + uint64(ks * 8)], ksh[kb + uint64(ks * 8 + 4)], c0, c1, c2, c3,
                                         scr, t)
                sacc[nt * 4] = c0
                sacc[nt * 4 + 1] = c1
                sacc[nt * 4 + 2] = c2
                sacc[nt * 4 + 3] = c3
            # the mask, the rows' running max (the row's four lanes meet), P (no branches: a masked score is -inf,
            # and a row with no key yet subtracts 0, so its exponentials are 0)
            xa = ma
            xb_ = mb
            for nt in range(4):
                for m in range(2):
                    key = key0 + nt * 8 + 2 * tq + m
                    va = sacc[nt * 4 + m] * scale if key < na else NINF
                    vb = sacc[nt * 4 + 2 + m] * scale if key < nb else NINF
                    sacc[nt * 4 + m] = va
                    sacc[nt * 4 + 2 + m] = vb
                    xa = max(xa, va)
                    xb_ = max(xb_, vb)
            xa = max(xa, _xor(xa, 1, red, t))
            xa = max(xa, _xor(xa, 2, red, t))
            xb_ = max(xb_, _xor(xb_, 1, red, t))
            xb_ = max(xb_, _xor(xb_, 2, red, t))
            za = xa if xa != NINF else float32(0.0)
            zb = xb_ if xb_ != NINF else float32(0.0)
            ca_ = math.exp(ma - za)
            cb_ = math.exp(mb - zb)
            la *= ca_
            lb *= cb_
            for nt in range(nnt):
                oacc[nt * 4] *= ca_
                oacc[nt * 4 + 1] *= ca_
                oacc[nt * 4 + 2] *= cb_
                oacc[nt * 4 + 3] *= cb_
            for nt in range(4):
                for m in range(2):
                    pa = math.exp(sacc[nt * 4 + m] - za)
                    pb = math.exp(sacc[nt * 4 + 2 + m] - zb)
                    la += pa
                    lb += pb
                    sacc[nt * 4 + m] = pa
                    sacc[nt * 4 + 2 + m] = pb
            ma = xa
            mb = xb_
            # O += P V: P's C fragments of n-tiles 2k, 2k + 1 are the A fragment of k-step k
            for k2 in range(KT // 16):
                p0 = pack_h2(sacc[8 * k2], sacc[8 * k2 + 1])
                p1 = pack_h2(sacc[8 * k2 + 2], sacc[8 * k2 + 3])
                p2 = pack_h2(sacc[8 * k2 + 4], sacc[8 * k2 + 5])
                p3 = pack_h2(sacc[8 * k2 + 6], sacc[8 * k2 + 7])
                for nt in range(nnt):
                    vb = vbase + uint64(nt * 8 * vs + k2 * 8)
                    o0, o1, o2, o3 = mma(p0, p1, p2, p3, vsh[vb], vsh[vb + uint64(4)], oacc[nt * 4],
                                         oacc[nt * 4 + 1], oacc[nt * 4 + 2], oacc[nt * 4 + 3], scr, t)
                    oacc[nt * 4] = o0
                    oacc[nt * 4 + 1] = o1
                    oacc[nt * 4 + 2] = o2
                    oacc[nt * 4 + 3] = o3
        # 3. the rows' sums over their four lanes; O
        la += _xor(la, 1, red, t)
        la += _xor(la, 2, red, t)
        lb += _xor(lb, 1, red, t)
        lb += _xor(lb, 2, red, t)
        bad_a = not ok_b or base + sa >= mpos
        bad_b = not ok_b or base + sb >= mpos
        oa = ((bi * s_ + sa) * hq + h) * d
        ob = ((bi * s_ + sb) * hq + h) * d
        ia = NAN if bad_a else (float32(1.0) / la if la > 0 else float32(0.0))     # la = 0: a row past s_
        ib = NAN if bad_b else (float32(1.0) / lb if lb > 0 else float32(0.0))
        for nt in range(nnt):
            j = nt * 8 + 2 * tq
            if sa < s_:
                st16(out, oa + j, oacc[nt * 4] * ia)
                st16(out, oa + j + 1, oacc[nt * 4 + 1] * ia)
            if sb < s_:
                st16(out, ob + j, oacc[nt * 4 + 2] * ib)
                st16(out, ob + j + 1, oacc[nt * 4 + 3] * ib)

    return kernel


def _make_append(d):
    """The append for head size ``d``: past into present where they are two buffers (16-byte chunks, grid-stride,
    the new tokens' positions left out), then one thread per (token, kv head, chunk pair): the new key's chunks c
    and c + D / 16 (the two halves rotation pairs) rotated as _rotation rotates them (fp32 products and sum, no
    FMA contraction, rounded to fp16) and the value's two chunks copied, 16-byte loads and stores."""
    half = d // 2
    cpr = d // 8                # 16-byte chunks per K / V row
    hc = cpr // 2               # chunks per half
    ld4 = make_ld4(LOAD)
    st4 = make_st(4)

    @cuda.jit
    def append(qkv, pk, pv, ok, ov, seql, cs, sn, b_, s_, hq, hkv, p, length, mpos):
        i = int64(cuda.blockIdx.x) * NT + cuda.threadIdx.x
        if addr(pk) != addr(ok):
            n_ch = int64(b_) * hkv * p * cpr
            stride = int64(cuda.gridDim.x) * NT
            j = i
            while j < n_ch:
                bh = j // (int64(p) * cpr)
                pos_t = (j // cpr) % p
                tb = int64(seql[bh // hkv]) + 1
                lo = int64(0) if tb <= s_ else tb - s_
                hi = int64(s_) if tb <= s_ else tb
                if pos_t < lo or pos_t >= hi:
                    e = ((bh * length + pos_t) * cpr + j % cpr) * 8
                    w0, w1, w2, w3 = ld4(pk, j)
                    st4(ok, e, w0, w1, w2, w3)
                    w0, w1, w2, w3 = ld4(pv, j)
                    st4(ov, e, w0, w1, w2, w3)
                j += stride
        if i >= int64(b_) * s_ * hkv * hc:
            return
        c = i % hc
        r = i // hc
        kh = r % hkv
        bs = r // hkv
        bi = bs // s_
        si = bs % s_
        tb = int64(seql[bi]) + 1
        pos = si if tb <= s_ else tb - s_ + si
        if tb < 1 or tb > length or pos >= mpos:
            return
        xc = (bs * (hq + 2 * hkv) + hq + kh) * cpr + c     # the key's chunk c in QKV
        cc = pos * hc + c                                    # cos / sin chunk
        oe = ((bi * hkv + kh) * length + pos) * d + c * 8   # present element of chunk c
        rw = cuda.local.array(16, uint32)
        lo_w = cuda.local.array(4, uint32)
        hi_w = cuda.local.array(4, uint32)
        rot_pair(qkv, xc, hc, cs, sn, cc, rw, lo_w, hi_w)
        v0, v1, v2, v3 = ld4(qkv, xc + hkv * cpr)
        u0, u1, u2, u3 = ld4(qkv, xc + hkv * cpr + hc)
        st4(ok, oe, lo_w[0], lo_w[1], lo_w[2], lo_w[3])
        st4(ok, oe + half, hi_w[0], hi_w[1], hi_w[2], hi_w[3])
        st4(ov, oe, v0, v1, v2, v3)
        st4(ov, oe + half, u0, u1, u2, u3)

    return append


_launchers = {}
_appends = {}

def launcher(d):
    """The direct-launch wrapper of the kernel for head size ``d``, compiled once per process (under the simulator
    launch.SimLauncher)."""
    if d not in _launchers:
        a = Array(np.uint16)
        sig = [a, a, a, Array(np.int32), a, a, a] + ["int64"] * 6 + ["float32", "int64", "int64"]
        _launchers[d] = (SimLauncher if SIM else Launcher)(_make(d), sig)
    return _launchers[d]


def append_launcher(d):
    """The direct-launch wrapper of the append for head size ``d``, compiled once per process."""
    if d not in _appends:
        a = Array(np.uint16)
        sig = [a, a, a, a, a, Array(np.int32), a, a] + ["int64"] * 7
        _appends[d] = (SimLauncher if SIM else Launcher)(_make_append(d), sig)
    return _appends[d]


def launch(stream, ptrs, b, s, hq, hkv, d, p, length, mpos, scale, sms):
    """The append, then one launch over the prompt's query rows; ``ptrs``: (qkv, past_key, past_value,
    present_key, present_value, seqlens_k, cos, sin, O) as (device pointer or array, elements) pairs as
    Launcher.launch takes them; ``p``: past's positions; ``sms``: the device's SM count (device/host.sm_count), the
    length of the block order's rounds."""
    qkv, pk, pv, ok, ov, sl, cs, sn, o = ptrs
    threads = b * s * hkv * (d // 16)
    append_launcher(d).launch(max(1, -(-threads // NT)), NT, stream, qkv, pk, pv, ok, ov, sl, cs, sn, b, s, hq, hkv,
                              p, length, mpos)
    ntq = -(-s // QT)
    launcher(d).launch(b * hq * ntq, NT, stream, qkv, ok, ov, sl, cs, sn, o, b, s, hq, hkv, length, mpos,
                       float(scale), ntq, sms)

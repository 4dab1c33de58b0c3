"""The NF4/FP4 decode kernel generator shared by MatMulNF4 (its M=1 and two-row kernels, ``matmul=True``) and
FusedFFNNF4 (its decode kernel, two weights): ``make_decode`` writes the kernel as straight-line code for a row bucket,
a column step and a table mode (its docstring says what every option does; fusedffnnf4_cuda's module docstring
describes the kernel and what was measured). Also the host side those kernels share: ``lut_for`` (the decode
table), ``threads`` (a block's), TAB_BYTES and ``sig`` (FusedFFNNF4's launch signature, which the warp-column
kernel of nf4warp_cuda shares).
Moved out of fusedffnnf4_cuda so that nf4/ never imports ffn/."""
from __future__ import annotations

import re

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from ..device import half2, pdl
from ..device.fp16 import as_f32, pack_h2
from ..device.launch import Array
from ..device.memory import LOAD, ld16, ld32, make_ld4, st16, st32
from ..device.mma import silu
from ..device.ptx import add32, andor32, f2u, hfma2, lds32, lds64, mad32, min32, prmt, shr32
from ..device.target import SIM

COLS = 4                  # columns per block step
TAB_BYTES = 255 * 256 + 16 * 8  # the 64 KiB tables in dynamic shared memory (byte-pair: byte v, copy l at v * 256 +
                                # l * 8; packed-fp16: byte v, lane l at v * 256 + 4 l)
MAX_REGISTERS = {1: 80}   # ptxas limit per row bucket (MT=1: 80, no spills, 3 blocks of 256 threads per SM)
NWMAX = 32                # warps per block, at most
FULL = np.uint32(0xFFFFFFFF)
M32 = np.uint64(0xFFFFFFFF)
U32 = np.uint64(32)
_ld4w = make_ld4(LOAD)     # wide: a 16-byte chunk of a weight row, streamed past L1


def red_index(lane, nv):
    """The partial-sum index lane ``lane`` holds after the reduce-scatter of ``nv`` values (host mirror)."""
    idx, s = 0, 0
    while (nv >> (s + 1)) >= 1:
        idx += ((lane >> (4 - s)) & 1) * (nv >> (s + 1))
        s += 1
    return idx


def _make_rs(nv):
    """Warp reduce-scatter of v[0..nv) (nv a power of two <= 32): returns, in every lane, the warp-wide sum of
    v[red_index(lane)]. GPU: straight-line shuffles (generated, so every index is a constant and v stays in
    registers); simulator (no shuffles): through shared memory."""
    steps = nv.bit_length() - 1
    if SIM:
        @cuda.jit(device=True)
        def rs(v, lane, simred, tid):
            for i in range(nv):
                simred[tid * nv + i] = v[i]
            cuda.syncthreads()
            idx = 0
            for s in range(steps):
                idx += ((lane >> (4 - s)) & 1) * (nv >> (s + 1))
            tot = float32(0.0)
            for j in range(32):
                tot += simred[(tid - lane + j) * nv + idx]
            cuda.syncthreads()
            return tot
        return rs
    lines = ["def rs(v, lane, simred, tid):"]
    h, off = nv // 2, 16
    while h >= 1:
        lines.append(f"    up = ((lane >> {off.bit_length() - 1}) & 1) != 0")
        for i in range(h):
            lines.append(f"    snd = v[{i}] if up else v[{i + h}]")
            lines.append(f"    kp = v[{i + h}] if up else v[{i}]")
            lines.append(f"    v[{i}] = kp + cuda.shfl_xor_sync(FULL, snd, {off})")
        h //= 2
        off //= 2
    while off >= 1:
        lines.append(f"    v[0] += cuda.shfl_xor_sync(FULL, v[0], {off})")
        off //= 2
    lines.append("    return v[0]")
    ns = {"cuda": cuda, "FULL": FULL}
    exec("\n".join(lines), ns)  # noqa: S102 - generated straight-line code, no outside input
    return cuda.jit(device=True, inline=True)(ns["rs"])


def make_decode(mt, a16, pair=True, max_registers=None, matmul=False, pingpong=False, early=False, nib=False, h2=False,
                wide=False, groups=1, u4=False):
    """The decode kernel for row bucket ``mt`` and COLS columns per step (the next step's words prefetched while
    one is decoded), generated as straight-line code so that every per-thread value (16*mt x values, 2*COLS words
    and scales in flight and prefetched, 2*COLS*mt partial sums) has a constant name or index and stays in
    registers. Integer work is 32-bit (uint32 indices:
    N * K / 16 < 2^32). ``pair``: byte-pair table in dynamic shared memory (TAB_BYTES; entry of byte v for copy l
    at byte offset v * 256 + l * 8: fp32 code[v >> 4] in the low half, code[v & 15] in the high half), addressed
    by one PRMT per byte (the byte into bits 8..15, the lane's copy l = lane & 15 into bits 3..6: each half-warp
    reads 16 distinct bank pairs); else the 16-entry fp32 code table (a shift, a mask and a load per nibble).
    ``max_registers``: ptxas limit (default MAX_REGISTERS[mt], except wide: ptxas's choice). ``matmul``:
    MatMulNF4's M=1 kernel instead (one weight, y = x W^T + bias, matmulnf4_cuda's signature: x / y / bias in their
    own dtype, the 16 fp32 code values from which the pair table is built, column slices from the grid size;
    mt = 1); with mt = 2 its M <= 16 kernel (rows in chunks of 2, m_dim after s in the signature, grid = row chunks x
    column slices).
    ``pingpong``: the step loop unrolled twice with the two word buffers' roles swapped, instead of copying the
    prefetched words into the current ones (fewer moves, twice the code). ``early``: the first step's words
    are loaded before the table is built, so the table build overlaps their latency (matters when a block has only
    a few steps). Every variant reads X (and writes anything) only after ``pdl.wait()``, behind the first step's
    weight loads and (early) the table build: launched as a programmatic dependent launch, those overlap the end of
    the kernel before (device/pdl.py; the weights must then be constants, which the hosts check). matmul with pair=False: the 16-entry table built from the 16 code values (no dynamic shared
    memory: occupancy bound by registers only). ``bs_shift`` (every signature): BlockSize.log2_words. ``nib``
    (with pair=False): the 16-entry table as 32 lane copies in static shared memory
    (entry v of lane l at byte v * 256 + 4 l, 4 KiB): each word's nibbles are split into two words of bytes (one
    AND, one shift + AND per 8 nibbles) and each nibble's table address is one PRMT (nibble byte into bits 8..15,
    4 * lane into bits 0..7) instead of a shift and a mask. ``h2`` = c (2 or 4; fp16 X, two weights; replaces
    pair / nib): packed-fp16 decode. Each row of X is scaled by p = 2^(11 - floor(log2 max|x|)) (the row's largest
    |x| over the block: |x p| < 2^12, so a chain of c <= 4 products with code values |a v| < 2 stays below 2^15 and
    never overflows; tiny rows become normal fp16) and held as 8 half2 registers; the table holds the byte-pair
    values times a = half2.h2_scale(code) (1.3662 for NF4: it halves the fp16 rounding of the levels) as fp16 (high
    nibble's value in the low half), 32 lane copies in dynamic shared memory (byte v, lane l at byte v * 256 + 4 l),
    addressed by one PRMT per byte. Per byte: one PRMT, one LDS, one fma.rn.f16x2 into a chain of c bytes; each
    word's chains are converted to fp32 and summed (hsum2) and scaled by the absmax; the epilogue multiplies by
    1 / (p a). NaN / Inf in X stay non-finite (p = 1 for a row whose max is Inf). Error: benchmarks/h2_error.py.
    The table build's stores: half2.h2_table_src's default (half2.VEC_TABLE).
    ``groups`` = G: a block is G thread groups of the one-group block's size, each on its own column slice (part
    (bid // nch) * G + group; the host passes G times the parts, matmul: G x the grid), sharing one table (one build,
    one 64 KiB copy per G groups: more warps per SM where the table bounds the resident blocks). The groups' step
    loops run the same number of steps (the longest slice's; past its own slice a group's loads are clamped and
    nothing is stored), since the per-step barrier is the block's.
    ``u4`` (with h2): the weights are uniform int4 (quant_type "int4"), decoded with no table (half2.u4_src: per
    32-bit word one shift, four LOP3 and four fma.rn.f16x2 give the code values exactly, a = 1; X's pairs packed in
    half2.U4_PAIRS order): no table build, no shared memory but the reductions'."""
    if h2 and (not (a16 or matmul) or h2 not in (2, 4)):
        raise ValueError("h2 (the fp16 chain length, 2 or 4) is a mode for fp16 X (matmul: X's own dtype)")
    if h2:
        pair = nib = False
    if u4 and not h2:
        raise ValueError("u4 (the table-free int4 decode) is a mode of the h2 decode")
    if wide and not h2:
        raise ValueError("wide (two words per thread and row) is a mode of the h2 decode")
    ne = 32 if wide else 16             # elements of K per thread
    cols = COLS
    nw = 1 if matmul else 2
    if max_registers is None and not wide:
        max_registers = MAX_REGISTERS.get(mt)       # wide: ptxas's choice
    nv = nw * cols * mt                 # partial sums per thread: [weight][column][row]
    steps = nv.bit_length() - 1
    low = 5 - steps                     # lane bits reduced by the final butterfly
    src = []
    a = src.append
    if matmul and mt > 1:     # M rows in row chunks of mt: grid = chunks x slices
        a("def decode(x, q1, am1, lut, b1, has_b1, s, m_dim, k_dim, n_dim, bs_shift):")
        a(f"    parts = (int64(cuda.gridDim.x) // ((int64(m_dim) + int64({mt - 1})) // int64({mt})))"
          f"{f' * int64({groups})' if groups > 1 else ''}")
    elif matmul:
        a("def decode(x, q1, am1, lut, b1, has_b1, s, k_dim, n_dim, bs_shift):")
        a("    m_dim = 1")
        a(f"    parts = int64(cuda.gridDim.x){f' * int64({groups})' if groups > 1 else ''}")
    else:
        a("def decode(x, q1, am1, q3, am3, lut, b1, b3, s, m_dim, k_dim, n_dim, bs_shift, parts, has_b1, has_b3):")
    nib = nib and not pair
    if pair:
        a("    tab = cuda.shared.array(0, uint64)")
    elif h2:
        if not u4:
            a("    tab = cuda.shared.array(0, uint32)")
        a(f"    xmax = cuda.shared.array({NWMAX * mt}, float32)")
    elif nib:
        a("    tab = cuda.shared.array(1024, uint32)")
    else:
        a("    tab = cuda.shared.array(16, uint32)")
    a(f"    red = cuda.shared.array({2 * NWMAX * nv}, float32)")
    a(f"    simred = cuda.shared.array({1024 * nv if SIM else 1}, float32)")
    a(f"    pv = cuda.local.array({nv}, float32)")
    a("    tid = uint32(cuda.threadIdx.x)")
    a("    nthreads = uint32(cuda.blockDim.x)")
    a("    lane = tid & U31")
    a("    warp = tid >> U5")
    a("    nwarps = nthreads >> U5")
    tg = "tid"          # the thread's index in its group
    if groups > 1:
        tg = "tg"
        a(f"    gthreads = nthreads // uint32({groups})")
        a("    grp = tid // gthreads")
        a("    tg = uint32(tid - grp * gthreads)")
        a("    gwarps = gthreads >> U5")
    tsrc = ["    i = tid"]      # the table build: emitted before or (early) after the first loads
    t_ = tsrc.append

    if pair:        # unrolled by 4 (independent loads and stores in flight), then the remainder
        ent = ("uint64(f2u(lut[(I >> U4) >> U4])) | (uint64(f2u(lut[(I >> U4) & U15])) << U32)" if matmul else
               "lut[I >> U4]")   # matmul: from the 16 fp32 code values: low half code[v >> 4], high half code[v & 15]
        iu4 = ("i", "i1", "i2", "i3")   # entries i + u * nthreads: their loads before their stores
        t_("    n3 = nthreads * U3")
        t_("    while i + n3 < U4096:")
        for u, iu in enumerate(iu4):
            if u:
                t_(f"        {iu} = i + nthreads * uint32({u})")
            t_(f"        e{u} = {ent.replace('I', iu)}")
        for u, iu in enumerate(iu4):
            t_(f"        tab[(({iu} >> U4) << U5) | ({iu} & U15)] = e{u}")
        t_("        i = uint32(i + (nthreads << uint32(2)))")
        t_("    while i < U4096:")
        t_(f"        tab[((i >> U4) << U5) | (i & U15)] = {ent.replace('I', 'i')}")
    elif h2:       # half2.h2_table_src: the values are the code values times half2.h2_scale (matmul: built from
                   # lut[0..16]; else the host's lut)
        tsrc[:] = [] if u4 else half2.h2_table_src(matmul)
    elif nib:      # 512 stores: entry i >> 5, lane copy i & 31
        t_("    while i < uint32(512):")
        t_("        tab[((i >> U5) << uint32(6)) | (i & U31)] = f2u(lut[i >> U5])" if matmul else
           "        tab[((i >> U5) << uint32(6)) | (i & U31)] = lut[i >> U5]")
    else:
        t_("    while i < U16:")
        t_("        tab[i] = f2u(lut[i])" if matmul else "        tab[i] = lut[i]")
    if not h2:
        t_("        i = uint32(i + nthreads)")
    if not early:
        src.extend(tsrc)
    a("    lane8 = (tid & U15) << U3")
    a("    lane4 = lane << uint32(2)")
    # a thread's unit of each row: one 8-byte word, or (wide, K % 32 == 0) two words read as one 16-byte chunk;
    # wpr units per row, absmax block of unit i: i >> sh
    a(f"    wpr = uint32(k_dim) >> {'U5' if wide else 'U4'}")
    a(f"    sh = uint32(bs_shift){' - U1' if wide else ''}")
    a(f"    owns = {tg} < wpr")
    a(f"    tcl = {tg} if owns else wpr - U1   # non-owners (last warp) read a valid unit; their x and scales are 0")
    a(f"    nch = (uint32(m_dim) + uint32({mt - 1})) // uint32({mt})")
    a("    bid = uint32(cuda.blockIdx.x)")
    a(f"    m0 = uint32(bid % nch) * uint32({mt})")
    a("    part = uint32(bid // nch)" + (f" * uint32({groups}) + grp" if groups > 1 else ""))
    a("    n_lo = uint32(int64(part) * n_dim // parts)")
    a("    n_hi = uint32(int64(part + U1) * n_dim // parts)")
    a("    mdim = uint32(m_dim)")
    a("    ndim = uint32(n_dim)")
    xsrc = []           # X's loads: after the first step's weight words and pdl.wait (device/pdl.py)
    xa = xsrc.append
    for m in range(mt):
        xa(f"    okx = owns and m0 + uint32({m}) < mdim")
        xa(f"    xb = uint32(uint32((m0 + uint32({m})) * uint32(k_dim)) + ({tg} << {'U5' if wide else 'U4'}))")
        xa("    if okx:     # 16-byte loads (X's base 16-byte aligned: the hosts check)")
        for e in range(0, ne, 8):
            xa("        " + ", ".join(f"x_{m}_{e + j}" for j in range(8)) + f" = ldx8(x, (xb >> U3) + uint32({e // 8}))")
        xa("    else:")
        for e in range(ne):
            xa(f"        x_{m}_{e} = F0")
        if h2:      # the row's largest |x| over the block (NaN ignored), for its power-of-two scale: a tree of
                    # fmax (depth 5 for 32 values; a chain took ~6% of the kernel's warp time), then the warp's max
            lv = [f"abs(x_{m}_{e})" for e in range(ne)]
            t = 0
            while len(lv) > 1:
                nxt = []
                for i in range(0, len(lv) - 1, 2):
                    xa(f"    xt{t} = fmax({lv[i]}, {lv[i + 1]})")
                    nxt.append(f"xt{t}")
                    t += 1
                lv = nxt + lv[len(lv) - len(lv) % 2:]
            xa(f"    xm = warp_max({lv[0]}, simred, tid)")
            xa("    if lane == U0:")
            xa(f"        xmax[uint32({m * NWMAX}) + warp] = xm")
    a("    my_idx = uint32(0)")
    for st in range(steps):
        a(f"    my_idx += ((lane >> uint32({4 - st})) & U1) * uint32({nv >> (st + 1)})")
    a(f"    writer = (lane & uint32({(1 << low) - 1})) == uint32(0)")
    for c in range(1, cols + 1):
        a(f"    cw_{c} = wpr * uint32({c})")
    a("    cw_0 = uint32(0)")
    a("    last = n_hi - U1 if n_lo < n_hi else n_lo    # a valid row even for an empty slice (grid > N)")
    n_end = "n_hi"
    if groups > 1:      # every group walks the longest slice's steps (the barrier is the block's)
        n_end = "n_stop"
        a("    mc = uint32((int64(n_dim) + parts - int64(1)) // parts)")
        a(f"    n_stop = add32(n_lo, ((mc + uint32({cols - 1})) // uint32({cols})) * uint32({cols}))")

    def loads(out, prefix, nbase, wbase, ind):
        """Loads of the step at column nbase (word index of its first column: wbase): unchecked when the whole
        step is inside the slice, else with the columns clamped to the slice's last one (never stored)."""
        out(f"{ind}if add32({nbase}, uint32({cols})) <= n_hi:")
        for c in range(cols):
            out(f"{ind}    wi_{c} = add32({wbase}, cw_{c})")
        out(f"{ind}else:")
        for c in range(cols):
            out(f"{ind}    wi_{c} = mad32(min32(add32({nbase}, uint32({c})), last), wpr, tcl)")
        for c in range(cols):
            for w in (1,) if matmul else (1, 3):
                if wide:    # 16 bytes: the two words as 4 uint32 halves, low first
                    out(f"{ind}" + ", ".join(f"{prefix}w{w}_{c}_{h}" for h in range(4)) + f" = ld4(q{w}, wi_{c})")
                else:
                    out(f"{ind}{prefix}w{w}_{c} = q{w}[wi_{c}]")
            out(f"{ind}{prefix}s1_{c} = float32(am1[shr32(wi_{c}, sh)]) if owns else F0")
            if not matmul:
                out(f"{ind}{prefix}s3_{c} = float32(am3[shr32(wi_{c}, sh)]) if owns else F0")

    a("    n0 = n_lo")
    a("    wb = mad32(n_lo, wpr, tcl)")
    loads(a, "", "n0", "wb", "    ")
    if early:
        src.extend(tsrc)
    a("    pdl_wait()")       # what earlier kernels wrote (X, the output's old readers) only from here on
    a("    pdl_trigger()")
    src.extend(xsrc)
    a("    cuda.syncthreads()")
    if h2:
        a("    ia = F1" if u4 else "    ia = lut[17]" if matmul else "    ia = as_f32(lut[U256])")
        for m in range(mt):     # p = 2^(11 - floor(log2 max|x|)): |x p| < 2^12, a chain of 4 products < 2^15
            a("    xm = F0")
            a("    wj = uint32(0)")
            a("    while wj < nwarps:")
            a(f"        av = xmax[uint32({m * NWMAX}) + wj]")
            a("        xm = av if av > xm else xm")
            a("        wj = uint32(wj + U1)")
            a("    eb = (f2u(xm) >> uint32(23)) & uint32(255)")
            a("    okp = eb >= uint32(11) and eb != uint32(255)")
            a(f"    p_{m} = as_f32((uint32(265) - eb) << uint32(23)) if okp else F1")
            a(f"    ip_{m} = (as_f32((eb - uint32(11)) << uint32(23)) if okp else F1) * ia   # and 1 / h2_scale")
            for j in range(ne // 2):
                e0, e1 = (8 * (j // 4) + e for e in half2.U4_PAIRS[j % 4]) if u4 else (2 * j, 2 * j + 1)
                a(f"    x2_{m}_{j} = pack_h2(x_{m}_{e0} * p_{m}, x_{m}_{e1} * p_{m})")
    a("    buf = uint32(0)")
    a(f"    while n0 < {n_end}:")
    body = []
    b_ = body.append
    b_("nn = add32(n0, uint32(%d))" % cols)
    b_(f"wbn = add32(wb, cw_{cols})")
    loads(b_, "n", "nn", "wbn", "")     # the next step's words (clamped past the slice: never stored)
    nch2 = ne // 2 // h2 if h2 else 0   # fp16 chains per row and step (h2 bytes each)
    for c in range(cols if h2 else 0):
        for wsel in (1,) if matmul else (1, 3):
            for half in range(ne // 8):
                if wide:
                    b_(f"wd = w{wsel}_{c}_{half}")
                else:
                    b_(f"wd = uint32(w{wsel}_{c} & M32)" if half == 0 else f"wd = uint32(w{wsel}_{c} >> U32)")
                if u4:
                    body.extend(half2.u4_src("wd", [f"t{b}" for b in range(4)], ""))
                for b in range(4):
                    j = half * 4 + b
                    if u4:
                        b_(f"t = t{b}")
                    else:
                        b_(f"t = lds32(tab, prmt(wd, lane4, SEL_{b}))")
                    for m in range(mt):
                        hv = f"h{j // h2}_{m}"
                        b_(f"{hv} = hfma2(t, x2_{m}_{j}, {'H0' if j % h2 == 0 else hv})")
            for m in range(mt):
                idx = ((0 if wsel == 1 else 1) * cols + c) * mt + m
                tot = " + ".join(f"hsum2(h{2 * i}_{m}, h{2 * i + 1}_{m})" for i in range(nch2 // 2))
                b_(f"pv[{idx}] = ({tot}) * s{wsel}_{c}")
    for c in range(0 if h2 else cols):
        for wsel in (1,) if matmul else (1, 3):
            for m in range(mt):
                b_(f"acc_{m} = F0")
            for half in range(2):
                b_(f"wd = uint32(w{wsel}_{c} & M32)" if half == 0 else f"wd = uint32(w{wsel}_{c} >> U32)")
                if nib:
                    b_("wl = wd & NIBS")                 # the low nibble of each byte, as a byte
                    b_("wh = (wd >> U4) & NIBS")         # the high nibble of each byte
                for b in range(4):
                    e0 = half * 8 + 2 * b
                    if pair:
                        b_(f"ent = lds64(tab, prmt(wd, lane8, SEL_{b}))")
                        b_("c0 = as_f32(ent & M32)")
                        b_("c1 = as_f32(ent >> U32)")
                    elif nib:
                        b_(f"c0 = as_f32(lds32(tab, prmt(wh, lane4, SEL_{b})))")
                        b_(f"c1 = as_f32(lds32(tab, prmt(wl, lane4, SEL_{b})))")
                    else:       # element 2b = high nibble of byte b (bits 8b+4..8b+7), 2b+1 = low nibble
                        b_(f"c0 = as_f32(lds32(tab, (wd >> uint32({8 * b + 2})) & U60))")
                        b_(f"c1 = as_f32(lds32(tab, (wd >> uint32({8 * b - 2})) & U60))" if b else
                           "c1 = as_f32(lds32(tab, (wd << uint32(2)) & U60))")
                    for m in range(mt):
                        b_(f"acc_{m} += c0 * x_{m}_{e0}")
                        b_(f"acc_{m} += c1 * x_{m}_{e0 + 1}")
            for m in range(mt):
                idx = ((0 if wsel == 1 else 1) * cols + c) * mt + m
                b_(f"pv[{idx}] = acc_{m} * s{wsel}_{c}")
    b_("tot = rs(pv, lane, simred, tid)")
    b_("if writer:")
    b_(f"    red[mad32(mad32(buf, uint32({NWMAX}), warp), uint32({nv}), my_idx)] = tot")
    b_("cuda.syncthreads()")
    b_(f"if {tg} < uint32({cols * mt}):")
    b_(f"    c = {tg} // uint32({mt})")
    b_(f"    m = uint32({tg} - c * uint32({mt}))")
    b_("    n = add32(n0, c)")
    b_("    if n < n_hi and add32(m0, m) < mdim:")
    b_("        g = F0")
    if not matmul:
        b_("        u = F0")
    b_(f"        r = mad32(buf, uint32({NWMAX * nv}), mad32(c, uint32({mt}), m))")
    if groups > 1:      # the group's warps' partials
        b_(f"        r = mad32(grp * gwarps, uint32({nv}), r)")
    b_("        wj = uint32(0)")
    b_(f"        while wj < {'gwarps' if groups > 1 else 'nwarps'}:")
    b_("            g += red[r]")
    if not matmul:
        b_(f"            u += red[r + uint32({cols * mt})]")
    b_(f"            r = add32(r, uint32({nv}))")
    b_("            wj = add32(wj, U1)")
    if h2:              # undo the rows' power-of-two scale
        b_("        ipm = " + " if m == U0 else ".join(f"ip_{m}" for m in range(mt)))
        b_("        g *= ipm")
        if not matmul:
            b_("        u *= ipm")
    if matmul:
        b_("        if has_b1:")
        b_("            g += float32(b1[n])")
        b_("        s[n] = g" if mt == 1 else "        s[mad32(add32(m0, m), ndim, n)] = g")
    else:
        b_("        if has_b1:")
        b_("            g += load(b1, n)")
        b_("        if has_b3:")
        b_("            u += load(b3, n)")
        b_("        store(s, mad32(add32(m0, m), ndim, n), silu(g) * u)")
    b_("buf ^= U1")
    b_("n0 = nn")
    b_("wb = wbn")
    if pingpong:
        swap = re.compile(r"\b(n?)((?:w1|w3|s1|s3)_\d+(?:_\d)?)\b")
        src.extend("        " + line for line in body)
        src.append(f"        if n0 >= {n_end}:")
        src.append("            break")
        src.extend("        " + swap.sub(lambda mo: ("" if mo.group(1) else "n") + mo.group(2), line) for line in body)
    else:
        for c in range(cols):
            for v in ("w1", "s1") if matmul else ("w1", "w3", "s1", "s3"):
                for sfx in ([f"_{h}" for h in range(4)] if wide and v[0] == "w" else [""]):
                    b_(f"{v}_{c}{sfx} = n{v}_{c}{sfx}")
        src.extend("        " + line for line in body)
    ns = {"cuda": cuda, "float32": float32, "uint32": uint32, "uint64": uint64, "int64": int64, "as_f32": as_f32,
          "load": ld16 if a16 else ld32, "store": st16 if a16 else st32, "silu": silu, "rs": _make_rs(nv),
          "prmt": prmt, "lds64": lds64, "lds32": lds32, "add32": add32, "mad32": mad32, "shr32": shr32,
          "min32": min32, "andor32": andor32, "f2u": f2u, "hfma2": hfma2, "hsum2": half2.hsum2,
          "pack_h2": pack_h2, "warp_max": half2.warp_max, "fmax": half2.fmax, "ld4": _ld4w,
          "ldx8": half2.ldx8, "sts4": half2.sts4, "pdl_wait": pdl.wait, "pdl_trigger": pdl.trigger,
          "F0": np.float32(0.0), "F1": np.float32(1.0), "H0": np.uint32(0), "M32": M32, "U32": U32,
          "NIBS": np.uint32(0x0F0F0F0F)}
    ns.update({f"U{v}": np.uint32(v) for v in (0, 1, 3, 4, 5, 15, 16, 31, 60, 256, 4096)})
    ns.update(half2.U4_CONSTS)
    # PRMT selectors: output byte 0 = lane8 (byte 4 of b:a), byte 1 = byte b of the word, bytes 2, 3 = 0 (byte 5)
    ns.update({f"SEL_{b}": np.uint32(0x5504 | (b << 4)) for b in range(4)})
    exec("\n".join(src), ns)  # noqa: S102 - generated from constants only
    opts = {} if SIM or not max_registers else {"max_registers": max_registers}
    return cuda.jit(**opts)(ns["decode"])


# ------------------------------------------------------------------------------------------------- host side
def threads(k, wide=False):
    """Threads of a decode block (one group): one per 8-byte word of a row (wide: per 16 bytes), whole warps."""
    return max(32, 32 * -(-(k // (32 if wide else 16)) // 32))


def lut_for(code, pair=True, h2=False):
    """The decode kernel's table: pair -> uint64 [256], entry b = fp32 bits of code[b >> 4] (low half, the first
    element of the byte) | code[b & 15] << 32; h2 -> uint32 [257], the same two values times a = half2.h2_scale(code)
    as fp16 bits (RNE), then the fp32 bits of 1 / a; else the 16 fp32 code values' bits (uint32)."""
    if h2:
        a = half2.h2_scale(code)
        c16 = (np.ascontiguousarray(code, np.float32) * a).astype(np.float16).view(np.uint16).astype(np.uint32)
        b = np.arange(256)
        tab = (c16[b >> 4] | (c16[b & 15] << np.uint32(16))).astype(np.uint32)
        return np.append(tab, (np.float32(1) / a).view(np.uint32))
    code = np.ascontiguousarray(code, np.float32).view(np.uint32).astype(np.uint64)
    if not pair:
        return code.astype(np.uint32)
    b = np.arange(256)
    return (code[b >> 4] | (code[b & 15] << np.uint64(32))).astype(np.uint64)


def sig(a16, generic, pair=True):
    """The launch signature of FusedFFNNF4's kernels: the decode kernel (two weights), or (``generic``) the generic one
    (fusedffnnf4_cuda); ``pair``: the byte-pair table (uint64 entries)."""
    t = Array(np.uint16) if a16 else Array(np.float32)
    q = Array(np.uint8) if generic else Array(np.uint64)
    tab = Array(np.float32) if generic else Array(np.uint64 if pair else np.uint32)
    am = Array(np.float32)
    return [t, q, am, q, am, tab, t, t, t] + ["int64"] * (6 if generic else 7)

"""NF4/FP4 GEMV at M = 1, 2 with fp16 X, warp-column decode (FusedFFNNF4's two weights): every warp owns a
contiguous range of output columns and reads the whole of K for each of them, so partial sums never leave the warp
(no shared-memory reduction, no barrier per step; the block decode kernel of fusedffnnf4_cuda.py splits K over a
block's warps and meets once a step). K % 1024 == 0 and K <= 1024 * MAX_CHUNKS: a 16-byte load per lane covers 32
elements, a warp-wide load 1024 (a chunk), and a lane keeps its 32 elements of every chunk of X in registers as 16
half2 (32 registers at K = 2048).

Per column and weight a lane issues one 16-byte load per chunk (``ld.global.nc.L1::no_allocate.v4``) and one absmax
load; the next column's loads are in flight while the current one is decoded (the step is written out twice with
the two register sets' roles swapped, so nothing is copied between them). The decode is fusedffnnf4's packed-fp16
one with chains of 4: the byte-pair table of scaled fp16 code values (half2.h2_scale), 32 lane copies in 64 KiB of
dynamic shared memory (byte v of lane l at v * 256 + 4 l), one PRMT, one LDS and one fma.rn.f16x2 per byte; each
chunk's four chains are summed in fp32 and scaled by the absmax. X is scaled by p = 2^(11 - floor(log2 max|x|))
as there (each warp reduces the row's max itself: it holds all of X). The sums are reduced across the warp with
shuffles (6 for the gate / up pair) and lane 0 applies 1 / (p a), the biases, SiLU * mul and
stores the column. Under the CUDA simulator (no shuffles) the warps step in lockstep and reduce through shared
memory.

``mt=2``: two rows of X (M = 2), each with its own scale; each weight byte's table entry serves both.

``split=2``: a pair of warps shares each column range, warp 2p + h decoding half h of K (X and weights), so K up
to 2 * 1024 * MAX_CHUNKS with the registers of half; half 1's lane 0 leaves its sums in shared memory and the pair
meets at its own named barrier (``bar.sync 1 + p, 64``) once a column; the row's max |x| is taken over the block.

Where it pays (H100, weights cycled past L2, benchmarks/nf4shapes_gpu.py, BENCHMARKS.md 2026-11-26 session 21):
FusedFFNNF4 2048 -> 2 x 8192 10.16 / 10.22 us against 12.68 / 12.61 for the block kernel in the same runs (8 warps
per block, 128 registers, 2 blocks per SM; 6 warps: 10.86-11.05 against 12.43-12.95 in four runs); at 4096 -> 2 x
11008 it is slower (23.1 against 21.4-22.5: 254 registers, 8 warps per SM), and so were X in the table's unused half
(24.8) and cp.async rings of 2-4 stages per warp (24.6+); split=2 (8 warps, 128 registers) ties with the block
kernel there (21.51 against 21.75, same run), MatMulNF4 4096 x 11008 13.50 against 13.96, 8192 x 2048 8.93 against
7.92. At M = 2 (mt=2) pairs are needed for the registers: 2048 -> 2 x 8192 12.24 / 12.72 against 15.13 for the pair-
table block kernel (sessions take it), 4096 26.7 at best against 23.6. K = 1024 (M = 1, 2) and 3072 (M = 1) gain
too (4.89 / 6.75, 6.11 / 9.87, 14.78 / 17.06). Sessions: fusedffnnf4_cuda.WARPCOLS.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, uint32

from ..device import half2, pdl
from ..device.fp16 import as_f32, pack_h2
from ..device.inputs import check_x_biases
from ..device.launch import arg
from ..device.memory import LOAD, ld16, make_ld4, st16
from ..device.mma import silu
from ..device.ptx import add32, f2u, hfma2, lds32, mad32, min32, prmt, shr32, warp_sum
from ..device.target import SIM
from ..device import host
from . import common as nf4_common
from .common import check_weights
from .decode_cuda import TAB_BYTES, lut_for, sig

CHUNK = 1024            # elements of K per warp-wide 16-byte load
MAX_CHUNKS = 5          # X in registers: 16 half2 per chunk
WARPS = 8               # warps per block (the table is built once per block): 2 blocks per SM at 128 registers
MAX_REGISTERS = 168     # ptxas limit (12 warps per SM at most); K = 2048 needs 128
FULL = np.uint32(0xFFFFFFFF)
_ld4 = make_ld4(LOAD)


def ok(m, k, a16, split=1):
    """Whether the warp-column kernel can take this call: fp16 X, M = 1 or 2, K a multiple of 1024 * split up to
    MAX_CHUNKS chunks per warp (``split`` warps share a column). (Absmax blocks of at least 32 elements, one per
    16-byte unit: every BlockSize.)"""
    return a16 and 1 <= m <= 2 and k % (CHUNK * split) == 0 and 1 <= k // CHUNK // split <= MAX_CHUNKS


if SIM:
    @cuda.jit(device=True)
    def _pair_sum(g, u, lane, simred, tid):
        """Warp sums of g and u, in lane 0 (simulator: through shared memory; every thread calls it)."""
        simred[2 * tid] = g
        simred[2 * tid + 1] = u
        cuda.syncthreads()
        sg = float32(0.0)
        su = float32(0.0)
        if lane == 0:
            for i in range(32):
                sg += simred[2 * (tid + i)]
                su += simred[2 * (tid + i) + 1]
        cuda.syncthreads()
        return sg, su
else:
    @cuda.jit(device=True, inline=True)
    def _pair_sum(g, u, lane, simred, tid):
        """Warp sums of g and u, in lane 0: lanes 0..15 keep g and send u, 16..31 the other way (one shuffle), a
        4-step butterfly, then lane 0 takes lane 16's u (6 shuffles)."""
        up = (lane & uint32(16)) != uint32(0)
        snd = g if up else u
        v = (u if up else g) + cuda.shfl_xor_sync(FULL, snd, 16)
        v += cuda.shfl_xor_sync(FULL, v, 8)
        v += cuda.shfl_xor_sync(FULL, v, 4)
        v += cuda.shfl_xor_sync(FULL, v, 2)
        v += cuda.shfl_xor_sync(FULL, v, 1)
        return v, cuda.shfl_xor_sync(FULL, v, 16)


if SIM:
    @cuda.jit(device=True)
    def _pair_bar(p):
        """Barrier of warp pair p (the simulator's warps run in lockstep: the block's barrier)."""
        cuda.syncthreads()
else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _pair_bar(typingctx, p):
        """bar.sync 1 + p, 64: the named barrier of warp pair p (ids 1..15; 0 is __syncthreads')."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            pid = builder.add(context.cast(builder, args[0], sig.args[0], types.uint32), ir.Constant(i32, 1))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32]), "bar.sync $0, 64;", "r,~{memory}",
                               side_effect=True)
            builder.call(asm, [pid])
            return context.get_dummy_value()
        return types.void(p), codegen


def _make(chunks, split=1, mt=1):
    """The kernel for K = 1024 * ``chunks``, generated as straight-line code (every per-lane value has its own
    name: X as x2_{row}_{chunk}_{pair}, the current and next column's words as a{w}_{chunk}_{h} / na..., so nothing
    spills to local memory). fusedffnnf4_cuda's decode signature (``lut`` its h2 table: 256 half2 entries + the bits
    of 1 / a; ``parts`` unused: the columns are split over all the grid's warps; ``bs_shift``: BlockSize.log2_words).
    ``mt``: rows of X, 1 or 2 (M must equal it: each weight byte's table entry serves both rows)."""
    if not 1 <= chunks // split <= MAX_CHUNKS or split not in (1, 2) or chunks % split or mt not in (1, 2):
        raise ValueError(f"chunks / split must be 1..{MAX_CHUNKS}, split 1 or 2 (dividing chunks), mt 1 or 2")
    nw = 2                          # two weights (the one-weight form, for MatMulNF4, was never routed)
    cl = chunks // split            # the chunks one warp decodes
    ws = (1, 3)
    rows = range(mt)
    nv = nw * mt                    # sums per column leaving a warp
    src = []
    a = src.append
    a("def kern(x, q1, am1, q3, am3, lut, b1, b3, s, m_dim, k_dim, n_dim, bs_shift, parts, has_b1, has_b3):")
    a("    tab = cuda.shared.array(0, uint32)")
    a("    xmaxs = cuda.shared.array(64, float32)")
    a("    red = cuda.shared.array(128, float32)")
    a(f"    simred = cuda.shared.array({2048 if SIM else 1}, float32)")
    a("    tid = uint32(cuda.threadIdx.x)")
    a("    nthreads = uint32(cuda.blockDim.x)")
    a("    lane = tid & U31")
    a("    warp = tid >> U5")
    a("    nwb = nthreads >> U5")
    if split == 2:    # warps 2p, 2p + 1 of a block: a pair on the same columns, halves hf = 0, 1 of K
        a("    pw = warp >> U1")
        a("    hf = warp & U1")
        a("    npb = nwb >> U1")
        a("    tw = uint32(cuda.gridDim.x) * npb")
        a("    gw = uint32(cuda.blockIdx.x) * npb + pw")
        a(f"    hoff = hf * uint32({32 * cl})      # the half's first 16-byte unit of a row")
        a(f"    xoff = hf * uint32({128 * cl})     # and of X, in units of 8 elements")
        a(f"    bufi = pw * uint32({2 * nv})        # the pair's two slots of {nv} sums in red")
    else:
        a("    tw = uint32(cuda.gridDim.x) * nwb")
        a("    gw = uint32(cuda.blockIdx.x) * nwb + warp")
        a("    hoff = U0")
        a("    xoff = U0")
    a("    ndim = uint32(n_dim)")
    a("    n_lo = uint32(int64(gw) * n_dim // int64(tw))")
    a("    n_hi = uint32(int64(gw + U1) * n_dim // int64(tw))")
    a("    wpr = uint32(k_dim) >> U5")
    a("    sh = uint32(bs_shift) - U1")
    a("    xrow = uint32(k_dim) >> uint32(3)     # a row of X in units of 8 elements")

    def loads(pre, col, ind):
        a(f"{ind}wb = mad32({col}, wpr, lane) + hoff")
        for w in ws:
            for j in range(cl):
                a(f"{ind}wi = add32(wb, uint32({32 * j}))")
                a(f"{ind}" + ", ".join(f"{pre}a{w}_{j}_{h}" for h in range(4)) + f" = ld4(q{w}, wi)")
                a(f"{ind}{pre}s{w}_{j} = am{w}[shr32(wi, sh)]")

    loads("", "min32(n_lo, ndim - U1)", "    ")     # a valid column even for an empty range
    t = [0]

    def tree(vals):
        """fmax tree of ``vals`` (names); returns the name of the root."""
        while len(vals) > 1:
            nxt = []
            for i in range(0, len(vals) - 1, 2):
                a(f"    xt{t[0]} = fmax({vals[i]}, {vals[i + 1]})")
                nxt.append(f"xt{t[0]}")
                t[0] += 1
            vals = nxt + vals[len(vals) - len(vals) % 2:]
        return vals[0]

    src.extend(half2.h2_table_src(False))
    # what earlier kernels wrote (X, the output's old readers) only from here on (device/pdl.py)
    a("    pdl_wait()")
    a("    pdl_trigger()")
    # X: lane l's elements 1024 j + 32 l .. + 31 of chunk j of each row as unscaled half2 (exact), the rows' max |x|
    for m in rows:
        mx = []
        for j in range(cl):
            for e in range(4):
                a("    " + ", ".join(f"xv{i}" for i in range(8)) +
                  f" = ldx8(x, lane * U4 + xoff + xrow * uint32({m}) + uint32({128 * j + e}))")
                for i in range(4):
                    a(f"    x2_{m}_{j}_{4 * e + i} = pack_h2(xv{2 * i}, xv{2 * i + 1})")
                mx.append(tree([f"abs(xv{i})" for i in range(8)]))
        a(f"    xm = warp_max({tree(mx)}, simred, tid)")
        a("    if lane == U0:")
        a(f"        xmaxs[warp + uint32({32 * m})] = xm")
    a("    cuda.syncthreads()")
    ia = "as_f32(lut[U256])"
    for m in rows:
        if split == 2:      # the row's max over all the block's warps (each holds half of X)
            a("    xm = F0")
            a("    wj = uint32(0)")
            a("    while wj < nwb:")
            a(f"        xm = fmax(xm, xmaxs[wj + uint32({32 * m})])")
            a("        wj = uint32(wj + U1)")
        else:
            a(f"    xm = xmaxs[warp + uint32({32 * m})]")
        a("    eb = (f2u(xm) >> uint32(23)) & uint32(255)")
        a("    okp = eb >= uint32(11) and eb != uint32(255)")
        a("    p = as_f32((uint32(265) - eb) << uint32(23)) if okp else F1")
        a(f"    ip{m} = (as_f32((eb - uint32(11)) << uint32(23)) if okp else F1) * {ia}   # and 1 / h2_scale")
        for j in range(cl):
            for i in range(16):
                a(f"    x2_{m}_{j}_{i} = hscale2(x2_{m}_{j}_{i}, p)")
    a("    lane4 = lane << U2")
    a("    n = n_lo")
    if SIM:     # lockstep: every warp runs the largest range's steps (the reductions synchronise the block)
        a("    it = uint32(0)")
        a("    steps = (ndim + tw - U1) // tw")
        a("    while it < steps:")
        more = "it = uint32(it + U1)", "if it >= steps:"
    else:
        a("    while n < n_hi:")
        more = "", "if n >= n_hi:"
    ind = "        "
    sums = [f"{v}{m}" for m in rows for v in ("g", "u")]

    def body(cur, nxt):
        """One column: the next column's loads into ``nxt``-prefixed registers (skipped past the range: those
        registers are then never read), the decode of ``cur``, the reduction and lane 0's epilogue."""
        a(f"{ind}nn = add32(n, U1)")
        a(f"{ind}if nn < n_hi:")
        loads(nxt, "nn", ind + "    ")
        if SIM:     # lockstep: a warp past its range still decodes (never stores) its next "column"
            a(f"{ind}else:")
            for w in ws:
                for j in range(cl):
                    a(f"{ind}    " + ", ".join(f"{nxt}a{w}_{j}_{h}" for h in range(4)) + " = U0, U0, U0, U0")
                    a(f"{ind}    {nxt}s{w}_{j} = F0")
        for w in ws:
            for m in rows:
                a(f"{ind}acc{w}_{m} = F0")
        for j in range(cl):
            for w in ws:
                for h in range(4):          # word h of the chunk: bytes 4h .. 4h + 3, one chain of 4 products
                    for b in range(4):
                        a(f"{ind}tv = lds32(tab, prmt({cur}a{w}_{j}_{h}, lane4, SEL_{b}))")
                        for m in rows:
                            a(f"{ind}c{h}_{m} = hfma2(tv, x2_{m}_{j}_{4 * h + b}, {'H0' if b == 0 else f'c{h}_{m}'})")
                for m in rows:
                    a(f"{ind}acc{w}_{m} += (hsum2(c0_{m}, c1_{m}) + hsum2(c2_{m}, c3_{m})) * {cur}s{w}_{j}")
        for m in rows:
            a(f"{ind}g{m}, u{m} = pair_sum(acc1_{m}, acc3_{m}, lane, simred, tid)")
        if split == 2:      # the pair meets: half 1's lane 0 leaves its sums, half 0's finishes the column
            a(f"{ind}if hf == U1 and lane == U0:")
            for i, v in enumerate(sums):
                a(f"{ind}    red[bufi + uint32({i})] = {v}")
            a(f"{ind}pair_bar(pw)")
            a(f"{ind}if hf == U0 and lane == U0:")
            for i, v in enumerate(sums):
                a(f"{ind}    {v} += red[bufi + uint32({i})]")
            a(f"{ind}bufi ^= uint32({nv})")
        a(f"{ind}if lane == U0 and n < n_hi{' and hf == U0' if split == 2 else ''}:")
        for m in rows:
            a(f"{ind}    g{m} *= ip{m}")
            a(f"{ind}    u{m} *= ip{m}")
            a(f"{ind}    if has_b1:")
            a(f"{ind}        g{m} += load(b1, n)")
            a(f"{ind}    if has_b3:")
            a(f"{ind}        u{m} += load(b3, n)")
            a(f"{ind}    store(s, n + ndim * uint32({m}), silu(g{m}) * u{m})")
        a(f"{ind}n = nn")
        if more[0]:
            a(ind + more[0])

    # two copies of the step with the word registers' roles swapped (no copies between them)
    body("", "n")
    a(ind + more[1])
    a(ind + "    break")
    body("n", "")
    ns = {"cuda": cuda, "float32": float32, "uint32": uint32, "int64": int64, "as_f32": as_f32, "load": ld16,
          "store": st16, "silu": silu, "prmt": prmt, "lds32": lds32, "add32": add32, "mad32": mad32,
          "shr32": shr32, "min32": min32, "f2u": f2u, "hfma2": hfma2, "hsum2": half2.hsum2,
          "hscale2": half2.hscale2, "pack_h2": pack_h2, "warp_max": half2.warp_max, "fmax": half2.fmax,
          "ld4": _ld4, "ldx8": half2.ldx8, "sts4": half2.sts4, "pair_sum": _pair_sum, "pair_bar": _pair_bar,
          "warp_sum": warp_sum, "pdl_wait": pdl.wait, "pdl_trigger": pdl.trigger,
          "F0": np.float32(0.0), "F1": np.float32(1.0), "H0": np.uint32(0)}
    ns.update({f"U{v}": np.uint32(v) for v in (0, 1, 2, 4, 5, 15, 31, 256)})
    # PRMT selectors: output byte 0 = lane4 (byte 4 of b:a), byte 1 = byte b of the word, bytes 2, 3 = 0 (byte 5)
    ns.update({f"SEL_{b}": np.uint32(0x5504 | (b << 4)) for b in range(4)})
    exec("\n".join(src), ns)  # noqa: S102 - generated from constants only
    return cuda.jit(**({} if SIM else {"max_registers": MAX_REGISTERS}))(ns["kern"])


_launchers = {}


def launcher(chunks, split=1, mt=1):
    """Direct-launch wrapper of the kernel (compiled once per process; device/host.launcher: a SimLauncher answering 1
    resident block per SM under the simulator). Signature: decode_cuda.sig's fp16 decode kernel's."""
    key = (chunks, split, mt)
    if key not in _launchers:
        _launchers[key] = host.launcher(_make(chunks, split=split, mt=mt), sig(True, False, False),
                                        dynamic_shared=TAB_BYTES, pdl=True)
    return _launchers[key]


def grid_for(lau, warps, sms):
    """One wave: SMs x resident blocks of ``warps`` warps."""
    return sms * max(1, lau.blocks_per_sm(32 * warps))


def run_arrays(x, q1, am1, q3, am3, quant_type, block_size, K, N, b1=None, b3=None, *,  # noqa: N803
               warps=WARPS, blocks=None, split=1):
    """Runs the kernel on host arrays and returns S. Kept beside runtime/direct.py (which runs what FusedFFNNF4's
    routing picks, with its geometry) for the tests that choose what sessions never do on small shapes: a few warps
    per block, a grid of ``blocks`` (default one wave) and pairs of warps (``split``) at any K. Through the Numba
    dispatcher under the simulator, the direct launch path on a GPU."""
    qt, bs, k, n, code = nf4_common.parse_attrs({"quant_type": quant_type, "block_size": block_size, "K": K, "N": N})
    check_weights(q1, am1, q3, am3, k, n, bs)
    m = check_x_biases(x, b1, b3, k, n, 5, 6)
    if not ok(m, k, x.dtype == np.float16, split):
        raise ValueError("the warp-column kernel takes fp16 X with one or two rows, K % 1024 == 0, "
                         "K / 1024 / split <= 5")
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    ds = cuda.device_array(m * n, np.uint16)
    args = (dev(x, np.uint16), dev(q1, np.uint64), dev(np.asarray(am1, np.float32), np.float32), dev(q3, np.uint64),
            dev(np.asarray(am3, np.float32), np.float32), cuda.to_device(lut_for(code, False, True)),
            dev(b1, np.uint16) if b1 is not None else ds, dev(b3, np.uint16) if b3 is not None else ds, ds, m, k, n,
            bs.log2_words, 0, int(b1 is not None), int(b3 is not None))
    chunks = k // CHUNK
    if SIM:
        _make(chunks, split=split, mt=m)[blocks or 2, 32 * warps, 0, TAB_BYTES](*args)
    else:
        lau = launcher(chunks, split, m)
        lau.launch(blocks or grid_for(lau, warps, host.sm_count()), 32 * warps, 0, *[arg(a) for a in args])
        cuda.synchronize()
    return ds.copy_to_host().view(np.float16).reshape(tuple(x.shape[:-1]) + (n,))

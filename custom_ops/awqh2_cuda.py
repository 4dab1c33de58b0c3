"""Experimental (benchmarks and tests only; no op uses it yet): MatMulAWQ's M = 1 product with a packed-fp16 decode
of AutoAWQ's K-major layout (onnx_lowbit.awq): y[N] = x[K] W (+ bias), fp16 x / y / bias, N % 32 == 0,
group_size % rows == 0, rows % 4 == 0.

A lane owns 32 columns (one 16-byte chunk of a qweight row: 4 int32 words, each 8 columns in AutoAWQ's nibble order
[0, 2, 4, 6, 1, 3, 5, 7]); a warp owns ``rows`` consecutive rows of K for its 32 chunks (1024 columns, a tile), so
its slice lies in one group: one 16-byte load of zero points, one scale per column. Decode: (w >> 4j) & 0x000F000F |
0x64006400 is the half2 (1024 + q[2j], 1024 + q[2j + 1]) of word w (the order puts columns 2j, 2j + 1 in nibbles j,
j + 4); minus (1024 + z) (the zero points decoded alike) it is q - z exactly; one fma.rn.f16x2 with (x_k p, x_k p)
accumulates it into a chain of 4 rows, then the chain is added into fp32 (p = 2^(136 - e) for the warp's largest
|x| = 2^(e - 127 + f): |x p| < 2^10, so a chain stays below 4 * 15 * 2^10 < 65504). Per row and 32 columns: 4
loads' worth of words (one 16-byte load), 12 shifts / LOP3, 16 HSUB2, 16 HFMA2, and per 4 rows 32 conversions and
adds. The warp's sums times the columns' scales / p meet the block's other warps in shared memory; across blocks
(``splits`` = ceil(K / (rows * warps))) each block stores its tile's sums into its slot of a scratch part[splits, N]
and the last block of a tile (threadfence + counter, left zero again) sums the slots in split order
(matmulawq_cuda.sum_splits: deterministic), adds the bias and stores y. Grid: tiles x splits."""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from .dequantawq_cuda import SIM, as_f32, h2f, pack_h2
from .fusedffn_cuda import LOAD, _make_ld4
from .half2 import fmax, ldx8
from .matmulawq_cuda import sum_splits
from .matmulnf4_cuda import f2u, hfma2

CHAIN = 4
_ld4 = _make_ld4(LOAD)
_ld4z = _make_ld4("ld.global.nc.v4.u32")     # zero points and scales: reused by the tile's other splits

if SIM:
    def hsub2(a, b):
        """a - b on both halves (fp16 bits in uint32), rounded to fp16."""
        ha = np.array([int(a) & 0xFFFF, int(a) >> 16], np.uint16).view(np.float16).astype(np.float32)
        hb = np.array([int(b) & 0xFFFF, int(b) >> 16], np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):
            r = (ha - hb).astype(np.float16).view(np.uint16)
        return np.uint32(int(r[0]) | int(r[1]) << 16)
else:
    from .matmulnf4_cuda import _asm32
    hsub2 = _asm32("hsub2", "sub.rn.f16x2 $0, $1, $2;", 2)


def _make(rows=32, warps=4):
    """The kernel for ``rows`` rows per warp and ``warps`` warps per block (straight-line code: every per-lane
    value has its own name, so nothing goes to local memory)."""
    if rows % CHAIN or rows % 8:
        raise ValueError("rows must be a multiple of 8")
    src = []
    a = src.append
    a("def kern(x, qw, qz, sc, bias, y, part, cnt, k_dim, n_dim, g_shift, splits, has_bias):")
    a(f"    red = cuda.shared.array({warps * 1024}, float32)")
    a("    flag = cuda.shared.array(1, uint32)")
    a("    tid = uint32(cuda.threadIdx.x)")
    a("    lane = tid & U31")
    a("    warp = tid >> U5")
    a("    ng32 = uint32(n_dim) >> U5")
    a("    tiles = (ng32 + U31) >> U5")
    a("    bid = uint32(cuda.blockIdx.x)")
    a("    tile = bid % tiles")
    a("    split = bid // tiles")
    a("    c = (tile << U5) + lane")
    a("    ok = c < ng32")
    a("    cc = c if ok else ng32 - U1")
    a(f"    r0 = (split * uint32({warps}) + warp) * uint32({rows})")
    a("    act = r0 < uint32(k_dim)")
    a("    rr = r0 if act else uint32(0)")
    for e in range(rows // 8):      # the warp's x (every lane the same 16-byte loads)
        a("    " + ", ".join(f"x_{8 * e + j}" for j in range(8)) + f" = ldx8(x, (rr >> uint32(3)) + uint32({e}))")
    lv = [f"abs(x_{r})" for r in range(rows)]
    t = 0
    while len(lv) > 1:
        nxt = []
        for i in range(0, len(lv) - 1, 2):
            a(f"    xt{t} = fmax({lv[i]}, {lv[i + 1]})")
            nxt.append(f"xt{t}")
            t += 1
        lv = nxt + lv[len(lv) - len(lv) % 2:]
    a(f"    eb = (f2u({lv[0]}) >> uint32(23)) & uint32(255)")
    a("    okp = eb >= uint32(10) and eb != uint32(255)")
    a("    p = as_f32((uint32(263) - eb) << uint32(23)) if okp else F1")
    a("    ip = as_f32((eb - uint32(9)) << uint32(23)) if okp else F1")
    for r in range(rows):
        a(f"    xp = x_{r} * p")
        a(f"    x2_{r} = pack_h2(xp, xp)")
    a("    g = rr >> uint32(g_shift)")
    a("    zw_0, zw_1, zw_2, zw_3 = ld4z(qz, g * ng32 + cc)")
    for h in range(4):
        for j in range(4):
            a(f"    zz_{h}_{j} = ((zw_{h} >> uint32({4 * j})) & LO4) | MAGIC")
    for col in range(32):
        a(f"    f_{col} = F0")
    a("    wb = rr * ng32 + cc")
    nb = rows // CHAIN

    def loads(prefix, b):
        for r in range(CHAIN):
            a(f"    {prefix}w_{r}_0, {prefix}w_{r}_1, {prefix}w_{r}_2, {prefix}w_{r}_3 = "
              f"ld4(qw, wb + uint32({b * CHAIN + r}) * ng32)")
    loads("", 0)
    for b in range(nb):
        if b + 1 < nb:
            loads("n", b + 1)
        for r in range(CHAIN):
            for h in range(4):
                for j in range(4):
                    a(f"    v = hsub2(((w_{r}_{h} >> uint32({4 * j})) & LO4) | MAGIC, zz_{h}_{j})")
                    a(f"    ch_{h}_{j} = hfma2(v, x2_{b * CHAIN + r}, {'H0' if r == 0 else f'ch_{h}_{j}'})")
        for h in range(4):
            for j in range(4):
                a(f"    f_{8 * h + 2 * j} += h2f(ch_{h}_{j} & U65535)")
                a(f"    f_{8 * h + 2 * j + 1} += h2f(ch_{h}_{j} >> U16)")
        if b + 1 < nb:
            for r in range(CHAIN):
                for h in range(4):
                    a(f"    w_{r}_{h} = nw_{r}_{h}")
    # the columns' scales (fp16; 32 of them = 4 x 16 bytes), times 1 / p
    a("    sb = ((g * uint32(n_dim)) >> U3) + (cc << U2)")
    for q in range(4):
        a(f"    s_{q}_0, s_{q}_1, s_{q}_2, s_{q}_3 = ld4z(sc, sb + uint32({q}))")
    a("    live = act and ok")
    for col in range(32):       # red[warp][col][lane]: a warp's stores hit 32 banks
        q, rem = divmod(col, 8)
        half = f"(s_{q}_{rem // 2} >> U16)" if rem % 2 else f"(s_{q}_{rem // 2} & U65535)"
        a(f"    red[(warp << uint32(10)) + uint32({col * 32}) + lane] = f_{col} * h2f({half}) * ip if live else F0")
    a("    cuda.syncthreads()")
    a("    n64 = uint64(n_dim)")
    a("    cl = tid")
    a("    while cl < uint32(1024):")
    a("        tot = F0")
    for w in range(warps):
        a(f"        tot += red[uint32({w * 1024}) + ((cl & U31) << U5) + (cl >> U5)]")
    a("        col = uint64((tile << uint32(10)) + cl)")
    a("        if col < n64:")
    a("            if splits == 1:")
    a("                if has_bias:")
    a("                    tot += h2f(bias[col])")
    a("                y[col] = f2h(tot)")
    a("            else:")
    a("                part[uint64(split) * n64 + col] = tot")
    a(f"        cl = uint32(cl + uint32({32 * warps}))")
    a("    if splits == 1:")
    a("        return")
    a("    cuda.threadfence()")
    a("    cuda.syncthreads()")
    a("    if tid == U0:")
    a("        old = cuda.atomic.add(cnt, tile, uint32(1))")
    a("        flag[0] = uint32(1) if uint64(old) == uint64(splits) - uint64(1) else uint32(0)")
    a("    cuda.syncthreads()")
    a("    if flag[0] != U0:")
    a("        cuda.threadfence()")
    a("        cl = tid")
    a("        while cl < uint32(1024):")
    a("            col = uint64((tile << uint32(10)) + cl)")
    a("            if col < n64:")
    a("                v = sum_splits(part, col, n64, splits)")
    a("                if has_bias:")
    a("                    v += h2f(bias[col])")
    a("                y[col] = f2h(v)")
    a(f"            cl = uint32(cl + uint32({32 * warps}))")
    a("        if tid == U0:")
    a("            cnt[tile] = uint32(0)")
    ns = {"cuda": cuda, "float32": float32, "uint32": uint32, "uint64": uint64, "as_f32": as_f32, "h2f": h2f,
          "f2h": _f2h16, "pack_h2": pack_h2, "ldx8": ldx8, "fmax": fmax, "f2u": f2u, "hfma2": hfma2, "hsub2": hsub2,
          "ld4": _ld4, "ld4z": _ld4z, "sum_splits": sum_splits, "F0": np.float32(0.0), "F1": np.float32(1.0),
          "H0": np.uint32(0), "LO4": np.uint32(0x000F000F), "MAGIC": np.uint32(0x64006400),
          "U65535": np.uint32(0xFFFF)}
    ns.update({f"U{v}": np.uint32(v) for v in (0, 1, 2, 3, 5, 16, 31)})
    exec("\n".join(src), ns)  # noqa: S102 - generated from constants only
    return ns["kern"]


if SIM:
    def _f2h16(v):
        return np.uint16(np.float32(v).astype(np.float16).view(np.uint16))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _f2h16(v):
        return uint16(libdevice.float2half_rn(v))


def ok(k, n, group_size, rows=32):
    g = int(group_size)
    return n % 32 == 0 and k % rows == 0 and g % rows == 0 and rows % 8 == 0 and g & (g - 1) == 0


def grid(k, n, rows=32, warps=4):
    """(blocks, splits): tiles of 1024 columns x K splits of rows * warps rows."""
    splits = -(-k // (rows * warps))
    return -(-(n // 32) // 32) * splits, splits


_kernels = {}


def sig():
    from .cuda_launch import Array
    h = Array(np.uint16)
    return [h, Array(np.uint32), Array(np.uint32), Array(np.uint32), h, h, Array(np.float32), Array(np.uint32),
            "int64", "int64", "int64", "int64", "int64"]


def launcher(rows=32, warps=4, max_registers=None):
    """Direct-launch wrapper (GPU only; compiled once per process)."""
    from .cuda_launch import Launcher
    key = (rows, warps, max_registers)
    if key not in _kernels:
        fn = cuda.jit(**({"max_registers": max_registers} if max_registers else {}))(_make(rows, warps))
        lau = Launcher(fn, sig())
        lau.dispatcher = fn
        _kernels[key] = lau
    return _kernels[key]


def run_arrays(x, qweight, qzeros, scales, group_size, K, N, bias=None, *, rows=32, warps=4):  # noqa: N803
    """y = x W (+ bias) for fp16 x [K] (tests, benchmarks): through the simulator's dispatcher or a direct launch."""
    if not ok(K, N, group_size, rows):
        raise ValueError(f"awqh2 needs N % 32 == 0, K and group_size (a power of two) multiples of rows ({rows}), "
                         "rows % 8 == 0")
    blocks, splits = grid(K, N, rows, warps)
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    dx = dev(np.asarray(x, np.float16), np.uint16)
    dy = cuda.device_array(N, np.uint16)
    db = dev(np.asarray(bias, np.float16), np.uint16) if bias is not None else dy
    part = cuda.device_array(max(1, splits * N), np.float32)
    cnt = cuda.to_device(np.zeros(-(-(N // 32) // 32), np.uint32))
    args = (dx, dev(np.asarray(qweight, np.int32), np.uint32), dev(np.asarray(qzeros, np.int32), np.uint32),
            dev(np.asarray(scales, np.float16), np.uint32), db, dy, part, cnt, K, N,
            int(group_size).bit_length() - 1, splits, int(bias is not None))
    if SIM:
        cuda.jit(_make(rows, warps))[blocks, 32 * warps](*args)
    else:
        p = lambda a: (a.device_ctypes_pointer.value, (a.size,)) if hasattr(a, "device_ctypes_pointer") else a  # noqa: E731
        launcher(rows, warps).launch(blocks, 32 * warps, 0, *[p(v) for v in args])
        cuda.synchronize()
    return dy.copy_to_host().view(np.float16)

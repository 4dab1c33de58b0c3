"""NF4/FP4 tensor-core decode kernel (fp16 X, M <= 16, K % 64 == 0, block_size >= 64): MatMulNF4 (nw=1,
Y = X W^T + bias) and FusedFFNNF4 (nw=2, S = SiLU(X W1^T + B1) * (X W3^T + B3)); the weights stay packed
(bitsandbytes layout, onnx_lowbit.nf4: W^T [N, K] row-major, element i in byte i >> 1, high nibble first, one fp32
absmax per block), dequantised in registers and fed to mma.sync m16n8k16 (fp16 inputs, fp32 accumulation).

Why: the fp32 decode kernels (fusedffnnf4_cuda) spend one 8-byte shared-memory load and two FFMAs per weight byte;
ncu on the H100 (FusedFFNNF4, LLaMA-7B gate+up, M=1): 0.43 instructions issued per cycle and scheduler, 35% of
the stalls on shared-memory loads, 43% of DRAM bandwidth, while the same access pattern without decoding reads at
2.8-3.2 TB/s (benchmarks/stream4_gpu.py). Here one 4-byte shared load gives both fp16 code values of a byte (the
A fragment's half2 as is) and one mma takes 16 rows x 16 k: per weight byte one PRMT and one LDS.32, plus an
mma, the x loads and 4 FFMAs per 64 k.

Mapping: a warp owns a 16-row tile (fragment row g = lane >> 2: W^T rows n0 + g and n0 + g + 8) and a run of
64-element chunks of K; for each chunk lane t = lane & 3 loads bytes 8t .. 8t+7 of the chunk of both its rows
(one 8-byte load per row and weight: 4 lanes read one 32-byte sector), and the chunk's absmax of both rows (K %
64 == 0 and block_size >= 64: a chunk lies in one absmax block). mma step s (0..3) takes bytes 2s and 2s+1: the
fragment's k pair (2t, 2t+1) is byte 2s (elements 16t + 4s, +1: high, low nibble), (2t+8, 2t+9) byte 2s+1; the sum
over k does not care about the order as long as B (= x) uses the same: B column j = activation row m0 + j (8 rows
per pass; from M = 9 both row chunks in one block, each A fragment feeding two mma: RC2_*), the lane's 4 x values
one 8-byte load per row chunk. D of a
chunk is scaled by its absmax (4 FFMAs per weight) into the lane's accumulators. The half2 table (the fp16 code
values of a byte's high then low nibble) is in dynamic shared memory, 32 copies (entry of byte v for lane l at
byte v * 256 + 4l: no bank conflicts), addressed by one PRMT (byte into bits 8..15, 4 * lane into bits 0..7).
A block is WARPS warps on a contiguous run of tiles; its warps split K (ceil(K / 64 / WARPS) chunks each, the
next chunk's words prefetched while the current one is decoded), their partials meet in shared memory once per
tile (double-buffered, one barrier per tile), and 16 x rows threads apply bias / SiLU * mul in fp32 and store in
fp16. Grid: row chunks x (SMs x resident blocks), one wave. MatMulNF4 from HALVES_MIN_M rows (N even) runs as the
two-weight kernel on its weight's two halves of rows (``halves``: both products stored, no SiLU * mul), which keeps
twice the one-weight kernel's words in flight per warp.

Accuracy: the code values are rounded to fp16 (bitsandbytes' own kernels dequantise to fp16 too): at most 2^-12
relative per weight, products and sums in fp32. NaN/Inf in a row of X make that row's outputs non-finite.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32, uint64

from ..device.fp16 import f2h, h2f
from ..device.launch import Array, arg
from ..device.mma import mma as _mma, silu
from ..device.ptx import add32, lds32, mad32, prmt, shr32
from ..device.target import SIM
from ..device import host

WARPS = 8                  # warps per block (they split K)
MAX_M = 16
TAB_BYTES = 65536          # half2 table: 256 bytes x 32 lanes x 4 B at stride 256
CPL = 2                    # chunks of 64 per load batch (the next batch is in flight while one is decoded)
SEL = tuple(np.uint32(0x5504 | (b << 4)) for b in range(4))   # PRMT: byte b of the word -> bits 8..15
M32 = np.uint64(0xFFFFFFFF)
U0 = np.uint64(0)
U32 = np.uint64(32)
F0 = np.float32(0.0)


def lut(code):
    """uint32 [256]: entry v = fp16 bits of code[v >> 4] (low half: the byte's first element) | code[v & 15] << 16."""
    h = np.asarray(code, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    v = np.arange(256)
    return (h[v >> 4] | (h[v & 15] << 16)).astype(np.uint32)


@cuda.jit(device=True, inline=True)
def build_table(tab, lt, tid, nthr, lane):
    """The 32 copies of the half2 table (entry v of copy l at word 64 v + l): thread v loads entry v once and
    writes its copies starting at its own lane, so a warp's 32 stores of a step hit 32 banks. (Loading an entry per
    store: 32 dependent global loads per thread.)"""
    v = tid
    while v < uint32(256):
        val = lt[v]
        for s in range(32):
            tab[(v << uint32(6)) | ((uint32(s) + lane) & uint32(31))] = val
        v = add32(v, nthr)


def ok(a16, m, k, n, bs):
    """Whether this kernel can take the product (element offsets of W^T are 32-bit)."""
    return bool(a16) and 0 < m <= MAX_M and k % 64 == 0 and bs >= 64 and k * n < 2 ** 32


RC2_MIN_M = 9              # from this M one block takes both chunks of 8 rows (rc = 2), with RC2_WARPS warps and
RC2_WARPS = 4              # CPL chunks per batch. H100, LLaMA-7B gate / up (benchmarks/nf4tc_gpu.py, session 25),
                           # us at M = 9 / 12 / 16: FusedFFNNF4 44.3 / 46.2 / 49.1 against 69.5 / 70.9 / 73.7 for two
                           # blocks of one chunk each (8 warps, cpl 2); MatMulNF4 25.7 / 27.4 / 31.1 against 41.5 /
                           # 41.4 / 41.4; 8 warps or cpl 1 with rc = 2: 28.0-57.9


def row_chunks(m):
    """Chunks of 8 rows per block: 2 from RC2_MIN_M (each A fragment decoded once for both chunks' mma), else 1."""
    return 2 if m >= RC2_MIN_M else 1


def warps_for(rc):
    """Warps per block of the kernel with ``rc`` row chunks per block."""
    return WARPS if rc == 1 else RC2_WARPS


def chunks(m, rc=1):
    """Row chunks of the grid (blocks of rc chunks of 8 rows each)."""
    return -(-m // (8 * rc))


HALVES_MIN_M = 8           # MatMulNF4 (one weight, even N) from HALVES_MIN_M rows: the two-weight kernel on the
                          # weight's two halves (twice the words in flight per warp). H200, LLaMA-7B gate / up,
                           # weights past L2 (benchmarks/nf4tc_gpu.py --halves, BENCHMARKS.md session 26), us, halves
                           # / one weight: M = 9 / 12 / 16 (rc 2) 30.7 / 31.8 / 33.9 against 32.9 / 35.5 / 39.3; M = 8
                           # 23.8 / 24.7; M = 2, 4 slower (22.2 / 20.7, 22.3 / 21.6). H100: M = 8 / 12 / 16 23.5 /
                           # 31.8 / 33.7 against 24.1 / 34.8 / 38.4; M = 4 22.6 against 21.8


def use_halves(n, k, bs):
    """Whether a one-weight product of N = ``n`` columns (K = ``k``, block size ``bs``) can run as two halves through
    the two-weight kernel: N even and the second half's first absmax block starting at its first element (MatMulNF4
    routes there from HALVES_MIN_M rows)."""
    return n % 2 == 0 and (n // 2 * k) % bs == 0


def half_sizes(n, k, bs):
    """(rows, packed uint64 words, absmax values) of each half of a weight of N = ``n`` rows that ``use_halves``
    takes: the second half starts that many words / absmax values into the arrays."""
    nh = n // 2
    return nh, nh * k // 16, nh * k // bs


def parts_for(n, nch, sms, occupancy):
    return max(1, min(-(-n // 16), (sms * occupancy) // nch))


def session_mode(nw, rc, halves):
    """(launcher, block, resident blocks per SM) of the kernel a MatMulNF4 (nw = 1; ``halves``: the two-weight kernel
    on its weight's halves) / FusedFFNNF4 (nw = 2) kernel object launches with ``rc`` row chunks per block; the grid
    of a call is chunks(M, rc) * parts_for(...)."""
    warps = warps_for(rc)
    lau = launcher(2 if halves else nw, warps, rc, halves)
    return lau, 32 * warps, max(1, lau.blocks_per_sm(32 * warps))


def make(nw, warps=WARPS, rc=1, halves=False):
    """The kernel for ``nw`` weights (1: MatMulNF4, 2: FusedFFNNF4), CPL chunks of 64 per load batch, ``rc``
    chunks of 8 rows of X per block (2: M = 9 .. 16 with each A fragment decoded once for both chunks' mma).
    Signature: x uint64 [M*K/4] (fp16 bits), q1 uint64 [N*K/16], am1 float32, q3, am3 (nw=1: pass q1's), lut
    uint32 [256] (``lut``), b1, b3, out uint16, m_dim, k_dim, n_dim, bs_shift (BlockSize.log2), parts, has_b1,
    has_b3. ``halves`` (nw = 2; MatMulNF4 with an even N): W1 / W3 are the first and second halves of one weight's
    rows (n_dim = N / 2 each; q3, am3, b3 point into the same arrays), and the output is the plain product Y [M, N]:
    column n of a half-product goes to column n (W1) and N / 2 + n (W3) of Y; the two-weight kernel keeps twice the
    words in flight per warp of the one-weight kernel."""
    assert not halves or nw == 2
    red_size = 2 * warps * rc * nw * 128   # [buffer][warp][row chunk][weight][16 columns x 8 rows]
    scr_size = warps * 32 * 6 if SIM else 1
    cpl = CPL
    nwd = 2 * nw * cpl          # words (and absmax) per batch: [chunk][weight][row]
    nxv = 4 * cpl * rc          # x words per batch: [row chunk][chunk][step]
    nacc = 4 * nw * rc          # [row chunk][weight][4]

    @cuda.jit(device=True, inline=True)
    def fetch(wv, av, xv, q1, am1, q3, am3, x, e0, e1, sh, xi, jc, jmax, rok, xi1, rok1):
        """The batch of chunks jc .. jc+cpl-1 of this warp, at elements e0 / e1 of the flat W^T (rows r0 / r1, the
        lane's 16 elements of the first chunk): 8-byte words and absmax of each weight (absmax 0 past K), and
        the lane's 4 x words per chunk (0 where B column g is no row of X or the chunk is past K), of each row chunk
        (xi / rok, and xi1 / rok1 for the second with rc = 2)."""
        for u in range(cpl):
            f0 = add32(e0, uint32(64 * u))
            f1 = add32(e1, uint32(64 * u))
            i0 = shr32(f0, uint32(4))
            i1 = shr32(f1, uint32(4))
            a0 = shr32(f0, sh)
            a1 = shr32(f1, sh)
            o = u * 2 * nw
            if add32(jc, uint32(u)) < jmax:
                wv[o] = q1[i0]
                wv[o + 1] = q1[i1]
                av[o] = am1[a0]
                av[o + 1] = am1[a1]
                if nw == 2:
                    wv[o + 2] = q3[i0]
                    wv[o + 3] = q3[i1]
                    av[o + 2] = am3[a0]
                    av[o + 3] = am3[a1]
                for s in range(4):
                    xv[4 * u + s] = x[add32(xi, uint32(16 * u + s))] if rok else U0
                    if rc == 2:
                        xv[4 * (cpl + u) + s] = x[add32(xi1, uint32(16 * u + s))] if rok1 else U0
            else:
                for q in range(2 * nw):
                    av[o + q] = F0
                for s in range(4):
                    xv[4 * u + s] = U0
                    if rc == 2:
                        xv[4 * (cpl + u) + s] = U0

    @cuda.jit(device=True, inline=True)
    def chunk(wv, av, xv, acc, tab, lane4, scr, tid):
        for u in range(cpl):
            for w in range(nw):
                o = u * 2 * nw + 2 * w
                d0 = F0
                d1 = F0
                d2 = F0
                d3 = F0
                f0 = F0
                f1 = F0
                f2 = F0
                f3 = F0
                for s in range(4):
                    wg = wv[o]
                    wg8 = wv[o + 1]
                    hg = uint32(wg & M32) if s < 2 else uint32(wg >> U32)
                    hg8 = uint32(wg8 & M32) if s < 2 else uint32(wg8 >> U32)
                    lo = SEL[2 * (s & 1)]
                    hi = SEL[2 * (s & 1) + 1]
                    a0 = lds32(tab, prmt(hg, lane4, lo))
                    a1 = lds32(tab, prmt(hg8, lane4, lo))
                    a2 = lds32(tab, prmt(hg, lane4, hi))
                    a3 = lds32(tab, prmt(hg8, lane4, hi))
                    xq = xv[4 * u + s]
                    r = _mma(a0, a1, a2, a3, uint32(xq & M32), uint32(xq >> U32), d0, d1, d2, d3, scr, tid)
                    d0 = r[0]
                    d1 = r[1]
                    d2 = r[2]
                    d3 = r[3]
                    if rc == 2:         # the second row chunk on the same A fragment
                        xq = xv[4 * (cpl + u) + s]
                        r = _mma(a0, a1, a2, a3, uint32(xq & M32), uint32(xq >> U32), f0, f1, f2, f3, scr, tid)
                        f0 = r[0]
                        f1 = r[1]
                        f2 = r[2]
                        f3 = r[3]
                acc[4 * w] += av[o] * d0
                acc[4 * w + 1] += av[o] * d1
                acc[4 * w + 2] += av[o + 1] * d2
                acc[4 * w + 3] += av[o + 1] * d3
                if rc == 2:
                    acc[4 * (nw + w)] += av[o] * f0
                    acc[4 * (nw + w) + 1] += av[o] * f1
                    acc[4 * (nw + w) + 2] += av[o + 1] * f2
                    acc[4 * (nw + w) + 3] += av[o + 1] * f3

    @cuda.jit
    def nf4tc(x, q1, am1, q3, am3, lt, b1, b3, out, m_dim, k_dim, n_dim, bs_shift, parts, has_b1, has_b3):
        tab = cuda.shared.array(0, uint32)
        red = cuda.shared.array(red_size, float32)
        scr = cuda.shared.array(scr_size, uint32)
        tid = uint32(cuda.threadIdx.x)
        nthr = uint32(cuda.blockDim.x)
        lane = tid & uint32(31)
        warp = tid >> uint32(5)
        nwarps = nthr >> uint32(5)
        g = lane >> uint32(2)
        t = lane & uint32(3)
        build_table(tab, lt, tid, nthr, lane)
        lane4 = lane << uint32(2)
        mdim = uint32(m_dim)
        kdim = uint32(k_dim)
        ndim = uint32(n_dim)
        sh = uint32(bs_shift)
        nch = (mdim + uint32(8 * rc - 1)) // uint32(8 * rc)
        bid = uint32(cuda.blockIdx.x)
        m0 = (bid % nch) * uint32(8 * rc)
        part = uint64(bid // nch)
        tiles = uint64((ndim + uint32(15)) >> uint32(4))
        t_lo = uint32(part * tiles // uint64(parts))
        t_hi = uint32((part + uint64(1)) * tiles // uint64(parts))
        kc = kdim >> uint32(6)
        per = uint32((kc + nwarps * uint32(cpl) - uint32(1)) // (nwarps * uint32(cpl)))   # batches per warp
        c_lo = uint32(warp * per * uint32(cpl))
        jmax = uint32(kc - c_lo) if c_lo < kc else uint32(0)   # this warp's chunks inside K
        rok = m0 + g < mdim
        rok1 = m0 + g + uint32(8) < mdim
        xrow = mad32(m0 + g, kdim >> uint32(2), t << uint32(2))   # x word of (row m0 + g, chunk 0, lane t)
        x8 = kdim << uint32(1)                                     # x words of 8 rows
        last = ndim - uint32(1)
        wv = cuda.local.array(nwd, uint64)
        av = cuda.local.array(nwd, float32)
        xv = cuda.local.array(nxv, uint64)
        wn = cuda.local.array(nwd, uint64)
        an = cuda.local.array(nwd, float32)
        xn = cuda.local.array(nxv, uint64)
        acc = cuda.local.array(nacc, float32)
        for q in range(nacc):
            acc[q] = F0
        cuda.syncthreads()
        if t_lo >= t_hi:
            return
        tile = t_lo
        j = uint32(0)                                        # batch of the tile, first chunk jc = j * cpl
        jc = uint32(0)
        xc = mad32(c_lo, uint32(16), xrow)                   # the lane's x word at its first chunk
        ec = (c_lo << uint32(6)) + (t << uint32(4))         # element offset in a row: first chunk, lane t
        e0 = mad32(min((tile << uint32(4)) + g, last), kdim, ec)
        e1 = mad32(min((tile << uint32(4)) + g + uint32(8), last), kdim, ec)
        xi = xc
        fetch(wv, av, xv, q1, am1, q3, am3, x, e0, e1, sh, xi, jc, jmax, rok, add32(xi, x8), rok1)
        buf = uint32(0)
        while True:
            j = add32(j, uint32(1))
            jc = add32(jc, uint32(cpl))
            e0 = add32(e0, uint32(64 * cpl))
            e1 = add32(e1, uint32(64 * cpl))
            xi = add32(xi, uint32(16 * cpl))
            end = j == per
            more = True
            if end:
                j = uint32(0)
                jc = uint32(0)
                more = tile + uint32(1) < t_hi
                e0 = mad32(min(((tile + uint32(1)) << uint32(4)) + g, last), kdim, ec)
                e1 = mad32(min(((tile + uint32(1)) << uint32(4)) + g + uint32(8), last), kdim, ec)
                xi = xc
            if more:
                fetch(wn, an, xn, q1, am1, q3, am3, x, e0, e1, sh, xi, jc, jmax, rok, add32(xi, x8), rok1)
            chunk(wv, av, xv, acc, tab, lane4, scr, tid)
            if end:                   # the tile's K is done: partials of the block's warps, then the epilogue
                base = (buf * nwarps + warp) * uint32(rc * nw * 128) + (g << uint32(3)) + (t << uint32(1))
                for w in range(rc * nw):                  # [row chunk][weight]
                    o = base + uint32(w * 128)
                    red[o] = acc[4 * w]
                    red[o + uint32(1)] = acc[4 * w + 1]
                    red[o + uint32(64)] = acc[4 * w + 2]
                    red[o + uint32(65)] = acc[4 * w + 3]
                for q in range(nacc):
                    acc[q] = F0
                cuda.syncthreads()
                mc = min(uint32(8 * rc), mdim - m0)
                e = tid
                while e < (mc << uint32(4)):
                    col = e >> uint32(4)
                    row = e & uint32(15)
                    n = (tile << uint32(4)) + row
                    if n < ndim:
                        gv = F0
                        uv = F0
                        r = (buf * nwarps * uint32(rc) + (col >> uint32(3))) * uint32(nw * 128) + (row << uint32(3)) + \
                            (col & uint32(7))
                        wj = uint32(0)
                        while wj < nwarps:
                            gv += red[r]
                            if nw == 2:
                                uv += red[r + uint32(128)]
                            r += uint32(rc * nw * 128)
                            wj += uint32(1)
                        if has_b1:
                            gv += h2f(b1[n])
                        oi = (m0 + col) * ndim + n
                        if nw == 1:
                            out[oi] = f2h(gv)
                        elif halves:          # Y [M, 2 n_dim]: the first half's column, then the second's
                            oi = mad32(m0 + col, ndim << uint32(1), n)
                            out[oi] = f2h(gv)
                            if has_b3:
                                uv += h2f(b3[n])
                            out[add32(oi, ndim)] = f2h(uv)
                        else:
                            if has_b3:
                                uv += h2f(b3[n])
                            out[oi] = f2h(silu(gv) * uv)
                    e += nthr
                buf ^= uint32(1)
                tile = add32(tile, uint32(1))
                if not more:
                    break
            for q in range(nwd):
                wv[q] = wn[q]
                av[q] = an[q]
            for q in range(nxv):
                xv[q] = xn[q]

    return nf4tc


def sig():
    u64, f32, u16 = Array(np.uint64), Array(np.float32), Array(np.uint16)
    return [u64, u64, f32, u64, f32, Array(np.uint32), u16, u16, u16] + ["int64"] * 7


_launchers = {}


def launcher(nw, warps=WARPS, rc=1, halves=False):
    """Direct-launch wrapper, compiled once per process (device/host.launcher; ``.dispatcher``: the Numba kernel)."""
    key = (nw, warps, rc, halves)
    if key not in _launchers:
        _launchers[key] = host.launcher(make(nw, warps, rc, halves), sig(), dynamic_shared=TAB_BYTES)
    return _launchers[key]


def device_args(x, q1, am1, q3, am3, code, b1, b3, out_size, words):
    """(nw, device arrays x, q1, am1, q3, am3, the half2 table, b1, b3, out) of a host run of this kernel or
    nf4mma_cuda's: x and the packed weights as ``words`` (uint64 here, uint32 there), fp16 as uint16; nw = 2 when
    q3 is given (else q3 / am3 are q1's), a missing bias is the output array (never read)."""
    nw = 1 if q3 is None else 2
    dev = lambda a, dt: cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(dt))  # noqa: E731
    dq1, dam1 = dev(q1, words), dev(np.asarray(am1, np.float32), np.float32)
    dq3, dam3 = (dq1, dam1) if nw == 1 else (dev(q3, words), dev(np.asarray(am3, np.float32), np.float32))
    dout = cuda.device_array(out_size, np.uint16)
    db1 = dev(np.asarray(b1, np.float16), np.uint16) if b1 is not None else dout
    db3 = dev(np.asarray(b3, np.float16), np.uint16) if b3 is not None else dout
    return nw, (dev(x, words), dq1, dam1, dq3, dam3, cuda.to_device(lut(code)), db1, db3, dout)


def run(x, q1, am1, q3, am3, code, block_size, K, N, b1=None, b3=None, *, warps=None, sms=None,  # noqa: N803
        repeat=1, rc=None, halves=None):
    """Host arrays in, host array out: nw = 2 when q3 is given, else 1. x fp16 [..., K]. Kept beside
    runtime/direct.py (which runs what the ops route to, with their geometry) for what tests and benchmarks choose
    that sessions do not: ``warps`` per block (default warps_for(rc); 2 under the simulator), ``sms`` (the grid),
    ``rc`` row chunks of 8 per block at any M (default: ``row_chunks(M)``), ``halves`` (one weight: through the
    two-weight kernel on its two halves; default use_halves(N, K, block_size) from HALVES_MIN_M rows, as
    MatMulNF4 routes), ``repeat`` launches."""
    x = np.ascontiguousarray(x, np.float16)
    lead = x.shape[:-1]
    m = int(np.prod(lead)) if lead else 1
    assert ok(True, m, K, N, block_size), "shape not served by the tensor-core kernel"
    nw, (dx, dq1, dam1, dq3, dam3, dlut, db1, db3, dout) = device_args(x, q1, am1, q3, am3, code, b1, b3, m * N,
                                                                        np.uint64)
    if halves is None:
        halves = use_halves(N, K, block_size) and m >= HALVES_MIN_M
    halves = nw == 1 and halves
    nd, hb3 = N, int(b3 is not None)
    if halves:      # the two halves of the weight's rows (and of its bias) as W1 / W3
        assert use_halves(N, K, block_size), "halves need an even N and whole absmax blocks"
        nd, w, a = half_sizes(N, K, block_size)
        nw, hb3 = 2, int(b1 is not None)
        dq1, dq3, dam1, dam3 = dq1[:w], dq1[w:], dam1[:a], dam1[a:]
        if b1 is not None:
            db1, db3 = db1[:nd], db1[nd:]
    rc = rc or row_chunks(m)
    nch = chunks(m, rc)
    warps = warps or (2 if SIM else warps_for(rc))
    if SIM:
        occ, sms = 1, sms or 2
    else:
        lau = launcher(nw, warps, rc, halves)
        occ = max(1, lau.blocks_per_sm(32 * warps))
        sms = sms or host.sm_count()
    parts = parts_for(nd, nch, sms, occ)
    args = (dx, dq1, dam1, dq3, dam3, dlut, db1, db3, dout, m, K, nd, block_size.bit_length() - 1, parts,
            int(b1 is not None), hb3)
    if SIM:
        kern = make(nw, warps, rc, halves)
        for _ in range(repeat):
            kern[nch * parts, 32 * warps, 0, TAB_BYTES](*args)
    else:
        for _ in range(repeat):
            lau.launch(nch * parts, 32 * warps, 0, *[arg(a) for a in args])
        cuda.synchronize()
    return dout.copy_to_host().view(np.float16).reshape(tuple(lead) + (N,))

"""MatMulNF4 (and FusedFFNNF4) at accuracy_level 4 on the CPU: A quantised to int8 per group, integer dot products
with the NF4 / FP4 codes as int8 levels, per group one fp32 scale (reference and definition: onnx_lowbit.nf4_int8).

* ``quantize``: A (float32 [M, K]) -> ``QuantA`` (int8 rows; on VNNI CPUs per 8-element lane the -128 x sum
  correction and the scale amax / 127^2), once per call (per task in the native entries: about 16 columns' work).
* ``cols``: out[:, n0:n1] from a QuantA on AVX-512 VNNI CPUs (nf4vnni_cpu's tiles: 4, 2 or 1 rows x 4 or 1
  columns; one row: the prescaled tiles, absmax x scale formed once per call by ``prescale``), else
  ``cols_scalar`` (Numba scalar loops, the same integer sums; fp32 scales applied per group).
* ``product``: the host-array product (the Python path; FusedFFNNF4's too) over threads (device/threads.py);
  ``native_matmul``: MatMulNF4's native entry (runtime/plans.py), ``Level4``: a node's setup and task grain.
* A constant weight on VNNI CPUs (``Level4.pack_constant``: the node's initializer, repacked once into column lanes
  by nf4col_cpu; its copy costs N x K / 2 + 4 x N x K / g bytes per node): ``product_packed`` (the Python path) and
  ``native_matmul_packed`` (the native entry) run nf4col_cpu's tiles instead, for every M of that node.
Level 4 needs K % 32 == 0 (``group``); the kernels compute level 0 otherwise (matmulnf4_cpu). Every column is
computed by the same operations whatever the tile, the range or the task, so all paths of one weight layout give
the same bytes: a node whose weight is packed gets the same bytes at every M and thread split (nf4col_cpu's
operations), as does a node whose weight is not (nf4vnni_cpu's / the scalar path's); the two layouts differ from
each other by fp32 summation order only (the integer sums are the same)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from onnx_lowbit import nf4_int8

from ..device import native, threads
from . import nf4col_cpu as col
from . import nf4vnni_cpu as vnni
from .nf4decode_cpu import absmax32
from .nf4vnni_cpu import VNNI

PARALLEL_MIN_MACS = 1 << 21   # as matmulnf4_cpu: from here the columns are split over threads


def group(k: int, bs: int):
    """(activation group, weight block size the kernels index with: bs, or 32 for one absmax per 32-element piece)
    of level 4 for this weight, or None where level 4 computes as level 0 (K % 32 != 0)."""
    g = nf4_int8.int8_group(k, bs)
    return None if g is None else (g, bs if k % bs == 0 else 32)


def table(quant_type: str) -> np.ndarray:
    """The kernels' level table of ``quant_type``: uint8[nf4vnni_cpu.TABLE_BYTES], the 16 int8 levels
    (nf4_int8.code_levels) + 128, four times, then the level divisor L (nf4vnni_cpu.table; the scalar path reads
    its first 16 bytes)."""
    return vnni.table(nf4_int8.code_levels(quant_type), nf4_int8.level_divisor(quant_type))


@njit(cache=True, inline="always")
def _log2(v):
    r = 0
    while (1 << r) < v:
        r += 1
    return r


@njit(cache=True, nogil=True, boundscheck=False)
def quantize_scalar(a, g, aq, sal):
    """Scalar path: aq[m, k] = int8 of a[m, k] in natural order (nf4_int8.quantize_activations' fp32 operations),
    sal[m, j] = amax x fp32(1 / 127^2) of group j as quantize_row has it (NaN for a group with a NaN or inf)."""
    m_dim, k_dim = a.shape
    for m in range(m_dim):
        for j0 in range(0, k_dim, g):
            amax = np.float32(0.0)
            bad = False
            for k in range(j0, j0 + g):
                v = abs(a[m, k])
                if not (v < np.float32(np.inf)):
                    bad = True
                elif v > amax:
                    amax = v
            inv = np.float32(0.0)
            if bad:
                sal[m, j0 // g] = np.float32(np.nan)
            else:
                sal[m, j0 // g] = amax * np.float32(vnni.SAL)
                if amax > 0:
                    inv = np.float32(127.0) / amax
            for k in range(j0, j0 + g):
                x = np.rint(a[m, k] * inv) if not bad else np.float32(0.0)
                aq[m, k] = np.int8(min(max(x, np.float32(-127.0)), np.float32(127.0)))


@njit(cache=True, nogil=True, boundscheck=False)
def quantize_vnni(a, lg, aq, corr, sal):
    for m in range(a.shape[0]):
        vnni.quantize_row(a[m], a.shape[1], lg, aq[m], corr[m], sal[m])


class QuantA:
    """A quantised for the kernels: ``aq`` int8 [M, Kp], ``corr`` int32 [M, Kp / 8], ``sal`` float32 [M, Kp / 8]
    (VNNI layout, Kp = K rounded up to 128), or ``aq`` [M, K] and ``sal`` [M, K / g] (scalar path, corr empty)."""
    __slots__ = ("aq", "corr", "sal")

    def __init__(self, aq, corr, sal):
        self.aq, self.corr, self.sal = aq, corr, sal


@njit(cache=True, nogil=True)
def quantize_arrays(a, g):
    """(aq, corr, sal) of float32 a [M, K] in the layout this CPU's kernels read (QuantA)."""
    m, k = a.shape
    if VNNI:
        kp = (k + 127) // 128 * 128
        aq = np.empty((m, kp), np.int8)
        corr = np.empty((m, kp // 8), np.int32)
        sal = np.empty((m, kp // 8), np.float32)
        quantize_vnni(a, _log2(g), aq, corr, sal)
        return aq, corr, sal
    aq = np.empty((m, k), np.int8)
    sal = np.empty((m, k // g), np.float32)
    quantize_scalar(a, g, aq, sal)
    return aq, np.empty((m, 0), np.int32), sal


def quantize(a2, g) -> QuantA:
    """float32 [M, K] -> QuantA (groups of g)."""
    return QuantA(*quantize_arrays(np.ascontiguousarray(a2, dtype=np.float32), g))


@njit(cache=True, nogil=True, boundscheck=False)
def prescale(absmax, start, sal, k_dim, lg, lbs, n_cols):
    """absmax x sal per kernel block (2^lbs elements, <= K, dividing K) of the n_cols columns whose first element is
    ``start`` (a multiple of 2^lbs): absmax[(element) >> lg] (blocks of 2^lg in ``absmax``: the weight's own, so a
    32-element piece needs no absmax32 first) times row 0's scale of that block. The prescaled one-row tiles' scales:
    the same fp32 products as the other tiles form per span."""
    nbr = k_dim >> lbs
    per = np.empty(nbr, np.float32)
    for b in range(nbr):
        per[b] = sal[0, (b << lbs) >> 3]
    out = np.empty(n_cols * nbr, np.float32)
    if lg == lbs:                   # the kernel's blocks are the weight's: contiguous, vectorised
        am = absmax[start >> lg:]
        for n in range(n_cols):
            for b in range(nbr):
                out[n * nbr + b] = am[n * nbr + b] * per[b]
        return out
    for n in range(n_cols):         # 32-element pieces of larger blocks
        base = start + n * k_dim
        for b in range(nbr):
            out[n * nbr + b] = absmax[(base + (b << lbs)) >> lg] * per[b]
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def cols_one_row(aq, corr, sal, q, sc, tbl, k_dim, lbs, n_cols, out):
    """out[0, n] for n < n_cols with the prescaled one-row tiles (q from the first column's bytes, sc: ``prescale``;
    out's row 0 any view)."""
    kp = aq.shape[1]
    ld = out.strides[0] // 4
    n = 0
    while n + 4 <= n_cols:
        vnni.tile_1_4p(q, sc, tbl, aq, corr, sal, kp, k_dim, lbs, n, 0, out, ld)
        n += 4
    while n < n_cols:
        vnni.tile_1_1p(q, sc, tbl, aq, corr, sal, kp, k_dim, lbs, n, 0, out, ld)
        n += 1


@njit(cache=True, nogil=True, boundscheck=False)
def cols_vnni(aq, corr, sal, q, am, tbl, k_dim, lbs, n0, n1, out):
    """out[m, n] (float32 [M, >= n1], rows any stride) for n in [n0, n1): tiles of 4 / 2 / 1 rows x 4 / 1
    columns; one row: the prescaled one-row tiles (absmax x scale formed once here)."""
    kp = aq.shape[1]
    ld = out.strides[0] // 4
    m_dim = aq.shape[0]
    if m_dim == 1:
        if n1 > n0:
            sc = prescale(am, (n0 * k_dim), sal, k_dim, lbs, lbs, n1 - n0)
            cols_one_row(aq, corr, sal, q[(n0 * k_dim) >> 1:], sc, tbl, k_dim, lbs, n1 - n0, out[:, n0:])
        return
    n = n0
    while n < n1:
        wide = n + 4 <= n1
        m = 0
        while m + 4 <= m_dim:
            if wide:
                vnni.tile_4_4(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, n, m, out, ld)
            else:
                vnni.tile_4_1(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, n, m, out, ld)
            m += 4
        while m + 2 <= m_dim:
            if wide:
                vnni.tile_2_4(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, n, m, out, ld)
            else:
                vnni.tile_2_1(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, n, m, out, ld)
            m += 2
        while m < m_dim:
            if wide:
                vnni.tile_1_4(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, n, m, out, ld)
            else:
                vnni.tile_1_1(q, am, tbl, aq, corr, sal, kp, k_dim, lbs, n, m, out, ld)
            m += 1
        n += 4 if wide else 1


@njit(cache=True, nogil=True, boundscheck=False)
def cols_scalar(aq, sal, q, am, tbl, k_dim, bs, g, n0, n1, out):
    """cols_vnni's result on any CPU (``tbl``: ``table``): per column and group the exact integer sum of a_q x level,
    times absmax x sal in fp32, summed in fp32."""
    m_dim = aq.shape[0]
    for n in range(n0, n1):
        base = n * k_dim
        for m in range(m_dim):
            acc = np.float32(0.0)
            for j0 in range(0, k_dim, g):
                isum = 0
                for k in range(j0, j0 + g, 2):
                    byte = np.int64(q[(base + k) >> 1])
                    isum += (np.int64(aq[m, k]) * (np.int64(tbl[byte >> 4]) - 128)
                             + np.int64(aq[m, k + 1]) * (np.int64(tbl[byte & 15]) - 128))
                acc += np.float32(isum) * (am[(base + j0) // bs] * sal[m, j0 // g])
            out[m, n] = acc


@njit(cache=True, nogil=True)
def cols(aq, corr, sal, q, am, tbl, k_dim, bs, g, n0, n1, out):
    """out[:, n0:n1] = the quantised A (quantize_arrays' layout) x columns n0..n1 of the weight (q, am: from the
    first column's bytes / blocks of bs elements, n0 * K a multiple of bs), whichever kernel this CPU has."""
    if VNNI:
        cols_vnni(aq, corr, sal, q, am, tbl, k_dim, _log2(bs), n0, n1, out)
    else:
        cols_scalar(aq, sal, q, am, tbl, k_dim, bs, g, n0, n1, out)


@njit(cache=True, nogil=True)
def cols_product(aq, corr, sal, q, absmax, tbl, k_dim, bs, g, n0, n1, res):
    """res[:, :n1 - n0] = the quantised A x columns n0..n1 of the whole weight (q, absmax; n0 * K a multiple of bs):
    ``cols`` on views from column n0, with one absmax per 32-element piece where K % bs != 0. The native entries'
    product (MatMulNF4's, FusedFFNNF4's) and ``product``'s."""
    qs = q[(n0 * k_dim) >> 1:]
    if VNNI and aq.shape[0] == 1:      # one row: absmax x scale straight from the weight's absmax (no absmax32)
        lbs = 5 if k_dim % bs != 0 else _log2(bs)
        sc = prescale(absmax, n0 * k_dim, sal, k_dim, _log2(bs), lbs, n1 - n0)
        cols_one_row(aq, corr, sal, qs, sc, tbl, k_dim, lbs, n1 - n0, res)
    elif k_dim % bs != 0:
        ams = absmax32(absmax, n0 * k_dim, (n1 - n0) * (k_dim // 32), bs)
        cols(aq, corr, sal, qs, ams, tbl, k_dim, 32, g, 0, n1 - n0, res)
    else:
        cols(aq, corr, sal, qs, absmax[(n0 * k_dim) // bs:], tbl, k_dim, bs, g, 0, n1 - n0, res)
    vnni.rescale(tbl, res, n1 - n0)


def product(qa: QuantA, q, absmax, tbl, k, n, bs, g):
    """qa (A quantised in groups of g, M rows) @ W -> float32 [M, N], the columns split over threads from
    PARALLEL_MIN_MACS multiply-adds (ranges of whole blocks: n0 * K a multiple of bs)."""
    m = qa.aq.shape[0]
    out = np.empty((m, n), np.float32)
    if m == 0:
        return out
    q1 = np.ascontiguousarray(q).reshape(-1)
    am = np.ascontiguousarray(absmax, dtype=np.float32).reshape(-1)
    unit = bs // math.gcd(k, bs)
    rs = [(0, n)] if m * k * n < PARALLEL_MIN_MACS else threads.split(n, unit)

    def args(lo, hi):
        return qa.aq, qa.corr, qa.sal, q1, am, tbl, k, bs, g, lo, hi, out[:, lo:hi]
    threads.run_ranges(cols_product, args, rs)
    return out


def product_packed(a2, pk, tbl):
    """float32 [M, K] @ a packed constant weight (nf4col_cpu.ColPack) -> float32 [M, N]: A quantised once in natural
    order, the column tiles split over threads from PARALLEL_MIN_MACS multiply-adds."""
    if a2.shape[0] == 0:
        return np.empty((0, pk.n), np.float32)
    return product_packed_q(col.quantize_arrays(np.ascontiguousarray(a2, dtype=np.float32), pk.g), pk, tbl)


def product_packed_q(qa, pk, tbl):
    """``product_packed`` of A already quantised (qa: nf4col_cpu.quantize_arrays' (aq, cg, sg) in groups of pk.g;
    FusedFFNNF4 quantises once for both products)."""
    aq, cg, sg = qa
    m = aq.shape[0]
    out = np.empty((m, pk.n), np.float32)
    rs = [(0, pk.tiles)] if m * pk.k * pk.n < PARALLEL_MIN_MACS else threads.split(pk.tiles)

    def args(lo, hi):
        return aq, cg, sg, pk.qk, pk.sk, tbl, pk.k, pk.lg, lo, hi, pk.n, out[:, lo * col.TILE:]
    threads.run_ranges(col.cols, args, rs)
    return out


def matmul_packed(a, pk, tbl, bias=None):
    """``matmul`` with a packed constant weight (nf4col_cpu.ColPack)."""
    a2 = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, pk.k)
    out = product_packed(a2, pk, tbl)
    if bias is not None:
        out += bias.astype(np.float32)
    return out.astype(a.dtype).reshape(*a.shape[:-1], pk.n)


def matmul(a, q, absmax, tbl, k, n, bs, bias=None):
    """Host-array entry (the Python path, tests): a [..., K] float32/float16 -> [..., N] of a's dtype at level 4
    (``tbl``: ``table``; K must be a multiple of 32: ``group``)."""
    g, _ = group(k, bs)
    a2 = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, k)
    out = product(quantize(a2, g), q, absmax, tbl, k, n, bs, g)
    if bias is not None:
        out += bias.astype(np.float32)
    return out.astype(a.dtype).reshape(*a.shape[:-1], n)


class Level4:
    """A MatMulNF4 / FusedFFNNF4 node's level-4 setup (``make``: None where the node computes as level 0): the
    activation group ``g``, the level table ``tbl`` (kernel-owned: the native entries read it) and the tasks'
    grain of the native entries."""

    def __init__(self, quant_type, k, bs):
        self.g, _ = group(k, bs)
        self.tbl = table(quant_type)
        self.k, self.bs = k, bs

    def pack_constant(self, constants, qi, ai, n):
        """(nf4col_cpu.ColPack, (Q address, absmax address)) of the weight at inputs qi (codes) and ai (absmax)
        when both are constant initializers of the op's sizes and types on a VNNI CPU, else (None, None)."""
        q, am = constants.get(qi), constants.get(ai)
        if not VNNI or q is None or am is None:
            return None, None
        qv, av = q.numpy(), am.numpy()
        total = self.k * n
        if (qv.dtype != np.uint8 or av.dtype != np.float32 or qv.size != (total + 1) // 2
                or av.size != (total + self.bs - 1) // self.bs):
            return None, None   # compute's checks name the problem
        return col.pack(qv, av, self.k, n, self.bs, self.g), (q.ptr, am.ptr)

    @classmethod
    def make(cls, level, quant_type, k, bs):
        return cls(quant_type, k, bs) if level == nf4_int8.INT8 and group(k, bs) is not None else None

    @staticmethod
    def grain(m, k, unit, products=1):
        """Work items (``unit`` columns each) per task: at least TASK_MACS multiply-adds and TASK_COLS columns
        (each task quantises A: about 16 columns' work at any K), a multiple of 4 columns (the tiles' width)."""
        cols = max(TASK_COLS, -(-TASK_MACS // max(1, products * m * k)))
        cols = -(-cols // 4) * 4
        return max(1, -(-cols // unit))


# ---- native entry (runtime/plans.py, "CPU kernels"), M <= SMALL_M: every task quantises A (per task: no scratch
# memory on the CPU; TASK_COLS keeps that a small part of its work) and computes its columns with cols_product.
# params: A, Q, absmax, bias (0: none), Y, tbl, M, K, N, block size, A is fp16, has bias, columns per item, group
SMALL_M = 16          # larger M: the Python path every call (A quantised once)
TASK_COLS = 512
TASK_MACS = 1 << 16


def native_matmul(p, begin, end):
    m, k, n, bs = native.arg(p, 6), native.arg(p, 7), native.arg(p, 8), native.arg(p, 9)
    f16, unit, g = native.arg(p, 10), native.arg(p, 12), native.arg(p, 13)
    n0, n1 = begin * unit, min(end * unit, n)
    if n1 <= n0 or m == 0:
        return 0
    total = k * n
    aq, corr, sal = quantize_arrays(native.load_f32(p[0], m, k, f16), g)
    res = np.empty((m, n1 - n0), np.float32) if f16 else native.array(p[4], (m, n), np.float32)[:, n0:n1]
    cols_product(aq, corr, sal, native.vector(p[1], (total + 1) // 2, np.uint8),
                 native.vector(p[2], (total + bs - 1) // bs, np.float32), native.vector(p[5], vnni.TABLE_BYTES, np.uint8), k, bs, g,
                 n0, n1, res)
    if p[11]:
        native.add_bias(res, p[3], n0, f16)
    if f16:
        native.store_cols(res, p[4], n, n0, f16)
    return 0


# ---- native entry with a packed constant weight (Level4.pack_constant), M <= PACKED_MAX_M: the column tiles are
# claimed in chunks of chunk_tiles (native.claim on slot 18; claim_tasks tasks): every task that gets a chunk
# quantises A once in natural order and runs nf4col_cpu's tiles on its chunks, so one thread pays one quantisation
# whatever the number of tasks and two threads share the tiles. params: native_matmul's (slot 12: log2 of the group,
# unused slot 13), then the ColPack's qk and sk addresses, the Q and absmax addresses it was packed from (the call's
# must be those, else DECLINED: the Python path takes the unpacked kernels), the claim counter (0), the chunk.
PACKED_MAX_M = 256      # larger M: the packed Python path (A quantised once, Python threads)
CHUNK_TILES = 16        # tiles (16 columns) per claimed chunk at least: 256 columns
CHUNKS_PER_TASK = 4     # chunks per task (the tiles over CLAIM_TASKS x this many chunks, where that is more)


def chunk_tiles(tiles, least=CHUNK_TILES):
    """Tiles per claimed chunk: ``least``, or more for wide weights (about CHUNKS_PER_TASK chunks per task: each
    claim costs a call and a view)."""
    return max(least, -(-tiles // (native.CLAIM_TASKS * CHUNKS_PER_TASK)))


def claim_tasks(tiles, chunk):
    """Tasks of a claimed packed step: one per core, at most one per chunk."""
    return max(1, min(native.CLAIM_TASKS, -(-tiles // chunk)))


def native_matmul_packed(p, begin, end):
    if p[1] != p[16] or p[2] != p[17]:
        return native.DECLINED
    m, k, n = native.arg(p, 6), native.arg(p, 7), native.arg(p, 8)
    f16, lg, g, chunk = native.arg(p, 10), native.arg(p, 12), native.arg(p, 13), native.arg(p, 19)
    tiles = (n + col.TILE - 1) // col.TILE
    c = native.claim(p, 18)
    if m == 0 or c * chunk >= tiles:
        return 0
    aq, cg, sg = col.quantize_arrays(native.load_f32(p[0], m, k, f16), g)
    nq, ns = col.sizes(k, n, 1 << lg)
    qk, sk = native.vector(p[14], nq, np.uint8), native.vector(p[15], ns, np.float32)
    tbl = native.vector(p[5], vnni.TABLE_BYTES, np.uint8)
    while c * chunk < tiles:
        t0, t1, n0, n1 = col.task_tiles(c * chunk, (c + 1) * chunk, n)
        res = np.empty((m, n1 - n0), np.float32) if f16 else native.array(p[4], (m, n), np.float32)[:, n0:n1]
        col.cols(aq, cg, sg, qk, sk, tbl, k, lg, t0, t1, n, res)
        if p[11]:
            native.add_bias(res, p[3], n0, f16)
        if f16:
            native.store_cols(res, p[4], n, n0, f16)
        c = native.claim(p, 18)
    return 0

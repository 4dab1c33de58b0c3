"""FusedFFNNF4, CPU face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 and W3 each stored as MatMulNF4's weight
(bitsandbytes NF4/FP4 blocks of W^T; onnx_lowbit.nf4). Both products come from MatMulNF4's CPU code
(matmulnf4_cpu.product: Numba kernels for every M, the vector-permute decode on AVX-512 CPUs, no BLAS), in fp32;
the SwiGLU epilogue is common4's (SiLU in float64, one rounding to fp32); S has X's type.

At M <= SMALL_M the call runs natively (runtime/plans.py, "CPU kernels"): the output columns split into tasks of
whole absmax blocks on onnxruntime's intra-op pool, each task computing its columns of both products with the
kernels ``product`` picks (matmulnf4_cpu.cols_product), the biases, SiLU * up and the store: the same bytes as the
Python path.

With accuracy_level 4 (K % 32 == 0) both products are matmulnf4_int8_cpu's (X quantised to int8 once per call, per
task natively), as MatMulNF4's at that level; where W1 and W3 (codes and absmax) are constant initializers on a VNNI
CPU, both are repacked once per node into column lanes (nf4col_cpu; copies of 2 x (N x K / 2 + 4 x N x K / g)
bytes kept by the kernel object) and every M of the node takes those kernels (``_native_ffn8_packed`` up to
matmulnf4_int8_cpu.PACKED_MAX_M rows, its column tiles claimed in chunks by as many tasks as the machine has cores;
beyond, the Python path with ``packs``)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..device import native
from ..device.inputs import check_x_biases
from ..nf4 import common as nf4_common
from ..nf4 import matmulnf4_int8_cpu as int8
from ..nf4 import nf4col_cpu as col
from ..nf4 import nf4vnni_cpu as vnni
from ..nf4.common import check_weights
from ..nf4.matmulnf4_cpu import cols_product, even_odd, fast_path, pieces_path, product
from ..runtime import plans
from ..runtime.kernels import Kernel
from .common4 import opt, silu_mul, swiglu_f32

SMALL_M = 16              # larger M: the Python path every call
TASK_MACS = 1 << 16       # multiply-adds per task (both products), at least


def swiglu(x, q1, am1, q3, am3, code, k, n, bs, b1=None, b3=None, l4=None, packs=None):
    """Host-array entry (the kernel, tests): x [..., K] float32/float16 -> S [..., N] of x's dtype; ``l4`` (an
    int8.Level4): accuracy_level 4, X quantised to int8 once for both products; with ``packs`` (W1's and W3's
    nf4col_cpu.ColPack, l4 given) the packed products (q1 .. am3 not read)."""
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
    if x2.shape[0] == 0:
        return np.empty(lead + (n,), x.dtype)
    if packs is not None:
        qa = col.quantize_arrays(x2, l4.g)
        g = int8.product_packed_q(qa, packs[0], l4.tbl)
        u = int8.product_packed_q(qa, packs[1], l4.tbl)
    elif l4 is not None:
        qa = int8.quantize(x2, l4.g)
        g = int8.product(qa, q1, am1, l4.tbl, k, n, bs, l4.g)
        u = int8.product(qa, q3, am3, l4.tbl, k, n, bs, l4.g)
    else:
        g = product(x2, q1, np.asarray(am1, np.float32), code, k, n, bs)
        u = product(x2, q3, np.asarray(am3, np.float32), code, k, n, bs)
    s = swiglu_f32(g, u, b1, b3)
    with np.errstate(over="ignore"):
        return s.astype(x.dtype).reshape(lead + (n,))


class FusedFFNNF4Kernel(Kernel):
    native_plans = True  # M <= SMALL_M: the native entry (below); larger M: the Python path every call

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, self.code = nf4_common.parse_attrs(self.attrs)
        self.l4 = int8.Level4.make(nf4_common.parse_level(self.attrs), self.qt, self.k, self.bs.size)
        self.packs, self.packed_from = None, None     # level 4, constant W1 and W3 on a VNNI CPU: packed once
        if self.l4 is not None:
            p1, f1 = self.l4.pack_constant(self.constants, 1, 2, self.n)
            p3, f3 = self.l4.pack_constant(self.constants, 3, 4, self.n) if p1 is not None else (None, None)
            if p3 is not None:
                self.packs, self.packed_from = (p1, p3), f1 + f3

    def compute(self, ctx, inputs):
        x, q1, am1, q3, am3, b1, b3 = (opt(inputs, i) for i in range(7))
        check_weights(q1, am1, q3, am3, self.k, self.n, self.bs)
        m = check_x_biases(x, b1, b3, self.k, self.n, 5, 6)
        packs = self.packs if self.packed_from == (q1.ptr, am1.ptr, q3.ptr, am3.ptr) else None
        if packs is not None and ctx.native and m <= int8.PACKED_MAX_M:
            k, n, bs = self.k, self.n, self.bs.size
            s = ctx.output(0, tuple(x.shape[:-1]) + (n,))
            values = [x.ptr, q1.ptr, am1.ptr, q3.ptr, am3.ptr, b1.ptr if b1 is not None else 0,
                      b3.ptr if b3 is not None else 0, s, self.l4.tbl.ctypes.data, m, k, n, bs, int(x.elem_type == 10),
                      int(b1 is not None), int(b3 is not None), packs[0].lg, self.l4.g,
                      *(a.ctypes.data for pk in packs for a in (pk.qk, pk.sk)), *self.packed_from, 0,
                      int8.chunk_tiles(packs[0].tiles, CHUNK_TILES)]
            if ctx.run_native(native.compile_entry(_native_ffn8_packed), int8.claim_tasks(packs[0].tiles, values[-1]),
                              1, values, (0, 1, 2, 3, 4, 5, 6, 7)):
                return
        elif packs is None and self.l4 is not None and ctx.native and m <= int8.SMALL_M:
            k, n, bs = self.k, self.n, self.bs.size
            s = ctx.output(0, tuple(x.shape[:-1]) + (n,))
            unit = bs // math.gcd(k, bs)
            values = [x.ptr, q1.ptr, am1.ptr, q3.ptr, am3.ptr, b1.ptr if b1 is not None else 0,
                      b3.ptr if b3 is not None else 0, s, self.l4.tbl.ctypes.data, m, k, n, bs, int(x.elem_type == 10),
                      int(b1 is not None), int(b3 is not None), unit, self.l4.g]
            if ctx.run_native(native.compile_entry(_native_ffn8), -(-n // unit), self.l4.grain(m, k, unit, 2), values,
                              (0, 1, 2, 3, 4, 5, 6, 7)):
                return
        elif self.l4 is None and ctx.native and m <= SMALL_M:
            k, n, bs = self.k, self.n, self.bs.size
            s = ctx.output(0, tuple(x.shape[:-1]) + (n,))
            unit = bs // math.gcd(k, bs)                      # columns whose weights start a block
            values = [x.ptr, q1.ptr, am1.ptr, q3.ptr, am3.ptr, b1.ptr if b1 is not None else 0,
                      b3.ptr if b3 is not None else 0, s, self.code.ctypes.data, m, k, n, bs, int(x.elem_type == 10),
                      int(b1 is not None), int(b3 is not None), unit]
            grain = max(1, -(-max(1, TASK_MACS // max(1, 2 * m * k)) // unit))
            if fast_path(k, bs) or pieces_path(k, bs):
                grain = -(-grain // 4) * 4                      # gemv_fast_cols runs four columns at a time
            if ctx.run_native(native.compile_entry(_native_ffn), -(-n // unit), grain, values, (0, 1, 2, 3, 4, 5, 6, 7)):
                return
        elif ctx.native:
            plans.not_replayable()
        xv = x.numpy()
        out = ctx.output_numpy(0, tuple(x.shape[:-1]) + (self.n,), xv.dtype)
        if m:
            out[...] = swiglu(xv, q1.numpy(), am1.numpy(), q3.numpy(), am3.numpy(), self.code, self.k, self.n,
                              self.bs.size, None if b1 is None else b1.numpy(), None if b3 is None else b3.numpy(),
                              self.l4, packs)


KERNEL = FusedFFNNF4Kernel


@njit(cache=True, nogil=True)
def _native_out(p, g, u, n, n0, f16):
    """The end of the three native entries below (their params): the biases (params 14, 15: present; 5, 6:
    addresses) added to g and u, SiLU(g) * u, stored into Y's columns n0.. (param 7)."""
    if native.arg(p, 14):
        native.add_bias(g, p[5], n0, f16)
    if native.arg(p, 15):
        native.add_bias(u, p[6], n0, f16)
    silu_mul(g, u)
    native.store_cols(g, p[7], n, n0, f16)


# ---- native entry: params X, Q1, absmax1, Q3, absmax3, B1 (0: none), B3 (0: none), S, code, M, K, N, block size,
# X is fp16, has B1, has B3, columns per item (whole absmax blocks)
def _native_ffn(p, begin, end):
    m, k, n, bs = native.arg(p, 9), native.arg(p, 10), native.arg(p, 11), native.arg(p, 12)
    f16, unit = native.arg(p, 13), native.arg(p, 16)
    n0, n1 = begin * unit, min(end * unit, n)
    if n1 <= n0 or m == 0:
        return 0
    total = k * n
    nq, nb = (total + 1) // 2, (total + bs - 1) // bs
    a = native.load_f32(p[0], m, k, f16)
    code = native.vector(p[8], 16, np.float32)
    ae, ao = even_odd(a)
    g = np.empty((m, n1 - n0), np.float32)
    u = np.empty((m, n1 - n0), np.float32)
    cols_product(a, ae, ao, native.vector(p[1], nq, np.uint8), native.vector(p[2], nb, np.float32), code, k, bs,
                 n0, n1, g)
    cols_product(a, ae, ao, native.vector(p[3], nq, np.uint8), native.vector(p[4], nb, np.float32), code, k, bs,
                 n0, n1, u)
    _native_out(p, g, u, n, n0, f16)
    return 0


# ---- native entry at accuracy_level 4: the same params, then the activation group; each task quantises X once
# for both products (matmulnf4_int8_cpu.native_matmul's scheme)
def _native_ffn8(p, begin, end):
    m, k, n, bs = native.arg(p, 9), native.arg(p, 10), native.arg(p, 11), native.arg(p, 12)
    f16, unit, grp = native.arg(p, 13), native.arg(p, 16), native.arg(p, 17)
    n0, n1 = begin * unit, min(end * unit, n)
    if n1 <= n0 or m == 0:
        return 0
    total = k * n
    nq, nb = (total + 1) // 2, (total + bs - 1) // bs
    aq, corr, sal = int8.quantize_arrays(native.load_f32(p[0], m, k, f16), grp)
    tbl = native.vector(p[8], vnni.TABLE_BYTES, np.uint8)
    g = np.empty((m, n1 - n0), np.float32)
    u = np.empty((m, n1 - n0), np.float32)
    int8.cols_product(aq, corr, sal, native.vector(p[1], nq, np.uint8), native.vector(p[2], nb, np.float32), tbl, k, bs,
                      grp, n0, n1, g)
    int8.cols_product(aq, corr, sal, native.vector(p[3], nq, np.uint8), native.vector(p[4], nb, np.float32), tbl, k, bs,
                      grp, n0, n1, u)
    _native_out(p, g, u, n, n0, f16)
    return 0


# ---- native entry at accuracy_level 4 with W1 and W3 packed (FusedFFNNF4Kernel.packs), M <= int8.PACKED_MAX_M:
# _native_ffn8's params (slot 16: log2 of the group), then W1's qk, sk, W3's qk, sk, the Q1, absmax1, Q3, absmax3
# addresses they were packed from (the call's must be those, else DECLINED), the claim counter (0) and the chunk
# (tiles of 16 columns): chunks claimed as matmulnf4_int8_cpu.native_matmul_packed's, each task that gets one
# quantises X once for both products.
CHUNK_TILES = 8         # two products per tile: half of MatMulNF4's chunk


def _native_ffn8_packed(p, begin, end):
    if p[1] != p[22] or p[2] != p[23] or p[3] != p[24] or p[4] != p[25]:
        return native.DECLINED
    m, k, n = native.arg(p, 9), native.arg(p, 10), native.arg(p, 11)
    f16, lg, grp, chunk = native.arg(p, 13), native.arg(p, 16), native.arg(p, 17), native.arg(p, 27)
    tiles = (n + col.TILE - 1) // col.TILE
    c = native.claim(p, 26)
    if m == 0 or c * chunk >= tiles:
        return 0
    nq, ns = col.sizes(k, n, 1 << lg)
    aq, cg, sg = col.quantize_arrays(native.load_f32(p[0], m, k, f16), grp)
    tbl = native.vector(p[8], vnni.TABLE_BYTES, np.uint8)
    qk1, sk1 = native.vector(p[18], nq, np.uint8), native.vector(p[19], ns, np.float32)
    qk3, sk3 = native.vector(p[20], nq, np.uint8), native.vector(p[21], ns, np.float32)
    while c * chunk < tiles:
        t0, t1, n0, n1 = col.task_tiles(c * chunk, (c + 1) * chunk, n)
        g = np.empty((m, n1 - n0), np.float32)
        u = np.empty((m, n1 - n0), np.float32)
        col.cols(aq, cg, sg, qk1, sk1, tbl, k, lg, t0, t1, n, g)
        col.cols(aq, cg, sg, qk3, sk3, tbl, k, lg, t0, t1, n, u)
        _native_out(p, g, u, n, n0, f16)
        c = native.claim(p, 26)
    return 0

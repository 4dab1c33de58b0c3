"""FusedFFNNF4, CPU face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 and W3 each stored as MatMulNF4's weight
(bitsandbytes NF4/FP4 blocks of W^T; onnx_lowbit.nf4). Both products come from MatMulNF4's CPU code
(matmulnf4_cpu.product: Numba kernels for every M, the vector-permute decode on AVX-512 CPUs, no BLAS), in fp32;
the SwiGLU epilogue is common4's (SiLU in float64, one rounding to fp32); S has X's type.

At M <= SMALL_M the call runs natively (runtime/plans.py, "CPU kernels"): the output columns split into tasks of
whole absmax blocks on onnxruntime's intra-op pool, each task computing its columns of both products with the
kernels ``product`` picks (matmulnf4_cpu.cols_product), the biases, SiLU * up and the store: the same bytes as the
Python path.

With accuracy_level 4 (K % 32 == 0) both products are matmulnf4_int8_cpu's (X quantised to int8 once per call, per
task natively), as MatMulNF4's at that level."""
from __future__ import annotations

import math

import numpy as np

from ..device import native
from ..device.inputs import check_x_biases
from ..nf4 import common as nf4_common
from ..nf4 import matmulnf4_int8_cpu as int8
from ..nf4.common import check_weights
from ..nf4.matmulnf4_cpu import cols_product, even_odd, fast_path, pieces_path, product
from ..runtime import plans
from ..runtime.kernels import Kernel
from .common4 import opt, silu_mul, swiglu_f32

SMALL_M = 16              # larger M: the Python path every call
TASK_MACS = 1 << 16       # multiply-adds per task (both products), at least


def swiglu(x, q1, am1, q3, am3, code, k, n, bs, b1=None, b3=None, l4=None):
    """Host-array entry (the kernel, tests): x [..., K] float32/float16 -> S [..., N] of x's dtype; ``l4`` (an
    int8.Level4): accuracy_level 4, X quantised to int8 once for both products."""
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
    if x2.shape[0] == 0:
        return np.empty(lead + (n,), x.dtype)
    if l4 is not None:
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

    def compute(self, ctx, inputs):
        x, q1, am1, q3, am3, b1, b3 = (opt(inputs, i) for i in range(7))
        check_weights(q1, am1, q3, am3, self.k, self.n, self.bs)
        m = check_x_biases(x, b1, b3, self.k, self.n, 5, 6)
        if self.l4 is not None and ctx.native and m <= int8.SMALL_M:
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
                              self.l4)


KERNEL = FusedFFNNF4Kernel


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
    if native.arg(p, 14):
        native.add_bias(g, p[5], n0, f16)
    if native.arg(p, 15):
        native.add_bias(u, p[6], n0, f16)
    silu_mul(g, u)
    native.store_cols(g, p[7], n, n0, f16)
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
    tbl = native.vector(p[8], 64, np.uint8)
    g = np.empty((m, n1 - n0), np.float32)
    u = np.empty((m, n1 - n0), np.float32)
    int8.cols_product(aq, corr, sal, native.vector(p[1], nq, np.uint8), native.vector(p[2], nb, np.float32), tbl, k, bs,
                      grp, n0, n1, g)
    int8.cols_product(aq, corr, sal, native.vector(p[3], nq, np.uint8), native.vector(p[4], nb, np.float32), tbl, k, bs,
                      grp, n0, n1, u)
    if native.arg(p, 14):
        native.add_bias(g, p[5], n0, f16)
    if native.arg(p, 15):
        native.add_bias(u, p[6], n0, f16)
    silu_mul(g, u)
    native.store_cols(g, p[7], n, n0, f16)
    return 0

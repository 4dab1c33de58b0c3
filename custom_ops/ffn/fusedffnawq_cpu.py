"""FusedFFNAWQ, CPU face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 and W3 each stored as MatMulAWQ's weight
(AutoAWQ GEMM layout; onnx_lowbit.awq). Both products come from MatMulAWQ's CPU code (matmulawq_cpu.product: one
Numba kernel for every M, no BLAS; exact (q - z) * s weights), in fp32; the SwiGLU epilogue is fp32; S has X's
type.

At M <= SMALL_M the call runs natively (runtime/plans.py, "CPU kernels"): the qweight words split into tasks on
onnxruntime's intra-op pool as MatMulAWQ's entry splits them, each task computing its columns of both products
with gemv_cols (matmulawq_cpu.cols_product, scales widened once per weight: ScalesCache), the biases, SiLU * up
and the store: the same bytes as the Python path."""
from __future__ import annotations

import numpy as np

from ..awq.dequantawq_cpu import check_both, parse_attrs
from ..awq.matmulawq_cpu import ITEM_WORDS, SMALL_M, ScalesCache, cols_product, product, scales_f32, task_items
from ..device import native
from ..device.inputs import check_x_biases
from ..runtime import plans
from ..runtime.kernels import Kernel
from .common4 import opt, silu_mul, swiglu_f32


def swiglu(x, w1, w3, group_size, K, N, b1=None, b3=None):  # noqa: N803 - the format's names
    """Host-array entry (tests): x [..., K], w1 / w3 = (qweight, qzeros, scales) -> S [..., N] of x's dtype.
    Inputs are checked as in a session."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_both(w1, w3, sh)
    check_x_biases(x, b1, b3, K, N, 7, 8)
    return _swiglu(x, w1, w3, sh, b1, b3)


def _swiglu(x, w1, w3, sh, b1, b3):
    lead = tuple(x.shape[:-1])
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, sh.K)
    if x2.shape[0] == 0:
        return np.empty(lead + (sh.N,), x.dtype)
    s = swiglu_f32(product(x2, *w1, sh), product(x2, *w3, sh), b1, b3)
    with np.errstate(over="ignore"):
        return s.astype(x.dtype).reshape(lead + (sh.N,))


def operands(inputs, sh):
    """(X, W1, W3, B1, B3, M) of a FusedFFNAWQ call's inputs (bridge Tensors; W = (qweight, qzeros, scales)),
    checked (KernelError naming the input); the CUDA face's too."""
    x = opt(inputs, 0)
    w1 = tuple(opt(inputs, i) for i in (1, 2, 3))
    w3 = tuple(opt(inputs, i) for i in (4, 5, 6))
    b1, b3 = opt(inputs, 7), opt(inputs, 8)
    check_both(w1, w3, sh)
    return x, w1, w3, b1, b3, check_x_biases(x, b1, b3, sh.K, sh.N, 7, 8)


class FusedFFNAWQKernel(Kernel):
    native_plans = True  # M <= SMALL_M: the native entry (below); larger M: the Python path every call

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sh = parse_attrs(self.attrs)
        self.scales = ScalesCache()

    def compute(self, ctx, inputs):
        x, w1, w3, b1, b3, m = operands(inputs, self.sh)
        if ctx.native and m <= SMALL_M:
            sh = self.sh
            s = ctx.output(0, tuple(x.shape[:-1]) + (sh.N,))
            values = [x.ptr, *(t.ptr for t in w1), *(t.ptr for t in w3), b1.ptr if b1 is not None else 0,
                      b3.ptr if b3 is not None else 0, s, m, sh.K, sh.N, sh.group_size, int(x.elem_type == 10),
                      int(b1 is not None), int(b3 is not None), self.scales.get(w1[2]), self.scales.get(w3[2])]
            items, grain = task_items(sh)
            if ctx.run_native(native.compile_entry(_native_ffn), items, grain, values, tuple(range(10))):
                return
        elif ctx.native:
            plans.not_replayable()
        xv = x.numpy()
        out = ctx.output_numpy(0, tuple(x.shape[:-1]) + (self.sh.N,), xv.dtype)
        if m:
            out[...] = _swiglu(xv, tuple(t.numpy() for t in w1), tuple(t.numpy() for t in w3), self.sh,
                               None if b1 is None else b1.numpy(), None if b3 is None else b3.numpy())


KERNEL = FusedFFNAWQKernel


# ---- native entry: params X, qweight1, qzeros1, scales1, qweight3, qzeros3, scales3, B1 (0: none), B3 (0: none), S,
# M, K, N, group size, X is fp16, has B1, has B3, cached float32 scales1, scales3 (0: none)
def _native_ffn(p, begin, end):
    m, k, n, g = native.arg(p, 10), native.arg(p, 11), native.arg(p, 12), native.arg(p, 13)
    f16 = native.arg(p, 14)
    ng = n // 8
    c0, c1 = begin * ITEM_WORDS, min(end * ITEM_WORDS, ng)
    if c1 <= c0 or m == 0:
        return 0
    groups = (k + g - 1) // g
    a = native.load_f32(p[0], m, k, f16)
    gate = np.empty((m, n), np.float32)     # full width: gemv_cols writes columns 8 c0 .. 8 c1 of them
    up = np.empty((m, n), np.float32)
    cols_product(a, native.array(p[1], (groups * g, ng), np.int32), native.array(p[2], (groups, ng), np.int32),
                 scales_f32(p[3], p[17], groups, n, c0, c1), g, k, c0, c1, gate)
    cols_product(a, native.array(p[4], (groups * g, ng), np.int32), native.array(p[5], (groups, ng), np.int32),
                 scales_f32(p[6], p[18], groups, n, c0, c1), g, k, c0, c1, up)
    gv, uv = gate[:, 8 * c0:8 * c1], up[:, 8 * c0:8 * c1]
    if native.arg(p, 15):
        native.add_bias(gv, p[7], 8 * c0, f16)
    if native.arg(p, 16):
        native.add_bias(uv, p[8], 8 * c0, f16)
    silu_mul(gv, uv)
    native.store_cols(gv, p[9], n, 8 * c0, f16)
    return 0

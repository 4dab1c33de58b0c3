"""FusedFFNAWQ, CPU face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 and W3 each stored as MatMulAWQ's weight
(AutoAWQ GEMM layout; onnx_lowbit.awq). Both products come from MatMulAWQ's CPU code (matmulawq_cpu.product: one
Numba kernel for every M, no BLAS; exact (q - z) * s weights), in fp32; the SwiGLU epilogue is fp32; S has X's
type."""
from __future__ import annotations

import numpy as np

from ..awq.dequantawq_cpu import check_both, parse_attrs
from ..awq.matmulawq_cpu import product
from ..device.inputs import check_x_biases
from ..runtime.kernels import Kernel
from .common4 import opt, swiglu_f32


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
    def __init__(self, **kw):
        super().__init__(**kw)
        self.sh = parse_attrs(self.attrs)

    def compute(self, ctx, inputs):
        x, w1, w3, b1, b3, m = operands(inputs, self.sh)
        xv = x.numpy()
        out = ctx.output_numpy(0, tuple(x.shape[:-1]) + (self.sh.N,), xv.dtype)
        if m:
            out[...] = _swiglu(xv, tuple(t.numpy() for t in w1), tuple(t.numpy() for t in w3), self.sh,
                               None if b1 is None else b1.numpy(), None if b3 is None else b3.numpy())


KERNEL = FusedFFNAWQKernel

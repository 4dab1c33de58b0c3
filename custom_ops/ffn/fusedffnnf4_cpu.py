"""FusedFFNNF4, CPU face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 and W3 each stored as MatMulNF4's weight
(bitsandbytes NF4/FP4 blocks of W^T; onnx_lowbit.nf4). Both products come from MatMulNF4's CPU code
(matmulnf4_cpu.product: Numba kernels for every M, the vector-permute decode on AVX-512 CPUs, no BLAS), in fp32;
the SwiGLU epilogue is fp32; S has X's type."""
from __future__ import annotations

import numpy as np

from ..device.inputs import check_x_biases
from ..nf4 import common as nf4_common
from ..nf4.common import check_weights
from ..nf4.matmulnf4_cpu import product
from ..runtime.kernels import Kernel
from .common4 import opt, swiglu_f32


def swiglu(x, q1, am1, q3, am3, code, k, n, bs, b1=None, b3=None):
    """Host-array entry (the kernel, tests): x [..., K] float32/float16 -> S [..., N] of x's dtype."""
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
    if x2.shape[0] == 0:
        return np.empty(lead + (n,), x.dtype)
    g = product(x2, q1, np.asarray(am1, np.float32), code, k, n, bs)
    u = product(x2, q3, np.asarray(am3, np.float32), code, k, n, bs)
    s = swiglu_f32(g, u, b1, b3)
    with np.errstate(over="ignore"):
        return s.astype(x.dtype).reshape(lead + (n,))


class FusedFFNNF4Kernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, self.code = nf4_common.parse_attrs(self.attrs)

    def compute(self, ctx, inputs):
        x, q1, am1, q3, am3, b1, b3 = (opt(inputs, i) for i in range(7))
        check_weights(q1, am1, q3, am3, self.k, self.n, self.bs)
        m = check_x_biases(x, b1, b3, self.k, self.n, 5, 6)
        xv = x.numpy()
        out = ctx.output_numpy(0, tuple(x.shape[:-1]) + (self.n,), xv.dtype)
        if m:
            out[...] = swiglu(xv, q1.numpy(), am1.numpy(), q3.numpy(), am3.numpy(), self.code, self.k, self.n,
                              self.bs.size, None if b1 is None else b1.numpy(), None if b3 is None else b3.numpy())


KERNEL = FusedFFNNF4Kernel

"""MatMulAWQ, CUDA face: Y[..., N] = A[..., K] x W (+ bias), W in AutoAWQ GEMM layout (see dequantawq_cpu).

``ROUTES`` says which kernel serves a call (the kernel object, session_cuda.AWQDecodeKernel, builds the call's
Case and launches the row's kernel):

* ``gemv1`` / ``gemv8``: the small-M tensor-core GEMV (matmulawq1_cuda: mma.sync m16n8k16 with the nibbles as
  exact fp16 subnormals; M = 1, and M = 2 .. 16 as chunks of 8 rows of X in B's columns). fp16 A only, on GPUs
  with tensor cores, for K % 4 == 0 and group sizes of whole 16-row steps, with A and the scales 8-byte aligned.
* ``decode``: the fp32-accumulating decode kernel (gemv_cuda.make_gemv: 32-bit nibble decoding, split-K with a
  deterministic last-block reduction, one kernel per row bucket 1, 2, 4, 8), M = 1 .. 16: fp32 A and the shapes /
  buffers the GEMV cannot take.
* ``prefill``: fp16 A from M = 17 where cuBLAS and onnxruntime's scratch exist (awq/prefill_cuda): W dequantised
  into fp16 scratch by DequantAWQ's kernel, then one cublasGemmEx.
* ``generic``: any M (gemv_cuda.make_generic), correct, not tuned: the calls past M = 16 the prefill route does not
  take (fp32 A, no cuBLAS, no scratch).

Up to M = 16 the fp16 weight is never written: every nibble is dequantised in registers. Split-K partials per call from
onnxruntime's allocator, tile counters the node's own per stream (session_cuda).
"""
from __future__ import annotations

import dataclasses

from ..device import cublas
from ..device.host import sm_count
from ..runtime.routing import Route, always, options
from . import dequantawq_cuda, prefill_cuda, session_cuda
from .matmulawq_cpu import operands
from .session_cuda import AWQDecodeKernel

ROUTES = session_cuda.ROUTES[:-1] + (  # the table both AWQ decode ops share (awq/session_cuda) ...
    Route("prefill", prefill_cuda.WHEN, prefill_cuda.takes, prefill_cuda.MEASURED),
    Route("generic", "M > 16 where the prefill row does not apply (fp32 X, no cuBLAS, no scratch memory)", always,
          "none: the fallback for any M (correct, not tuned)"),
)   # ... with the prefill route above its generic row


class MatMulAWQCudaKernel(AWQDecodeKernel):
    NW = 1
    ROUTES = ROUTES

    def __init__(self, **kw):
        super().__init__(**kw)
        self.blas = cublas.load() is not None       # else the generic kernel serves every M > 16
        self.dequant = None
        if self.a16 and self.blas:                  # the prefill route's kernels, compiled now (once per process)
            self.dequant = (dequantawq_cuda.launcher(), *dequantawq_cuda.plan(self.sh.K, self.sh.N, sm_count()))
            prefill_cuda.prepare()
        self.launch["prefill"] = self._prefill

    def operands(self, inputs):
        a, w, bias, m = operands(inputs, self.sh)
        return a, [w], [bias], m

    def case(self, m, x, ws, scratch=True):
        """The routing Case (session_cuda's) with the prefill row's switches: cuBLAS found, the call has scratch."""
        return dataclasses.replace(super().case(m, x, ws), opts=options(cublas=self.blas, scratch=bool(scratch)))

    def _prefill(self, kernel, ctx, m, x, ws, bs, out):
        prefill_cuda.run(ctx, m, self.sh, self.dequant, x, ws[0], bs[0], out)


KERNEL = MatMulAWQCudaKernel

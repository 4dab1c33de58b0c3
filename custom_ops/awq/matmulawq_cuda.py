"""MatMulAWQ, CUDA face: Y[..., N] = A[..., K] x W (+ bias), W in AutoAWQ GEMM layout (see dequantawq_cpu).

``ROUTES`` says which kernel serves a call (the kernel object, session_cuda.AWQDecodeKernel, builds the call's
Case and launches the row's kernel):

* ``gemv1`` / ``gemv8``: the small-M tensor-core GEMV (matmulawq1_cuda: mma.sync m16n8k16 with the nibbles as
  exact fp16 subnormals; M = 1, and M = 2 .. 16 as chunks of 8 rows of X in B's columns). fp16 A only, on GPUs
  with tensor cores, for K % 4 == 0 and group sizes of whole 16-row steps, with A and the scales 8-byte aligned.
* ``decode``: the fp32-accumulating decode kernel (gemv_cuda.make_gemv: 32-bit nibble decoding, split-K with a
  deterministic last-block reduction, one kernel per row bucket 1, 2, 4, 8), M = 1 .. 16: fp32 A and the shapes /
  buffers the GEMV cannot take.
* ``generic``: any M (gemv_cuda.make_generic), correct, not tuned (prefill: DequantAWQ + a cuBLAS MatMul is the
  faster graph).

The fp16 weight is never written: every nibble is dequantised in registers. Split-K partials per call from
onnxruntime's allocator, tile counters the node's own per stream (session_cuda).
"""
from __future__ import annotations

from .matmulawq_cpu import operands
from . import session_cuda
from .session_cuda import AWQDecodeKernel

ROUTES = session_cuda.ROUTES  # one table for both AWQ decode ops (awq/session_cuda)


class MatMulAWQCudaKernel(AWQDecodeKernel):
    NW = 1

    def operands(self, inputs):
        a, w, bias, m = operands(inputs, self.sh)
        return a, [w], [bias], m


KERNEL = MatMulAWQCudaKernel

"""FusedFFNAWQ, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 each stored as MatMulAWQ's weight
(AutoAWQ GEMM layout; onnx_lowbit.awq). Up to M = 16 one launch that never writes the fp16 weights, SiLU * mul in
its epilogue; past it (fp16 X) the weights dequantised into scratch and cuBLAS GEMMs.

``ROUTES`` says which kernel serves a call, as MatMulAWQ's (awq/matmulawq_cuda, awq/session_cuda) plus the prefill
row: the small-M tensor-core GEMV with two weights (awq/matmulawq1_cuda, nw = 2) for fp16 X at M = 1 .. 16 where it
takes the shape and buffers, else the decode kernel below (M <= 16); from M = 17 with fp16 X the prefill route, else
the generic kernel.

Decode kernel (M <= 16): MatMulAWQ's decode kernel with two weights (awq/gemv_cuda.make_gemv, nw=2), reading both
in the same pass: lane = column group c (one int32 = 8 columns of a qweight row; a warp reads 128
contiguous bytes of a row of each weight), warp = a slice of R rows of K inside one group; every thread loads
the qweight words of W1 AND W3 for its rows (2 * UNROLL loads in flight, software-pipelined, UNROLL per row
bucket; whole batches run without bounds checks), the x slice is staged once per block in shared memory as fp32
and used for both, nibbles are decoded in 32-bit ops (gemv_cuda: one shift per two nibbles, one LOP3 and one
FFMA per nibble; 3.4 SASS instructions per nibble in the hot loop), and per weight P[m][j] = sum x*v,
S[m] = sum x (shared) give s_j (C_j P - (C_j + z_j) S); zero points and scales are read after the hot loop.
Split-K partials of both products meet in shared memory (the block's warps) and, across the blocks of a column
tile, in an fp32 scratch acc[splits, 2, M, N] (plain stores, one slot per split); the last block of a tile
(threadfence + counter) sums the splits in split order (deterministic: the same bits on every run and replay),
applies the biases and SiLU * mul in fp32, stores S in X's type and resets the tile counter. As in MatMulAWQ
(awq/gemv_cuda, "split-K memory"): the partials come per call from onnxruntime's allocator (``Context.scratch``;
the kernel's own per-stream buffer only with onnxruntime < 1.18), the tile counters stay the kernel's, one set per
CUDA stream (``ScratchPool``). With a single split (K <= 8R) the block writes S directly (no partials). M runs
in row buckets MT in {1, 2, 4} (2 x 4 x 8 accumulators per thread at most); M = 5..16 as row chunks of 4 in
neighbouring blocks (the weight reads are shared through L2).
Prefill (fp16 X, M >= 17, cuBLAS and onnxruntime's scratch; ffn/fusedffn4_prefill_cuda): W1, then W3 dequantised
into fp16 [K, N] scratch by DequantAWQ's kernel, each right before its GEMM (FusedFFN's cuBLAS path, fp16 G), then
the SiLU * mul kernel.
Generic kernel (any M; awq/gemv_cuda.make_generic, nw=2): thread = (row, column group), walks all of K for both
weights; correct, not tuned: the calls past M = 16 the prefill route does not take (fp32 X, no cuBLAS, no scratch).
"""
from __future__ import annotations

import dataclasses

from ..awq import dequantawq_cuda, session_cuda
from ..awq.session_cuda import AWQDecodeKernel
from ..device import cublas
from ..device.host import sm_count
from ..runtime.routing import Route, always, options
from . import fusedffn4_prefill_cuda as p4
from .fusedffnawq_cpu import operands

ROUTES = session_cuda.ROUTES[:-1] + (  # MatMulAWQ's table (awq/session_cuda: the same kernels with two weights) ...
    Route("prefill", p4.WHEN.format(layout="DequantAWQ's, W [K, N]", op="with op N"), p4.takes, p4.MEASURED_AWQ),
    Route("generic", "M > 16 where the prefill row does not apply (fp32 X, no cuBLAS, no scratch memory)", always,
          "none: the fallback for any M (correct, not tuned)"),
)   # ... with the prefill route above its generic row


class FusedFFNAWQCudaKernel(AWQDecodeKernel):
    NW = 2
    ROUTES = ROUTES

    def __init__(self, **kw):
        super().__init__(**kw)
        self.blas = cublas.load() is not None       # else the generic kernel serves every M > 16
        self.dequant = None
        if self.a16 and self.blas:                  # the prefill route's kernels, compiled now (once per process)
            sh = self.sh
            self.dequant = (dequantawq_cuda.launcher(), *dequantawq_cuda.plan(sh.K, sh.N, sm_count()))
            p4.prepare()
        self.launch["prefill"] = self._prefill

    def operands(self, inputs):
        x, w1, w3, b1, b3, m = operands(inputs, self.sh)
        return x, [w1, w3], [b1, b3], m

    def case(self, m, x, ws, scratch=True):
        """The routing Case (session_cuda's) with the prefill row's switches: cuBLAS found, the call has scratch."""
        return dataclasses.replace(super().case(m, x, ws), opts=options(cublas=self.blas, scratch=bool(scratch)))

    def _prefill(self, kernel, ctx, m, x, ws, bs, out):
        sh = self.sh
        lau, grid, rows = self.dequant

        def dequant(i, ptr):
            dequantawq_cuda.launch(lau, grid, rows, ctx.stream, *ws[i], ptr, sh)

        p4.run(ctx, m, sh.K, sh.N, True, dequant, x.ptr, bs[0].ptr if bs[0] is not None else 0,
               bs[1].ptr if bs[1] is not None else 0, out)


KERNEL = FusedFFNAWQCudaKernel

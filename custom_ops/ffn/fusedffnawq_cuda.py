"""FusedFFNAWQ, CUDA face: S = SiLU(X W1^T + B1) * (X W3^T + B3), W1 / W3 each stored as MatMulAWQ's weight
(AutoAWQ GEMM layout; onnx_lowbit.awq). One launch; the fp16 weights are never written; SiLU * mul in the
epilogue.

``ROUTES`` says which kernel serves a call, as MatMulAWQ's (awq/matmulawq_cuda, awq/session_cuda): the small-M
tensor-core GEMV with two weights (awq/matmulawq1_cuda, nw = 2) for fp16 X at M = 1 .. 16 where it takes the shape
and buffers, else the decode kernel below (M <= 16), else the generic kernel.

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
Generic kernel (any M; awq/gemv_cuda.make_generic, nw=2): thread = (row, column group), walks all of K for both
weights; correct, not tuned.
"""
from __future__ import annotations

from ..awq import session_cuda
from ..awq.session_cuda import AWQDecodeKernel
from .fusedffnawq_cpu import operands

ROUTES = session_cuda.ROUTES  # one table for both AWQ decode ops (awq/session_cuda)


class FusedFFNAWQCudaKernel(AWQDecodeKernel):
    NW = 2

    def operands(self, inputs):
        x, w1, w3, b1, b3, m = operands(inputs, self.sh)
        return x, [w1, w3], [b1, b3], m


KERNEL = FusedFFNAWQCudaKernel

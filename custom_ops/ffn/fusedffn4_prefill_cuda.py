"""The prefill route of the fused 4-bit FFN ops (FusedFFNAWQ, FusedFFNNF4: the ``prefill`` row of their ROUTES): fp16
X at M >= PREFILL_MIN_M, where the 4-bit GEMV kernels re-read the weights per row chunk and their generic kernel is
correct but untuned.

W1 and W3 are dequantised into fp16 in the call's scratch by the dequant ops' own kernels (AWQ: DequantAWQ's kernel,
awq/dequantawq_cuda, W [K, N]; NF4: DequantNF4's transposed kernel, nf4/dequantnf4_cuda, W^T [N, K], the storage
order: neither needs a transpose), then FusedFFN's cuBLAS path runs on them (ffn/fusedffn_prefill_cuda.launch_gemm,
as its ``gemm_f16out`` route: per chunk of rows two cublasGemmEx with fp32 accumulation and fp16 outputs into G
[rows, 2N], op N on [K, N] weights, op T on [N, K]; then the elementwise kernel adds the biases, applies SiLU * mul
in fp32 and writes S in fp16). Where all rows fit one chunk (up to ~3000 rows at N = 8192), each weight is
dequantised right before its GEMM into one buffer (dequant W1, GEMM, dequant W3, GEMM: the GEMM reads a weight the
dequant just wrote, much of it still in L2; H200, K x N = 2048 x 8192, M = 128: the GEMM pair took 27.8 us after
both dequants, 20.8 us as MatMulAWQ x2 runs it, dequant then GEMM); several chunks keep both weights for every
chunk.

Scratch: one buffer per call from onnxruntime's allocator (``Context.scratch``, the only scratch call of the call):
the weight buffer (one chunk: K * N fp16, W3 reusing W1's; several: W1 then W3, 256-byte aligned), then the cuBLAS
path's own (``prefill_plan``'s bytes: G). A native plan (runtime/plans.py) records the dequant launches, the GEMMs
and the activation launch with their pointers into the inputs, the output and that scratch, and replays them
without Python (also under CUDA-graph capture); the weights are dequantised again on every call (nothing survives
a call).

Accuracy: the fp16 weights are the dequant kernels' outputs (AWQ: bit-exact with onnx_lowbit.awq.dequantize, which
FusedFFNAWQ's reference uses; NF4: code * absmax rounded once to fp16, 2^-12 relative at most, where the NF4
reference keeps fp32), fp32 accumulation, G rounded to fp16 (as the unfused graph's MatMul outputs are; fp32 G
cost 6% at M = 1024 on the H200 and gained nothing at M = 17 / 128), one fp16 rounding of S. NaN / Inf in a row
of X reach that row's outputs through the GEMMs, as in the reference.
"""
from __future__ import annotations

from . import fusedffn_prefill_cuda as pre

PREFILL_MIN_M = 17      # fp16 X from this M on (where the tensor-core GEMVs of both ops stop: M <= 16); not
                        # timed against the generic kernel at M = 17..32
ALIGN = 256             # bytes: the weights' and the GEMM scratch's offsets in the call's scratch

WHEN = (f"fp16 X, M >= PREFILL_MIN_M ({PREFILL_MIN_M}), cuBLAS and scratch memory (onnxruntime >= 1.18): W1, W3 "
        "dequantised into fp16 scratch by the dequant op's kernel ({layout}), each right before its GEMM where the "
        "rows fit one chunk, then FusedFFN's cuBLAS path (two GEMMs {op}, fp32 accumulation, fp16 outputs, the "
        "SiLU * mul kernel)")
MEASURED = ("H200, 2026-11-29, x[M, 2048] fp16, W1 / W3 2048 x 8192, CUDA graphs, against onnxruntime's unfused "
            "graph with MatMulNBits (int4 group 128) in the same run (benchmarks/session_gpu.py): FusedFFNNF4 "
            "56.3 / 60.3 / 160.6 us at M = 17 / 128 / 1024 against 60.7 / 68.2 / 173.1 (1.08x / 1.13x / 1.08x "
            "faster); M = 17..32 not timed against the generic kernel")
MEASURED_AWQ = ("H200, 2026-11-29, as FusedFFNNF4's prefill row: 67.3 / 66.1 / 163.5 us at M = 17 / 128 / 1024 "
                "against 60.7 / 68.2 / 173.1 (1.11x slower / 1.03x / 1.06x faster; before each weight was "
                "dequantised right before its GEMM and G went fp16: 73.0 us at M = 128); the generic kernel it "
                "replaced: onnxruntime-genai's int4 LLaMA, d = 2048, 16 layers, 128-token prefill 24.9 ms (genai's "
                "own 3.85 ms)")


def takes(c):
    """The routing condition of the ``prefill`` row (Case opts 'cublas', 'scratch')."""
    return c.dtype == "float16" and c.m >= PREFILL_MIN_M and c.k > 0 and bool(c.opt("cublas")) and \
        bool(c.opt("scratch"))


def _r(b):
    return -(-b // ALIGN) * ALIGN


def scratch_layout(m, k, n):
    """(offset of W3, offset of the GEMM scratch, total bytes) of a call's scratch (W1 at offset 0; W3 at 0 too
    where the rows fit one chunk: each weight is dequantised right before its GEMM)."""
    wbytes = _r(k * n * 2)
    rows, *_, (_, _, gemm) = pre.prefill_plan(m, k, n, True, True, True)
    w3 = wbytes if rows < m else 0
    return w3, w3 + wbytes, w3 + wbytes + gemm


def prepare():
    """Compile (once per process) the cuBLAS path's kernels this route launches (the dequant kernels are the dequant
    modules' own)."""
    pre.launcher("act", True, True)


def run(ctx, m, k, n, kn, dequant, xp, b1p, b3p, yp):
    """The route on device pointers: ``dequant(i, out_ptr)`` launches the dequantisation of weight i (0: W1, 1: W3)
    into ``out_ptr`` (fp16, [K, N] with ``kn``, else [N, K]); b1p / b3p 0 when absent."""
    w3off, goff, total = scratch_layout(m, k, n)
    base = ctx.scratch(total)
    if w3off:                       # several chunks of rows: both weights first, read by every chunk
        dequant(0, base)
        dequant(1, base + w3off)

        def weight(i):
            return base + (w3off if i else 0)
    else:                           # one chunk: each weight right before its GEMM, into the one buffer

        def weight(i):
            dequant(i, base)
            return base

    def gemm_scratch(nbytes):
        if goff + nbytes > total:
            raise RuntimeError(f"the GEMM path asks for {nbytes} bytes, the call's scratch has {total - goff}")
        return base + goff

    pre.launch_gemm(ctx.stream, m, k, n, True, True, kn, True, False, xp, 0, 0, b1p, b3p, yp, gemm_scratch,
                    weight=weight)

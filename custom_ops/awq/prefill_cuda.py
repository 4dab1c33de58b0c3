"""The prefill route of MatMulAWQ (the ``prefill`` row of its ROUTES): fp16 X from M = PREFILL_MIN_M on, where the
small-M GEMV kernels stop (M <= 16) and the generic kernel is correct but slow: with every 4-bit product of
onnxruntime-genai's int4 LLaMA (d = 2048, 16 layers) as MatMulAWQ on the generic kernel, a 128-token prefill took
52.0 ms against genai's own 4.2 ms (H200, 2026-11-29).

W is dequantised into fp16 [K, N] in the call's scratch by DequantAWQ's kernel (awq/dequantawq_cuda: bit-exact with
onnx_lowbit.awq.dequantize, the weight of MatMulAWQ's reference), then device/prefill's GEMM end (one cublasGemmEx,
op N on the [K, N] weight; a bias added in fp32 by its elementwise kernel); scratch and replay: device/prefill.
"""
from __future__ import annotations

from ..device import prefill
from ..device.prefill import PREFILL_MIN_M, prepare, scratch_bytes, takes  # noqa: F401 - the route's (ROUTES, tests)
from . import dequantawq_cuda

WHEN = (f"fp16 X, M >= {PREFILL_MIN_M}, cuBLAS and scratch memory (onnxruntime >= 1.18): W dequantised into fp16 "
        "[K, N] scratch by DequantAWQ's kernel, then one cublasGemmEx (fp32 accumulation; a bias added in fp32 by "
        "an elementwise kernel)")
MEASURED = ("H200, 2026-11-29, x[M, 2048] fp16, gate + up 2048 x 8192 int4 group 128, CUDA graphs "
            "(benchmarks/session_gpu.py): MatMulAWQ x2 56.2 / 57.1 / 133.5 us at M = 17 / 128 / 1024 against "
            "onnxruntime's MatMulNBits x2 56.0 / 58.3 / 135.0 (level); what it replaces: onnxruntime-genai's int4 "
            "LLaMA d = 2048 with every product MatMulAWQ, 128-token prefill 52.0 ms on the generic kernel (genai's "
            "own 4.2 ms)")


def run(ctx, m, sh, dequant, x, w, bias, yp):
    """The route on one call: ``dequant`` DequantAWQ's (launcher, grid, rows), ``x`` / ``bias`` bridge Tensors (bias
    None when absent), ``w`` (qweight, qzeros, scales), ``yp`` the output's device pointer (fp16 [M, N])."""
    lau, grid, rows = dequant
    base = ctx.scratch(scratch_bytes(m, sh.K, sh.N, bias is not None)[1])
    dequantawq_cuda.launch(lau, grid, rows, ctx.stream, *w, base, sh)
    prefill.gemm(ctx, m, sh.K, sh.N, x.ptr, base, True, bias.ptr if bias is not None else 0, yp)

"""The prefill route of MatMulAWQ (the ``prefill`` row of its ROUTES): fp16 X from M = PREFILL_MIN_M on, where the
small-M GEMV kernels stop (M <= 16) and the generic kernel is correct but slow: with every 4-bit product of
onnxruntime-genai's int4 LLaMA (d = 2048, 16 layers) as MatMulAWQ on the generic kernel, a 128-token prefill took
52.0 ms against genai's own 4.2 ms (H200, 2026-11-29).

W is dequantised into fp16 [K, N] in the call's scratch by DequantAWQ's kernel (awq/dequantawq_cuda: bit-exact with
onnx_lowbit.awq.dequantize, the weight of MatMulAWQ's reference), then one cublasGemmEx (fp16 X and W, fp32
accumulation, op N on the [K, N] weight, onnxruntime's MatMul layout) writes Y in fp16. With a bias the GEMM writes
fp32 G [M, N] into the scratch and the elementwise kernel ``addbias`` writes Y = fp16(G + bias): one rounding, as
in the reference.

Scratch: one buffer per call from onnxruntime's allocator (``Context.scratch``): W (K * N fp16, 256-byte aligned),
then G with a bias. A native plan (runtime/plans.py) records the dequant launch, the GEMM and the bias launch with
their pointers and replays them without Python (also under CUDA-graph capture); the weight is dequantised again on
every call (nothing survives a call).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, uint64

from ..device import cublas
from ..device.fp16 import f2h, h2f
from ..device.launch import Array, Launcher, SimLauncher
from ..device.target import SIM
from . import dequantawq_cuda

PREFILL_MIN_M = 17      # where the GEMV routes stop (M <= 16)
ALIGN = 256             # bytes: G's offset in the call's scratch
BLOCK = 256

WHEN = (f"fp16 X, M >= {PREFILL_MIN_M}, cuBLAS and scratch memory (onnxruntime >= 1.18): W dequantised into fp16 "
        "[K, N] scratch by DequantAWQ's kernel, then one cublasGemmEx (fp32 accumulation; a bias added in fp32 by "
        "an elementwise kernel)")
MEASURED = ("H200, 2026-11-29, x[M, 2048] fp16, gate + up 2048 x 8192 int4 group 128, CUDA graphs "
            "(benchmarks/session_gpu.py): MatMulAWQ x2 56.2 / 57.1 / 133.5 us at M = 17 / 128 / 1024 against "
            "onnxruntime's MatMulNBits x2 56.0 / 58.3 / 135.0 (level); what it replaces: onnxruntime-genai's int4 "
            "LLaMA d = 2048 with every product MatMulAWQ, 128-token prefill 52.0 ms on the generic kernel (genai's "
            "own 4.2 ms)")


def takes(c):
    """The routing condition of the ``prefill`` row (Case opts 'cublas', 'scratch')."""
    return c.dtype == "float16" and c.m >= PREFILL_MIN_M and c.k > 0 and bool(c.opt("cublas")) and \
        bool(c.opt("scratch"))


def _r(b):
    return -(-b // ALIGN) * ALIGN


def scratch_bytes(m, k, n, bias):
    """(offset of G, total bytes) of a call's scratch (W at offset 0; G only with a bias)."""
    goff = _r(k * n * 2)
    return goff, goff + (m * n * 4 if bias else 0)


def make_addbias():
    @cuda.jit
    def addbias(g, b, y, count, n_dim):
        """y[i] = fp16(g[i] + b[i % N]) (g fp32, b and y fp16 bits)."""
        i = uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x) + uint64(cuda.threadIdx.x)
        if i < uint64(count):
            y[i] = f2h(g[i] + h2f(b[i % uint64(n_dim)]))

    return addbias


_launcher = []


def prepare():
    """Compile (once per process) the bias kernel; the dequant kernel is DequantAWQ's own."""
    if not _launcher:
        sig = [Array(np.float32), Array(np.uint16), Array(np.uint16), "int64", "int64"]
        _launcher.append((SimLauncher if SIM else Launcher)(make_addbias(), sig))
    return _launcher[0]


def run(ctx, m, sh, dequant, x, w, bias, yp):
    """The route on one call: ``dequant`` DequantAWQ's (launcher, grid, rows), ``x`` / ``bias`` bridge Tensors (bias
    None when absent), ``w`` (qweight, qzeros, scales), ``yp`` the output's device pointer (fp16 [M, N])."""
    lau, grid, rows = dequant
    goff, total = scratch_bytes(m, sh.K, sh.N, bias is not None)
    base = ctx.scratch(total)
    dequantawq_cuda.launch(lau, grid, rows, ctx.stream, *w, base, sh)
    blas = cublas.handle_for(ctx.stream)
    if bias is None:
        blas.gemm_rows(x.ptr, cublas.R_16F, base, cublas.R_16F, yp, m, sh.N, sh.K, sh.N, cublas.R_16F, w_kn=True)
        return
    g = base + goff
    blas.gemm_rows(x.ptr, cublas.R_16F, base, cublas.R_16F, g, m, sh.N, sh.K, sh.N, cublas.R_32F, w_kn=True)
    count = m * sh.N
    prepare().launch(-(-count // BLOCK), BLOCK, ctx.stream, (g, (count,)), (bias.ptr, (sh.N,)), (yp, (count,)),
                     count, sh.N)

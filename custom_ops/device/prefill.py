"""The GEMM end of the one-weight 4-bit prefill routes (MatMulAWQ's awq/prefill_cuda, MatMulNF4's nf4/prefill_cuda):
fp16 X from M = PREFILL_MIN_M on, where the small-M GEMV kernels stop (M <= 16). The route dequantises its weight
into fp16 at the start of the call's scratch with its dequant op's kernel; ``gemm`` then runs one cublasGemmEx
(fp16 X and W, fp32 accumulation; op N on a [K, N] weight, onnxruntime's MatMul layout, or op T on [N, K], the
NF4 storage order) writing Y in fp16. With a bias the GEMM writes fp32 G [M, N] into the scratch after the weight
and the elementwise kernel ``addbias`` writes Y = fp16(G + bias): one rounding, as in the references.

Scratch: one buffer per call from onnxruntime's allocator (``Context.scratch``): W (K * N fp16, 256-byte aligned),
then G with a bias. A native plan (runtime/plans.py) records the dequant launch, the GEMM and the bias launch with
their pointers and replays them without Python (also under CUDA-graph capture); the weight is dequantised again on
every call (nothing survives a call).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, uint64

from . import cublas
from .fp16 import f2h, h2f
from .launch import Array, Launcher, SimLauncher
from .target import SIM

PREFILL_MIN_M = 17      # where the GEMV routes stop (M <= 16)
ALIGN = 256             # bytes: G's offset in the call's scratch
BLOCK = 256


def takes(c):
    """The routing condition of a ``prefill`` row (Case opts 'cublas', 'scratch')."""
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
    """Compile (once per process) the bias kernel."""
    if not _launcher:
        sig = [Array(np.float32), Array(np.uint16), Array(np.uint16), "int64", "int64"]
        _launcher.append((SimLauncher if SIM else Launcher)(make_addbias(), sig))
    return _launcher[0]


def gemm(ctx, m, k, n, xp, base, w_kn, bias_ptr, yp):
    """Y [M, N] (fp16, device pointer ``yp``) = X (fp16, ``xp``) . W (+ bias) with W fp16 at ``base``, the call's
    scratch of ``scratch_bytes`` ([K, N] with ``w_kn``, else [N, K]); ``bias_ptr`` 0 when absent."""
    blas = cublas.handle_for(ctx.stream)
    if not bias_ptr:
        blas.gemm_rows(xp, cublas.R_16F, base, cublas.R_16F, yp, m, n, k, n, cublas.R_16F, w_kn=w_kn)
        return
    g = base + scratch_bytes(m, k, n, True)[0]
    blas.gemm_rows(xp, cublas.R_16F, base, cublas.R_16F, g, m, n, k, n, cublas.R_32F, w_kn=w_kn)
    count = m * n
    prepare().launch(-(-count // BLOCK), BLOCK, ctx.stream, (g, (count,)), (bias_ptr, (n,)), (yp, (count,)), count, n)

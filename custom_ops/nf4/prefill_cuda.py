"""The prefill route of MatMulNF4 (the ``prefill`` row of its ROUTES): fp16 A from M = PREFILL_MIN_M on, where the
small-M kernels stop (M <= 16) and the generic kernel is correct but slow (onnxruntime-genai's int4 LLaMA, d = 2048,
16 layers, every product MatMulNF4 int4 through ``onnx-lowbit genai --to int4``: a 128-token prefill took 282.9 ms
on it against genai's own 4.08 ms; H200, 2026-11-29).

W^T [N, K] is dequantised into fp16 in the call's scratch by DequantNF4's transposed kernel (the variant its ROUTES
pick for Q's alignment: code * absmax in fp32, rounded once to fp16, 2^-12 relative at most, where the reference
keeps fp32), then device/prefill's GEMM end (one cublasGemmEx, op T on the [N, K] weight, fp32 accumulation; a
bias added in fp32 by its elementwise kernel); scratch and replay: device/prefill. As FusedFFNNF4's prefill route
(ffn/fusedffn4_prefill_cuda) does for its two weights.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..device import host, prefill
from ..device.prefill import PREFILL_MIN_M, scratch_bytes, takes  # noqa: F401 - the route's (ROUTES, tests)
from ..device.target import SIM
from ..runtime.routing import route
from . import dequantnf4_cuda as dq

WHEN = (f"fp16 A, M >= {PREFILL_MIN_M}, cuBLAS and scratch memory (onnxruntime >= 1.18): W^T dequantised into fp16 "
        "[N, K] scratch by DequantNF4's transposed kernel, then one cublasGemmEx (op T, fp32 accumulation; a bias "
        "added in fp32 by an elementwise kernel)")


def dequant_launchers():
    """{"vec" | "rows": (launcher, variant)}: DequantNF4's transposed kernels (fp32 absmax -> fp16 W^T), as its
    ROUTES name them (compiled once per process; FusedFFNNF4's prefill route uses them for its two weights)."""
    out = {}
    for v in ("vec", "rows"):
        var = dq.DEFAULT["float16"] if v == "vec" else dq.LEGACY
        if SIM and v == "vec":
            var = dataclasses.replace(var, block=32)    # fewer simulated threads (a launch setting)
        out[v] = dq._launcher(True, np.float16, var, absmax=np.float32), var
    return out


def prepare():
    """dequant_launchers(), after the GEMM end's bias kernel is compiled."""
    prefill.prepare()
    return dequant_launchers()


def run(ctx, m, k, n, bs, sms, launchers, code_ptr, a, q, absmax, bias, yp):
    """The route on one call: ``launchers`` (``prepare``'s), ``bs`` the node's BlockSize, ``a`` / ``q`` / ``absmax``
    / ``bias`` bridge Tensors (bias None when absent), ``yp`` the output's device pointer (fp16 [M, N])."""
    kind = route_dequant(k, n, bs.size, q.ptr)
    lau, var = launchers[kind]
    base = ctx.scratch(scratch_bytes(m, k, n, bias is not None)[1])
    dq.launch_transposed(lau, var, ctx.stream, True, q, absmax, code_ptr, base, k * n, bs, sms)
    prefill.gemm(ctx, m, k, n, a.ptr, base, False, bias.ptr if bias is not None else 0, yp)


def route_dequant(k, n, bs, *q_ptrs):
    """DequantNF4's kernel for these weights' alignment ("vec" or "rows"; one kernel for all of them)."""
    return route(dq.ROUTES, dq.case(np.float16, k, n, bs, True, host.alignment(*q_ptrs))).kernel

"""Why the fused FFN's cuBLAS prefill path trails onnxruntime's unfused graph by 0-8% (docs/ffn.md): the two
GEMMs of a SwiGLU block (x[M, 4096] . W1, W3 with N = 11008, fp16) timed as the prefill path issues them
(W stored [N, K], op T, fp32 outputs) against the same with fp16 outputs, against the layout onnxruntime's
MatMul uses (W stored [K, N], op N) and against X as cuBLAS's A operand; medians per pair of GEMMs (CUDA events
around 10 back-to-back pairs), and the cuBLAS kernels each case runs (torch.profiler), per M.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/gemm_out_gpu.py
"""
from __future__ import annotations

import ctypes
import os

import torch
from timing import time_cuda

from onnx_lowbit.custom_ops import cublas

K, N = 4096, 11008
MS = [int(v) for v in os.environ.get("MS", "3,4,8,16,32,64,128,256").split(",")]


def main():
    lib = cublas.load()
    torch.manual_seed(0)
    w_nk = [torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(2)]
    w_kn = [w.t().contiguous() for w in w_nk]
    w13 = torch.cat(w_nk)       # [2N, K]: gate rows, then up rows (one GEMM for both)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    print("GPU:", torch.cuda.get_device_name(0))

    ll, vp, ci = ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, ci, ll, vp, ci, ci, ll, vp, vp,
                                               ci, ci, ll, ci, ci, ci]

    def pair(x, cs, ctype, layout):
        h = cublas.handle_for(torch.cuda.current_stream().cuda_stream)
        m = x.shape[0]
        if layout in ("TNB", "TNB-"):   # one call, batch 2: A = W1 then W3 (stride W3 - W1, maybe negative), B shared
            a0, a1 = (w_nk[0], w_nk[1]) if layout == "TNB" else (w_nk[1], w_nk[0])
            stride = (a1.data_ptr() - a0.data_ptr()) // 2
            cublas.check(lib.cublasGemmStridedBatchedEx(
                h.h, cublas.OP_T, cublas.OP_N, N, m, K, ctypes.byref(one), vp(a0.data_ptr()), cublas.R_16F, K, stride,
                vp(x.data_ptr()), cublas.R_16F, K, 0, ctypes.byref(zero), vp(cs[0].data_ptr()), ctype, 2 * N, N, 2,
                cublas.COMPUTE_32F, cublas.GEMM_DEFAULT), "cublasGemmStridedBatchedEx")
            return
        if layout == "TN2":         # one GEMM: [M, 2N] = X . [W1; W3]^T
            cublas.check(lib.cublasGemmEx(h.h, cublas.OP_T, cublas.OP_N, 2 * N, m, K, ctypes.byref(one),
                                          ctypes.c_void_p(w13.data_ptr()), cublas.R_16F, K,
                                          ctypes.c_void_p(x.data_ptr()), cublas.R_16F, K, ctypes.byref(zero),
                                          ctypes.c_void_p(cs[0].data_ptr()), ctype, 2 * N, cublas.COMPUTE_32F,
                                          cublas.GEMM_DEFAULT), "cublasGemmEx")
            return
        for i in range(2):
            if layout == "swap":    # C^T: column-major [M, N] = op_T(X as K x M) . (W [N, K] row-major as K x N)
                cublas.check(lib.cublasGemmEx(h.h, cublas.OP_T, cublas.OP_N, m, N, K, ctypes.byref(one),
                                              ctypes.c_void_p(x.data_ptr()), cublas.R_16F, K,
                                              ctypes.c_void_p(w_nk[i].data_ptr()), cublas.R_16F, K,
                                              ctypes.byref(zero), ctypes.c_void_p(cs[i].data_ptr()), ctype, m,
                                              cublas.COMPUTE_32F, cublas.GEMM_DEFAULT), "cublasGemmEx")
                continue
            if layout == "TN":      # the prefill path: W [N, K] row-major, op T
                a, op, lda = w_nk[i], cublas.OP_T, K
            else:                   # onnxruntime's MatMul: W [K, N] row-major, op N
                a, op, lda = w_kn[i], cublas.OP_N, N
            cublas.check(lib.cublasGemmEx(h.h, op, cublas.OP_N, N, m, K, ctypes.byref(one),
                                          ctypes.c_void_p(a.data_ptr()), cublas.R_16F, lda,
                                          ctypes.c_void_p(x.data_ptr()), cublas.R_16F, K, ctypes.byref(zero),
                                          ctypes.c_void_p(cs[i].data_ptr()), ctype, N, cublas.COMPUTE_32F,
                                          cublas.GEMM_DEFAULT), "cublasGemmEx")

    cases = [("TN fp32 out (prefill path)", "TN", cublas.R_32F, torch.float32),
             ("TN fp16 out", "TN", cublas.R_16F, torch.float16),
             ("NN fp16 out (onnxruntime MatMul)", "NN", cublas.R_16F, torch.float16),
             ("NN fp32 out", "NN", cublas.R_32F, torch.float32),
             ("W [N, K], X as A, fp32 out transposed", "swap", cublas.R_32F, torch.float32),
             ("TN one GEMM of [W1; W3] (2N), fp32 out", "TN2", cublas.R_32F, torch.float32),
             ("TN one GEMM of [W1; W3] (2N), fp16 out", "TN2", cublas.R_16F, torch.float16),
             ("TN strided-batched W1, W3 (one call), fp32 out", "TNB", cublas.R_32F, torch.float32),
             ("same, batch order W3, W1 (negative stride if W3 lies after W1)", "TNB-", cublas.R_32F, torch.float32)]
    if os.environ.get("CASES"):
        cases = [cases[int(i)] for i in os.environ["CASES"].split(",")]
    print("| M | " + " | ".join(c[0] for c in cases) + " |")
    print("| ---: |" + " ---: |" * len(cases))
    names = {}
    for m in MS:
        x = torch.randn(m, K, device="cuda", dtype=torch.float16)
        row = []
        for label, layout, ctype, tdt in cases:
            cs = ([torch.empty(m, 2 * N, device="cuda", dtype=tdt)] if layout in ("TN2", "TNB", "TNB-") else
                  [torch.empty(m, N, device="cuda", dtype=tdt) for _ in range(2)])
            t = time_cuda(lambda: pair(x, cs, ctype, layout), batch=10)
            ref = (x.float() @ w_nk[0].float().t())
            got = (cs[0].float().reshape(N, m).t() if layout == "swap" else
                   cs[0].float()[:, :N] if layout in ("TN2", "TNB") else
                   cs[0].float()[:, N:] if layout == "TNB-" else cs[0].float())
            err = float((got - ref).abs().max() / ref.abs().max())
            row.append(f"{t:.1f}" + ("" if err < 2e-3 else f" (ERR {err:.1e})"))
            if m in (8, 128) and not os.environ.get("NO_PROFILE"):
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    pair(x, cs, ctype, layout)
                    torch.cuda.synchronize()
                ks = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                names[(m, label)] = sorted(set(k[:110] for k in ks))
        print(f"| {m} | " + " | ".join(row) + " |", flush=True)
    for (m, label), ks in names.items():
        print(f"M={m} {label}: {len(ks)} kernel(s): " + "; ".join(ks))


if __name__ == "__main__":
    main()

"""Does cublasGemmEx's algo argument change the fused FFN prefill GEMMs on this GPU? (docs/ffn.md: the [N, K]
weight layout, op T, trails onnxruntime's [K, N] op N by up to 8 us at M = 128 with the default algo.) For each M,
the pair of GEMMs x[M, 4096] . W1, W3 (N = 11008, fp16 in, fp32 out, op T) with every algo value cuBLAS accepts,
CUDA-event medians per pair, against NN fp16 out with the default algo (onnxruntime's MatMul).

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/gemm_algo_gpu.py
"""
from __future__ import annotations

import ctypes

import torch
from timing import time_cuda

from onnx_lowbit.custom_ops import cublas

K, N = 4096, 11008
MS = [3, 8, 32, 128, 256]
ALGOS = [-1] + list(range(0, 24)) + [99] + list(range(100, 116))


def main():
    lib = cublas.load()
    torch.manual_seed(0)
    w_nk = [torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(2)]
    w_kn = [w.t().contiguous() for w in w_nk]
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    print("GPU:", torch.cuda.get_device_name(0))

    def pair(x, cs, layout, ctype, algo):
        h = cublas.handle_for(torch.cuda.current_stream().cuda_stream)
        m = x.shape[0]
        for i in range(2):
            a, op, lda = (w_nk[i], cublas.OP_T, K) if layout == "TN" else (w_kn[i], cublas.OP_N, N)
            rc = lib.cublasGemmEx(h.h, op, cublas.OP_N, N, m, K, ctypes.byref(one), ctypes.c_void_p(a.data_ptr()),
                                  cublas.R_16F, lda, ctypes.c_void_p(x.data_ptr()), cublas.R_16F, K,
                                  ctypes.byref(zero), ctypes.c_void_p(cs[i].data_ptr()), ctype, N,
                                  cublas.COMPUTE_32F, algo)
            if rc:
                raise RuntimeError(f"status {rc}")

    for m in MS:
        x = torch.randn(m, K, device="cuda", dtype=torch.float16)
        c16 = [torch.empty(m, N, device="cuda", dtype=torch.float16) for _ in range(2)]
        c32 = [torch.empty(m, N, device="cuda", dtype=torch.float32) for _ in range(2)]
        t_nn = time_cuda(lambda: pair(x, c16, "NN", cublas.R_16F, -1), batch=10)
        ref = x.float() @ w_nk[0].float().t()
        res = []
        for algo in ALGOS:
            try:
                pair(x, c32, "TN", cublas.R_32F, algo)
                torch.cuda.synchronize()
                err = float((c32[0] - ref).abs().max() / ref.abs().max())
                t = time_cuda(lambda: pair(x, c32, "TN", cublas.R_32F, algo), batch=10)
                res.append((t, algo, err))
            except RuntimeError:
                pass
        res.sort()
        dflt = [r for r in res if r[1] == -1]
        print(f"M={m}: NN fp16 default {t_nn:.1f} us; TN fp32 default {dflt[0][0] if dflt else float('nan'):.1f} us; "
              f"{len(res)} algos accepted; best: " + ", ".join(f"{a}: {t:.1f} ({e:.0e})" for t, a, e in res[:5]),
              flush=True)
        print(f"      distinct times: {sorted(set(round(r[0], 1) for r in res))[:12]}")


if __name__ == "__main__":
    main()

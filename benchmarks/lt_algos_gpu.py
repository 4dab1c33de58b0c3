"""Does cuBLASLt have a TN kernel as fast as onnxruntime's NN one? (issue 4, prefill "never slower")

The fused FFN's prefill path multiplies X[M, K] by W1, W3 stored [N, K] (op T, "TN", fp32 outputs, through
cublasGemmEx's heuristic); onnxruntime's unfused graph multiplies by W [K, N] (op N, "NN", fp16 outputs) and is
2-8 us ahead at M = 64 .. 256 (docs/ffn.md). Here every algorithm cublasLtMatmulAlgoGetHeuristic offers for the
TN product (up to 32) is timed at each M, next to cublasGemmEx TN / NN in the same run; us per pair of GEMMs
(W1, W3: x[M, 4096] . W, N = 11008, fp16, CUDA events around 10 back-to-back pairs).

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/lt_algos_gpu.py        (MS=17,32,64 to choose rows)
"""
from __future__ import annotations

import ctypes
import os

import torch
from timing import time_cuda

from onnx_lowbit.custom_ops import cublas

K, N = 4096, 11008
MS = [int(v) for v in os.environ.get("MS", "17,24,32,48,64,96,128,192,256").split(",")]
REQUEST = 32
WS = 32 << 20


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def lt_lib():
    torch.ones(8, 8, device="cuda", dtype=torch.float16) @ torch.ones(8, 8, device="cuda", dtype=torch.float16)
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "/libcublasLt.so" in ln})
    if not paths:
        raise SystemExit("libcublasLt not mapped")
    return ctypes.CDLL(paths[0])


def main():
    lt = lt_lib()
    vp = ctypes.c_void_p

    def ok(st, what):
        if st != 0:
            raise RuntimeError(f"{what}: status {st}")

    h = vp()
    ok(lt.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    desc = vp()
    ok(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), ctypes.c_int(cublas.COMPUTE_32F), ctypes.c_int(cublas.R_32F)),
       "desc")
    opt = ctypes.c_int(cublas.OP_T)
    ok(lt.cublasLtMatmulDescSetAttribute(desc, 3, ctypes.byref(opt), 4), "transa")
    pref = vp()
    ok(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
    wsz = ctypes.c_uint64(WS)
    ok(lt.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(wsz), 8), "pref ws")

    def layout(dt, rows, cols, ld):
        lay = vp()
        ok(lt.cublasLtMatrixLayoutCreate(ctypes.byref(lay), ctypes.c_int(dt), ctypes.c_uint64(rows),
                                         ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return lay

    desc_n = vp()
    ok(lt.cublasLtMatmulDescCreate(ctypes.byref(desc_n), ctypes.c_int(cublas.COMPUTE_32F), ctypes.c_int(cublas.R_32F)),
       "desc")
    torch.manual_seed(0)
    w_nk = [torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(2)]
    w_kn = [w.t().contiguous() for w in w_nk]
    ws = torch.empty(WS, device="cuda", dtype=torch.uint8)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    lib = cublas.load()

    def sweep(variant, m, x, ctype, tdt, stream):
        """Times of every offered algorithm [(us, index)] and how many were offered."""
        cs = [torch.empty(m, N, device="cuda", dtype=tdt) for _ in range(2)]
        if variant == "tn":       # C^T [N, M] = op_T(W as K x N) . (X as K x M)
            d, la, lb, lc = desc, layout(cublas.R_16F, K, N, K), layout(cublas.R_16F, K, m, K), layout(ctype, N, m, N)
            ops = lambda j: (w_nk[j], x)  # noqa: E731
        elif variant == "swap":   # C [M, N] col-major = out^T row-major: op_T(X as K x M) . (W as K x N)
            d, la, lb, lc = desc, layout(cublas.R_16F, K, m, K), layout(cublas.R_16F, K, N, K), layout(ctype, m, N, m)
            ops = lambda j: (x, w_nk[j])  # noqa: E731
        elif variant == "rowA":   # A = W described row-major N x K, op N
            d, la, lb, lc = desc_n, layout(cublas.R_16F, N, K, K), layout(cublas.R_16F, K, m, K), layout(ctype, N, m, N)
            order = ctypes.c_int(1)
            ok(lt.cublasLtMatrixLayoutSetAttribute(la, 1, ctypes.byref(order), 4), "order")
            ops = lambda j: (w_nk[j], x)  # noqa: E731
        else:                     # "nn": onnxruntime's layout, W [K, N] row-major = N x K col-major, op N
            d, la, lb, lc = desc_n, layout(cublas.R_16F, N, K, N), layout(cublas.R_16F, K, m, K), layout(ctype, N, m, N)
            ops = lambda j: (w_kn[j], x)  # noqa: E731
        heur = (Heuristic * REQUEST)()
        cnt = ctypes.c_int(0)
        st = lt.cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc, lc, pref, REQUEST, heur, ctypes.byref(cnt))
        if st != 0:
            return [], f"status {st}"
        ref = x.float() @ w_nk[0].float().t()
        times = []
        for i in range(cnt.value):
            r = heur[i]
            if r.state != 0 or r.workspace > WS:
                continue

            def pair(r=r):
                for j in range(2):
                    a, b = ops(j)
                    ok(lt.cublasLtMatmul(h, d, ctypes.byref(one), vp(a.data_ptr()), la, vp(b.data_ptr()), lb,
                                         ctypes.byref(zero), vp(cs[j].data_ptr()), lc, vp(cs[j].data_ptr()), lc,
                                         ctypes.byref(r.algo), vp(ws.data_ptr()), ctypes.c_size_t(WS), vp(stream)),
                       "matmul")
            try:
                pair()
                torch.cuda.synchronize()
            except RuntimeError:
                continue
            got = cs[0].float().reshape(N, m).t() if variant == "swap" else cs[0].float()
            err = float((got - ref).abs().max() / ref.abs().max())
            if err > 2e-3:
                times.append((float("inf"), i))
                continue
            times.append((time_cuda(pair, batch=10), i))
        return times, cnt.value

    def fmt(times):
        if not times:
            return "-"
        t, i = min(times)
        return f"{t:.1f} (#{i} of {len(times)})"

    print("GPU:", torch.cuda.get_device_name(0))
    print("| M | GemmEx TN fp32 (prefill path) | GemmEx NN fp16 (onnxruntime) | Lt TN fp32 #0 | best Lt TN fp32 | "
          "best Lt TN fp16 | best Lt swap fp32 | best Lt row-major A fp32 | best Lt NN fp16 |")
    print("| ---: |" + " ---: |" * 8)
    for m in MS:
        x = torch.randn(m, K, device="cuda", dtype=torch.float16)
        stream = torch.cuda.current_stream().cuda_stream
        hb = cublas.handle_for(stream)

        def gemmex(op, ctype, tdt):
            cs = [torch.empty(m, N, device="cuda", dtype=tdt) for _ in range(2)]

            def pair():
                for j in range(2):
                    a, lda = (w_nk[j], K) if op == cublas.OP_T else (w_kn[j], N)
                    cublas.check(lib.cublasGemmEx(hb.h, op, cublas.OP_N, N, m, K, ctypes.byref(one), vp(a.data_ptr()),
                                                  cublas.R_16F, lda, vp(x.data_ptr()), cublas.R_16F, K,
                                                  ctypes.byref(zero), vp(cs[j].data_ptr()), ctype, N,
                                                  cublas.COMPUTE_32F, cublas.GEMM_DEFAULT), "cublasGemmEx")
            return time_cuda(pair, batch=10)
        tn = gemmex(cublas.OP_T, cublas.R_32F, torch.float32)
        nn = gemmex(cublas.OP_N, cublas.R_16F, torch.float16)
        t32, _ = sweep("tn", m, x, cublas.R_32F, torch.float32, stream)
        t16, _ = sweep("tn", m, x, cublas.R_16F, torch.float16, stream)
        sw, _ = sweep("swap", m, x, cublas.R_32F, torch.float32, stream)
        ra, _ = sweep("rowA", m, x, cublas.R_32F, torch.float32, stream)
        nl, _ = sweep("nn", m, x, cublas.R_16F, torch.float16, stream)
        h0 = next((t for t, i in t32 if i == 0), float("nan"))
        print(f"| {m} | {tn:.1f} | {nn:.1f} | {h0:.1f} | {fmt(t32)} | {fmt(t16)} | {fmt(sw)} | {fmt(ra)} | {fmt(nl)} |",
              flush=True)
        print("    all TN fp32:", " ".join(f"#{i}:{t:.1f}" for t, i in t32), flush=True)

if __name__ == "__main__":
    main()

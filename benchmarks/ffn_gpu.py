"""FusedFFN (fp weights) on the GPU: decode kernel and prefill path against torch's unfused gate/up
(two F.linear + silu * mul) and a 512 MiB device copy, all measured in the same run.

    PYTHONPATH=.:tests python3 benchmarks/ffn_gpu.py [--json out.json]

Our kernels are launched as the bridge launches them (FusedFFNCudaKernel.run: Launcher / cuLaunchKernel, cuBLAS
through ctypes) on torch's current stream. Times: medians of CUDA-event timings around 20 back-to-back calls
(benchmarks/timing.py), so host launch cost overlaps the GPU work as in a pipeline.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from timing import copy_gbps, time_cuda, time_graph, write_json

from onnx_lowbit import ffn
from onnx_lowbit.custom_ops.device import cublas
from onnx_lowbit.custom_ops.ffn import fusedffn_cuda as fc

K, N = 4096, 11008
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def kernel(x16, w16):
    return fc.FusedFFNCudaKernel(spec=None, attrs={}, node_name="bench", in_types=(10 if x16 else 1, 10 if w16 else 1),
                                 out_types=(10 if x16 else 1,))


def runner(kern, x, w1, w3, y, path=None, follow_stream=False):
    """A call of the kernel as the bridge makes it; ``follow_stream``: ask torch for its current stream at each
    call (for CUDA-graph capture, which runs on a side stream)."""
    m, k = x.numel() // x.shape[-1], x.shape[-1]
    n = w1.shape[0]
    s = torch.cuda.current_stream().cuda_stream
    args = (m, k, n, x.data_ptr(), w1.data_ptr(), w3.data_ptr(), 0, 0, y.data_ptr())
    if follow_stream:
        return lambda: kern.run(torch.cuda.current_stream().cuda_stream, *args, path=path)
    return lambda: kern.run(s, *args, path=path)


def torch_ffn(x, w1, w3):
    return lambda: F.silu(F.linear(x, w1)) * F.linear(x, w3)


_host = {}


def rel_err(y, x, w1, w3, rows=8):
    """max |y - ref| / max |ref| over the first ``rows`` rows, ref = float64 reference (onnx_lowbit.ffn)."""
    key = (w1.data_ptr(), w3.data_ptr())
    if key not in _host:
        _host.clear()
        _host[key] = (w1.float().cpu().numpy(), w3.float().cpu().numpy())
    a1, a3 = _host[key]
    ref = ffn.swiglu_ref(x[:rows].float().cpu().numpy(), a1, a3)
    return float(np.abs(y[:rows].double().cpu().numpy() - ref).max() / np.abs(ref).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {"gpu": torch.cuda.get_device_name(0)}
    print("GPU:", out["gpu"])
    torch.manual_seed(0)
    bw, t_copy = copy_gbps(mib=512)
    out["copy_GBps"] = bw
    wbytes16 = 2 * N * K * 2

    # ---- decode, fp16, x[1, 4096] x [4096, 11008] x 2
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    w1 = (torch.randn(N, K, device="cuda") * 0.02).half()
    w3 = (torch.randn(N, K, device="cuda") * 0.02).half()
    y = torch.empty(1, N, device="cuda", dtype=torch.float16)
    k16 = kernel(True, True)
    ours = runner(k16, x, w1, w3, y)
    ours()
    torch.cuda.synchronize()
    err = rel_err(y, x, w1, w3)
    t_ours = time_cuda(ours)
    t_torch = time_cuda(torch_ffn(x, w1, w3))
    g_ours, g_torch = time_graph(runner(k16, x, w1, w3, y, follow_stream=True)), time_graph(torch_ffn(x, w1, w3))
    rows = [("device copy 512 MiB", t_copy, bw),
            ("torch: 2 x F.linear + silu * mul (fp16)", t_torch, wbytes16 / t_torch / 1e3),
            ("FusedFFN decode kernel (ours, fp16)", t_ours, wbytes16 / t_ours / 1e3),
            ("  same, in a CUDA graph (no host launch cost)", g_ours, wbytes16 / g_ours / 1e3),
            ("  torch, in a CUDA graph", g_torch, wbytes16 / g_torch / 1e3)]
    print(f"\n### Decode: x[1,{K}] . W1,W3[{N},{K}] fp16 (180.4 MB of weights); ours vs float64 reference: "
          f"rel err {err:.1e}\n")
    print("| case | us | GB/s | % of copy |\n| --- | ---: | ---: | ---: |")
    for name, t, gb in rows:
        print(f"| {name} | {t:.1f} | {gb:.0f} | {100 * gb / bw:.1f} |")
    print(f"\nspeedup vs torch: {t_torch / t_ours:.2f}x (graphs: {g_torch / g_ours:.2f}x); goal <= 68 us and >= 1.3x")
    out.update(decode_fp16_us=t_ours, torch_us=t_torch, decode_graph_us=g_ours, torch_graph_us=g_torch, rel_err=err)

    # ---- the other type variants at M = 1
    print("\n### Decode, other type variants (M = 1)\n\n| X | W | us | GB/s (weights) | % of copy | rel err |"
          "\n| --- | --- | ---: | ---: | ---: | ---: |")
    for x16, w16 in [(False, False), (False, True), (True, False)]:
        xt = (x if x16 else x.float()).contiguous()
        a1, a3 = (w1, w3) if w16 else (w1.float(), w3.float())
        yt = torch.empty(1, N, device="cuda", dtype=xt.dtype)
        kk = kernel(x16, w16)
        fn = runner(kk, xt, a1, a3, yt)
        fn()
        torch.cuda.synchronize()
        e = rel_err(yt, xt, a1, a3)
        t = time_cuda(fn)
        wb = 2 * N * K * (2 if w16 else 4)
        print(f"| {'fp16' if x16 else 'fp32'} | {'fp16' if w16 else 'fp32'} | {t:.1f} | {wb / t / 1e3:.0f} | "
              f"{100 * wb / t / 1e3 / bw:.1f} | {e:.1e} |")
        out[f"decode_{int(x16)}{int(w16)}_us"] = t
        del a1, a3

    # ---- prefill sweep, fp16
    print("\n### M sweep, fp16, K=4096, N=11008: ours (the routed kernel) vs torch's unfused path; the GEMMs alone: "
          "two [N, K] GEMMs (as the cuBLAS path) vs one on concatenated gate|up weights [2N, K] (fp32 out)\n\n"
          "| M | routed kernel | ours us | cuBLAS path us | torch us | ours / torch | rel err | 2 GEMMs us | "
          "1 GEMM [2N,K] us |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    wcat = torch.cat([w1, w3]) if k16.blas else None
    gbuf = torch.empty(max(SWEEP) * 2 * N, device="cuda", dtype=torch.float32) if k16.blas else None
    sweep = {}
    for m in SWEEP:
        xm = torch.randn(m, K, device="cuda", dtype=torch.float16)
        ym = torch.empty(m, N, device="cuda", dtype=torch.float16)
        auto = k16.serving_row(m, K, N, xm.data_ptr(), w1.data_ptr(), w3.data_ptr(), None).kernel
        t_auto = time_cuda(runner(k16, xm, w1, w3, ym))
        e = rel_err(ym, xm, w1, w3)
        t_gemm = time_cuda(runner(k16, xm, w1, w3, ym, "gemm")) if k16.blas else None
        t_t = time_cuda(torch_ffn(xm, w1, w3))
        t_two = t_one = None
        if k16.blas:
            h = cublas.handle_for(torch.cuda.current_stream().cuda_stream)
            xp, gp, r16 = xm.data_ptr(), gbuf.data_ptr(), cublas.R_16F
            t_two = time_cuda(lambda: [h.gemm_rows(xp, r16, w.data_ptr(), r16, gp + off * 4, m, N, K, 2 * N)
                                       for w, off in ((w1, 0), (w3, N))])
            t_one = time_cuda(lambda: h.gemm_rows(xp, r16, wcat.data_ptr(), r16, gp, m, 2 * N, K, 2 * N))
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"| {m} | {auto} | {t_auto:.1f} | {f(t_gemm)} | {t_t:.1f} | {t_auto / t_t:.2f} | {e:.1e} | {f(t_two)} | "
              f"{f(t_one)} |")
        sweep[m] = dict(path=auto, ours=t_auto, gemm=t_gemm, torch=t_t, err=e, two_gemms=t_two, one_gemm_concat=t_one)
    slower = [m for m, v in sweep.items() if v["ours"] > v["torch"]]
    print(f"\nM where ours is slower than torch's unfused path: {slower or 'none'}")
    out["sweep"] = sweep
    wcat = gbuf = None
    # the fallback kernel (no cuBLAS), two sizes
    for m in (1, 512):
        xm = torch.randn(m, K, device="cuda", dtype=torch.float16)
        ym = torch.empty(m, N, device="cuda", dtype=torch.float16)
        t = time_cuda(runner(k16, xm, w1, w3, ym, "tiled"), iters=5, warmup=1, batch=3)
        print(f"tiled fallback kernel (no cuBLAS), M={m}: {t:.1f} us")
        out[f"tiled_M{m}_us"] = t
    write_json(args.json, out)


if __name__ == "__main__":
    main()

"""FusedFFN on K-major weights ([K, N], attribute weights_kn) against [N, K] weights and torch, same run, same GPU:
each layout as routed (fusedffn_cuda.ROUTES), at decode M and, with --prefill-ms, prefill M.

    PYTHONPATH=.:benchmarks python3 benchmarks/ffn_kn_gpu.py [--shapes 4096x11008,...] [--ms 1,2]
        [--prefill-ms 3,16,64]

Times: medians of CUDA-event timings around 20 back-to-back calls (benchmarks/timing.py); weights (>= 180 MB at the
LLaMA shapes) are past the 50 MB L2. Every variant's output is checked against the float64 reference first.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from timing import copy_gbps, time_cuda, time_graph

from onnx_lowbit import ffn
from onnx_lowbit.custom_ops.ffn import fusedffn_cuda as fc


def err_of(y, x, w1t, w3t):
    ref = ffn.swiglu_ref(x.float().cpu().numpy(), w1t.float().cpu().numpy(), w3t.float().cpu().numpy())
    return float(np.abs(y.double().cpu().numpy() - ref).max() / np.abs(ref).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x11008")
    ap.add_argument("--ms", default="1,2")
    ap.add_argument("--prefill-ms", default="", help="also time both layouts as routed at these M (e.g. 3,16,64)")
    args = ap.parse_args()
    print("GPU:", torch.cuda.get_device_name(0))
    bw, _ = copy_gbps(mib=512)
    print(f"copy: {bw:.0f} GB/s")
    nk = fc.FusedFFNCudaKernel(spec=None, attrs={}, node_name="bench", in_types=(10, 10), out_types=(10,))
    knk = fc.FusedFFNCudaKernel(spec=None, attrs={"weights_kn": 1}, node_name="bench", in_types=(10, 10),
                                out_types=(10,))
    torch.manual_seed(0)
    print("\n| shape | M | case | us | graph us | % copy | rel err |\n| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for shp in args.shapes.split(","):
        K, N = (int(v) for v in shp.split("x"))  # noqa: N806
        w1t = (torch.randn(N, K, device="cuda") * 0.02).half()
        w3t = (torch.randn(N, K, device="cuda") * 0.02).half()
        w1, w3 = w1t.t().contiguous(), w3t.t().contiguous()
        wb = 2 * N * K * 2
        ms = [int(v) for v in args.ms.split(",")] + [int(v) for v in args.prefill_ms.split(",") if v]
        for m in ms:
            x = torch.randn(m, K, device="cuda", dtype=torch.float16)
            y = torch.empty(m, N, device="cuda", dtype=torch.float16)
            rows = []

            def nk_call():
                nk.run(torch.cuda.current_stream().cuda_stream, m, K, N, x.data_ptr(), w1t.data_ptr(),
                       w3t.data_ptr(), 0, 0, y.data_ptr())
            served = nk.serving_row(m, K, N, x.data_ptr(), w1t.data_ptr(), w3t.data_ptr(), None).kernel
            rows.append((f"[N, K] as routed ({served})", nk_call))

            def kn_routed():
                knk.run(torch.cuda.current_stream().cuda_stream, m, K, N, x.data_ptr(), w1.data_ptr(),
                        w3.data_ptr(), 0, 0, y.data_ptr())
            served = knk.serving_row(m, K, N, x.data_ptr(), w1.data_ptr(), w3.data_ptr(), None).kernel
            rows.append((f"[K, N] as routed (weights_kn = 1: {served})", kn_routed))
            rows.append(("torch, W [K, N]: silu(x @ W1) * (x @ W3)", lambda: F.silu(x @ w1) * (x @ w3)))
            rows.append(("torch, W [N, K]: F.linear", lambda: F.silu(F.linear(x, w1t)) * F.linear(x, w3t)))
            for name, fn in rows:
                fn()
                torch.cuda.synchronize()
                out = y if "torch" not in name else fn()
                err = err_of(out, x, w1t, w3t)
                t = time_cuda(fn)
                g = time_graph(fn)
                print(f"| {K}x{N} | {m} | {name} | {t:.2f} | {g:.2f} | {100 * wb / t / 1e3 / bw:.1f} | {err:.1e} |",
                      flush=True)


if __name__ == "__main__":
    main()

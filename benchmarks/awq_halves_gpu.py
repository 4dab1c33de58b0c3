"""MatMulAWQ on the small-M tensor-core GEMV (custom_ops/matmulawq1_cuda) as sessions launch it, one weight per
launch against the weight's two column halves through the two-weight kernel (``halves``, matmulawq1_cuda.HALVES),
M = 1 .. 16, weights cycled past L2 (a pool of >= 128 MB), CUDA-graph medians per call; torch fp16 x @ W in the
same run; every output checked against onnx_lowbit.awq.matmul on the last pool entry.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/awq_halves_gpu.py [--ms 1,4,12] [KxN ...]
"""
from __future__ import annotations

import argparse

import numpy as np
from timing import copy_gbps, time_graph

G = 128
POOL_BYTES = 128 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["4096x11008", "2048x2048", "8192x2048", "2048x6144"])
    ap.add_argument("--ms", default="1,2,4,8,12,16")
    a = ap.parse_args()
    import torch

    from onnx_lowbit import awq
    from onnx_lowbit.custom_ops import matmulawq1_cuda as m1
    from onnx_lowbit.custom_ops.cuda_launch import current_device, sm_count
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0))
    sms = sm_count(current_device())
    bw = copy_gbps()[0]
    print(f"device copy 256 MiB: {bw:.0f} GB/s")
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    arr = lambda t, off=0, unit=4: (t.data_ptr() + off, ((t.numel() * t.element_size() - off) // unit,))  # noqa: E731
    for shape in a.shapes:
        k, n = (int(v) for v in shape.split("x"))
        per = k * n // 2 + k // G * n * 2 + k // G * n // 2
        cnt = max(3, -(-POOL_BYTES // per))
        pool = [(torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32, device="cuda"),
                 torch.randint(-2 ** 31, 2 ** 31 - 1, (k // G, n // 8), dtype=torch.int32, device="cuda"),
                 (torch.rand(k // G, n, device="cuda") * 0.004 + 0.001).half()) for _ in range(cnt)]
        host = [t.cpu().numpy() for t in pool[-1]]
        wf = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02
              for _ in range(max(2, -(-POOL_BYTES // (k * n * 2))))]
        for m in (int(v) for v in a.ms.split(",")):
            mr = 1 if m == 1 else 8
            x = (torch.randn(m, k, device="cuda") * 0.5).half()
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            ref = awq.matmul(x.cpu().numpy(), *host, G, k, n).astype(np.float64)
            it = iter(range(1 << 30))
            yt = torch.empty(m, n, device="cuda", dtype=torch.float16)
            t_torch = time_graph(lambda: torch.matmul(x, wf[next(it) % len(wf)], out=yt), batch=len(wf))
            print(f"{k}x{n} M={m:2d} torch fp16 x @ W {t_torch:7.2f} us", flush=True)
            for halves in (False, True):
                if halves and not m1.use_halves(n, mr):
                    continue
                nw, nc = (2, n // 2) if halves else (1, n)
                warps, unroll, cap, wpl = m1.config(True, k, nc, G, sms, nw, mr)
                lau = m1.launcher(warps, unroll, cap, wpl, 0, nw, mr, halves)
                grid, gpw, splits = m1.plan(k, nc, G, sms, max(1, lau.blocks_per_sm(32 * warps)), warps, None, wpl)
                part = torch.zeros(max(1, splits * nw * m * nc), dtype=torch.float32, device="cuda")
                ctr = torch.zeros(m1.tiles(nc, wpl), dtype=torch.int32, device="cuda")
                u = 4 * wpl
                off = (nc // 2, nc // 2, 2 * nc) if halves else (0, 0, 0)    # the second half's bytes into each row

                def call(w, lau=lau, grid=grid, warps=warps, gpw=gpw, splits=splits, part=part, ctr=ctr, u=u,
                         off=off, nc=nc, wpl=wpl):
                    qw, qz, sc = w
                    ws = (arr(qw, 0, u), arr(qz, 0, u), arr(sc, 0, 8))
                    w3 = (arr(qw, off[0], u), arr(qz, off[1], u), arr(sc, off[2], 8)) if off[0] else ws
                    yb = arr(y, 0, 2)
                    lau.launch(grid, 32 * warps, stream(), arr(x, 0, 8), *ws, *w3, yb, yb, yb, arr(part),
                               arr(ctr), *m1.scalars(k, nc, G, gpw, splits, False, False, wpl, m))
                calls = [lambda w=w: call(w) for w in pool]
                it2 = iter(range(1 << 30))
                t = time_graph(lambda: calls[next(it2) % len(calls)](), batch=len(calls))
                calls[-1]()
                torch.cuda.synchronize()
                err = float(np.max(np.abs(y.float().cpu().numpy() - ref)) / np.max(np.abs(ref)))
                gbs = per / t / 1e3
                print(f"{k}x{n} M={m:2d} {'halves (two-weight kernel)' if halves else 'one weight':28s} {t:7.2f} us "
                      f"{gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy {t_torch / t:5.2f}x torch rel {err:.1e} "
                      f"[wpl {wpl}, gpw {gpw}, {splits} splits, {grid} blocks]", flush=True)
        pool = wf = None


if __name__ == "__main__":
    main()

"""FusedFFN prefill at small M, fp16 (x[M, 4096], W1/W3 [11008, 4096]): the tensor-core kernel
(custom_ops/ffn/fusedffn_tc_cuda.py, the configuration sessions launch at each M: fusedffn_tc_cuda.config) against torch's block on [N, K] weights (F.linear: the TN
GEMMs of the op's cuBLAS path, fp16 outputs) and against torch's unfused block in onnxruntime's layout (W [K, N], x @ W1, x @ W3 in fp16, silu,
mul: the kernels onnxruntime's unfused graph runs), all in the same run. medians of CUDA events around 20 back-to-back calls (time_cuda);
every output checked against a float64 reference first.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/ffn_tc_gpu.py [M,M,...]
"""
from __future__ import annotations

import sys

import torch
from timing import copy_gbps, time_cuda

from onnx_lowbit.custom_ops.ffn import fusedffn_tc_cuda as tc

K, N = 4096, 11008
MS = [3, 4, 8, 16, 32, 64, 128]


def main():
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ms = [int(v) for v in args[0].split(",")] if args else MS
    torch.manual_seed(0)
    gbs, _ = copy_gbps()
    print("GPU:", torch.cuda.get_device_name(0), f"copy {gbs:.0f} GB/s")
    w1 = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    w3 = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    w1kn, w3kn = w1.t().contiguous(), w3.t().contiguous()
    wbytes = 2 * N * K * 2
    st = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    print("| M | torch unfused NN (us) | torch TN, W [N, K] (us) | tc (us) | tc config (mt, kw, ring, mfast) | "
          "% copy bw | vs unfused | vs torch TN |")
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for m in ms:
        x = torch.randn(m, K, device="cuda", dtype=torch.float16)
        xd = x.double()
        g = xd @ w1.double().t()
        ref = (g / (1 + torch.exp(-g)) * (xd @ w3.double().t()))
        scale = float(ref.abs().max())
        y = torch.empty(m, N, device="cuda", dtype=torch.float16)

        def unfused():
            return torch.nn.functional.silu(x @ w1kn) * (x @ w3kn)

        def torch_tn():
            return torch.nn.functional.silu(torch.nn.functional.linear(x, w1)) * torch.nn.functional.linear(x, w3)

        errs = {}
        res = {}
        errs["unfused"] = float((unfused().double() - ref).abs().max()) / scale
        errs["tn"] = float((torch_tn().double() - ref).abs().max()) / scale
        res["unfused"] = time_cuda(unfused)
        res["tn"] = time_cuda(torch_tn)
        tcs = []
        for mt, kw, ring, mfast in [tc.config(m)]:
            def f(mt=mt, kw=kw, ring=ring, mfast=mfast):
                tc.launch(st(), m, K, N, x.data_ptr(), w1.data_ptr(), w3.data_ptr(), 0, 0, y.data_ptr(), mt, kw,
                          ring, mfast)
            y.zero_()
            f()
            torch.cuda.synchronize()
            e = float((y.double() - ref).abs().max()) / scale
            if not e < 1e-3:
                print(f"M={m} tc {(mt, kw, ring, mfast)}: max rel error {e:.2e} (FAIL)")
                continue
            tcs.append((time_cuda(f), (mt, kw, ring, mfast), e))
        tcs.sort()
        best = tcs[0]
        print(f"| {m} | {res['unfused']:.1f} | {res['tn']:.1f} | {best[0]:.1f} | {best[1]} | "
              f"{wbytes / best[0] / 1e3 / gbs * 100:.1f} | {res['unfused'] / best[0]:.2f}x | "
              f"{res['tn'] / best[0]:.2f}x |")
        print(f"  errors (max abs / max |ref|): unfused {errs['unfused']:.1e}, torch TN {errs['tn']:.1e}, "
              f"tc {max(e for _, _, e in tcs):.1e}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

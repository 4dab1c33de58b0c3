"""FusedFFN decode on K-major weights ([K, N], attribute weights_kn) against the [N, K] decode kernel and torch, same
run, same GPU: kernel variants (column warps, rows per step, blocks per SM the split count aims at).

    PYTHONPATH=.:benchmarks python3 benchmarks/ffn_kn_gpu.py [--shapes 4096x11008,...] [--ms 1,2] [--variants]
        [--prefill-ms 3,16,64] [--tc-variants]

Times: medians of CUDA-event timings around 20 back-to-back calls (benchmarks/timing.py); weights (>= 180 MB at the
LLaMA shapes) are past the 50 MB L2. Every variant's output is checked against the float64 reference first.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from numba import cuda
from timing import copy_gbps, time_cuda, time_graph

from onnx_lowbit import ffn
from onnx_lowbit.custom_ops import fusedffn_cuda as fc
from onnx_lowbit.custom_ops import fusedffn_kn_cuda as kn
from onnx_lowbit.custom_ops import fusedffn_kn_tc_cuda as kntc
from onnx_lowbit.custom_ops.cuda_launch import current_device, sm_count

VARIANTS = [dict(cw=1, u=4, occ=3, db=False), dict(cw=1, u=4, occ=2, db=False), dict(cw=1, u=4, occ=1, db=False),
            dict(cw=1, u=2, occ=2, db=False), dict(cw=1, u=4, occ=2, db=True), dict(cw=1, u=4, occ=1, db=True),
            dict(cw=1, u=2, occ=1, db=True), dict(cw=1, u=8, occ=1, db=False), dict(cw=2, u=4, occ=1, db=False),
            dict(cw=1, u=2, occ=4, db=True)]


TC_VARIANTS = [(1, 8, 2), (1, 4, 2), (1, 8, 3), (1, 16, 1), (2, 8, 2), (2, 8, 1), (2, 4, 2), (2, 4, 1), (2, 2, 2),
               (4, 8, 1), (4, 4, 1)]


def err_of(y, x, w1t, w3t):
    ref = ffn.swiglu_ref(x.float().cpu().numpy(), w1t.float().cpu().numpy(), w3t.float().cpu().numpy())
    return float(np.abs(y.double().cpu().numpy() - ref).max() / np.abs(ref).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x11008")
    ap.add_argument("--ms", default="1,2")
    ap.add_argument("--variants", action="store_true", help="decode-kernel variants at M <= 2")
    ap.add_argument("--tc-variants", action="store_true", help="tensor-core kernel variants at M >= 2")
    ap.add_argument("--prefill-ms", default="", help="also time both layouts as routed at these M (e.g. 3,16,64)")
    args = ap.parse_args()
    print("GPU:", torch.cuda.get_device_name(0))
    bw, _ = copy_gbps(mib=512)
    print(f"copy: {bw:.0f} GB/s")
    sms = sm_count(current_device())
    nk = fc.FusedFFNCudaKernel(spec=None, attrs={}, node_name="bench", in_types=(10, 10), out_types=(10,))
    knk = fc.FusedFFNCudaKernel(spec=None, attrs={"weights_kn": 1}, node_name="bench", in_types=(10, 10),
                                out_types=(10,))
    cnt = cuda.to_device(np.zeros(kn.TILES_MAX, np.uint32))
    cntp = (cnt.device_ctypes_pointer.value, (kn.TILES_MAX,))
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
            routed_only = m > kn.MAX_M
            x = torch.randn(m, K, device="cuda", dtype=torch.float16)
            y = torch.empty(m, N, device="cuda", dtype=torch.float16)
            rows = []

            def nk_call():
                nk.run(torch.cuda.current_stream().cuda_stream, m, K, N, x.data_ptr(), w1t.data_ptr(),
                       w3t.data_ptr(), 0, 0, y.data_ptr())
            rows.append(("[N, K] as routed (shipped)", nk_call))

            def kn_routed():
                knk.run(torch.cuda.current_stream().cuda_stream, m, K, N, x.data_ptr(), w1.data_ptr(),
                        w3.data_ptr(), 0, 0, y.data_ptr())
            rows.append(("[K, N] as routed (weights_kn = 1)", kn_routed))
            rows.append(("torch, W [K, N]: silu(x @ W1) * (x @ W3)", lambda: F.silu(x @ w1) * (x @ w3)))
            rows.append(("torch, W [N, K]: F.linear", lambda: F.silu(F.linear(x, w1t)) * F.linear(x, w3t)))
            for v in ([] if routed_only else VARIANTS if args.variants else VARIANTS[:1]):
                lau = kn.launcher(kn.bucket(m), True, True, cw=v["cw"], u=v["u"], db=v["db"])
                occ = min(v["occ"], lau.blocks_per_sm(kn.BLOCK, 0))
                geo = kn.geometry(K, N, True, sms, occ, cw=v["cw"], u=v["u"])
                part = torch.empty(max(kn.partial_floats(geo[1], m, N), 1), device="cuda", dtype=torch.float32)

                def kn_call(lau=lau, geo=geo, part=part):
                    kn.launch(lau, torch.cuda.current_stream().cuda_stream, m, K, N, True, x.data_ptr(),
                              w1.data_ptr(), w3.data_ptr(), 0, 0, y.data_ptr(), (part.data_ptr(), part.numel()),
                              cntp, geo)
                rows.append((f"[K, N] split-K cw={v['cw']} u={v['u']} db={int(v['db'])} occ={occ} tiles x splits={geo[0]}x{geo[1]} "
                             f"ks={geo[2]}", kn_call))
            for mt, kw, ring in (TC_VARIANTS if args.tc_variants and m >= 2 else []):
                if m > 8 * mt * 2 or m <= 8 * mt // 2 and mt > 1:
                    continue
                if min(kntc.red_bytes(mt, kw, True), kntc.red_bytes(mt, kw, False)) > kntc.SMEM_MAX:
                    continue                  # the sums do not fit shared memory (_make refuses it)

                def tc_call(mt=mt, kw=kw, ring=ring):
                    kntc.launch(torch.cuda.current_stream().cuda_stream, m, K, N, x.data_ptr(), w1.data_ptr(),
                                w3.data_ptr(), 0, 0, y.data_ptr(), mt, kw, ring)
                rows.append((f"[K, N] tensor-core mt={mt} kw={kw} ring={ring}", tc_call))
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

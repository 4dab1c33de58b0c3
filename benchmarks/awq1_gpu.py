"""MatMulAWQ's M=1 decode kernel with weights cycled past L2 (a pool of >= 128 MB of distinct weights, one per
call, as in a decode step; the older benchmarks reuse one 22.5 MB weight, which partly stays in the 50 MB L2), and
variants of it: words in flight per thread (unroll), column groups per thread (gpt), the register cap. CUDA-graph
medians per call; torch fp16 x @ W on a pool of fp16 weights in the same run; outputs checked against
onnx_lowbit.awq.matmul on the last pool entry.

    PYTHONPATH=/tmp/site:.:benchmarks:tests python3 benchmarks/awq1_gpu.py
"""
from __future__ import annotations

import numpy as np
from ffn4_gpu import regs
from timing import copy_gbps, time_graph

G = 128
POOL_BYTES = 128 << 20
SHAPES = [(4096, 11008), (2048, 2048), (8192, 2048), (2048, 6144)]   # last: q/k/v merged
VARIANTS = [("default", {}),
            # narrower column tiles, more K slices per block (ct column groups x warps slices: ct * warps threads;
            # "warp" is a K slice here, ct = 8 puts 4 slices in one hardware warp, each reading 32 B of its row)
            ("ct 8 x 32", {"ct": 8, "warps": 32}), ("ct 16 x 16", {"ct": 16, "warps": 16}),
            # forced rows per slice (fewer K splits than the plan takes; rows * warps >= K: one split, no partials)
            ("ct 8 x 32, R 64", {"ct": 8, "warps": 32, "rows": 64}),
            ("ct 16 x 16, R 64", {"ct": 16, "warps": 16, "rows": 64})]


def main():
    import torch

    from onnx_lowbit import awq
    from onnx_lowbit.custom_ops import matmulawq_cuda as mc
    from onnx_lowbit.custom_ops.cuda_launch import Launcher, current_device, sm_count
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0))
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    ptr = lambda t: (t.data_ptr(), (t.numel(),))  # noqa: E731
    bw, _ = copy_gbps()
    print(f"device copy 256 MiB: {bw:.0f} GB/s")
    rng = np.random.default_rng(0)
    made = {}       # variant kernels, compiled once for all shapes

    def timed(calls):
        it = iter(range(1 << 30))
        t = time_graph(lambda: calls[next(it) % len(calls)](), batch=len(calls))
        calls[-1]()
        torch.cuda.synchronize()
        return t

    for k, n in SHAPES:
        qw = rng.integers(-2 ** 31, 2 ** 31, (k, n // 8), dtype=np.int64).astype(np.int32)
        qz = rng.integers(-2 ** 31, 2 ** 31, (k // G, n // 8), dtype=np.int64).astype(np.int32)
        sc = (rng.random((k // G, n)) * 0.004 + 0.001).astype(np.float16)
        per = qw.nbytes + qz.nbytes + sc.nbytes
        cnt = max(4, -(-POOL_BYTES // per))
        pool = [tuple(torch.from_numpy(np.ascontiguousarray(np.roll(t, 7 * (cnt - 1 - i), axis=1))).cuda()
                      for t in (qw, qz, sc)) for i in range(cnt)]     # the last entry: the host weights
        x = (torch.randn(1, k, device="cuda") * 0.5).half()
        y = torch.empty(1, n, device="cuda", dtype=torch.float16)
        ref = awq.matmul(x.cpu().numpy(), qw, qz, sc, G, k, n).astype(np.float64)
        wp = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02
              for _ in range(max(4, -(-POOL_BYTES // (k * n * 2))))]
        t_torch = timed([lambda w=w: torch.matmul(x, w, out=y) for w in wp])
        del wp
        print(f"MatMulAWQ M=1 {k}->{n}: torch fp16 {t_torch:.2f} us")
        for label, kw in VARIANTS:
            gpt = kw.get("gpt", mc.gpt_for(1, n))
            if n % (16 * gpt):
                continue
            if not kw:
                lau = mc.launcher(True, 1, gpt)
            elif label in made:
                lau = made[label]
            else:
                fn = mc._make_gemv(1, True, ct=kw.get("ct", mc.CT), warps=kw.get("warps", mc.WARPS),
                                   unroll=kw.get("unroll", mc.UNROLL_M1), gpt=gpt,
                                   max_registers=kw.get("max_registers"))
                lau = Launcher(fn, mc._sig(True, True, gpt))
                lau.dispatcher = fn
                made[label] = lau
            ct, warps = kw.get("ct", mc.CT), kw.get("warps", mc.WARPS)
            block = ct * warps
            occ = max(1, lau.blocks_per_sm(block, 0))
            grid, r, splits = mc.decode_plan(1, k, n, G, sms, occ, ct, warps, gpt=gpt)
            tiles = -(-(n // 8) // (ct * gpt))
            if "rows" in kw:
                r = kw["rows"]
                splits = -(-k // (warps * r))
                grid = tiles * splits
            acc = torch.zeros(splits * n, dtype=torch.float32, device="cuda")
            ctr = torch.zeros(tiles, dtype=torch.int32, device="cuda")

            def call(w, lau=lau, grid=grid, r=r, splits=splits, acc=acc, ctr=ctr, gpt=gpt, block=block):
                qw_, qz_, sc_ = w
                lau.launch(grid, block, stream(), ptr(x), (qw_.data_ptr(), (qw_.numel() // gpt,)),
                           (qz_.data_ptr(), (qz_.numel() // gpt,)), ptr(sc_), ptr(y), ptr(y), ptr(acc), ptr(ctr),
                           1, k, n, G, r, splits, 0)
            try:
                t = timed([lambda w=w: call(w) for w in pool])
            except Exception as e:  # noqa: BLE001
                print(f"  {label}: FAILED {type(e).__name__}: {e}")
                continue
            err = float(np.max(np.abs(y.float().cpu().numpy().astype(np.float64) - ref)) / np.max(np.abs(ref)))
            gbs = per / t / 1e3
            print(f"  {label:22s} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy {t_torch / t:5.2f}x torch "
                  f"rel {err:.1e} [{grid} blocks, R={r}, {splits} splits, {occ}/SM, {regs(lau)}]", flush=True)


if __name__ == "__main__":
    main()

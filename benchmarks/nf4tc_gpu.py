"""NF4 tensor-core decode kernel (custom_ops/nf4/nf4tc_cuda.py) against the kernels sessions use today, same run, H100:
  fused  FusedFFNNF4 (gate+up + SiLU*mul): nf4tc nw=2 vs what a session node runs at that M
  matmul MatMulNF4 (one weight): nf4tc nw=1 vs what a session node runs at that M
("session kernel": the op's CUDA kernel object called as the bridge calls it, custom_ops.runtime.direct, so its
launch is the session's own choice at that M, the row its ROUTES table picks: decode kernels, groups, two-buffer
loop, two-row decode, tensor cores)
Shape: LLaMA-7B gate/up (4096 -> 11008), fused M = 1, 2, 3, 4, 8, 16, matmul M = 1, 2, 4, 16. NF4 block 64, random
bytes/absmax, x fp16. CUDA-graph medians (benchmarks/timing.py) over calls that cycle through a pool of distinct
weights (>= 128 MB in all, past the 50 MB L2, as layer after layer of a decode step; before 2026-11-26 session 26 one
weight was reused, so part of it came from L2); every output checked against the CPU face on the first pool entry.
GB/s counts the packed weight bytes + absmax.
    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/nf4tc_gpu.py [--quick] [--variants 8,4:2]
        [--fused-ms 12,16] [--matmul-ms 12,16] [--halves]
(a variant is warps[:rc], rc = row chunks of 8 per block; default the kernel's row_chunks(M); CPL chunks per batch
and ptxas's register choice, the only ones sessions run since the options went: docs/lab-log.md, "Removed kernel
variants (NF4)")
"""
from __future__ import annotations

import argparse

import numpy as np
from ffn4_gpu import rel
from timing import copy_gbps, time_graph

BS = 64
POOL_BYTES = 128 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="LLaMA-7B only (fused M=1, 4; matmul M=1)")
    ap.add_argument("--variants", default="8", help="tensor-core kernel variants warps[:rc]")
    ap.add_argument("--fused-ms", help="FusedFFNNF4 cases at these M (default 1, 2, 3, 4, 8, 16)")
    ap.add_argument("--matmul-ms", help="MatMulNF4 cases at these M (default 1, 2, 4, 16)")
    ap.add_argument("--halves", action="store_true", help="MatMulNF4 cases also through the two-weight kernel on the "
                    "weight's two halves (MatMulNF4 routes there from nf4tc_cuda.HALVES_MIN_M rows)")
    a = ap.parse_args()
    import torch

    from onnx_lowbit.custom_ops.device.launch import current_device, sm_count
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cpu
    from onnx_lowbit.custom_ops.nf4 import common as nf4_common, matmulnf4_cpu, nf4tc_cuda as tc
    from onnx_lowbit.custom_ops.runtime import direct
    print("GPU:", torch.cuda.get_device_name(0))
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    print(f"device copy 256 MiB: {copy_gbps()[0]:.0f} GB/s")
    code = nf4_common.parse_attrs({"quant_type": "nf4", "block_size": BS, "K": 64, "N": 64})[4]
    td = lambda v: torch.from_numpy(np.ascontiguousarray(v)).cuda()  # noqa: E731
    ptr = lambda t, n=None: (t.data_ptr(), (t.numel() if n is None else n,))  # noqa: E731
    dlut = td(tc.lut(code).view(np.int32))
    rng = np.random.default_rng(0)
    variants = [tuple(int(v) for v in t.split(":")) for t in a.variants.split(",")]
    fms = [int(v) for v in a.fused_ms.split(",")] if a.fused_ms else [1, 2, 3, 4, 8, 16]
    mms = [int(v) for v in a.matmul_ms.split(",")] if a.matmul_ms else [1, 2, 4, 16]
    cases = [("fused", 4096, 11008, 1), ("fused", 4096, 11008, 4), ("matmul", 4096, 11008, 1)] if a.quick else [
        ("fused", 4096, 11008, m) for m in fms] + [("matmul", 4096, 11008, m) for m in mms]
    ws = {}
    for kind, K, N, m in cases:  # noqa: N806
        nw = 2 if kind == "fused" else 1
        if (K, N) not in ws:
            ws[(K, N)] = [(rng.integers(0, 256, K * N // 2, dtype=np.uint8),
                           (rng.random(K * N // BS) * 0.1 + 0.01).astype(np.float32)) for _ in range(2)]
        w = ws[(K, N)][:nw]
        dw = [(td(q), td(am)) for q, am in w]
        cnt = max(3, -(-POOL_BYTES // (nw * (K * N // 2 + K * N // BS * 4))))
        pool = [dw] + [[(torch.roll(q, 977 * i), torch.roll(am, 31 * i)) for q, am in dw] for i in range(1, cnt)]
        x = (torch.randn(m, K, device="cuda") + 0.2).half()
        xa = x.cpu().numpy().astype(np.float32)
        if nw == 2:
            ref = fusedffnnf4_cpu.swiglu(xa, *w[0], *w[1], code, K, N, BS).astype(np.float64)
        else:
            ref = matmulnf4_cpu.matmul(xa, *w[0], code, K, N, BS).astype(np.float64)
        wbytes = nw * (K * N // 2 + K * N // BS * 4)
        out = torch.empty(m, N, device="cuda", dtype=torch.float16)
        y3 = torch.empty_like(out)

        def rec(name, fns):
            """fns: one launch per pool entry (the first on the host weights), cycled in the timed graph."""
            it = iter(range(1 << 30))
            try:
                tg = time_graph(lambda: fns[next(it) % len(fns)](), batch=len(fns) * max(1, 20 // len(fns)))
                fns[0]()
                torch.cuda.synchronize()
                err = rel(out.float().cpu().numpy(), ref)
                out.zero_()
                print(f"{kind:6s} K={K:5d} N={N:5d} M={m:2d} {name:44s} {tg:7.1f} us {wbytes / tg / 1e3:6.0f} GB/s"
                      f"  err {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{kind} K={K} N={N} M={m} {name}: FAILED {type(e).__name__}: {e}", flush=True)

        for (warps, *rc), halves in [(v, h) for v in variants
                                     for h in ((False, True) if a.halves and nw == 1 else (False,))]:
            rc = rc[0] if rc else tc.row_chunks(m)
            if rc == 2 and m <= 8:
                continue
            lau = tc.launcher(2 if halves else nw, warps, rc, halves)
            occ = max(1, lau.blocks_per_sm(32 * warps))
            nch = tc.chunks(m, rc)
            # halves: the weight's two halves of rows as W1 / W3, N / 2 rows each
            nd, wq, wa = tc.half_sizes(N, K, BS) if halves else (N, K * N // 16, K * N // BS)
            parts = tc.parts_for(nd, nch, sms, occ)

            def w3(d, wq=wq, wa=wa, halves=halves):
                if halves:
                    return (d[0][0].data_ptr() + 8 * wq, (wq,)), (d[0][1].data_ptr() + 4 * wa, (wa,))
                return ptr(d[-1][0], wq), ptr(d[-1][1], wa)
            fns = [lambda lau=lau, g=nch * parts, b=32 * warps, d=d, p=parts, nd=nd, wq=wq, wa=wa, w3=w3: lau.launch(
                g, b, stream(), ptr(x, m * K // 4), ptr(d[0][0], wq), ptr(d[0][1], wa), *w3(d), ptr(dlut), ptr(out),
                ptr(out), ptr(out), m, K, nd, BS.bit_length() - 1, p, 0, 0) for d in pool]
            r = lau.dispatcher.get_regs_per_thread()
            r = list(r.values())[0] if isinstance(r, dict) else r
            rec(f"tc w={warps} rc={rc} {r}r ({occ}/SM){' halves' if halves else ''}", fns)
        # what a session node runs at this M (custom_ops.runtime.direct: the op's kernel object and its per-call choice)
        op = "FusedFFNNF4" if nw == 2 else "MatMulNF4"
        attrs = {"quant_type": "nf4", "block_size": BS, "K": K, "N": N}
        rec(f"session kernel ({op})", [direct.call(op, attrs, [x] + [t for qa in d for t in qa], [out], stream)
                                       for d in pool])
        del y3, pool


if __name__ == "__main__":
    main()

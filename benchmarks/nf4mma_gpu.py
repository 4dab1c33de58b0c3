"""The balanced NF4 tensor-core GEMV (custom_ops/nf4mma_cuda.py) against the kernels sessions use today and torch
fp16, same run: MatMulNF4 (one weight) and FusedFFNNF4 (gate+up + SiLU*mul) at the decode sample's and LLaMA-7B's
shapes, M = 1 (and 2, 4 at 4096 -> 11008).

Method as benchmarks/nf4shapes_gpu.py: every case cycles through a pool of distinct weights (>= 128 MB in all,
more than the 50 MB L2), one per call, as a decode step does layer after layer; CUDA-graph medians per call; torch
fp16 on a pool of fp16 weights and a 256 MiB device copy in the same run; every output checked against the CPU
face on the last pool entry. GB/s counts packed weight bytes + fp32 absmax.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/nf4mma_gpu.py [--quick] [--variants 8:0,4:0,16:0]
"""
from __future__ import annotations

import argparse

import numpy as np
from ffn4_gpu import regs, rel
from timing import copy_gbps, time_graph

BS = 64
POOL_BYTES = 128 << 20
CASES = [("mm", 1, 4096, 11008), ("ffn", 1, 4096, 11008), ("mm", 1, 2048, 2048), ("mm", 1, 8192, 2048),
         ("mm", 1, 2048, 6144), ("mm", 1, 2048, 4096), ("ffn", 1, 2048, 8192), ("ffn", 2, 4096, 11008),
         ("ffn", 3, 4096, 11008), ("ffn", 4, 4096, 11008), ("ffn", 3, 2048, 8192), ("ffn", 4, 2048, 8192),
         ("mm", 2, 4096, 11008), ("mm", 4, 4096, 11008), ("ffn", 8, 4096, 11008), ("ffn", 16, 4096, 11008)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4096 -> 11008 at M = 1 only")
    ap.add_argument("--ms", default="", help="only these M (comma list)")
    ap.add_argument("--variants", default="8:0:1,8:0:2,4:0:1",
                    help="nf4mma variants warps:maxreg:depth (maxreg 0: ptxas's choice)")
    ap.add_argument("--occ", default="0", help="blocks per SM to plan with, comma list (0: the occupancy query)")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F  # noqa: N812

    from onnx_lowbit.custom_ops import (fusedffnnf4_cpu, fusedffnnf4_cuda, matmulnf4_cpu, matmulnf4_cuda, nf4_common,
                                        nf4mma_cuda, nf4tc_cuda)
    from onnx_lowbit.custom_ops.cuda_launch import current_device, sm_count
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0))
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    ptr = lambda t, n=None: (t.data_ptr(), (t.numel() if n is None else n,))  # noqa: E731
    bw, t_copy = copy_gbps()
    print(f"device copy 256 MiB: {t_copy:.1f} us = {bw:.0f} GB/s")
    rng = np.random.default_rng(0)
    code = nf4_common.parse_attrs({"quant_type": "nf4", "block_size": BS, "K": 64, "N": 1})[4]
    td = lambda v: torch.from_numpy(np.ascontiguousarray(v)).cuda()  # noqa: E731
    dcode = td(code)
    tclut = td(nf4tc_cuda.lut(code).view(np.int32))
    variants = [tuple(int(v) for v in s.split(":")) for s in a.variants.split(",")]
    occs = [int(v) for v in a.occ.split(",")]
    cases = [c for c in CASES if not a.quick or (c[1] == 1 and c[2:] == (4096, 11008))]
    if a.ms:
        cases = [c for c in cases if c[1] in {int(v) for v in a.ms.split(",")}]
    best = {}

    def pool_of(k, n, nw):
        per = nw * (k * n // 2 + k * n // BS * 4)
        cnt = max(4, -(-POOL_BYTES // per))
        host = [(rng.integers(0, 256, k * n // 2, dtype=np.uint8),
                 (rng.random(k * n // BS) * 0.1 + 0.01).astype(np.float32)) for _ in range(nw)]
        dev = []
        for i in range(cnt):
            ws = host if i == cnt - 1 else [(np.roll(q, 977 * (i + 1)), np.roll(am, 31 * (i + 1))) for q, am in host]
            dev.append([(td(q), td(am)) for q, am in ws])
        return host, dev

    def timed(calls):
        it = iter(range(1 << 30))

        def fn():
            calls[next(it) % len(calls)]()
        t = time_graph(fn, batch=len(calls))
        calls[-1]()
        torch.cuda.synchronize()
        return t

    for kind, m, k, n in cases:
        nw = 2 if kind == "ffn" else 1
        case = f"{'FusedFFNNF4' if nw == 2 else 'MatMulNF4'} M={m} {k}->{'2x' if nw == 2 else ''}{n}"
        host, dev = pool_of(k, n, nw)
        x = (torch.randn(m, k, device="cuda") * 0.5).half()
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        xa = x.float().cpu().numpy()
        if nw == 2:
            ref = fusedffnnf4_cpu.swiglu(xa, *host[0], *host[1], code, k, n, BS).astype(np.float64)
        else:
            ref = matmulnf4_cpu.matmul(xa, *host[0], code, k, n, BS).astype(np.float64)
        nbytes = nw * (k * n // 2 + k * n // BS * 4)
        # torch fp16 anchor
        wp = [[torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02 for _ in range(nw)]
              for _ in range(max(4, -(-POOL_BYTES // (nw * k * n * 2))))]
        g = torch.empty(m, n, device="cuda", dtype=torch.float16)
        u = torch.empty_like(g)

        def tcall(w):
            if nw == 1:
                torch.matmul(x, w[0], out=y)
            else:
                torch.matmul(x, w[0], out=g)
                torch.matmul(x, w[1], out=u)
                torch.mul(F.silu(g), u, out=y)
        t_torch = timed([lambda w=w: tcall(w) for w in wp])
        del wp
        print(f"{case:30s} {'torch fp16':34s} {t_torch:7.2f} us", flush=True)

        def report(label, t, extra=""):
            err = rel(y.float().cpu().numpy(), ref)
            y.zero_()
            gbs = nbytes / t / 1e3
            print(f"{case:30s} {label:34s} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy "
                  f"{t_torch / t:5.2f}x torch  rel {err:.1e} {extra}", flush=True)
            if err < 4e-3 and (case not in best or t < best[case][1]):
                best[case] = (label, t, 100 * gbs / bw, t_torch / t)

        # today's kernel
        try:
            if nw == 1 and m == 1 and matmulnf4_cuda.m1_path(m, k):
                pair = matmulnf4_cuda.m1_pair(k)
                lau = matmulnf4_cuda._launcher("m1", np.float16, pair)
                grid, block = matmulnf4_cuda.m1_grid(n, sms, k), matmulnf4_cuda.m1_block(k)
                shm = matmulnf4_cuda.TAB_BYTES if pair else 0
                calls = [lambda q=q, am=am: lau.launch(grid, block, stream(), ptr(x), ptr(q, k * n // 16), ptr(am),
                                                        ptr(dcode), ptr(y), 0, ptr(y), k, n, BS.bit_length() - 5,
                                                        shmem=shm) for ((q, am),) in dev]
                report("today: M=1 decode kernel", timed(calls), f"[{grid} x {block}]")
            elif nw == 2 and m < fusedffnnf4_cuda.TC_MIN_M:
                mt = fusedffnnf4_cuda.bucket(m)
                pair = fusedffnnf4_cuda.PAIR[mt]
                lau = fusedffnnf4_cuda.launcher(True, mt)
                block = fusedffnnf4_cuda.threads(k)
                occ = fusedffnnf4_cuda.blocks_per_sm(lau, block)
                parts = fusedffnnf4_cuda.parts_for(n, 1, sms, occ)
                lt = td(fusedffnnf4_cuda.lut_for(code, pair).view(np.int64 if pair else np.int32))
                calls = [lambda w=w: lau.launch(-(-m // mt) * parts, block, stream(), ptr(x), ptr(w[0][0], k * n // 16),
                                                ptr(w[0][1]), ptr(w[1][0], k * n // 16), ptr(w[1][1]), ptr(lt), ptr(y),
                                                ptr(y), ptr(y), m, k, n, BS.bit_length() - 5, parts, 0, 0)
                         for w in dev]
                report("today: decode kernel", timed(calls), f"[{parts} x {block}, {occ}/SM]")
            else:
                lau = nf4tc_cuda.launcher(nw)
                occ = max(1, lau.blocks_per_sm(32 * nf4tc_cuda.WARPS))
                nch = nf4tc_cuda.chunks(m)
                parts = nf4tc_cuda.parts_for(n, nch, sms, occ)
                calls = [lambda w=w: lau.launch(nch * parts, 32 * nf4tc_cuda.WARPS, stream(), ptr(x, m * k // 4),
                                                ptr(w[0][0], k * n // 16), ptr(w[0][1]), ptr(w[-1][0], k * n // 16),
                                                ptr(w[-1][1]), ptr(tclut), ptr(y), ptr(y), ptr(y), m, k, n,
                                                BS.bit_length() - 1, parts, 0, 0) for w in dev]
                report("today: nf4tc", timed(calls), f"[{nch * parts} x {32 * nf4tc_cuda.WARPS}]")
        except Exception as e:  # noqa: BLE001
            print(f"{case}: today's kernel FAILED {type(e).__name__}: {e}", flush=True)
        # the balanced tensor-core kernel
        mm = nf4mma_cuda.mm_for(m)
        for warps, maxreg, depth in (variants if m <= nf4mma_cuda.MAX_M else []):
            for occ_req in occs:
                try:
                    lau = nf4mma_cuda.launcher(nw, mm, warps, maxreg or None, depth)
                    shm = nf4mma_cuda.shared_bytes(nw, mm, warps)
                    occ = occ_req or max(1, lau.blocks_per_sm(32 * warps, shm))
                    nblk = nf4mma_cuda.plan_blocks(k, n, sms, occ)
                    pf, nc = nf4mma_cuda.scratch(nw, mm, nblk, k, n)
                    part = torch.empty(max(pf, 1), device="cuda", dtype=torch.float32)
                    cnt = torch.zeros(nc, device="cuda", dtype=torch.int32)
                    calls = [lambda w=w: lau.launch(nblk, 32 * warps, stream(), ptr(x, m * k // 2),
                                                    ptr(w[0][0], k * n // 8), ptr(w[0][1]), ptr(w[-1][0], k * n // 8),
                                                    ptr(w[-1][1]), ptr(tclut), ptr(y), ptr(y), ptr(y), ptr(part),
                                                    ptr(cnt), m, k, n, BS.bit_length() - 1, nblk, 0, 0,
                                                    shmem=shm)
                             for w in dev]
                    t = timed(calls)
                    assert int(cnt.abs().sum()) == 0, "counters not left at zero"
                    report(f"nf4mma w{warps} r{maxreg} d{depth} occ{occ}", t, f"[{nblk} x {32 * warps}, {regs(lau)}]")
                except Exception as e:  # noqa: BLE001
                    print(f"{case}: nf4mma w{warps} r{maxreg} d{depth} FAILED {type(e).__name__}: {e}", flush=True)
        del dev
        torch.cuda.empty_cache()
    print("\nbest per case:")
    for case, (label, t, pct, vs) in best.items():
        print(f"  {case:30s} {label:34s} {t:7.2f} us ({pct:.1f}% copy, {vs:.2f}x torch)")


if __name__ == "__main__":
    main()

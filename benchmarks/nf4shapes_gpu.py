"""NF4 M=1 kernels at the shapes of the LLaMA-style decode sample (d=2048, h=8192, vocab 4096) and of LLaMA-7B,
with the decode generator's variants: MatMulNF4's M=1 kernel (q/k/v/o 2048x2048, down 8192->2048, lm_head
2048->4096, 4096x11008) and FusedFFNNF4's decode kernel (gate+up 2048->8192, 4096->11008).

Each case cycles through a pool of distinct weights (>= 128 MB in all, more than the 50 MB L2), one per call, as a
decode step does layer after layer; times are CUDA-graph medians per call (the graph holds one call per pool
entry). Anchor in the same run: torch fp16 (x @ W; for the FFN x @ W1, x @ W3, silu * mul) on a pool of fp16
weights, and a 256 MiB device copy. Every variant's output is checked against the CPU face on the last pool entry.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/nf4shapes_gpu.py [--quick]
    ... --mm-only 4096x11008 --mm-m 2      MatMulNF4 at M = 2: the tensor-core kernel (nf4tc) against the
                                           two-row decode kernel (matmulnf4_cuda.M2_DECODE; sessions take it at
                                           M = 2..4)
"""
from __future__ import annotations

import argparse

import numpy as np
from ffn4_gpu import regs, rel
from timing import copy_gbps, time_graph

BS = 64
POOL_BYTES = 128 << 20
MM_SHAPES = [(2048, 2048), (8192, 2048), (2048, 4096), (4096, 11008), (2048, 6144)]   # last: q/k/v merged
FFN_SHAPES = [(1, 2048, 8192), (1, 4096, 11008), (2, 2048, 8192), (2, 4096, 11008)]
# (label, _make_m1 keywords); grid = one wave at the variant's occupancy
MM_VARIANTS = [("pair c8 (was default)", {"COLS": 8, "prefetch": False, "pair": True}),
               ("tab16 c4 prefetch (default)", {}),
               ("tab16 c4 prefetch uneven", {}),
               ("tab16 c8 prefetch", {"COLS": 8}),
               ("pair c4 prefetch", {"COLS": 4, "prefetch": True, "pair": True}),
               ("pair c4 prefetch early", {"COLS": 4, "prefetch": True, "early": True, "pair": True}),
               ("tab16 c8", {"COLS": 8, "prefetch": False}),
               ("tab16 c2 prefetch", {"COLS": 2}),
               ("tab16 nib c4 prefetch", {"nib": True}),
               ("tab16 nib c8 prefetch", {"COLS": 8, "nib": True}),
               ("h2 chain2 c4 (fp16 default from K 4096)", {"h2": 2}),
               ("h2 chain4 c4", {"h2": 4}),
               ("h2 chain2 c4 wide", {"h2": 2, "wide": True}),
               ("h2 chain2 c8", {"h2": 2, "COLS": 8}),
               ("h2 chain2 c4 g3", {"h2": 2, "groups": 3}),
               ("h2 chain2 c4 g2", {"h2": 2, "groups": 2}),
               ("h2 chain4 c4 wide", {"h2": 4, "wide": True}),
               ("h2 chain4 c4 wide g3", {"h2": 4, "wide": True, "groups": 3})]
FFN_VARIANTS = [("pair c4 prefetch (M=1: older default)", {}),
                ("pair c4 prefetch early (M=2: default below K 4096)", {"early": True}),
                ("pair c2 prefetch early", {"cols": 2, "early": True}),
                ("tab16 c4 prefetch (M=1: was default)", {"pair": False, "nib": False}),
                ("tab16 c2 prefetch", {"pair": False, "cols": 2}),
                ("tab16 c4 no prefetch", {"pair": False, "prefetch": False}),
                ("tab16 nib c4 prefetch (M=1: fp32 decode default)", {"pair": False, "nib": True}),
                ("tab16 nib c2 prefetch", {"pair": False, "nib": True, "cols": 2}),
                ("h2 chain2 c4 (M=1: fp16 default below K 4096)", {"h2": 2}),
                ("h2 chain2 c8", {"h2": 2, "cols": 8}),
                ("h2 chain2 c4 pingpong", {"h2": 2, "pingpong": True}),
                ("h2 chain2 c8 early", {"h2": 2, "cols": 8, "early": True}),
                ("h2 chain4 c4", {"h2": 4}),
                ("h2 chain4 c8", {"h2": 4, "cols": 8}),
                ("h2 chain2 c4 early", {"h2": 2, "early": True}),
                ("h2 chain4 c4 pingpong", {"h2": 4, "pingpong": True}),
                ("h2 chain2 c8 pingpong", {"h2": 2, "cols": 8, "pingpong": True}),
                ("h2 chain2 c2", {"h2": 2, "cols": 2}),
                ("h2 chain2 c4 wide", {"h2": 2, "wide": True}),
                ("h2 chain2 c2 wide", {"h2": 2, "cols": 2, "wide": True}),
                ("h2 chain2 c8 wide", {"h2": 2, "cols": 8, "wide": True}),
                ("h2 chain4 c4 wide (fp16 default from K 4096)", {"h2": 4, "wide": True}),
                ("h2 chain4 c4 wide 4-byte table stores", {"h2": 4, "wide": True, "vec_table": False}),
                ("h2 chain4 c4 wide early", {"h2": 4, "wide": True, "early": True}),
                ("h2 chain4 c4 wide am16 (fp16 absmax)", {"h2": 4, "wide": True, "am16": True}),
                ("h2 chain4 c4 wide early am16", {"h2": 4, "wide": True, "early": True, "am16": True}),
                ("h2 chain2 c4 wide pingpong", {"h2": 2, "wide": True, "pingpong": True}),
                ("h2 chain2 c4 wide early", {"h2": 2, "wide": True, "early": True}),
                ("h2 chain4 c4 wide pingpong", {"h2": 4, "wide": True, "pingpong": True}),
                ("h2 chain4 c4 wide pingpong early", {"h2": 4, "wide": True, "pingpong": True, "early": True}),
                ("h2 chain4 c2 wide", {"h2": 4, "wide": True, "cols": 2}),
                ("h2 chain4 c2 wide pingpong", {"h2": 4, "wide": True, "cols": 2, "pingpong": True}),
                ("h2 chain4 c8 wide", {"h2": 4, "wide": True, "cols": 8}),
                ("h2 chain4 c8 wide pingpong", {"h2": 4, "wide": True, "cols": 8, "pingpong": True}),
                ("h2 chain4 c4 wide pingpong g2", {"h2": 4, "wide": True, "pingpong": True, "groups": 2}),
                ("h2 chain4 c4 wide pingpong g3", {"h2": 4, "wide": True, "pingpong": True, "groups": 3}),
                ("h2 chain4 c4 wide pingpong g4", {"h2": 4, "wide": True, "pingpong": True, "groups": 4}),
                ("h2 chain4 c4 wide g2", {"h2": 4, "wide": True, "groups": 2}),
                ("h2 chain4 c8 wide pingpong g2", {"h2": 4, "wide": True, "cols": 8, "pingpong": True, "groups": 2})]
# the warp-column kernel (nf4warp_cuda; FusedFFNNF4 at M=1, 2, MatMulNF4 at M=1): (label, warps per block, ptxas
# register limit, warps per column (split: 2 = a pair of warps on halves of K, meeting at a named barrier), the
# table built with 16-byte stores (half2.VEC_TABLE; False: 4-byte stores))
WC_VARIANTS = [("warpcols 6w r168", 6, 168, 1, True), ("warpcols 6w r168 4-byte table stores", 6, 168, 1, False),
               ("warpcols 4w r168", 4, 168, 1, True), ("warpcols 8w r168 (M=1 default at K 2048)", 8, 168, 1, True),
               ("warpcols 8w r168 4-byte table stores", 8, 168, 1, False), ("warpcols 4w", 4, None, 1, True),
               ("warpcols 8w", 8, None, 1, True), ("warpcols 12w r168", 12, 168, 1, True),
               ("warpcols 8w r128", 8, 128, 1, True),
               ("warpcols split2 8w r168 (M=2 default at K 2048)", 8, 168, 2, True),
               ("warpcols split2 8w r168 4-byte table stores", 8, 168, 2, False),
               ("warpcols split2 4w r168", 4, 168, 2, True), ("warpcols split2 6w r168", 6, 168, 2, True),
               ("warpcols split2 12w r168", 12, 168, 2, True), ("warpcols split2 16w r128", 16, 128, 2, True),
               ("warpcols split2 8w r128", 8, 128, 2, True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="defaults and the tab16 variants only")
    ap.add_argument("--mm-only", metavar="KxN,...",
                    help="only these MatMulNF4 shapes (e.g. 2048x6144,2048x2048), no FFN cases")
    ap.add_argument("--ffn-only", action="store_true", help="only the FusedFFNNF4 cases")
    ap.add_argument("--only", metavar="S1,S2", help="only the variants whose label holds one of these strings (=S: "
                    "is S; separated by ';' when a label has a comma)")
    ap.add_argument("--ffn-ms", metavar="M1,M2", help="only the FusedFFNNF4 cases at these M")
    ap.add_argument("--ffn-k", metavar="K1,K2", help="only the FusedFFNNF4 cases at these K")
    ap.add_argument("--ffn-shapes", metavar="MxKxN,...", help="these FusedFFNNF4 cases instead (e.g. 1x3072x8192)")
    ap.add_argument("--mm-m", type=int, default=1, metavar="M",
                    help="MatMulNF4 cases at this M (> 1: the tensor-core kernel, nf4tc, against the two-row decode "
                         "kernel, matmulnf4_cuda.gemv_m2, instead of the M = 1 variants)")
    ap.add_argument("--rounds", type=int, default=1, help="time the FusedFFNNF4 block-kernel variants this many "
                    "times, in turn (round by round), to see the run-to-run spread against the differences")
    a = ap.parse_args()
    mm_shapes, ffn_shapes = MM_SHAPES, FFN_SHAPES
    if a.ffn_only:
        mm_shapes = []
    if a.ffn_shapes:
        ffn_shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.ffn_shapes.lower().split(",")]
    if a.ffn_ms:
        ffn_shapes = [c for c in ffn_shapes if str(c[0]) in a.ffn_ms.split(",")]
    if a.ffn_k:
        ffn_shapes = [c for c in ffn_shapes if str(c[1]) in a.ffn_k.split(",")]
    keep = (lambda label: any(label == t[1:] if t.startswith("=") else t in label  # noqa: E731
                              for t in a.only.split(";" if ";" in a.only else ","))) if a.only else (lambda label: True)
    if a.mm_only:
        mm_shapes, ffn_shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.mm_only.lower().split(",")], []
    import torch
    import torch.nn.functional as F  # noqa: N812

    from onnx_lowbit.custom_ops import (fusedffnnf4_cpu, fusedffnnf4_cuda, half2, matmulnf4_cpu, matmulnf4_cuda,
                                        nf4_common, nf4warp_cuda)
    from onnx_lowbit.custom_ops.cuda_launch import Array, Launcher, current_device, sm_count
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0))
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    ptr = lambda t, n=None: (t.data_ptr(), (t.numel() if n is None else n,))  # noqa: E731
    bw, t_copy = copy_gbps()
    print(f"device copy 256 MiB: {t_copy:.1f} us = {bw:.0f} GB/s")
    rng = np.random.default_rng(0)
    code = nf4_common.parse_attrs({"quant_type": "nf4", "block_size": BS, "K": 64, "N": 1})[4]
    dcode = torch.from_numpy(half2.code_with_scale(code)).cuda()     # the h2 kernels read entries 16, 17
    nlut = torch.from_numpy(fusedffnnf4_cuda.lut_for(code, True).view(np.int64)).cuda()
    nlut32 = torch.from_numpy(fusedffnnf4_cuda.lut_for(code, False).view(np.int32)).cuda()
    nlut16 = torch.from_numpy(fusedffnnf4_cuda.lut_for(code, False, h2=True).view(np.int32)).cuda()
    mm_sig = [Array(np.float16), Array(np.uint64), Array(np.float32), Array(np.float32), Array(np.float16), "int32",
              Array(np.float16), "int64", "int64", "int64"]
    rows = []

    def pool_of(k, n, nw):
        """Distinct NF4 weights (bytes, absmax) on the device, >= POOL_BYTES in all; the last one also on the host."""
        per = nw * (k * n // 2 + k * n // BS * 4)
        cnt = max(4, -(-POOL_BYTES // per))
        host = [(rng.integers(0, 256, k * n // 2, dtype=np.uint8),
                 (rng.random(k * n // BS) * 0.1 + 0.01).astype(np.float32)) for _ in range(nw)]
        dev = []
        for i in range(cnt):
            if i == cnt - 1:
                ws = host
            else:   # cheap distinct bytes: a device-side permutation of the host weights
                ws = [(np.roll(q, 977 * (i + 1)), np.roll(am, 31 * (i + 1))) for q, am in host]
            dev.append([(torch.from_numpy(q).cuda(), torch.from_numpy(am).cuda()) for q, am in ws])
        return host, dev

    def timed(label, calls, check):
        """calls: one closure per pool entry (the last one on the host weights); graph median per call, then the
        last entry's output checked."""
        it = iter(range(1 << 30))

        def fn():
            calls[next(it) % len(calls)]()
        t = time_graph(fn, batch=len(calls))
        calls[-1]()
        torch.cuda.synchronize()
        err = check() if check else None
        return t, err

    def report(case, label, t, nbytes, t_torch, err, extra=""):
        gbs = nbytes / t / 1e3
        rows.append((case, label, t, 100 * gbs / bw, t_torch / t, err))
        print(f"{case:28s} {label:30s} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy  "
              f"{t_torch / t:5.2f}x torch  rel {err:.1e} {extra}", flush=True)

    m = a.mm_m
    for k, n in mm_shapes:
        case = f"MatMulNF4 M={m} {k}->{n}"
        host, dev = pool_of(k, n, 1)
        x = (torch.randn(m, k, device="cuda") * 0.5).half()
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ref = matmulnf4_cpu.matmul(x.float().cpu().numpy(), host[0][0], host[0][1], code, k, n, BS).astype(np.float64)
        wp = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02
              for _ in range(max(4, -(-POOL_BYTES // (k * n * 2))))]
        t_torch, _ = timed("torch", [lambda w=w: torch.matmul(x, w, out=y) for w in wp], None)
        del wp
        print(f"{case:28s} {'torch fp16':30s} {t_torch:7.2f} us {k * n * 2 / t_torch / 1e3:6.0f} GB/s")
        nbytes = k * n // 2 + k * n // BS * 4
        check = lambda: rel(y.float().cpu().numpy(), ref)  # noqa: E731
        if m > 1:   # the tensor-core kernel against the two-row decode
            if keep("tensor-core"):     # nf4tc as MatMulNF4CudaKernel.compute launches it (sessions: M > M2_MAX_M)
                from onnx_lowbit.custom_ops import nf4tc_cuda
                sk = nf4tc_cuda.SessionKernels(1, n, sms, k, BS)
                lau, grid, block, parts, halves = sk.pick(m)
                tlut = torch.from_numpy(nf4tc_cuda.lut(code).view(np.int32)).cuda()
                nw_, na_ = nf4tc_cuda.half_sizes(n, k, BS)[1:] if halves else (k * n // 16, k * n // BS)
                nd = n // 2 if halves else n

                def tc(q, am, lau=lau, grid=grid, block=block, parts=parts, halves=halves, nw_=nw_, na_=na_, nd=nd):
                    w1 = ((q.data_ptr(), (nw_,)), (am.data_ptr(), (na_,)))
                    w3 = ((q.data_ptr() + 8 * nw_, (nw_,)), (am.data_ptr() + 4 * na_, (na_,))) if halves else w1
                    lau.launch(grid, block, stream(), (x.data_ptr(), (m * k // 4,)), *w1, *w3, ptr(tlut),
                               (y.data_ptr(), (nd,)), (y.data_ptr(), (nd,)), ptr(y), m, k, nd, BS.bit_length() - 1,
                               parts, 0, 0)
                t, err = timed("tc", [lambda q=q, am=am: tc(q, am) for ((q, am),) in dev], check)
                report(case, "tensor-core (nf4tc)", t, nbytes, t_torch, err, f"[{grid} x {block}, halves {halves}]")
            if keep("two-row decode"):
                lau = matmulnf4_cuda._launcher("m2", np.float16)
                lau.dispatcher = matmulnf4_cuda.gemv_m2()     # for its register count
                block = matmulnf4_cuda.m1_block(k, True)
                occ = max(1, lau.blocks_per_sm(block))
                grid = matmulnf4_cuda.m2_grid(m, n, sms, occ)
                calls = [lambda q=q, am=am: lau.launch(grid, block, stream(), ptr(x), ptr(q, k * n // 16), ptr(am),
                                                        ptr(dcode), ptr(y), 0, ptr(y), m, k, n, BS.bit_length() - 5,
                                                        shmem=matmulnf4_cuda.TAB_BYTES)
                         for ((q, am),) in dev]
                t, err = timed("m2", calls, check)
                report(case, "two-row decode (M2_DECODE)", t, nbytes, t_torch, err,
                       f"[{grid} x {block}, {occ}/SM, {regs(lau)}]")
            continue
        for label, kw in MM_VARIANTS:
            if a.quick and "default" not in label and "nib" not in label or not keep(label):
                continue
            pair = kw.get("pair", matmulnf4_cuda.M1_PAIR) or bool(kw.get("h2"))     # 64 KiB of table
            cols = kw.get("COLS", matmulnf4_cuda.M1_COLS)
            fn_ = matmulnf4_cuda._make_m1(**kw)
            lau = Launcher(fn_, mm_sig, dynamic_shared=matmulnf4_cuda.TAB_BYTES if pair else 0)
            gr = kw.get("groups", 1)
            block = matmulnf4_cuda.m1_block(k, kw.get("wide", False)) * gr
            lau.dispatcher = fn_
            occ = max(1, lau.blocks_per_sm(block))
            grid = fusedffnnf4_cuda.parts_for(n, 1, sms, occ, cols, gr) // gr
            if "uneven" in label:
                grid = max(1, min(-(-n // cols), sms * occ))
            shm = matmulnf4_cuda.TAB_BYTES if pair else 0
            calls = [lambda q=q, am=am: lau.launch(grid, block, stream(), ptr(x), ptr(q, k * n // 16), ptr(am),
                                                    ptr(dcode), ptr(y), 0, ptr(y), k, n, BS.bit_length() - 5, shmem=shm)
                     for ((q, am),) in dev]
            t, err = timed(label, calls, check)
            report(case, label, t, nbytes, t_torch, err, f"[{grid} x {block}, {occ}/SM, {regs(lau)}]")
        for label, warps, mr, split, vec in WC_VARIANTS:
            if not keep(label) or not nf4warp_cuda.ok(1, k, True, BS, split):
                continue
            lau = nf4warp_cuda.launcher(k // nf4warp_cuda.CHUNK, 1, mr, split, vec_table=vec)
            grid = nf4warp_cuda.grid_for(lau, warps, sms)
            calls = [lambda q=q, am=am: lau.launch(grid, 32 * warps, stream(), ptr(x), ptr(q, k * n // 16), ptr(am),
                                                    ptr(dcode), ptr(y), 0, ptr(y), k, n, BS.bit_length() - 5)
                     for ((q, am),) in dev]
            t, err = timed(label, calls, check)
            report(case, label, t, nbytes, t_torch, err, f"[{grid} x {32 * warps}, {grid // sms}/SM, {regs(lau)}]")

    for m, k, n in ffn_shapes:
        case = f"FusedFFNNF4 M={m} {k}->2x{n}"
        host, dev = pool_of(k, n, 2)
        x = (torch.randn(m, k, device="cuda") * 0.5).half()
        s = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ref = fusedffnnf4_cpu.swiglu(x.float().cpu().numpy(), *host[0], *host[1], code, k, n, BS).astype(np.float64)
        wp = [(torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02,
               torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02)
              for _ in range(max(2, -(-POOL_BYTES // (k * n * 4))))]
        g = torch.empty(m, n, device="cuda", dtype=torch.float16)
        u = torch.empty_like(g)

        def tffn(w1, w3):
            torch.matmul(x, w1, out=g)
            torch.matmul(x, w3, out=u)
            torch.mul(F.silu(g), u, out=s)
        t_torch, _ = timed("torch", [lambda w=w: tffn(*w) for w in wp], None)
        del wp
        print(f"{case:28s} {'torch fp16 (2 GEMV + silu*mul)':30s} {t_torch:7.2f} us")
        nbytes = 2 * (k * n // 2 + k * n // BS * 4)
        # fp16 absmax (am16 variants, when one is selected): the same values rounded to fp16, and the reference on them
        dev16 = ref16 = None
        if any(kw.get("am16") and keep(label) for label, kw in FFN_VARIANTS):
            dev16 = [[(q, am.half()) for q, am in w] for w in dev]
            ref16 = fusedffnnf4_cpu.swiglu(x.float().cpu().numpy(), host[0][0], host[0][1].astype(np.float16),
                                           host[1][0], host[1][1].astype(np.float16), code, k, n,
                                           BS).astype(np.float64)
        mt = fusedffnnf4_cuda.bucket(m)
        jobs = []
        for label, kw in FFN_VARIANTS:
            if a.quick and kw.get("pair", True) and kw and "h2" not in kw or not keep(label):
                continue
            pair, cols, h2 = kw.get("pair", True), kw.get("cols", fusedffnnf4_cuda.COLS), kw.get("h2", 0)
            am16 = kw.get("am16", False)
            lau = fusedffnnf4_cuda.launcher(True, mt, pair, cols, kw.get("prefetch", True),
                                            pingpong=kw.get("pingpong", False), early=kw.get("early", False),
                                            nib=kw.get("nib", False), h2=h2, wide=kw.get("wide", False), am16=am16,
                                            vec_table=kw.get("vec_table"), groups=kw.get("groups", 1))
            gr = kw.get("groups", 1)
            block = fusedffnnf4_cuda.threads(k, kw.get("wide", False)) * gr
            occ = fusedffnnf4_cuda.blocks_per_sm(lau, block)
            parts = fusedffnnf4_cuda.parts_for(n, -(-m // mt), sms, occ, cols, gr)
            grid = -(-m // mt) * parts // gr
            lt = nlut16 if h2 else nlut if pair else nlut32
            calls = [lambda w=w, lau=lau, parts=parts, block=block, lt=lt, grid=grid:
                     lau.launch(grid, block, stream(), ptr(x), ptr(w[0][0], k * n // 16), ptr(w[0][1]),
                                ptr(w[1][0], k * n // 16), ptr(w[1][1]), ptr(lt), ptr(s), ptr(s), ptr(s), m,
                                k, n, BS.bit_length() - 5, parts, 0, 0)
                     for w in (dev16 if am16 else dev)]
            jobs.append((label, calls, ref16 if am16 else ref, nbytes - (k * n // BS * 4 if am16 else 0),
                         f"[{grid} x {block}, {occ}/SM, {regs(lau)}]"))
        for rnd in range(a.rounds):
            for label, calls, want, nb, extra in jobs:
                t, err = timed(label, calls, lambda want=want: rel(s.float().cpu().numpy(), want))
                report(case, label + (f" (round {rnd + 1})" if a.rounds > 1 else ""), t, nb, t_torch, err, extra)
        if a.rounds > 1:
            for label, *_ in jobs:
                ts = sorted(r[2] for r in rows if r[0] == case and r[1].startswith(label + " (round "))
                print(f"{case:28s} {label:30s} median {ts[len(ts) // 2]:7.2f} us, min {ts[0]:7.2f}, "
                      f"max {ts[-1]:7.2f} over {len(ts)} rounds", flush=True)
        for label, warps, mr, split, vec in WC_VARIANTS:
            if not keep(label) or not nf4warp_cuda.ok(m, k, True, BS, split):
                continue
            lau = nf4warp_cuda.launcher(k // nf4warp_cuda.CHUNK, 2, mr, split, m, vec_table=vec)
            grid = nf4warp_cuda.grid_for(lau, warps, sms)
            calls = [lambda w=w: lau.launch(grid, 32 * warps, stream(), ptr(x), ptr(w[0][0], k * n // 16),
                                            ptr(w[0][1]), ptr(w[1][0], k * n // 16), ptr(w[1][1]), ptr(nlut16),
                                            ptr(s), ptr(s), ptr(s), m, k, n, BS.bit_length() - 5, grid, 0, 0)
                     for w in dev]
            t, err = timed(label, calls, lambda: rel(s.float().cpu().numpy(), ref))
            report(case, label, t, nbytes, t_torch, err, f"[{grid} x {32 * warps}, {grid // sms}/SM, {regs(lau)}]")
    print("\nbest per case:")
    for case in dict.fromkeys(r[0] for r in rows):
        best = min((r for r in rows if r[0] == case), key=lambda r: r[2])
        print(f"  {case:28s} {best[1]:30s} {best[2]:7.2f} us ({best[3]:.1f}% copy, {best[4]:.2f}x torch)")


if __name__ == "__main__":
    main()

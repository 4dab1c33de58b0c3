"""MatMulAWQ at M = 1 with weights cycled past L2 (a pool of >= 128 MB of distinct weights, one per call, as in a
decode step; one reused 22.5 MB weight partly stays in the 50 MB L2): the small-M tensor-core GEMV (matmulawq1_cuda,
what sessions take for fp16 A) in the session configuration and in other configurations of its parameters (words
per lane, unroll, groups per warp), and the fp32 decode kernel (awq/gemv_cuda, sessions' kernel for fp32 A or
where the GEMV cannot go). CUDA-graph medians per call; torch fp16 x @ W on a pool of fp16 weights in the same run;
outputs checked against onnx_lowbit.awq.matmul on the last pool entry.

    PYTHONPATH=/tmp/site:.:benchmarks:tests python3 benchmarks/awq1_gpu.py [KxN ...]

``--ffn KxN``: FusedFFNAWQ at M = 1 instead (gate + up pairs cycled past L2): its fp32 decode kernel, the
two-weight tensor-core GEMV (matmulawq1_cuda, nw = 2), two MatMulAWQ GEMVs + torch silu * mul, torch fp16.
"""
from __future__ import annotations

import sys

import numpy as np
from ffn4_gpu import regs
from timing import copy_gbps, time_graph

G = 128
POOL_BYTES = 128 << 20
SHAPES = [(4096, 11008), (2048, 2048), (8192, 2048), (2048, 6144)]   # last: q/k/v merged
# the M = 1 tensor-core kernel (custom_ops/awq/matmulawq1_cuda): (label, warps per block, unroll, groups per warp
# or None for the plan's, register cap, int32 words per lane and row; None: what sessions launch)
TC1_VARIANTS = [("tc1 (session config)", None, None, None, None, None),
                ("tc1 wpl 2 gpw 1", 4, 4, 1, None, 2),
                ("tc1 wpl 2 unroll 2", 4, 2, None, None, 2),
                ("tc1 wpl 1", 4, 4, None, None, 1),
                ("tc1 wpl 1 gpw 1", 4, 4, 1, None, 1)]


def timed(calls):
    """CUDA-graph median per call of ``calls`` replayed in turn (one call per weight of a pool), then the last one
    once more, so that the output holds the last weight's result for the check."""
    import torch
    it = iter(range(1 << 30))
    t = time_graph(lambda: calls[next(it) % len(calls)](), batch=len(calls))
    calls[-1]()
    torch.cuda.synchronize()
    return t


def main():
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return
    import torch

    from onnx_lowbit import awq
    from onnx_lowbit.custom_ops.awq import gemv_cuda as gc
    from onnx_lowbit.custom_ops.device.launch import current_device, sm_count
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0))
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    ptr = lambda t: (t.data_ptr(), (t.numel(),))  # noqa: E731
    bw, _ = copy_gbps()
    print(f"device copy 256 MiB: {bw:.0f} GB/s")
    rng = np.random.default_rng(0)
    if "--ffn" in sys.argv:
        for a in sys.argv[1:]:
            if "x" in a:
                ffn1(*(int(v) for v in a.split("x")))
        return
    shapes = [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:] if "x" in a] or SHAPES
    for k, n in shapes:
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
        tc1(k, n, pool, x, y, ref, per, bw, t_torch, stream, ptr)
        # the fp32 decode kernel (bucket 1) at its session plan
        lau = gc.launcher(True, 1)
        occ = gc.blocks_per_sm(lau)
        grid, r, splits = gc.decode_plan(1, k, n, G, sms, occ)
        acc = torch.zeros(splits * n, dtype=torch.float32, device="cuda")
        ctr = torch.zeros(-(-(n // 8) // gc.CT), dtype=torch.int32, device="cuda")

        def call(w):
            lau.launch(grid, gc.BLOCK, stream(), ptr(x), *(ptr(t) for t in w), ptr(y), ptr(y), ptr(acc), ptr(ctr),
                       1, k, n, G, r, splits, 0)
        t = timed([lambda w=w: call(w) for w in pool])
        err = float(np.max(np.abs(y.float().cpu().numpy().astype(np.float64) - ref)) / np.max(np.abs(ref)))
        gbs = per / t / 1e3
        print(f"  {'fp32 decode kernel':22s} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy "
              f"{t_torch / t:5.2f}x torch rel {err:.1e} [{grid} blocks, R={r}, {splits} splits, {occ}/SM, "
              f"{regs(lau)}]", flush=True)


# FusedFFNAWQ M = 1 (--ffn): (label, weights per launch, wpl, unroll, groups per warp, register cap); None: the
# session configuration's (matmulawq1_cuda.config)
FFN1_VARIANTS = [("tc1 two weights (session config)", 2, None, None, None, None),
                 ("tc1 two weights gpw 4", 2, None, None, 4, None),
                 ("tc1 two weights gpw 3", 2, None, None, 3, None),
                 ("tc1 two weights unroll 2 cap 80", 2, None, 2, None, 80),
                 ("tc1 two weights unroll 2 gpw 4", 2, None, 2, 4, None),
                 ("two MatMulAWQ tc1 + silu*mul", 1, None, None, None, None)]


def tc1(k, n, pool, x, y, ref, per, bw, t_torch, stream, ptr):
    """The M = 1 tensor-core kernel's variants on the same pool."""
    import torch

    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    from onnx_lowbit.custom_ops.device.launch import current_device, sm_count
    if not m1.takes(k, G):
        return
    sms = sm_count(current_device())
    u64 = lambda t: (t.data_ptr(), (t.numel() * t.element_size() // 8,))  # noqa: E731
    for label, warps, unroll, gpw, cap, wpl in TC1_VARIANTS:
        if warps is None:
            warps, unroll, cap, wpl = m1.config(k, n, G, sms)
        if not m1.ok(1, k, n, G, unroll, wpl):
            continue
        try:
            lau = m1.launcher(warps, unroll, cap, wpl)
            occ = max(1, lau.blocks_per_sm(32 * warps))
        except Exception as e:  # noqa: BLE001
            print(f"  {label}: FAILED {type(e).__name__}: {e}")
            continue
        grid, gp, splits = m1.plan(k, n, G, sms, occ, warps, gpw, wpl)
        part = torch.zeros(max(1, splits * n), dtype=torch.float32, device="cuda")
        ctr = torch.zeros(m1.tiles(n, wpl), dtype=torch.int32, device="cuda")

        wv = u64 if wpl == 2 else ptr

        def call(w, lau=lau, grid=grid, gp=gp, splits=splits, part=part, ctr=ctr, warps=warps, wv=wv):
            qw_, qz_, sc_ = w
            w = (wv(qw_), wv(qz_), u64(sc_))
            lau.launch(grid, 32 * warps, stream(), u64(x), *w, *w, ptr(y), ptr(y), ptr(y), ptr(part), ptr(ctr),
                       *m1.scalars(k, n, G, gp, splits, False, False, wpl))
        t = timed([lambda w=w: call(w) for w in pool])
        err = float(np.max(np.abs(y.float().cpu().numpy().astype(np.float64) - ref)) / np.max(np.abs(ref)))
        gbs = per / t / 1e3
        print(f"  {label:22s} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy {t_torch / t:5.2f}x torch "
              f"rel {err:.1e} [{grid} blocks, gpw {gp}, {splits} splits, {occ}/SM, {regs(lau)}]", flush=True)


def ffn1(k, n):
    """FusedFFNAWQ at M = 1, LLaMA-style gate + up pairs, a pool past L2."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    from onnx_lowbit import ffn
    from onnx_lowbit.custom_ops.awq import gemv_cuda as gc
    from onnx_lowbit.custom_ops.awq import matmulawq1_cuda as m1
    from onnx_lowbit.custom_ops.device.launch import current_device, sm_count
    torch.zeros(1, device="cuda")
    sms = sm_count(current_device())
    bw, _ = copy_gbps()
    rng = np.random.default_rng(0)
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    ptr = lambda t, n=None: (t.data_ptr(), (t.numel() if n is None else n,))  # noqa: E731
    u64 = lambda t: (t.data_ptr(), (t.numel() * t.element_size() // 8,))  # noqa: E731

    def weights():
        return (rng.integers(-2 ** 31, 2 ** 31, (k, n // 8), dtype=np.int64).astype(np.int32),
                rng.integers(-2 ** 31, 2 ** 31, (k // G, n // 8), dtype=np.int64).astype(np.int32),
                (rng.random((k // G, n)) * 0.004 + 0.001).astype(np.float16))
    w1h, w3h = weights(), weights()
    per = 2 * sum(t.nbytes for t in w1h)
    cnt = max(4, -(-POOL_BYTES // per))
    pool = [tuple(tuple(torch.from_numpy(np.ascontiguousarray(np.roll(t, 7 * (cnt - 1 - i), axis=1))).cuda()
                        for t in w) for w in (w1h, w3h)) for i in range(cnt)]
    x = (torch.randn(1, k, device="cuda") * 0.5).half()
    s = torch.empty(1, n, device="cuda", dtype=torch.float16)
    y1, y3 = torch.empty_like(s), torch.empty_like(s)
    xa = x.cpu().numpy()
    ref = ffn.swiglu_awq_ref(xa, *w1h, *w3h, G, k, n, None, None).astype(np.float64)

    def report(label, t, extra=""):
        err = float(np.max(np.abs(s.float().cpu().numpy().astype(np.float64) - ref)) / np.max(np.abs(ref)))
        gbs = per / t / 1e3
        print(f"  {label:34s} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy rel {err:.1e} {extra}",
              flush=True)

    wp = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02
          for _ in range(max(4, -(-POOL_BYTES // (2 * k * n * 2))) * 2)]
    t = timed([lambda a=a, b=b: (torch.matmul(x, a, out=y1), torch.matmul(x, b, out=y3),
                                 torch.mul(F.silu(y1), y3, out=s)) for a, b in zip(wp[::2], wp[1::2])])
    del wp
    print(f"FusedFFNAWQ M=1 {k} -> 2 x {n}: torch fp16 {t:.2f} us")
    # the fp32 decode kernel (what sessions ran at M = 1 before)
    lau = gc.launcher(True, 1, 2)
    grid, r, splits = gc.decode_plan(1, k, n, G, sms, gc.blocks_per_sm(lau), 2)
    part = torch.zeros(max(1, splits * 2 * n), dtype=torch.float32, device="cuda")
    ctr = torch.zeros(-(-(n // 8) // gc.CT), dtype=torch.int32, device="cuda")
    wa = lambda w: [ptr(w[0]), ptr(w[1]), ptr(w[2])]  # noqa: E731
    t = timed([lambda p=p: lau.launch(grid, gc.BLOCK, stream(), ptr(x), *wa(p[0]), *wa(p[1]), ptr(s), ptr(s),
                                      ptr(s), ptr(part), ptr(ctr), 1, k, n, G, r, splits, 0, 0) for p in pool])
    report("fp32 decode kernel", t, f"[{grid} blocks, {splits} splits]")
    # the two-weight tensor-core GEMV, and two one-weight launches + torch silu * mul
    for label, nw, wpl, unroll, gpw, cap_ in FFN1_VARIANTS:
        warps, u, cap, wl = m1.config(k, n, G, sms, nw)
        u, wl, cap = unroll or u, wpl or wl, cap_ or cap
        l1 = m1.launcher(warps, u, cap, wl, nw)
        grid, gp, splits = m1.plan(k, n, G, sms, max(1, l1.blocks_per_sm(32 * warps)), warps, gpw, wl)
        part = torch.zeros(max(1, splits * nw * n), dtype=torch.float32, device="cuda")
        ctr = torch.zeros(m1.tiles(n, wl), dtype=torch.int32, device="cuda")
        wv = u64 if wl == 2 else ptr
        w_ = lambda w, wv=wv: [wv(w[0]), wv(w[1]), u64(w[2])]  # noqa: E731
        tail = [ptr(part), ptr(ctr), *m1.scalars(k, n, G, gp, splits, False, False, wl)]
        if nw == 2:
            calls = [lambda p=p, l1=l1, grid=grid, warps=warps, w_=w_, tail=tail: l1.launch(
                grid, 32 * warps, stream(), u64(x), *w_(p[0]), *w_(p[1]), ptr(s), ptr(s), ptr(s), *tail) for p in pool]
        else:
            def two(p, l1=l1, grid=grid, warps=warps, w_=w_, tail=tail):
                l1.launch(grid, 32 * warps, stream(), u64(x), *w_(p[0]), *w_(p[0]), ptr(y1), ptr(y1), ptr(y1), *tail)
                l1.launch(grid, 32 * warps, stream(), u64(x), *w_(p[1]), *w_(p[1]), ptr(y3), ptr(y3), ptr(y3), *tail)
                torch.mul(F.silu(y1), y3, out=s)
            calls = [lambda p=p: two(p) for p in pool]
        t = timed(calls)
        report(label, t, f"[{grid} blocks, wpl {wl}, unroll {u}, gpw {gp}, {splits} splits, {regs(l1)}]")


if __name__ == "__main__":
    main()

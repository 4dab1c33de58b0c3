"""AWQ 4-bit kernels on the GPU: correctness against the numpy reference (onnx_lowbit.awq) and speed against
torch's fp16 GEMV, measured in the same run.

    PYTHONPATH=. python benchmarks/awq_gpu.py [--variants] [--skip-correctness] [--json OUT.json]

Cases (LLaMA-7B FFN shapes, group 128):
  * correctness: MatMulAWQ of x[M, 4096] x W[4096, 11008] for M in {1, 4, 16} (fp16 A; M=1 also fp32 A) and M=17
    (generic kernel), through the same direct-launch path as onnxruntime sessions (run_arrays); DequantAWQ of
    one 4096 x 11008 weight, bit-exact;
  * timing: our fused decode GEMV for gate+up (two 4096 x 11008 AWQ weights) vs torch x @ W with two fp16
    W[4096, 11008], for M in {1, 4, 16}; DequantAWQ of one weight. CUDA events around 20 back-to-back launches
    (median of 30), and the same 20 launches replayed from a CUDA graph (no host launch cost: our launches go
    through Python + cuLaunchKernel, ~5 us each, which can exceed a ~8 us kernel when launched back to back).
  * effective bandwidth = bytes each must read (+ write), and % of a measured 256 MiB device-to-device copy.

Needs: a CUDA GPU, torch, numba-cuda (numpy < 2.5 for numba-cuda 0.30). Every case prints its own error
instead of stopping the run.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import numpy as np

from timing import copy_gbps, time_cuda, time_graph  # noqa: E402 - benchmarks/ is on sys.path when run as a script

from onnx_lowbit import awq

K, N, G = 4096, 11008, 128


def regs(launcher):
    """Registers per thread of a Launcher's kernel (cuFuncGetAttribute NUM_REGS)."""
    import ctypes

    from onnx_lowbit.custom_ops.cuda_launch import libcuda
    v = ctypes.c_int(0)
    fn = libcuda().cuFuncGetAttribute
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    rc = fn(ctypes.byref(v), 4, launcher.handle)
    return v.value if rc == 0 and v.value else "?"


def guarded(rows, name):
    """Decorator: run a case, on failure print the traceback and record the error instead of stopping."""
    def wrap(fn):
        def run(*a, **kw):
            try:
                out = fn(*a, **kw)
                import torch
                torch.cuda.synchronize()   # an asynchronous fault is reported under this case's name
                return out
            except Exception as e:  # noqa: BLE001 - a benchmark run must go on
                print(f"[{name}] FAILED: {type(e).__name__}: {e}")
                traceback.print_exc()
                rows.append((f"{name}: FAILED {type(e).__name__}", None, None, None))
                return None
        return run
    return wrap


def make_weight(seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * rng.uniform(0.01, 0.05, N)).astype(np.float32)
    return awq.quantize_rtn(w, G)


_ABS = {}


def check(y, a, w, bias=None):
    """Max error against awq.matmul relative to the per-output bound used by tests/test_awq_kernels.py."""
    qw, qz, sc = w
    ref = awq.matmul(a, qw, qz, sc, G, K, N, bias).astype(np.float64)
    x = np.abs(a.reshape(-1, K).astype(np.float64))
    if id(qw) not in _ABS:
        _ABS[id(qw)] = (np.abs(awq.dequantize(qw, qz, sc, G, K, N).astype(np.float64)),
                        np.repeat(np.abs(sc.astype(np.float64)), G, axis=0)[:K])
    w16, s_rows = _ABS[id(qw)]
    tol = 2.0 ** -18 * 32 * (x @ s_rows) + 2.0 ** -11 * (x @ w16)
    if a.dtype == np.float16:
        tol += 2.0 ** -10 * np.abs(ref) + 2.0 ** -24
    err = np.abs(y.astype(np.float64).reshape(ref.shape) - ref)
    return float(np.max(err / tol)), float(np.max(err) / max(float(np.max(np.abs(ref))), 1e-30))


def correctness(weights, results):
    from onnx_lowbit.custom_ops import dequantawq_cuda, matmulawq_cuda
    w = weights[0]
    rng = np.random.default_rng(1)
    cases = [(1, np.float16, False), (1, np.float32, True), (4, np.float16, True), (16, np.float16, False),
             (17, np.float16, True)]
    for m, dt, hb in cases:
        name = f"MatMulAWQ M={m} {np.dtype(dt).name}{' +bias' if hb else ''}"

        @guarded(results, name)
        def one():
            a = (rng.standard_normal((m, K)) + 0.2).astype(dt)
            bias = rng.standard_normal(N).astype(dt) if hb else None
            y = matmulawq_cuda.run_arrays(a, *w, G, K, N, bias, repeat=3)
            ratio, rel = check(y, a, w, bias)
            ok = ratio <= 1.0
            print(f"correctness {name:38s} err/tol {ratio:.3g}  max|err|/max|ref| {rel:.2e}  {'ok' if ok else 'FAIL'}")
            results.append((name, ok, ratio, rel))
        one()

    @guarded(results, "DequantAWQ")
    def dq():
        got = dequantawq_cuda.run_arrays(*w, G, K, N)
        ok = np.array_equal(got.view(np.uint16), awq.dequantize(*w, G, K, N).view(np.uint16))
        print(f"correctness DequantAWQ 4096x11008 bit-exact: {ok}")
        results.append(("DequantAWQ bit-exact", ok, None, None))
    dq()


def throughput(weights, variants, rows_out):
    import torch
    from onnx_lowbit.custom_ops import dequantawq_cuda as dc
    from onnx_lowbit.custom_ops import matmulawq_cuda as mc
    from onnx_lowbit.custom_ops.cuda_launch import Launcher, current_device, sm_count
    torch.cuda.init()
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    copy_bw, t_copy = copy_gbps()
    rows_out.append(("d2d copy 256 MiB (read+write)", t_copy, copy_bw, None))

    dev = [tuple(torch.from_numpy(np.ascontiguousarray(t)).cuda() for t in w) for w in weights]
    w16 = [torch.from_numpy(awq.dequantize(*w, G, K, N)).cuda() for w in weights]
    qbytes = sum(t.numel() * t.element_size() for t in dev[0])          # one weight: qweight + qzeros + scales

    t0 = time.perf_counter()
    gpts = {mt: mc.gpt_for(mt, N) for mt in mc.MT_BUCKETS}
    fast = {mt: mc.launcher(True, mt, gpts[mt]) for mt in mc.MT_BUCKETS}
    print(f"compile: {len(fast)} decode kernels (fp16 A) in {time.perf_counter() - t0:.1f} s")
    occ = {mt: mc.blocks_per_sm(lau) for mt, lau in fast.items()}
    for mt, lau in fast.items():
        print(f"  decode kernel MT={mt} gpt={gpts[mt]}: {regs(lau)} registers, {occ[mt]} resident blocks of "
              f"{mc.BLOCK} per SM")
    tiles = -(-(N // 8) // mc.CT)

    def ours_args(x, y, w, scratch, m, r_, splits_, gpt=1):
        qw, qz, sc = w
        acc, cnt = scratch
        return [(x.data_ptr(), (m * K,)), (qw.data_ptr(), (qw.numel() // gpt,)), (qz.data_ptr(), (qz.numel() // gpt,)),
                (sc.data_ptr(), (sc.numel(),)), (y.data_ptr(), (N,)), (y.data_ptr(), (m * N,)),
                (acc.data_ptr(), (acc.numel(),)), (cnt.data_ptr(), (cnt.numel(),)), m, K, N, G, r_, splits_, 0]

    def scratch(splits_, m):  # per-split partials [splits, M, N] and zeroed tile counters
        return (torch.zeros(splits_ * m * N, dtype=torch.float32, device="cuda"),
                torch.zeros(tiles, dtype=torch.int32, device="cuda"))

    for m in (1, 4, 16):
        name = f"gate+up M={m}"

        @guarded(rows_out, name)
        def case():
            x = (torch.randn(m, K, device="cuda") + 0.2).half()
            ys = [torch.empty(m, N, dtype=torch.float16, device="cuda") for _ in range(2)]
            lau = fast[mc.bucket(m)]
            gpt = gpts[mc.bucket(m)]
            grid, r, splits = mc.decode_plan(m, K, N, G, sms, occ[mc.bucket(m)], gpt=gpt)
            scr = [scratch(splits, m), scratch(splits, m)]
            print(f"decode plan M={m}: {grid} blocks = {mc.chunks(m, mc.bucket(m))} row chunks x "
                  f"{-(-(N // 8) // (mc.CT * gpt))} column tiles x {splits} K splits of {mc.WARPS} x {r} rows, "
                  f"{gpt} column group(s) per thread")
            args = [ours_args(x, ys[i], dev[i], scr[i], m, r, splits, gpt) for i in range(2)]

            def ours():
                lau.launch(grid, mc.BLOCK, stream(), *args[0])
                lau.launch(grid, mc.BLOCK, stream(), *args[1])

            def ref():
                torch.matmul(x, w16[0])
                torch.matmul(x, w16[1])
            t_ours, t_ref = time_cuda(ours), time_cuda(ref)
            g_ours, g_ref = time_graph(ours), time_graph(ref)
            torch.cuda.synchronize()
            xa = x.cpu().numpy()
            ok = all(check(ys[i].cpu().numpy(), xa, weights[i])[0] <= 1.0 for i in range(2))
            b_ours = 2 * (qbytes + m * K * 2 + m * N * 2)
            b_ref = 2 * (K * N * 2 + m * K * 2 + m * N * 2)
            rows_out.append((f"AWQ fused GEMV {name} (ours, events)", t_ours, b_ours / t_ours / 1e3, ok))
            rows_out.append((f"AWQ fused GEMV {name} (ours, graph)", g_ours, b_ours / g_ours / 1e3, ok))
            rows_out.append((f"torch fp16 x@W {name} (events)", t_ref, b_ref / t_ref / 1e3, None))
            rows_out.append((f"torch fp16 x@W {name} (graph)", g_ref, b_ref / g_ref / 1e3, None))
            rows_out.append((f"  speed-up vs torch {name} (graph)", g_ref / g_ours, None, None))
        case()

    @guarded(rows_out, "DequantAWQ")
    def dq():
        lau = dc.launcher()
        grid, rows = dc.plan(K, N, sms)
        out = torch.empty(K * N, dtype=torch.float16, device="cuda")
        qw, qz, sc = dev[0]
        args = [(qw.data_ptr(), (qw.numel(),)), (qz.data_ptr(), (qz.numel(),)), (sc.data_ptr(), (sc.numel(),)),
                (out.data_ptr(), (K * N // 4,)), K, N, G, rows]
        fn = lambda: lau.launch(grid, dc.BLOCK, stream(), *args)  # noqa: E731
        t, tg = time_cuda(fn), time_graph(fn)
        torch.cuda.synchronize()
        ok = np.array_equal(out.cpu().numpy().view(np.uint16).reshape(K, N),
                            awq.dequantize(*weights[0], G, K, N).view(np.uint16))
        nbytes = qbytes + K * N * 2
        rows_out.append(("DequantAWQ 4096x11008 (events)", t, nbytes / t / 1e3, ok))
        rows_out.append(("DequantAWQ 4096x11008 (graph)", tg, nbytes / tg / 1e3, ok))
        t_cp = time_cuda(lambda: w16[1].copy_(w16[0]))
        rows_out.append(("  torch copy of the fp16 4096x11008 W", t_cp, 2 * K * N * 2 / t_cp / 1e3, None))
    dq()
    if variants:
        x = (torch.randn(1, K, device="cuda") + 0.2).half()
        y = torch.empty(1, N, dtype=torch.float16, device="cuda")
        for gpt in (1, 2):
            for unroll in (4, 8, 16):
                lau = fast[1] if (unroll, gpt) == (mc.UNROLL_M1, gpts[1]) else None
                for r_ in (16, 32, 64):
                    name = f"  variant M=1 one weight gpt={gpt} unroll={unroll} R={r_}"

                    @guarded(rows_out, name)
                    def var():
                        la = lau or Launcher(mc._make_gemv(1, True, unroll=unroll, gpt=gpt), mc._sig(True, True, gpt))
                        sp = -(-K // (mc.WARPS * r_))
                        til = -(-(N // 8) // (mc.CT * gpt))
                        scr = scratch(sp, 1)
                        args = ours_args(x, y, dev[0], scr, 1, r_, sp, gpt)
                        t = time_graph(lambda: la.launch(til * sp, mc.BLOCK, stream(), *args))
                        torch.cuda.synchronize()
                        ok = check(y.cpu().numpy(), x.cpu().numpy(), weights[0])[0] <= 1.0
                        rows_out.append((f"{name} ({til * sp} blocks, {regs(la)} regs)", t,
                                         (qbytes + 2 * K + 2 * N) / t / 1e3, ok))
                    var()

    return copy_bw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--variants", action="store_true", help="also time decode-kernel variants (unroll, K slice)")
    ap.add_argument("--skip-correctness", action="store_true")
    a = ap.parse_args()
    import torch
    print("GPU:", torch.cuda.get_device_name(0))
    t0 = time.perf_counter()
    weights = [make_weight(0), make_weight(1)]
    print(f"quantised two {K}x{N} weights (group {G}) in {time.perf_counter() - t0:.1f} s")
    results, rows = [], []
    if not a.skip_correctness:
        correctness(weights, results)
    copy_bw = None
    try:
        copy_bw = throughput(weights, a.variants, rows)
    except Exception as e:  # noqa: BLE001
        print(f"throughput FAILED: {type(e).__name__}: {e}")
        traceback.print_exc()
    print(f"\n{'case':58s} {'us':>9s} {'GB/s':>8s} {'%copy':>6s}  correct")
    for name, us, bw, ok in rows:
        if us is None:
            print(name)
        elif bw is None:
            print(f"{name:58s} {us:9.3f}")
        else:
            pct = f"{100 * bw / copy_bw:6.1f}" if copy_bw else "     -"
            print(f"{name:58s} {us:9.1f} {bw:8.0f} {pct}  {'' if ok is None else ok}")
    bad = [r for r in results if r[1] is not True]
    print("correctness:", "all ok" if not bad and results else f"FAILED {[r[0] for r in bad]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "copy_bw": copy_bw, "correctness": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()

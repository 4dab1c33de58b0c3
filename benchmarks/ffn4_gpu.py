"""Fused 4-bit SwiGLU (FusedFFNNF4, FusedFFNAWQ) on the GPU: gate + up of LLaMA-7B (x[M, 4096], two [4096, 11008]
weights; NF4 block 64 / AWQ group 128), M in {1, 4, 16}, against, in the same run,
  (a) our two separate 4-bit MatMul ops (MatMulNF4 / MatMulAWQ session kernels) + torch silu(g) * u;
  (b) torch fp16: x @ W1, x @ W3 (fp16 W [4096, 11008]) + silu(g) * u.
Every fused output is checked against the CPU face (itself tested against onnx_lowbit.ffn) on the timed data.
Times: median us per call, "graph" = 20 calls replayed from a CUDA graph (no host launch cost), "events" = CUDA
events around 20 back-to-back launches (includes our Python launch cost). % of 2900 GB/s counts the packed 4-bit
bytes of both weights (2 * K * N / 2 = 45.1 MB), as the issue's floor does.

The "session" rows call each op's CUDA kernel object as a session node does (custom_ops.runtime.direct), so they
run what sessions run at that M; the other rows launch particular kernels with their launcher defaults
(FusedFFNNF4's block decode kernel for that M and K, one thread group per block; FusedFFNAWQ / MatMulAWQ's fp32
decode kernels, awq/gemv_cuda, which sessions take for fp32 X or where the small-M GEMV cannot go). One weight pair
is reused call after call, so part of it comes from L2: nf4shapes_gpu.py and nf4tc_gpu.py cycle weights past L2.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/ffn4_gpu.py [--ms 1,4,16] [--profile]

(--profile: only the fused kernels at M = 1, three launches each, for ncu. The FusedFFNAWQ variants an older
--variants flag timed are gone: docs/lab-log.md, "Removed kernel variants (AWQ)".)
"""
from __future__ import annotations

import argparse
import time
import traceback

import numpy as np
from timing import copy_gbps, time_cuda, time_graph

K, N, BS, G = 4096, 11008, 64, 128
PEAK = 2900.0
NIBBLE_BYTES = 2 * K * N // 2


def regs(lau):
    """'R regs, L B local' of a Launcher whose .dispatcher is its Numba kernel (local > 0: register spills)."""
    d = getattr(lau, "dispatcher", None)
    if d is None:
        return "? regs"
    try:
        r, loc = d.get_regs_per_thread(), d.get_local_mem_per_thread()
        r = list(r.values())[0] if isinstance(r, dict) else r
        loc = list(loc.values())[0] if isinstance(loc, dict) else loc
        return f"{r} regs, {loc} B local"
    except Exception as e:  # noqa: BLE001
        return f"? regs ({type(e).__name__})"


def rel(y, ref):
    y = np.asarray(y, np.float64).reshape(ref.shape)
    return float(np.max(np.abs(y - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--profile", action="store_true", help="only launch the fused kernels (M=1) 3 times each, for ncu")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F  # noqa: N812

    from onnx_lowbit.custom_ops.awq import gemv_cuda
    from onnx_lowbit.custom_ops.device.launch import current_device, sm_count
    from onnx_lowbit.custom_ops.ffn import fusedffnawq_cpu, fusedffnnf4_cpu, fusedffnnf4_cuda
    from onnx_lowbit.custom_ops.nf4 import common as nf4_common
    from onnx_lowbit.custom_ops.nf4.decode_cuda import lut_for, threads
    from onnx_lowbit.custom_ops.runtime import direct
    print("GPU:", torch.cuda.get_device_name(0))
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    rng = np.random.default_rng(0)
    code = nf4_common.parse_attrs({"quant_type": "nf4", "block_size": BS, "K": K, "N": N})[4]
    nq = [(rng.integers(0, 256, K * N // 2, dtype=np.uint8),
           (rng.random(K * N // BS) * 0.1 + 0.01).astype(np.float32)) for _ in range(2)]
    aw = [(rng.integers(-2 ** 31, 2 ** 31, (K, N // 8), dtype=np.int64).astype(np.int32),
           rng.integers(-2 ** 31, 2 ** 31, (K // G, N // 8), dtype=np.int64).astype(np.int32),
           (rng.random((K // G, N)) * 0.004 + 0.001).astype(np.float16)) for _ in range(2)]
    td = lambda v: torch.from_numpy(np.ascontiguousarray(v)).cuda()  # noqa: E731
    dnq = [(td(q), td(am)) for q, am in nq]
    daw = [tuple(td(t) for t in w) for w in aw]
    w16 = [torch.randn(K, N, device="cuda", dtype=torch.float16) * 0.02 for _ in range(2)]
    bw, t_copy = copy_gbps()
    print(f"device copy 256 MiB: {t_copy:.1f} us = {bw:.0f} GB/s")
    ptr = lambda t, n=None: (t.data_ptr(), (t.numel() if n is None else n,))  # noqa: E731
    rows = []

    def record(name, m, fn, ref_fn=None, check=None):
        try:
            tg, te = time_graph(fn), time_cuda(fn)
            torch.cuda.synchronize()
            err = check() if check else None
            rows.append((name, m, tg, te, err))
            print(f"{name:60s} M={m:2d} graph {tg:7.1f} us  events {te:7.1f} us"
                  + (f"  rel err {err:.1e}" if err is not None else ""), flush=True)
            return tg
        except Exception as e:  # noqa: BLE001
            print(f"{name} M={m}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc()
            rows.append((name + " FAILED", m, None, None, None))
            return None

    def refs(xa, m):
        x32 = xa.astype(np.float32)
        return (fusedffnnf4_cpu.swiglu(x32, *nq[0], *nq[1], code, K, N, BS).astype(np.float64),
                fusedffnawq_cpu.swiglu(x32, aw[0], aw[1], G, K, N).astype(np.float64))

    summary = []
    for m in [int(v) for v in a.ms.split(",")]:
        x = (torch.randn(m, K, device="cuda") + 0.2).half()
        xa = x.cpu().numpy()
        s = torch.empty(m, N, device="cuda", dtype=torch.float16)
        y1, y3 = torch.empty_like(s), torch.empty_like(s)
        t0 = time.perf_counter()
        if a.profile:
            ref_n = ref_a = None
        else:
            ref_n, ref_a = refs(xa, m)
        print(f"M={m}: CPU references in {time.perf_counter() - t0:.1f} s")
        chk = lambda ref: (lambda: rel(s.float().cpu().numpy(), ref))  # noqa: E731

        # ---- what session nodes run at this M (runtime.direct: each op's kernel object, its per-call choice)
        nf_attrs = {"quant_type": "nf4", "block_size": BS, "K": K, "N": N}
        aw_attrs = {"group_size": G, "K": K, "N": N}

        def two(calls):
            def run():
                for c in calls:
                    c()
                torch.mul(F.silu(y1), y3, out=s)
            return run
        t_sn = t_sn2 = t_sa = t_sa2 = None
        if not a.profile:
            t_sn = record("FusedFFNNF4 (session kernel)", m, direct.call(
                "FusedFFNNF4", nf_attrs, [x] + [t for qa in dnq for t in qa], [s], stream), check=chk(ref_n))
            t_sn2 = record("two MatMulNF4 (session kernels) + torch silu*mul", m, two(
                [direct.call("MatMulNF4", nf_attrs, [x, *qa], [y], stream) for qa, y in zip(dnq, (y1, y3))]),
                check=chk(ref_n))
            t_sa = record("FusedFFNAWQ (session kernel)", m, direct.call(
                "FusedFFNAWQ", aw_attrs, [x] + [t for w in daw for t in w], [s], stream), check=chk(ref_a))
            t_sa2 = record("two MatMulAWQ (session kernels) + torch silu*mul", m, two(
                [direct.call("MatMulAWQ", aw_attrs, [x, *w], [y], stream) for w, y in zip(daw, (y1, y3))]),
                check=chk(ref_a))

        # ---- NF4 fused: the block decode kernel FusedFFNNF4's routes name for this M and K (one thread group)
        def nf4_fused():
            fc = fusedffnnf4_cuda
            name = fc.decode_kernel(fc.case("float16", m, K, N, BS))
            mt, pair, _, _, h2, wide, _, groups = fc.DECODE[name]
            lau = fc.launcher(True, name)
            block = threads(K, wide) * groups
            occ = fc.blocks_per_sm(lau, block)
            nch = -(-m // mt)
            parts = fc.parts_for(N, nch, sms, occ, groups)
            lut = lut_for(code, pair, h2)
            dlut = td(lut.view(np.int64 if lut.dtype == np.uint64 else np.int32))
            keep.append(dlut)    # the launches hold raw pointers only
            args = [ptr(x), ptr(dnq[0][0], K * N // 16), ptr(dnq[0][1]), ptr(dnq[1][0], K * N // 16), ptr(dnq[1][1]),
                    ptr(dlut), ptr(s), ptr(s), ptr(s), m, K, N, BS.bit_length() - 5, parts, 0, 0]
            grid = nch * parts // groups
            desc = f"{name}: {grid} blocks x {block} thr, {regs(lau)}, {occ}/SM"
            return (lambda: lau.launch(grid, block, stream(), *args)), desc

        keep = []
        fn, desc = nf4_fused()
        t_nf = None if a.profile else record(f"FusedFFNNF4 block decode kernel [{desc}]", m, fn, check=chk(ref_n))

        t_n2 = None     # two MatMulNF4: the session rows above (the M = 1 kernel needs its session launch)

        # ---- AWQ fused: the fp32 decode kernel (two weights) sessions take for fp32 X or where the GEMV cannot go
        def awq_fused():
            mt = gemv_cuda.bucket(m, 2)
            lau = gemv_cuda.launcher(True, mt, 2)
            occ = gemv_cuda.blocks_per_sm(lau)
            grid, r, splits = gemv_cuda.decode_plan(m, K, N, G, sms, occ, 2)
            tiles = -(-(N // 8) // gemv_cuda.CT)
            acc = torch.zeros(splits * 2 * m * N, device="cuda", dtype=torch.float32)   # per-split partials
            cnt = torch.zeros(tiles, device="cuda", dtype=torch.int32)
            args = [ptr(x)] + [ptr(t) for w in daw for t in w] + [ptr(s), ptr(s), ptr(s), ptr(acc), ptr(cnt),
                                                                   m, K, N, G, r, splits, 0, 0]
            desc = f"{grid} blocks, R={r}, splits={splits}, {regs(lau)}, {occ}/SM"
            return (lambda: lau.launch(grid, gemv_cuda.BLOCK, stream(), *args)), desc, acc

        if a.profile:
            for fn in (nf4_fused()[0], awq_fused()[0]):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            return
        fn, desc, acc_keep = awq_fused()
        t_af = record(f"FusedFFNAWQ fp32 decode kernel [{desc}]", m, fn, check=chk(ref_a))

        lau_a = gemv_cuda.launcher(True, gemv_cuda.bucket(m), 1)
        grid_a, r_a, sp_a = gemv_cuda.decode_plan(m, K, N, G, sms, gemv_cuda.blocks_per_sm(lau_a))
        tiles_a = -(-(N // 8) // gemv_cuda.CT)
        scr = [(torch.zeros(sp_a * m * N, device="cuda", dtype=torch.float32),  # per-split partials [splits, M, N]
                torch.zeros(tiles_a, device="cuda", dtype=torch.int32)) for _ in range(2)]
        aargs = [[ptr(x), ptr(w[0]), ptr(w[1]), ptr(w[2]), ptr(y), ptr(y), ptr(sc[0]), ptr(sc[1]), m, K, N, G, r_a,
                  sp_a, 0] for w, y, sc in zip(daw, (y1, y3), scr)]

        def awq_two():
            for ar in aargs:
                lau_a.launch(grid_a, gemv_cuda.BLOCK, stream(), *ar)
            torch.mul(F.silu(y1), y3, out=s)
        t_a2 = record("two MatMulAWQ fp32 decode kernels + torch silu*mul", m, awq_two, check=chk(ref_a))

        # ---- torch fp16
        def torch_fp16():
            torch.matmul(x, w16[0], out=y1)
            torch.matmul(x, w16[1], out=y3)
            torch.mul(F.silu(y1), y3, out=s)
        t_t = record("torch fp16 x@W1, x@W3 + silu*mul", m, torch_fp16)
        summary.append((m, t_sn, t_sn2, t_sa, t_sa2, t_nf, t_n2, t_af, t_a2, t_t))

    print("\n| op | M | fused (us) | GB/s on 4-bit bytes | % of 2900 GB/s | two MatMul4 + silu*mul (us) | "
          "torch fp16 (us) | vs two MatMul4 | vs torch fp16 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    r_ = lambda a_, b_: "-" if a_ is None or b_ is None else f"{b_ / a_:.2f}x"  # noqa: E731
    for m, t_sn, t_sn2, t_sa, t_sa2, t_nf, t_n2, t_af, t_a2, t_t in summary:
        for op, tf, t2 in (("FusedFFNNF4 (session)", t_sn, t_sn2), ("FusedFFNAWQ (session)", t_sa, t_sa2),
                           ("FusedFFNNF4 block decode kernel", t_nf, t_n2),
                           ("FusedFFNAWQ fp32 decode", t_af, t_a2)):
            bw = None if tf is None else NIBBLE_BYTES / tf / 1e3
            print(f"| {op} | {m} | {f(tf)} | {f(bw)} | {f(None if bw is None else 100 * bw / PEAK)} | {f(t2)} | "
                  f"{f(t_t)} | {r_(tf, t2)} | {r_(tf, t_t)} |")
    print("(times: CUDA-graph replay medians; correctness: 'rel err' lines above, max |err| / max |ref| vs the "
          "CPU face on the timed data, fp16 output)")


if __name__ == "__main__":
    main()

"""DequantNF4 / DequantAWQ kernel variants on the GPU, one run (issue 3 goal: standalone dequant of a 4096 x 11008
weight >= 80% of the measured copy bandwidth).

    PYTHONPATH=/tmp/site:.:tests:benchmarks python3 benchmarks/dequant_gpu.py [--op nf4|awq|all] [--json OUT.json]

Data: one 4096 x 11008 weight, random packed bytes. NF4: W^T [N, K] (transposed=1), block 64, fp32 absmax
(fp32 output) and the same absmax as fp16 (fp16 output). AWQ: AutoAWQ GEMM layout, group 128, random qweight /
qzeros, scales in [2^-10, 2^-4].

NF4: each variant (the lists below; custom_ops/nf4/dequantnf4_cuda.Variant) is compiled, launched once on an
output prefilled with 0xFF bytes, compared bit for bit with the CPU face on the same data
(dequantnf4_cpu.dequantize), and timed as the median of 30 CUDA-graph replays of 20 launches (timing.time_graph),
through the same launch helpers the op uses (``geometry``, ``rows_args``); then the grid and block of the fastest
bit-exact variant of each case are swept (no recompilation). AWQ: DequantAWQ's one kernel (custom_ops/awq/
dequantawq_cuda; the variants it was chosen from are gone: docs/lab-log.md, "Removed kernel variants (AWQ)"), at its
session geometry, checked and timed the same way. Bytes moved = packed weights + absmax (or qzeros + scales) +
output; % of copy against a 256 MiB device-to-device copy timed the same way in the same run. The last lines print
the one-line change that makes the fastest bit-exact NF4 variants the op's defaults. Total runtime is mostly
compilation (~30 kernels).
"""
from __future__ import annotations

import argparse
import time
import traceback

import numpy as np
from timing import COPY_BYTES, copy_gbps, time_graph, write_json

K, N, BS, G = 4096, 11008, 64, 128


def nf4_variants():
    from onnx_lowbit.custom_ops.nf4.dequantnf4_cuda import LEGACY, Variant as V
    base = [LEGACY,
            V(4, 4, store="v4"), V(4, 8, store="v4"), V(4, 4, store="v4cs"),
            V(8, 2, store="v4"), V(8, 4, store="v4"), V(8, 4, store="v4cs"), V(8, 4, store="scalar"),
            V(16, 1, store="v4"), V(16, 2, store="v4"), V(16, 2, store="v4cs"),
            V(32, 1, store="v4", load="nc"), V(32, 1, store="v4cs", load="nc"), V(32, 2, store="v4", load="nc_na")]
    return {"float32": base,
            "float16": base + [V(8, 4, store="v4", h2=True), V(16, 2, store="v4cs", h2=True),
                               V(32, 1, store="v4", load="nc", h2=True)]}


def label(v, legacy):
    """Short name: the fields that differ from LEGACY."""
    if v == legacy:
        return "LEGACY"
    d = {f: getattr(v, f) for f in v.__dataclass_fields__ if getattr(v, f) != getattr(legacy, f)}
    return " ".join(f"{k}={x}" for k, x in d.items())


def regs(lau):
    import ctypes

    from onnx_lowbit.custom_ops.runtime.driver import libcuda
    r = ctypes.c_int(0)
    fn = libcuda().cuFuncGetAttribute
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    return r.value if fn(ctypes.byref(r), 4, lau.handle) == 0 else -1


class Table:
    def __init__(self, copy_bw):
        self.copy_bw = copy_bw
        self.rows = []   # dicts

    def add(self, case, name, variant, us, nbytes, exact, extra=""):
        gbs = nbytes / us / 1e3 if us else None
        self.rows.append(dict(case=case, name=name, variant=repr(variant), us=us, gbs=gbs,
                              pct=100 * gbs / self.copy_bw if gbs else None, exact=exact, extra=extra))
        r = self.rows[-1]
        t = f"{us:8.1f} {gbs:7.0f} {r['pct']:6.1f}" if us else f"{'-':>8s} {'-':>7s} {'-':>6s}"
        print(f"{case:14s} {name:44s} {t}  {'bit-exact' if exact else 'MISMATCH' if exact is False else '-':9s} "
              f"{extra}", flush=True)

    def best(self, case):
        ok = [r for r in self.rows if r["case"] == case and r["exact"] and r["us"]]
        return min(ok, key=lambda r: r["us"]) if ok else None


def run_case(table, case, variants, legacy, make_fn, nbytes, check, sweep):
    """Times every variant, then sweeps block/grid of the fastest bit-exact one. ``make_fn(v)`` -> (fn, note)."""
    timed = {}
    for v in variants:
        try:
            t0 = time.perf_counter()
            fn, note = make_fn(v)
            ct = time.perf_counter() - t0
            exact = check(fn)
            us = time_graph(fn)
            timed[v] = us if exact else None
            table.add(case, label(v, legacy), v, us, nbytes, exact, f"{note}, compile {ct:.1f} s")
        except Exception as e:  # noqa: BLE001 - a benchmark run goes on
            traceback.print_exc()
            table.add(case, label(v, legacy), v, None, nbytes, None, f"FAILED {type(e).__name__}: {e}"[:120])
    ok = {v: t for v, t in timed.items() if t}
    if not ok:
        return
    best = min(ok, key=ok.get)
    for v in dict.fromkeys(sweep(best)):
        if v in timed:
            continue
        try:
            fn, note = make_fn(v)
            exact = check(fn)
            table.add(case, "  sweep " + label(v, legacy), v, time_graph(fn), nbytes, exact, note)
        except Exception as e:  # noqa: BLE001
            msg = f"FAILED {type(e).__name__}: {e}"[:120]
            table.add(case, "  sweep " + label(v, legacy), v, None, nbytes, None, msg)


def nf4(table, sms, stream):
    import dataclasses

    import torch

    from onnx_lowbit import nf4 as ref
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cpu
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cuda as dq
    rng = np.random.default_rng(0)
    total = K * N
    q = rng.integers(0, 256, total // 2, dtype=np.uint8)
    am32 = (rng.random(total // BS) * 0.1 + 0.01).astype(np.float32)
    code = ref.code("nf4").astype(np.float32)
    dq_ = torch.from_numpy(q).cuda()
    dcode = torch.from_numpy(code).cuda()
    for dname, dt, tdt, idt in (("float32", np.float32, torch.float32, torch.int32),
                                ("float16", np.float16, torch.float16, torch.int16)):
        am = am32.astype(dt)
        t0 = time.perf_counter()
        w = dequantnf4_cpu.dequantize(q, am, code, K, N, BS, True)
        print(f"CPU face NF4 -> {dname}: {time.perf_counter() - t0:.1f} s")
        bits = np.ascontiguousarray(w).reshape(-1).view(np.int32 if dt == np.float32 else np.int16)
        wref = torch.from_numpy(bits).cuda()
        dam = torch.from_numpy(am).cuda()
        out = torch.empty(total, dtype=tdt, device="cuda")
        f16 = dt == np.float16
        nbytes = q.nbytes + am.nbytes + total * np.dtype(dt).itemsize

        def make_fn(v, dt=dt, dam=dam, out=out, f16=f16):
            lau = dq._launcher(True, dt, v)
            grid, block = dq.geometry(v, total, sms)
            args = dq.rows_args(v, f16, dq_.data_ptr(), dq_.numel(), dam.data_ptr(), dam.numel(), dcode.data_ptr(),
                                out.data_ptr(), total, BS)
            res = lau.blocks_per_sm(block)
            return (lambda: lau.launch(grid, block, stream(), *args)), \
                f"grid {grid} x {block}, {regs(lau)} regs, {res} blocks/SM resident"

        def check(fn, out=out, wref=wref, idt=idt):
            out.view(idt).fill_(-1)
            fn()
            torch.cuda.synchronize()
            return bool(torch.equal(out.view(idt), wref))

        def sweep(best):
            if best.epv == 2:
                return []
            return [dataclasses.replace(best, block=b, bps=g) for b in (128, 256, 512, 1024) for g in (0, 2048 // b,
                                                                                                      4096 // b, 4, 16)]

        run_case(table, f"NF4->{dname}", nf4_variants()[dname], dq.LEGACY, make_fn, nbytes, check, sweep)
        del out, wref, dam


def awq(table, sms, stream):
    import torch

    from onnx_lowbit.custom_ops.awq import dequantawq_cpu
    from onnx_lowbit.custom_ops.awq import dequantawq_cuda as dc
    rng = np.random.default_rng(1)
    qw = rng.integers(-2 ** 31, 2 ** 31, (K, N // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, (K // G, N // 8), dtype=np.int64).astype(np.int32)
    sc = (2.0 ** rng.uniform(-10, -4, (K // G, N))).astype(np.float16)
    t0 = time.perf_counter()
    w = dequantawq_cpu.dequantize(qw, qz, sc, G, K, N)
    print(f"CPU face AWQ -> float16: {time.perf_counter() - t0:.1f} s")
    wref = torch.from_numpy(w.reshape(-1).view(np.int16)).cuda()
    dqw, dqz, dsc = (torch.from_numpy(a).cuda() for a in (qw, qz, sc))
    out = torch.empty(K * N, dtype=torch.float16, device="cuda")
    nbytes = qw.nbytes + qz.nbytes + sc.nbytes + K * N * 2
    t0 = time.perf_counter()
    lau = dc.launcher()
    ct = time.perf_counter() - t0
    grid, rows = dc.plan(K, N, sms)
    args = [(dqw.data_ptr(), (dqw.numel(),)), (dqz.data_ptr(), (dqz.numel(),)), (dsc.data_ptr(), (dsc.numel(),)),
            (out.data_ptr(), (K * N // 4,)), K, N, G, rows]

    def fn():
        lau.launch(grid, dc.BLOCK, stream(), *args)
    out.view(torch.int16).fill_(-1)
    fn()
    torch.cuda.synchronize()
    exact = bool(torch.equal(out.view(torch.int16), wref))
    table.add("AWQ->float16", "session kernel", None, time_graph(fn), nbytes, exact,
              f"grid {grid} x {dc.BLOCK}, {rows} rows/warp, {regs(lau)} regs, "
              f"{lau.blocks_per_sm(dc.BLOCK)} blocks/SM resident, compile {ct:.1f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=["nf4", "awq", "all"], default="all")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    from onnx_lowbit.custom_ops.device.launch import current_device, sm_count
    t_start = time.perf_counter()
    print("GPU:", torch.cuda.get_device_name(0))
    torch.cuda.init()
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731 - the capture stream inside time_graph
    copy_bw, t_copy = copy_gbps(graph=True)      # a CUDA graph, as the kernels
    table = Table(copy_bw)
    print(f"\n{'case':14s} {'variant (fields != LEGACY)':44s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s}  "
          f"{'exact':9s} notes")
    table.add("copy", "device copy 256 MiB (read + write)", None, t_copy, COPY_BYTES, None)
    if a.op in ("nf4", "all"):
        nf4(table, sms, stream)
    if a.op in ("awq", "all"):
        awq(table, sms, stream)
    print(f"\nfastest bit-exact per case (goal: >= 80% of copy; runtime {time.perf_counter() - t_start:.0f} s):")
    for case in ("NF4->float32", "NF4->float16", "AWQ->float16"):
        b = table.best(case)
        if b:
            print(f"  {case:14s} {b['us']:8.1f} us {b['pct']:6.1f}%  {b['name'].strip()}")
    b32, b16 = (table.best(c) for c in ("NF4->float32", "NF4->float16"))
    if b32 or b16:
        print("\nto make them the defaults (one line):")
        print("  custom_ops/nf4/dequantnf4_cuda.py:  DEFAULT = {" + f"\"float32\": {b32['variant'] if b32 else 'LEGACY'}, "
              f"\"float16\": {b16['variant'] if b16 else 'LEGACY'}" + "}")
    write_json(a.json, {"copy_bw": copy_bw, "rows": table.rows})


if __name__ == "__main__":
    main()

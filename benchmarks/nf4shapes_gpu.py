"""NF4 kernels at the shapes of the LLaMA-style decode sample (d=2048, h=8192, vocab 4096) and of LLaMA-7B, each
kernel the ops' routing tables (ROUTES) can take there: MatMulNF4 (q/k/v/o 2048x2048, down 8192->2048, lm_head
2048->4096, 4096x11008, q/k/v merged 2048->6144) and FusedFFNNF4 (gate+up 2048->8192, 4096->11008).

Every row calls the op's kernel object as a session node does (runtime/direct.call), under a routing setting that
makes the table pick another of its kernels at this shape: "routed" (what sessions run), and e.g. "fp32 decode"
(ONNX_LOWBIT_FP32_DECODE=1), "chains of 2" (the wide decode's K bound raised), "no warp columns" (WARPCOLS off),
"one thread group", "tensor cores" (MatMulNF4's two-row decode off); each row names the kernel it ran. The decode
generator's other options, which no route takes, are gone (docs/lab-log.md, "Removed kernel variants (NF4)"; git
keeps this script's earlier variant sweeps).

Each case cycles through a pool of distinct weights (>= 128 MB in all, more than the 50 MB L2), one per call, as a
decode step does layer after layer; times are CUDA-graph medians per call (the graph holds one call per pool
entry). Anchor in the same run: torch fp16 (x @ W; for the FFN x @ W1, x @ W3, silu * mul) on a pool of fp16
weights, and a 256 MiB device copy. Every row's output is checked against the CPU face on the last pool entry.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/nf4shapes_gpu.py [--only S1,S2] [--rounds 3]
    ... --mm-only 4096x11008 --mm-m 2      MatMulNF4 at M = 2: the two-row decode against the tensor-core kernel
"""
from __future__ import annotations

import argparse
import contextlib
import os

import numpy as np
from timing import copy_gbps, time_graph

from ffn4_gpu import rel

BS = 64
POOL_BYTES = 128 << 20
MM_SHAPES = [(2048, 2048), (8192, 2048), (2048, 4096), (4096, 11008), (2048, 6144)]   # last: q/k/v merged
FFN_SHAPES = [(1, 2048, 8192), (1, 4096, 11008), (2, 2048, 8192), (2, 4096, 11008)]
# (label, module constants to set, ONNX_LOWBIT_FP32_DECODE): the routing settings; a setting that routes to the
# kernel an earlier one ran is skipped
# (U4 off: int4 weights (--quant int4) through the tables, as NF4's; the routed row takes the table-free decode)
MM_SETTINGS = [("routed", {}, False), ("u4 chains of 2", {"U4_WIDE_MIN_K": 1 << 30}, False),
               ("tables", {"U4": False}, False), ("fp32 decode", {}, True),
               ("chains of 2", {"M1_WIDE_MIN_K": 1 << 30, "U4": False}, False),
               ("16-entry table", {"M1_WIDE_MIN_K": 1 << 30, "M1_H2_MIN_K": 1 << 30, "M1_PAIR_MIN_K": 1 << 30,
                                   "U4": False}, False),
               ("tensor cores", {"M2_MAX_M": 1}, False)]
FFN_SETTINGS = [("routed", {}, False), ("no warp columns", {"WARPCOLS": {}}, False),
                ("one thread group", {"WARPCOLS": {}, "grouped": lambda a16, k: False}, False),
                ("chains of 2", {"WARPCOLS": {}, "WIDE_MIN_K": 1 << 30}, False), ("fp32 decode", {}, True)]


@contextlib.contextmanager
def setting(module, consts, fp32):
    """The module constants (and ONNX_LOWBIT_FP32_DECODE) of a routing setting, restored afterwards."""
    saved = {k: getattr(module, k) for k in consts}
    env = os.environ.get("ONNX_LOWBIT_FP32_DECODE")
    try:
        for k, v in consts.items():
            setattr(module, k, v)
        os.environ["ONNX_LOWBIT_FP32_DECODE"] = "1" if fp32 else "0"
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
        if env is None:
            os.environ.pop("ONNX_LOWBIT_FP32_DECODE", None)
        else:
            os.environ["ONNX_LOWBIT_FP32_DECODE"] = env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mm-only", metavar="KxN,...",
                    help="only these MatMulNF4 shapes (e.g. 2048x6144,2048x2048), no FFN cases")
    ap.add_argument("--ffn-only", action="store_true", help="only the FusedFFNNF4 cases")
    ap.add_argument("--only", metavar="S1,S2", help="only the settings whose label holds one of these strings")
    ap.add_argument("--ffn-ms", metavar="M1,M2", help="only the FusedFFNNF4 cases at these M")
    ap.add_argument("--ffn-k", metavar="K1,K2", help="only the FusedFFNNF4 cases at these K")
    ap.add_argument("--ffn-shapes", metavar="MxKxN,...", help="these FusedFFNNF4 cases instead (e.g. 1x3072x8192)")
    ap.add_argument("--mm-m", type=int, default=1, metavar="M", help="MatMulNF4 cases at this M")
    ap.add_argument("--bs", type=int, default=64, help=("NF4 block size (default 64; genai's int4 models: 32)"))
    ap.add_argument("--quant", default="nf4", choices=("nf4", "fp4", "int4"),
                    help="the weights' quant_type (int4: genai's MatMulNBits grid, the table-free decode)")
    ap.add_argument("--rounds", type=int, default=1, help="time every row this many times, in turn (round by "
                    "round), to see the run-to-run spread against the differences")
    a = ap.parse_args()
    global BS
    BS = a.bs
    mm_shapes, ffn_shapes = MM_SHAPES, FFN_SHAPES
    if a.ffn_only:
        mm_shapes = []
    if a.ffn_shapes:
        ffn_shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.ffn_shapes.lower().split(",")]
    if a.ffn_ms:
        ffn_shapes = [c for c in ffn_shapes if str(c[0]) in a.ffn_ms.split(",")]
    if a.ffn_k:
        ffn_shapes = [c for c in ffn_shapes if str(c[1]) in a.ffn_k.split(",")]
    keep = (lambda label: any(t in label for t in a.only.split(","))) if a.only else (lambda label: True)  # noqa: E731
    if a.mm_only:
        mm_shapes, ffn_shapes = [tuple(int(v) for v in sh.split("x")) for sh in a.mm_only.lower().split(",")], []
    import torch
    import torch.nn.functional as F  # noqa: N812

    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cpu, fusedffnnf4_cuda
    from onnx_lowbit.custom_ops.nf4 import common as nf4_common, matmulnf4_cpu, matmulnf4_cuda
    from onnx_lowbit.custom_ops.runtime import direct
    from onnx_lowbit.custom_ops.runtime.routing import route
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0))
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    bw, t_copy = copy_gbps()
    print(f"device copy 256 MiB: {t_copy:.1f} us = {bw:.0f} GB/s")
    rng = np.random.default_rng(0)
    code = nf4_common.parse_attrs({"quant_type": a.quant, "block_size": BS, "K": 64, "N": 1})[4]
    rows = []

    def pool_of(k, n, nw):
        """Distinct NF4 weights (bytes, absmax) on the device, >= POOL_BYTES in all; the last one also on the host."""
        per = nw * (k * n // 2 + k * n // BS * 4)
        cnt = max(4, -(-POOL_BYTES // per))
        host = [(rng.integers(0, 256, k * n // 2, dtype=np.uint8),
                 (rng.random(k * n // BS) * 0.1 + 0.01).astype(np.float32)) for _ in range(nw)]
        dev = []
        for i in range(cnt):
            ws = host if i == cnt - 1 else [(np.roll(q, 977 * (i + 1)), np.roll(am, 31 * (i + 1))) for q, am in host]
            dev.append([(torch.from_numpy(q).cuda(), torch.from_numpy(am).cuda()) for q, am in ws])
        return host, dev

    def timed(calls, check):
        """calls: one closure per pool entry (the last one on the host weights); graph median per call, then the
        last entry's output checked."""
        it = iter(range(1 << 30))
        t = time_graph(lambda: calls[next(it) % len(calls)](), batch=len(calls))
        calls[-1]()
        torch.cuda.synchronize()
        return t, check() if check else None

    def report(case, label, t, nbytes, t_torch, err):
        gbs = nbytes / t / 1e3
        rows.append((case, label, t, 100 * gbs / bw, t_torch / t, err))
        print(f"{case:28s} {label:44s} {t:7.2f} us {gbs:6.0f} GB/s {100 * gbs / bw:5.1f}% copy  "
              f"{t_torch / t:5.2f}x torch  rel {err:.1e}", flush=True)

    def run_settings(case, op, module, settings, m, x, out, dev, nbytes, t_torch, check):
        """Each setting's kernel object calls (one per pool entry), built and graph-captured under the setting."""
        attrs = {"quant_type": a.quant, "block_size": BS, "K": x.shape[1], "N": out.shape[1]}
        jobs, seen = [], set()
        for label, consts, fp32 in settings:
            if not keep(label):
                continue
            with setting(module, consts, fp32):
                calls = [direct.call(op, attrs, [x] + [t for qa in w for t in qa], [out], stream) for w in dev]
                name = route(module.ROUTES, calls[0].kernel.case(m)).kernel
            if name not in seen:
                seen.add(name)
                jobs.append((f"{label} ({name})", module, consts, fp32, calls))
        for rnd in range(a.rounds):
            for label, module_, consts, fp32, calls in jobs:
                with setting(module_, consts, fp32):
                    t, err = timed(calls, check)
                report(case, label + (f" (round {rnd + 1})" if a.rounds > 1 else ""), t, nbytes, t_torch, err)

    m = a.mm_m
    for k, n in mm_shapes:
        case = f"MatMulNF4 M={m} {k}->{n}"
        host, dev = pool_of(k, n, 1)
        x = (torch.randn(m, k, device="cuda") * 0.5).half()
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ref = matmulnf4_cpu.matmul(x.float().cpu().numpy(), host[0][0], host[0][1], code, k, n, BS).astype(np.float64)
        wp = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02
              for _ in range(max(4, -(-POOL_BYTES // (k * n * 2))))]
        t_torch, _ = timed([lambda w=w: torch.matmul(x, w, out=y) for w in wp], None)
        del wp
        print(f"{case:28s} {'torch fp16':44s} {t_torch:7.2f} us {k * n * 2 / t_torch / 1e3:6.0f} GB/s")
        run_settings(case, "MatMulNF4", matmulnf4_cuda, MM_SETTINGS, m, x, y, dev, k * n // 2 + k * n // BS * 4,
                     t_torch, lambda: rel(y.float().cpu().numpy(), ref))

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
        t_torch, _ = timed([lambda w=w: tffn(*w) for w in wp], None)
        del wp
        print(f"{case:28s} {'torch fp16 (2 GEMV + silu*mul)':44s} {t_torch:7.2f} us")
        run_settings(case, "FusedFFNNF4", fusedffnnf4_cuda, FFN_SETTINGS, m, x, s, dev,
                     2 * (k * n // 2 + k * n // BS * 4), t_torch, lambda: rel(s.float().cpu().numpy(), ref))
    print("\nbest per case:")
    for case in dict.fromkeys(r[0] for r in rows):
        best = min((r for r in rows if r[0] == case), key=lambda r: r[2])
        print(f"  {case:28s} {best[1]:44s} {best[2]:7.2f} us ({best[3]:.1f}% copy, {best[4]:.2f}x torch)")


if __name__ == "__main__":
    main()

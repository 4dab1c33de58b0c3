"""Where the time of a decode step goes: GPU kernels of the fp16 original and of the rewritten LLaMA-style decode
step (samples/llama_decode.py --no-bench builds both), profiled in onnxruntime CUDA-EP sessions with CUPTI
(torch.profiler records every kernel of the process, onnxruntime's and ours), without and with CUDA graphs.

    python3 samples/llama_decode.py --device cuda --out /tmp/llama --no-bench
    python3 benchmarks/llama_profile.py /tmp/llama/llama_decode.onnx /tmp/llama/llama_decode.nf4.onnx

Per model and mode: wall ms per step (median), kernels per step, sum of kernel durations per step, and that sum
split into our kernels (Numba: the 4-bit and fused FFN ops here), library weight products (cuBLAS GEMV/GEMM)
and everything else, plus the top kernels. What the 'other' part (and the launch gaps) cost bounds what weight
compression alone can gain. Wall times are taken in a first pass before torch is imported (with torch and its
CUDA libraries loaded the no-graph steps measured much slower: 5.8 vs 3.0 ms for the rewritten model).
"""
from __future__ import annotations

import argparse
import collections
import re

import numpy as np
import onnx
from timing import time_wall, write_json  # noqa: E402 - benchmarks/ is on sys.path when run as a script

WEIGHT_KERNELS = re.compile(r"gemv|gemm|nvjet|cutlass|MatMulNBits|Bnb4|sm90_xmma", re.I)
OURS = re.compile(r"_3cdynamic_3e|cudapy")     # Numba kernels (our ops)


def category(name: str) -> str:
    return "ours" if OURS.search(name) else "weights" if WEIGHT_KERNELS.search(name) else "other"


def short(name: str) -> str:
    """A Numba kernel's mangled name (its module path as length-prefixed parts: ..10custom_ops5fplut10fplut_cuda5_make
    ..) as the op module and what follows it (``fplut_cuda_make...``); other names cut to 90 characters."""
    i = name.find("10custom_ops")
    if i < 0:
        return name[:90]
    i += len("10custom_ops")
    while True:                             # the length-prefixed parts after custom_ops, up to the *_cuda module
        m = re.match(r"\d+", name[i:])
        if not m:
            return name[:90]
        j = i + len(m.group())
        part = name[j:j + int(m.group())]
        i = j + len(part)
        if part.endswith("_cuda"):
            m = re.match(r"\w*?(_[a-z]\w{3,40})", name[i:])
            return part + (m.group(1) if m else "")


def profile(path, ours, feeds, cuda_graph, steps, warmup, kernels=True):
    from onnx_lowbit import api
    from onnx_lowbit import bench as B

    if cuda_graph:
        s = B._make_session(path, ours, "cuda", False, api.InferenceSession)
        shapes, _ = B._output_shapes(s, feeds)
        del s
    sess = B._make_session(path, ours, "cuda", cuda_graph, api.InferenceSession)
    if not cuda_graph:
        shapes, _ = B._output_shapes(sess, feeds)
    bound = B._Bound(sess, feeds, shapes)
    for _ in range(warmup):
        bound.run()
    wall_us, _ = time_wall(bound.run, 50)
    if not kernels:
        del bound, sess
        return wall_us / 1e3
    import torch
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            bound.run()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern = [e for e in kern if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    per = collections.defaultdict(lambda: [0, 0.0])
    cats = collections.Counter()
    for e in kern:
        d = e.device_time if hasattr(e, "device_time") else e.cuda_time
        per[short(e.name)][0] += 1
        per[short(e.name)][1] += d
        cats[category(e.name)] += d
    total = sum(v[1] for v in per.values())
    span = 0.0
    if kern:
        starts = [e.time_range.start for e in kern]
        ends = [e.time_range.end for e in kern]
        span = (max(ends) - min(starts)) / steps
    del bound, sess
    return {"kernels_per_step": len(kern) / steps,
            "kernel_ms_per_step": total / steps / 1e3, "gpu_span_ms_per_step": span / 1e3,
            "ours_ms_per_step": cats["ours"] / steps / 1e3,
            "weights_ms_per_step": cats["weights"] / steps / 1e3, "other_ms_per_step": cats["other"] / steps / 1e3,
            "top": sorted(((k, v[0] / steps, v[1] / steps) for k, v in per.items()), key=lambda r: -r[2])[:18]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("original")
    ap.add_argument("rewritten")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    from onnx_lowbit import bench as B
    B._warm_cuda_context()
    sig = B._signature(onnx.load(a.original, load_external_data=False))
    feeds = B.random_inputs(sig, B.resolve_dims([sig], {}), seed=0)
    res = {}
    runs = [(f"{label}, {'CUDA graph' if g else 'no graph'}", path, ours, g)
            for label, path, ours in (("fp16 original", a.original, False), ("rewritten", a.rewritten, True))
            for g in (False, True)]
    walls = {key: profile(path, ours, feeds, g, a.steps, a.warmup, kernels=False) for key, path, ours, g in runs}
    for key, path, ours, g in runs:
        res[key] = r = profile(path, ours, feeds, g, a.steps, a.warmup)
        r["wall_ms_median"] = walls[key]
        print(f"\n== {key}: wall {r['wall_ms_median']:.3f} ms/step, {r['kernels_per_step']:.0f} kernels/step, "
              f"kernel sum {r['kernel_ms_per_step']:.3f} ms (ours {r['ours_ms_per_step']:.3f}, library weight "
              f"products {r['weights_ms_per_step']:.3f}, other {r['other_ms_per_step']:.3f}), GPU span "
              f"{r['gpu_span_ms_per_step']:.3f} ms")
        for name, n, us in r["top"]:
            print(f"   {us:8.1f} us  {n:5.0f}x  {name}")
    print("\n| model, mode | wall ms | kernels | kernel sum ms | ours ms | cuBLAS ms | other ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, r in res.items():
        print(f"| {k} | {r['wall_ms_median']:.3f} | {r['kernels_per_step']:.0f} | {r['kernel_ms_per_step']:.3f} | "
              f"{r['ours_ms_per_step']:.3f} | {r['weights_ms_per_step']:.3f} | {r['other_ms_per_step']:.3f} |")
    write_json(a.json, res)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()

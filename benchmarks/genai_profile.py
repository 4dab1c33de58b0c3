"""Where a decode token's GPU time goes in onnxruntime-genai's loop, per kernel (issue 32): each folder loaded as
genai_loop.py loads it (CUDA graphs on unless --no-cuda-graph), a prompt, a few warm-up tokens, then --tokens decode
tokens under torch's profiler (CUPTI records every kernel of the process, onnxruntime's and ours alike, also inside
CUDA graphs). Prints per folder: wall ms per token, summed kernel time per token (the rest is the GPU idle between
kernels), the kernels grouped (4-bit / float products, attention, norms, ours, other) and the top kernels.

    python benchmarks/genai_profile.py FOLDER [FOLDER ...] [--prompt 128] [--tokens 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from genai_loop import load  # noqa: E402
from timing import write_json  # noqa: E402

# kernel name patterns -> group (first match wins; names are CUPTI's, mangled or not)
GROUPS = [
    ("ours (onnx-lowbit)", re.compile(r"cudapy|_3cdynamic_3e|onnx_lowbit|fusedffn|matmulawq|nf4|fplut", re.I)),
    ("4-bit products (MatMulNBits)", re.compile(r"MatMulFloat4Bits|MatMulFloatInt4|MatMulNBits|fpA_intB|Dequantize.*4|int4|gemv_4b|"
                                                r"BlkQ4|blkq4", re.I)),
    ("float GEMM (cuBLAS)", re.compile(r"gemm|gemv|sm90_xmma|cutlass|nvjet|ampere_|sm80_", re.I)),
    ("attention (GQA, rotary)", re.compile(r"attention|flash|rotary|RoPE|softmax|GroupQuery|SequenceLengths|"
                                           r"concat.*kv|KV|kernel_mha", re.I)),
    ("norms", re.compile(r"LayerNorm|RMSNorm|SkipLayer", re.I)),
]


def group_of(name: str) -> str:
    for g, rx in GROUPS:
        if rx.search(name):
            return g
    return "other (elementwise, copies, sampling)"


def profile_folder(folder, prompt_len, tokens, warm, cuda_graph):
    import onnxruntime_genai as og
    from torch.profiler import ProfilerActivity, profile
    model, graph = load(folder, cuda_graph)
    params = og.GeneratorParams(model)
    total = prompt_len + warm + tokens + 2
    params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
    g = og.Generator(model, params)
    g.append_tokens(np.random.default_rng(0).integers(3, 1000, prompt_len).astype(np.int32).reshape(1, -1))
    for _ in range(warm):
        g.generate_next_token()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(tokens):
            g.generate_next_token()
        wall = (time.perf_counter() - t0) * 1e3 / tokens
    kernels = collections.Counter()
    counts = collections.Counter()
    from torch.autograd import DeviceType
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels[e.name] += e.device_time_total
            counts[e.name] += 1
    del g
    busy = sum(kernels.values()) / 1e3 / tokens       # us -> ms per token
    groups = collections.Counter()
    for n, t in kernels.items():
        groups[group_of(n)] += t / 1e3 / tokens
    top = [(n, t / 1e3 / tokens, counts[n] / tokens) for n, t in kernels.most_common(15)]
    return dict(folder=os.fspath(folder), cuda_graph=graph, wall_ms=wall, kernel_ms=busy,
                kernels_per_token=sum(counts.values()) / tokens, groups=dict(groups), top=top)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16, help="profiled decode tokens (default 16)")
    ap.add_argument("--warm", type=int, default=8, help="decode tokens before profiling (default 8)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    import torch  # noqa: F401,PLC0415 - the profiler's CUPTI before genai's first kernel
    from onnx_lowbit import genai_config
    for f in a.folders:
        genai_config.prepare(f)
    res = []
    for f in a.folders:
        r = profile_folder(f, a.prompt, a.tokens, a.warm, not a.no_cuda_graph)
        res.append(r)
        print(f"\n== {os.path.basename(os.path.normpath(f))}{' (CUDA graph)' if r['cuda_graph'] else ''}: "
              f"{r['wall_ms']:.3f} ms/token wall (under the profiler), kernels {r['kernel_ms']:.3f} ms/token "
              f"({100 * r['kernel_ms'] / r['wall_ms']:.0f}% busy), {r['kernels_per_token']:.0f} kernels/token")
        for gname, ms in sorted(r["groups"].items(), key=lambda kv: -kv[1]):
            print(f"   {gname:40s} {ms:7.3f} ms  {100 * ms / max(r['kernel_ms'], 1e-9):5.1f}%")
        print("   top kernels (ms/token, launches/token):")
        for n, ms, c in r["top"]:
            print(f"     {ms:7.4f}  {c:5.1f}  {n[:110]}")
    write_json(a.json, res)


if __name__ == "__main__":
    main()

"""Where the GPU time of a 4-bit SwiGLU prefill block goes, per kernel: onnxruntime's unfused graph with
MatMulNBits, our FusedFFNAWQ and FusedFFNNF4, our MatMulAWQ pair (session_gpu.py's models, x[M, K] fp16, int4 group
128 / NF4 block 64), each session run --runs times under torch's profiler (CUPTI sees onnxruntime's kernels and
ours; no CUDA graphs). Prints per model the summed kernel time per run and its top kernels.

    python3 benchmarks/prefill_profile_gpu.py [--shape 2048x8192] [--ms 128] [--runs 50]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import session_gpu as sg  # noqa: E402


def kernel_times(model, m, runs):
    """({kernel name: us per run}, summed us per run) of one session's runs at M = m."""
    import onnxruntime as ort
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import onnx_lowbit
    sess = onnx_lowbit.InferenceSession(model, providers=["CUDAExecutionProvider"])
    x = (np.random.default_rng(7).standard_normal((m, sg.K)) * 0.5).astype(np.float16)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    for o in sess.get_outputs():
        io.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_shape_and_type([m, sg.N], np.float16, "cuda", 0))
    for _ in range(20):
        sess.run_with_iobinding(io)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            sess.run_with_iobinding(io)
    k = collections.Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            k[e.name[:90]] += getattr(e, "device_time_total", None) or e.cuda_time_total
    return {n: t / runs for n, t in k.items()}, sum(k.values()) / runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x8192", help="K x N of the weights")
    ap.add_argument("--ms", default="128", help="comma-separated M values")
    ap.add_argument("--runs", type=int, default=50)
    a = ap.parse_args()
    sg.K, sg.N = (int(v) for v in a.shape.lower().split("x"))
    w1, w3 = sg._weights(1), sg._weights(3)
    sw = sg.swiglu_model(w1, w3)
    cases = [("onnxruntime unfused with MatMulNBits",
              sg.rewrite(sw, "weights4", weights="awq", weights_target="ort")[0]),
             ("ours FusedFFNAWQ", sg.rewrite(sw, "weights4,ffn", weights="awq")[0]),
             ("ours FusedFFNNF4", sg.rewrite(sw, "weights4,ffn", weights="nf4")[0]),
             ("ours MatMulAWQ x2 (gate + up only)", sg.rewrite(sg.pair_model(w1, w3), "weights4", weights="awq")[0])]
    for m in (int(v) for v in a.ms.split(",")):
        for name, model in cases:
            per, total = kernel_times(model, m, a.runs)
            print(f"M={m} {name}: kernels {total:.1f} us per run")
            for n, t in sorted(per.items(), key=lambda kv: -kv[1])[:6]:
                print(f"    {t:7.1f}  {n}")


if __name__ == "__main__":
    main()

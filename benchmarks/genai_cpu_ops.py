"""onnxruntime-genai's CPU products against what `onnx-lowbit genai` makes of them: MatMulNBits in the builder's
`-p int4 -e cpu` form (4 bits, block 32, symmetric, fp32 scales, accuracy_level 4) against our MatMulNF4 with the
int4 code (the same weight, converted without loss by onnx_lowbit.matmulnbits.to_int4, accuracy_level 4), one
node each in an onnxruntime CPU session (ours with our library), random weights of each K x N, rows M.
Medians of alternating rounds (benchmarks/cpu_kernels.compare), one intra-op thread, thread CPU time by default.
The outputs are checked against each other first (level 4 on both sides: relative max difference printed).

    python benchmarks/genai_cpu_ops.py [--shapes 576x960,576x576,576x1536,1536x576,576x49152] [--ms 1,16,64]
                                       [--rounds 7] [--threads 1] [--clock thread|wall]

Default shapes: SmolLM2-135M's products (q/k/v fused, o, gate / up, down, lm_head).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kernels import bound_run, compare, session  # noqa: E402
from timing import print_table  # noqa: E402


def models(K, N, m, seed=0):  # noqa: N803
    """(MatMulNBits model, MatMulNF4 int4 model) of one random weight, A [m, K] fp32."""
    from onnx import TensorProto, helper, numpy_helper

    from onnx_lowbit import domain, matmulnbits
    rng = np.random.default_rng(seed)
    bs, nb = 32, K // 32
    b = rng.integers(0, 256, (N, nb, bs // 2), dtype=np.uint8)
    s = (rng.random(N * nb) * 0.02 + 0.001).astype(np.float32)
    packed, absmax = matmulnbits.to_int4(b, s, None, K, N, bs)

    def model(node, inits, ours):
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, N])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
        ops = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(g, opset_imports=ops + ([domain.opset_import()] if ours else []), ir_version=10)
    nbits = model(helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", bits=4,
                                   block_size=bs, K=K, N=N, accuracy_level=4), {"b": b, "s": s}, False)
    ours = model(helper.make_node("MatMulNF4", ["a", "q", "am"], ["y"], domain=domain.DOMAIN, quant_type="int4",
                                  block_size=bs, K=K, N=N, accuracy_level=4), {"q": packed, "am": absmax}, True)
    return nbits, ours


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="576x960,576x576,576x1536,1536x576,576x49152")
    p.add_argument("--ms", default="1,16,64")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", default="thread", choices=["thread", "wall"])
    a = p.parse_args(argv)
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    rows = []
    for shape in a.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))  # noqa: N806
        for m in (int(v) for v in a.ms.split(",")):
            nbits, ours = models(K, N, m)
            x = np.random.default_rng(m + K).standard_normal((m, K)).astype(np.float32)
            f1, y1 = bound_run(session(nbits, a.threads), {"a": x}, (m, N), np.float32)
            f2, y2 = bound_run(session(ours, a.threads, ours=True), {"a": x}, (m, N), np.float32)
            f1()
            f2()
            diff = float(np.abs(y2 - y1).max() / np.abs(y1).max())
            t = compare({"nbits": f1, "ours": f2}, a.rounds, clock=clock)
            ratio = t["nbits"] / t["ours"]
            rows.append([f"{K} x {N}", m, f"{t['nbits']:.1f}", f"{t['ours']:.1f}",
                         f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower", f"{diff:.1e}"])
            print(rows[-1], flush=True)
    print(f"\n{a.threads} thread(s), {a.clock} clock, median of {a.rounds} alternating rounds, us per call")
    print_table(["K x N", "M", "MatMulNBits (genai -e cpu)", "ours MatMulNF4 int4", "ours is", "max diff"], rows)


if __name__ == "__main__":
    main()

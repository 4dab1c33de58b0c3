"""RMSNorm with its residual add against onnxruntime's SkipSimplifiedLayerNormalization (what onnxruntime-genai's
builder writes), one node each in an onnxruntime CPU session, one decode row [1, 1, D], fp32 and fp16: the residual
sums compared bit for bit, the largest output difference, and each session's median run in alternating rounds
(onnx_lowbit.rounds.timed_rounds).

    python benchmarks/rmsnorm_cpu.py [--d 576] [--runs 2500]
"""
from __future__ import annotations

import argparse

import numpy as np


def models(dtype, d):
    from onnx import TensorProto as TP
    from onnx import helper as oh
    from onnx import numpy_helper as nh

    from onnx_lowbit import domain
    et = TP.FLOAT16 if dtype == np.float16 else TP.FLOAT
    g = nh.from_array((1 + 0.1 * np.random.default_rng(0).standard_normal(d)).astype(dtype), "g")
    ins = [oh.make_tensor_value_info("x", et, [1, 1, d]), oh.make_tensor_value_info("s", et, [1, 1, d])]
    outs = [oh.make_tensor_value_info("y", et, [1, 1, d]), oh.make_tensor_value_info("h", et, [1, 1, d])]
    ort_node = oh.make_node("SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y", "", "", "h"],
                            domain="com.microsoft", epsilon=1e-5)
    our_node = oh.make_node("RMSNorm", ["x", "g", "s"], ["y", "h"], domain=domain.DOMAIN, epsilon=1e-5)
    out = []
    for node, dom in ((ort_node, ("com.microsoft", 1)), (our_node, (domain.DOMAIN, 1))):
        m = oh.make_model(oh.make_graph([node], "norm", ins, outs, [g]),
                          opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(*dom)])
        m.ir_version = 8
        out.append(m)
    return out


def main(argv=None):
    import onnxruntime as ort

    import onnx_lowbit
    from onnx_lowbit.rounds import timed_rounds
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--runs", type=int, default=2500, help="timed runs per session (spread over the rounds)")
    a = ap.parse_args(argv)
    print("| dtype | D | onnxruntime us per run | RMSNorm us per run | H bit-equal | max abs dY |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for dtype in (np.float32, np.float16):
        ref, our = models(dtype, a.d)
        sa = ort.InferenceSession(ref.SerializeToString(), providers=["CPUExecutionProvider"])
        sb = onnx_lowbit.InferenceSession(our, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(1)
        f = {"x": (3 * rng.standard_normal((1, 1, a.d))).astype(dtype),
             "s": rng.standard_normal((1, 1, a.d)).astype(dtype)}
        ra, rb = sa.run(None, f), sb.run(None, f)
        same_h = bool(np.array_equal(ra[1].view(np.uint8), rb[1].view(np.uint8)))
        err = float(np.max(np.abs(ra[0].astype(np.float64) - rb[0].astype(np.float64))))
        ta, tb = timed_rounds([lambda: sa.run(None, f), lambda: sb.run(None, f)], a.runs, warmup=200)
        print(f"| {np.dtype(dtype).name} | {a.d} | {1e3 * np.median(ta):.2f} | {1e3 * np.median(tb):.2f} | "
              f"{'yes' if same_h else 'no'} | {err:.2e} |")


if __name__ == "__main__":
    main()

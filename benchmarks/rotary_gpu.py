"""The rotary embedding of q and k in onnxruntime CUDA sessions: onnxruntime's own kernels for the exporters'
spelling (per tensor Mul, Slice, Slice, Neg, Concat, Mul, Add; cos / sin shared) against the same graph after our
``rotary`` pass (two Rotary nodes), in one run. fp16, LLaMA-style shapes q, k [B, H, S, D] with cos / sin
[1, 1, S, D]; IOBinding on fixed device buffers; median wall us per run() with and without CUDA graphs. Each
fused result is checked against the unfused session's first (bit for bit) before it is timed.

    PYTHONPATH=/tmp/ortgpu/site:/tmp/gs:.:benchmarks:tests python3 benchmarks/rotary_gpu.py [--runs 500]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from timing import time_session  # noqa: E402 - benchmarks/ is on sys.path when run as a script

SHAPES = [(1, 16, 1, 128), (1, 32, 1, 128), (1, 16, 128, 128), (4, 32, 512, 128)]


def qk_model(b, h, s, d, dt=np.float16):
    """q, k -> rotated q, k (the exporters' spelling), cos / sin inputs [1, 1, S, D]."""
    from onnx import TensorProto, helper, numpy_helper
    et = TensorProto.FLOAT16 if dt == np.float16 else TensorProto.FLOAT
    ints = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    nodes = []
    for t in ("q", "k"):
        nodes += [helper.make_node("Mul", [t, "cos"], [f"{t}_a"]),
                  helper.make_node("Slice", [t, "z", "h", "ax"], [f"{t}_s1"]),
                  helper.make_node("Slice", [t, "h", "big", "ax"], [f"{t}_s2"]),
                  helper.make_node("Neg", [f"{t}_s2"], [f"{t}_n"]),
                  helper.make_node("Concat", [f"{t}_n", f"{t}_s1"], [f"{t}_r"], axis=-1),
                  helper.make_node("Mul", [f"{t}_r", "sin"], [f"{t}_b"]),
                  helper.make_node("Add", [f"{t}_a", f"{t}_b"], [f"{t}_out"])]
    vi = lambda n, shp: helper.make_tensor_value_info(n, et, list(shp))  # noqa: E731
    g = helper.make_graph(nodes, "rotary_qk", [vi("q", (b, h, s, d)), vi("k", (b, h, s, d)), vi("cos", (1, 1, s, d)),
                                               vi("sin", (1, 1, s, d))],
                          [vi("q_out", (b, h, s, d)), vi("k_out", (b, h, s, d))],
                          [ints("z", [0]), ints("h", [d // 2]), ints("big", [2 ** 62]), ints("ax", [-1])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--json")
    a = ap.parse_args()
    import onnx_lowbit
    rows = []
    print(f"{'q, k shape':>18} {'graph':>5} {'unfused us':>11} {'Rotary us':>10} {'speed-up':>8}  ops")
    for shape in SHAPES:
        model = qk_model(*shape)
        fused, report = onnx_lowbit.rewrite(model, passes=["rotary"])
        ops = sorted({n.op_type for n in fused.graph.node})
        rng = np.random.default_rng(sum(shape))
        feeds = {n: (rng.standard_normal(shape) * 2).astype(np.float16) for n in ("q", "k")}
        for n in ("cos", "sin"):
            feeds[n] = rng.uniform(-1, 1, (1, 1) + shape[2:]).astype(np.float16)
        for graph in (False, True):
            tu, pu, yu = time_session(model, feeds, a.runs, graph, feeds["q"])
            tf, pf, yf = time_session(fused, feeds, a.runs, graph, feeds["q"])
            if not all(np.array_equal(u, f, equal_nan=True) for u, f in zip(yu, yf)):
                raise RuntimeError(f"{shape}: Rotary differs from onnxruntime's unfused result")
            rows.append({"shape": list(shape), "cuda_graph": graph, "unfused_us": tu, "unfused_p90": pu,
                         "rotary_us": tf, "rotary_p90": pf, "ops": ops})
            print(f"{str(shape):>18} {'yes' if graph else 'no':>5} {tu:11.1f} {tf:10.1f} {tu / tf:7.2f}x  "
                  f"{','.join(ops)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Decoder-side ops of ours in onnxruntime CUDA sessions against onnxruntime's own kernels for the exporters'
spelling of the same computation, one op per run, fp16, IOBinding on fixed device buffers, median wall us per run()
with and without CUDA graphs (timing.compare_sessions). Each fused result is checked against the unfused session's
before it is timed.

  rotary       q and k rotated (per tensor Mul, Slice, Slice, Neg, Concat, Mul, Add; cos / sin [1, 1, S, D] shared)
               against the same graph after the rotary pass (two Rotary nodes); bit for bit
  rmsnorm      residual Add + LLaMA RMSNorm (Add, Cast, Pow, ReduceMean, Add, Sqrt, Div, Mul, Cast, Mul; onnxruntime
               fuses the norm into its LayerNormalization) against the rmsnorm pass (one RMSNorm node writing Y
               and H); H bit for bit, Y within 2e-3
  kvattention  the eager attention over a KV cache of LLaMA exports (K / V repeats for grouped-query attention,
               MatMul with Transpose(K), scale, mask Add, Cast + Softmax + Cast, MatMul with V;
               tests/test_kvattention_kernels.unfused_model) against one KVAttention node; within one fp16 rounding

    PYTHONPATH=/tmp/ortgpu/site:/tmp/gs:.:benchmarks:tests python3 benchmarks/decoder_ops_gpu.py \\
        [--op rotary|rmsnorm|kvattention|all] [--runs 500] [--json OUT.json]

(Folded from rotary_gpu.py, rmsnorm_gpu.py and kvattention_gpu.py; same shapes and method.)
"""
from __future__ import annotations

import argparse

import numpy as np

from timing import compare_sessions, write_json  # noqa: E402 - benchmarks/ is on sys.path when run as a script

ROTARY_SHAPES = [(1, 16, 1, 128), (1, 32, 1, 128), (1, 16, 128, 128), (4, 32, 512, 128)]
RMSNORM_SHAPES = [(1, 1, 2048), (1, 1, 4096), (1, 128, 2048), (4, 512, 4096)]
# (B, Hq, S, D, Hkv, T, mask shape, scale, divide): the LLaMA sample's decode step (16 heads, cache 128 + 1),
# grouped-query decode at longer caches, 4 and 16 queries (speculative decoding), a prefill chunk
KVATTENTION_SHAPES = [(1, 16, 1, 128, 16, 129, (1, 1, 1, 129), 0.0884, 0),
                      (1, 32, 1, 128, 8, 1025, (1, 1, 1, 1025), 0.0884, 0),
                      (1, 32, 1, 128, 8, 4096, (1, 1, 1, 4096), 0.0884, 0),
                      (1, 16, 4, 128, 16, 132, (1, 1, 4, 132), 0.0884, 0),
                      (1, 16, 16, 128, 16, 144, (1, 1, 16, 144), 0.0884, 0),
                      (1, 32, 64, 128, 8, 576, (1, 1, 64, 576), 0.0884, 0)]


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


def rotary(runs):
    import onnx_lowbit
    cases = []
    for shape in ROTARY_SHAPES:
        model = qk_model(*shape)
        fused, _ = onnx_lowbit.rewrite(model, passes=["rotary"])
        print(str(shape), "ops after the pass:", ",".join(sorted({n.op_type for n in fused.graph.node})))
        rng = np.random.default_rng(sum(shape))
        feeds = {n: (rng.standard_normal(shape) * 2).astype(np.float16) for n in ("q", "k")}
        for n in ("cos", "sin"):
            feeds[n] = rng.uniform(-1, 1, (1, 1) + shape[2:]).astype(np.float16)
        cases.append((shape, model, fused, feeds, feeds["q"]))

    def check(yu, yf):
        if not all(np.array_equal(u, f, equal_nan=True) for u, f in zip(yu, yf)):
            raise RuntimeError("Rotary differs from onnxruntime's unfused result")
    return compare_sessions(cases, runs, "rotary", check, label="shape")


def rmsnorm(runs):
    import onnx_lowbit
    from test_rmsnorm_kernels import unfused_model
    cases = []
    for shape in RMSNORM_SHAPES:
        model = unfused_model(shape, np.float16, True)
        fused, _ = onnx_lowbit.rewrite(model, passes=["rmsnorm"])
        print(str(shape), "ops after the pass:", ",".join(sorted({n.op_type for n in fused.graph.node})))
        rng = np.random.default_rng(sum(shape))
        feeds = {n: (rng.standard_normal(shape) * 2).astype(np.float16) for n in ("X", "skip")}
        cases.append((shape, model, fused, feeds, feeds["X"]))

    def check(yu, yf):
        if not (np.array_equal(yu[1], yf[1]) and np.allclose(yu[0].astype(np.float32), yf[0].astype(np.float32),
                                                              rtol=2e-3, atol=2e-3)):
            raise RuntimeError("RMSNorm differs from onnxruntime's unfused result")
    return compare_sessions(cases, runs, "rmsnorm", check, label="shape")


def kvattention(runs):
    from test_kvattention_kernels import _close, _feeds, fused_model, unfused_model
    cases = []
    for case in KVATTENTION_SHAPES:
        feeds = _feeds(case, np.float16, seed=case[5])
        name = ",".join(str(x) for x in case[:6])
        cases.append((name, unfused_model(case, np.float16), fused_model(case, np.float16), feeds, feeds["Q"]))
    return compare_sessions(cases, runs, "attention", lambda yu, yf: _close(yf[0], yu[0], np.float16),
                            label="B,Hq,S,D,Hkv,T")


OPS = {"rotary": rotary, "rmsnorm": rmsnorm, "kvattention": kvattention}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=[*OPS, "all"], default="all")
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--json")
    a = ap.parse_args()
    ops = list(OPS) if a.op == "all" else [a.op]
    res = {op: OPS[op](a.runs) for op in ops}
    write_json(a.json, res[ops[0]] if len(ops) == 1 else res)


if __name__ == "__main__":
    main()

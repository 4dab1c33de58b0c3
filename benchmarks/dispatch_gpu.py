"""Per-op dispatch cost of our ops in an onnxruntime CUDA session, against a native op in the same run.

Chains of L unary nodes on x[1, 4096] fp16 (L = 1 and 16): onnxruntime's Relu vs our FPLUT, with native plan
replay on (default) and off (every compute through Python), and with onnxruntime's CUDA graphs. IOBinding on
device buffers; median wall time per run() over many runs. Per-op overhead = (ours - native) / L.

    python3 benchmarks/dispatch_gpu.py [--runs 3000] [--json out.json]
"""
from __future__ import annotations

import argparse

import numpy as np

from timing import bind_io, time_wall, write_json  # noqa: E402 - benchmarks/ is on sys.path when run as a script


def chain_model(op, length, table):
    from onnx import TensorProto, helper

    from onnx_lowbit import domain
    nodes = []
    for i in range(length):
        src, dst = ("x" if i == 0 else f"t{i}"), ("y" if i == length - 1 else f"t{i + 1}")
        if op == "Relu":
            nodes.append(helper.make_node("Relu", [src], [dst], name=f"n{i}"))
        else:
            nodes.append(helper.make_node("FPLUT", [src], [dst], domain=domain.DOMAIN, name=f"n{i}", function="silu",
                                          cut_points=list(table.cut_points),
                                          table=table.values.astype(np.float32).tolist()))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4096])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4096])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


def time_session(model, runs, cuda_graph=False):
    import onnx_lowbit
    prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if cuda_graph else {})]
    sess = onnx_lowbit.InferenceSession(model, providers=prov)
    x = np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float16)
    io, (yv,) = bind_io(sess, {"x": x}, x)
    med, p90 = time_wall(lambda: sess.run_with_iobinding(io), runs, warmup=200)
    return med, p90, yv.numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    from onnx_lowbit import fplut, fplut_tables
    from onnx_lowbit.custom_ops.runtime import bridge
    table = fplut_tables.get_table("silu")
    print("GPU:", torch.cuda.get_device_name(0))
    rows = []
    for length in (1, 16):
        native = chain_model("Relu", length, table)
        ours = chain_model("FPLUT", length, table)
        x = np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float16)
        want = x
        for _ in range(length):
            want = fplut.apply(want, table.cut_points, table.values)
        for graph in (False, True):
            med_n, p90_n, _ = time_session(native, a.runs, graph)
            cases = [("plans on", True)] + ([] if graph else [("plans off (Python per call)", False)])
            for label, plans_on in cases:
                bridge.set_native_plans(plans_on)
                try:
                    med, p90, y = time_session(ours, a.runs, graph)
                finally:
                    bridge.set_native_plans(True)
                exact = bool(np.array_equal(y.view(np.uint16), want.view(np.uint16)))
                rows.append({"nodes": length, "cuda_graph": graph, "case": label, "native_us": med_n,
                             "native_p90": p90_n, "ours_us": med, "ours_p90": p90,
                             "overhead_per_op_us": (med - med_n) / length, "bit_exact": exact})
    print("| nodes | CUDA graph | our FPLUT | native Relu us/run (p90) | FPLUT us/run (p90) | per-op overhead us "
          "| bit-exact |")
    print("| ---: | --- | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['nodes']} | {'yes' if r['cuda_graph'] else 'no'} | {r['case']} | {r['native_us']:.1f} "
              f"({r['native_p90']:.1f}) | {r['ours_us']:.1f} ({r['ours_p90']:.1f}) | "
              f"{r['overhead_per_op_us']:.1f} | {r['bit_exact']} |")
    write_json(a.json, rows)


if __name__ == "__main__":
    main()

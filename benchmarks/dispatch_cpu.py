"""Per-op dispatch cost of our CPU ops in an onnxruntime CPU session, against a native onnxruntime op in the same run.

A chain of L nodes (default 100) on a tiny float32 tensor x[1, 8]: onnxruntime's Sigmoid against our FPLUT with
native CPU replay on (the default: after the first call the shim runs FPLUT's compiled entry, no Python) and off
(every compute through the Python callback, as before native dispatch), each with default session options and with
intra_op_num_threads = 1. The cases alternate in one process, ``--rounds`` rounds of ``--runs`` run() calls each;
figures are medians over rounds of the mean time per run(). Per-node overhead = (ours - Sigmoid) / L. Outputs are
checked bit for bit against the numpy reference before timing. ``--size`` sets the tensor's elements (a larger one
shows the thread pools at work: FPLUT's entry splits from 32768 elements over onnxruntime's intra-op pool).
``--mlp L`` times instead L blocks MatMul [1, 576] x [576, 1536] -> activation -> MatMul [1536, 576] (SmolLM2's MLP
widths; onnxruntime's MatMuls use its intra-op threads between our ops, as in a decode step): per-block overhead.

    python3 benchmarks/dispatch_cpu.py [--nodes 100] [--size 8] [--mlp 0] [--rounds 15] [--runs 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from timing import write_json  # noqa: E402 - benchmarks/ is on sys.path when run as a script


def chain_model(op, length, size, table, mlp=False):
    from onnx import TensorProto, helper, numpy_helper

    from onnx_lowbit import domain
    nodes, inits = [], []
    rng = np.random.default_rng(1)
    for i in range(length):
        src, dst = ("x" if i == 0 else f"t{i}"), ("y" if i == length - 1 else f"t{i + 1}")
        if mlp:   # MatMul up, the activation, MatMul down
            w1, w2 = f"w1_{i}", f"w2_{i}"
            inits += [numpy_helper.from_array((rng.standard_normal((size, 1536)) * 0.04).astype(np.float32), w1),
                      numpy_helper.from_array((rng.standard_normal((1536, size)) * 0.04).astype(np.float32), w2)]
            nodes.append(helper.make_node("MatMul", [src, w1], [f"u{i}"], name=f"up{i}"))
            src, last = f"u{i}", dst
            dst = f"a{i}"
        if op == "Sigmoid":
            nodes.append(helper.make_node("Sigmoid", [src], [dst], name=f"n{i}"))
        else:
            nodes.append(helper.make_node("FPLUT", [src], [dst], domain=domain.DOMAIN, name=f"n{i}",
                                          function="sigmoid", cut_points=list(table.cut_points),
                                          table=table.values.astype(np.float32).tolist()))
        if mlp:
            nodes.append(helper.make_node("MatMul", [dst, w2], [last], name=f"down{i}"))
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, size]) for n in ("x", "y")]
    g = helper.make_graph(nodes, "g", vi[:1], vi[1:], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=10)


def session(model, threads):
    import onnxruntime as ort

    import onnx_lowbit
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    onnx_lowbit.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=0, help="L MLP blocks instead of the chain (the tensor: [1, 576])")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    import os

    import onnxruntime as ort

    from onnx_lowbit import fplut, fplut_tables
    from onnx_lowbit.custom_ops.runtime import bridge
    table = fplut_tables.get_table("sigmoid")
    mlp = a.mlp > 0
    nodes, size = (a.mlp, 576) if mlp else (a.nodes, a.size)
    x = {"x": np.random.default_rng(0).standard_normal((1, size)).astype(np.float32)}
    want = None
    if not mlp:
        want = x["x"]
        for _ in range(nodes):
            want = fplut.apply(want, table.cut_points, table.values)
    what = f"{nodes} MLP blocks (MatMul, activation, MatMul) on x[1, 576]" if mlp else \
        f"{nodes} nodes on x[1, {size}]"
    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs, {what} float32")
    cases = []   # (label, threads, session, native on)
    for threads, tlabel in ((0, "default options"), (1, "intra_op_num_threads=1")):
        anchor_sess = session(chain_model("Sigmoid", nodes, size, table, mlp), threads)
        cases.append(("Sigmoid (onnxruntime)", tlabel, anchor_sess, None))
        ours = session(chain_model("FPLUT", nodes, size, table, mlp), threads)
        for label, on in (("FPLUT native", True), ("FPLUT Python (native off)", False)):
            bridge.set_native_cpu(on)
            y = ours.run(None, x)[0]
            if want is not None and not np.array_equal(y.view(np.uint32), want.view(np.uint32)):
                raise SystemExit(f"{label}, {tlabel}: FPLUT chain differs from the numpy reference")
            if want is None:   # the MLP: FPLUT's table approximates Sigmoid (rel. error ~1e-3)
                ref = anchor_sess.run(None, x)[0]
                err = np.abs(y - ref).max() / np.abs(ref).max()
                if not err < 2e-2:
                    raise SystemExit(f"{label}, {tlabel}: MLP output off the Sigmoid graph's by {err:.3g}")
            cases.append((label, tlabel, ours, on))
    times = {i: [] for i in range(len(cases))}
    try:
        for _ in range(a.rounds):        # alternate the cases: drifts of a shared machine hit all of them alike
            for i, (_, _, sess, on) in enumerate(cases):
                if on is not None:
                    bridge.set_native_cpu(on)
                for _ in range(10):
                    sess.run(None, x)
                t0 = time.perf_counter()
                for _ in range(a.runs):
                    sess.run(None, x)
                times[i].append((time.perf_counter() - t0) / a.runs * 1e6)
    finally:
        bridge.set_native_cpu(True)
    med = {i: statistics.median(ts) for i, ts in times.items()}
    anchor = {c[1]: med[i] for i, c in enumerate(cases) if c[3] is None}
    rows = []
    unit = "block" if mlp else "node"
    print(f"| session options | op | us per run (median) | us per {unit} | over Sigmoid, us per {unit} |")
    print("| --- | --- | ---: | ---: | ---: |")
    for i, (label, tlabel, _, on) in enumerate(cases):
        over = (med[i] - anchor[tlabel]) / nodes
        rows.append({"options": tlabel, "op": label, "us_per_run": med[i], "us_per_node": med[i] / nodes,
                     "over_native_us_per_node": over, "rounds": times[i]})
        print(f"| {tlabel} | {label} | {med[i]:.1f} | {med[i] / nodes:.2f} | "
              f"{'-' if on is None else f'{over:.2f}'} |")
    write_json(a.json, rows)


if __name__ == "__main__":
    main()

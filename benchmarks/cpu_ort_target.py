"""Which 4-bit target is faster on the CPU: our ops (``--target lowbit``) or onnxruntime's own (``--target ort``),
the figures behind onnx_lowbit/cpu_passes.py's CPU_WEIGHTS table (issue 34).

    python benchmarks/cpu_ort_target.py                         # both sections, 1 thread
    python benchmarks/cpu_ort_target.py --only products --ms 1 --shapes 2048x2048

* ``products``: one MatMul [M, K] x [K, N] rewritten by the weights4 pass with each target, as the pass emits it:
  AWQ (RTN, group 128) as our MatMulAWQ, as onnxruntime's MatMulNBits with accuracy_level 0 and 4 (AWQ's zero
  points; ``--ort-form awq``) and in MatMulNBits' compact form at level 4 (block 32); NF4 (block 64) as our
  MatMulNF4 at accuracy_level 0 and 4 (int8 activations: what ``--device cpu --weights nf4`` emits) and as
  onnxruntime's MatMulBnb4; and the fp32 MatMul.
* ``mlp``: the demo's LLaMA MLP (samples/llama_mlp.onnx: 2 blocks, d = 128, 352 hidden), x [1, seq, 128], fp32 and
  rewritten as ``rewrite --device cpu`` selects the passes (weights4 + merge) with each target.

Sessions: one intra-op thread (``--threads``), IOBinding on preallocated buffers, all contenders in one process,
alternating rounds; each figure is the median over rounds of the per-call median of a batch. Clock: with one
intra-op thread onnxruntime runs every node on the calling thread, so time.thread_time (thread CPU time: other jobs
on a shared machine do not count); with more threads the wall clock (time.perf_counter).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kernels import bound_run, session, words  # noqa: E402
from ffn4_cpu import _clock, timed  # noqa: E402
from timing import print_table  # noqa: E402

# name -> weights4 options (passes/weights4.py); None: the fp32 model as it is (the products and the MLP alike)
VARIANTS = {
    "fp32": None,
    "awq lowbit": dict(weights="awq"),
    "awq ort lvl0": dict(weights="awq", weights_target="ort", weights_ort_accuracy=0),
    "awq ort lvl4": dict(weights="awq", weights_target="ort", weights_ort_accuracy=4),
    "compact ort lvl4": dict(weights="awq", weights_target="ort", weights_ort_form="compact",
                             weights_ort_accuracy=4),
    "nf4 lowbit": dict(weights="nf4"),
    "nf4 lowbit lvl4": dict(weights="nf4", weights_nf4_accuracy=4),   # what --device cpu --weights nf4 emits
    "nf4 ort (Bnb4)": dict(weights="nf4", weights_target="ort"),
}
# the rows of the table: (contender, its anchor)
PAIRS = [("awq ort lvl4", "awq lowbit"), ("awq ort lvl0", "awq lowbit"), ("compact ort lvl4", "awq lowbit"),
         ("nf4 ort (Bnb4)", "nf4 lowbit"), ("awq lowbit", "fp32"), ("awq ort lvl4", "fp32"), ("nf4 lowbit", "fp32"),
         ("nf4 lowbit lvl4", "nf4 lowbit"), ("nf4 lowbit lvl4", "awq ort lvl4"),
         ("nf4 lowbit lvl4", "compact ort lvl4"), ("nf4 lowbit lvl4", "awq ort lvl0"), ("nf4 lowbit lvl4", "fp32")]


def _matmul_model(K, N, seed=0):  # noqa: N803
    from onnx import TensorProto, helper, numpy_helper
    w = (np.random.default_rng(K + N + seed).standard_normal((K, N)) * 0.05).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _variants(model, variants, passes_names):
    from onnx_lowbit import passes
    out = {}
    for name, opts in variants.items():
        out[name] = model if opts is None else passes.run_passes(model, passes=passes_names, **opts)[0]
    return out


def _ours(model):
    return any(n.domain == "onnx_lowbit" for n in model.graph.node)


def _rows(got, outs, t, cname, label, m, ref="fp32"):
    rows = []
    for a, b in PAIRS:
        if a in got and b in got:
            err = float(np.linalg.norm(outs[a] - outs[ref]) / np.linalg.norm(outs[ref]))
            rows.append([t, cname, label, m, a, f"{got[a]:.1f}", b, f"{got[b]:.1f}", words(got[a], got[b]),
                         f"{err:.4f}"])
            print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    return rows


HEAD = ["threads", "clock", "model", "M", "contender", "us", "anchor", "anchor us", "contender is",
        "rel-L2 vs fp32"]


def products_section(threads, shapes, ms, rounds, batch):
    import numba
    rows = []
    for t in threads:
        numba.set_num_threads(t)
        clock, cname = _clock(t)
        for K, N in shapes:  # noqa: N806
            models = _variants(_matmul_model(K, N), VARIANTS, ["weights4"])
            for m in ms:
                a = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
                runs, outs = {}, {}
                for name, mod in models.items():
                    runs[name], outs[name] = bound_run(session(mod, t, ours=_ours(mod)), {"a": a}, (m, N), np.float32)
                got = timed(runs, rounds, clock, batch)
                rows += _rows(got, outs, t, cname, f"{K}x{N}", m)
    print_table(HEAD, rows, numeric=[0, 3, 5, 7, 9])
    return rows


def mlp_section(threads, seqs, rounds, batch):
    import numba

    from onnx_lowbit import model_io, samples
    model = model_io.load(samples.path("llama_mlp.onnx"))
    models = _variants(model, VARIANTS, ["weights4", "merge"])   # what rewrite --device cpu selects
    for name, mod in models.items():
        print(f"{name}: {', '.join(sorted({n.op_type for n in mod.graph.node}))}", file=sys.stderr)
    rows = []
    for t in threads:
        numba.set_num_threads(t)
        clock, cname = _clock(t)
        for seq in seqs:
            x = np.random.default_rng(seq).standard_normal((1, seq, 128)).astype(np.float32)
            runs, outs = {}, {}
            for name, mod in models.items():
                runs[name], outs[name] = bound_run(session(mod, t, ours=_ours(mod)), {"x": x}, (1, seq, 128),
                                                   np.float32)
            got = timed(runs, rounds, clock, batch)
            rows += _rows(got, outs, t, cname, "llama_mlp", seq)
    print_table(HEAD, rows, numeric=[0, 3, 5, 7, 9])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["products", "mlp"], action="append")
    p.add_argument("--threads", default="1")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=20, help="calls per round and contender")
    p.add_argument("--shapes", default="2048x2048,2048x5632,5632x2048", help="products' K x N")
    p.add_argument("--ms", default="1,16", help="products' rows M")
    p.add_argument("--variants", help="comma-separated VARIANTS names to time (default all)")
    p.add_argument("--seqs", default="1,16", help="the MLP's x [1, seq, 128]")
    args = p.parse_args(argv)
    import onnx_lowbit.custom_ops  # noqa: F401  (sets OMP_WAIT_POLICY before Numba's pool starts)
    threads = [int(v) for v in args.threads.split(",")]
    only = args.only or ["products", "mlp"]
    if args.variants:
        keep = args.variants.split(",")
        for name in [v for v in VARIANTS if v not in keep]:
            del VARIANTS[name]
    if "mlp" in only:
        mlp_section(threads, [int(v) for v in args.seqs.split(",")], args.rounds, args.batch)
    if "products" in only:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        products_section(threads, shapes, [int(v) for v in args.ms.split(",")], args.rounds, args.batch)


if __name__ == "__main__":
    main()

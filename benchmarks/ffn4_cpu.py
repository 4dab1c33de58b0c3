"""The 4-bit ops on the CPU against onnxruntime, timed by CPU clocks (issue 34):

* ``mlp``: the demo's LLaMA MLP (samples/llama_mlp.onnx: 2 blocks, d = 128, 352 hidden) as the fp32 original and
  rewritten with ``--weights nf4`` / ``--weights awq`` (FusedFFNNF4 / FusedFFNAWQ + MatMulNF4 / MatMulAWQ down
  products), x [1, seq, 128] for each seq;
* ``m1``: one product at M = 1 per K x N: MatMulNF4 (block 64), MatMulAWQ (group 128) in our sessions, the AWQ
  kernel alone (matmulawq_cpu.product), onnxruntime's MatMulNBits on the same AWQ weights (accuracy_level 0 and 4)
  and the fp32 MatMul.

Sessions run with IOBinding on preallocated buffers (benchmarks/cpu_kernels.py's helpers), all in one process,
alternating rounds; each figure is the median over rounds of the per-call median of a batch. Clocks: with one
intra-op thread onnxruntime runs every node on the calling thread, so the per-call time is that thread's CPU time
(time.thread_time: the other jobs on a shared machine do not count); with more threads the wall clock
(time.perf_counter), which such jobs do disturb.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from cpu_kernels import SETTLE_S, bound_run, session, words
from timing import print_table


def timed(fns: dict, rounds: int, clock, batch: int) -> dict:
    """name -> median over ``rounds`` alternating rounds of the per-call median of ``batch`` calls (us; before each
    batch a pause of SETTLE_S and one untimed call)."""
    for f in fns.values():
        f()
        f()
    got = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            time.sleep(SETTLE_S)   # the previous contender's onnxruntime threads stop spinning (onnx_lowbit/rounds.py)
            f()
            ts = []
            for _ in range(batch):
                t = clock()
                f()
                ts.append(clock() - t)
            got[k].append(statistics.median(ts) * 1e6)
    return {k: statistics.median(v) for k, v in got.items()}


def _clock(threads):
    return (time.thread_time, "thread CPU") if threads == 1 else (time.perf_counter, "wall")


def mlp_section(threads, seqs, rounds, batch):
    from onnx_lowbit import model_io, passes, samples
    model = model_io.load(samples.path("llama_mlp.onnx"))
    models = {"fp32": model}
    for w in ("nf4", "awq"):
        models[w], _ = passes.run_passes(model, weights=w)
        ops = sorted({n.op_type for n in models[w].graph.node if n.domain == "onnx_lowbit"})
        print(f"--weights {w}: {', '.join(ops)}", file=sys.stderr)
    rows = []
    for t in threads:
        clock, cname = _clock(t)
        for seq in seqs:
            x = np.random.default_rng(seq).standard_normal((1, seq, 128)).astype(np.float32)
            runs, outs = {}, {}
            for name, mod in models.items():
                runs[name], outs[name] = bound_run(session(mod, t, ours=name != "fp32"), {"x": x}, (1, seq, 128),
                                                   np.float32)
            got = timed(runs, rounds, clock, batch)
            for w in ("nf4", "awq"):
                err = np.abs(outs[w] - outs["fp32"]).max() / np.abs(outs["fp32"]).max()
                rows.append([t, cname, seq, w, f"{got['fp32']:.1f}", f"{got[w]:.1f}", words(got[w], got["fp32"]),
                             f"{err:.3f}"])
                print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(["threads", "clock", "seq (M)", "weights", "fp32 original us", "rewritten us", "rewritten is",
                 "rel err vs fp32"], rows, numeric=[0, 2, 4, 5])
    return rows


def m1_section(threads, shapes, rounds, batch):
    import numba

    from onnx_lowbit import awq, domain
    from onnx_lowbit.custom_ops.awq import matmulawq_cpu
    from onnx_lowbit.custom_ops.awq.dequantawq_cpu import parse_attrs

    from cpu_kernels_4bit import _models, _weights
    rows = []
    for t in threads:
        numba.set_num_threads(t)
        clock, cname = _clock(t)
        for K, N in shapes:  # noqa: N806
            w, qw, qz, sc, q, am = _weights(K, N)
            w32 = awq.dequantize(qw, qz, sc, 128, K, N).astype(np.float32)
            sh = parse_attrs({"group_size": 128, "K": K, "N": N})
            a = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
            runs = {}
            for name, mod in _models(K, N, w32, qw, qz, sc, q, am, 1).items():
                ours = any(n.domain == domain.DOMAIN for n in mod.graph.node)    # e.g. "nf4 lvl4" too
                runs[name], _ = bound_run(session(mod, t, ours=ours), {"a": a}, (1, N), np.float32)
            runs["awq kernel"] = lambda: matmulawq_cpu.product(a, qw, qz, sc, sh)  # noqa: B023
            got = timed(runs, rounds, clock, batch)
            for ours in ("nf4", "awq"):
                s_us = got[ours]
                rows.append([t, cname, f"{K}x{N}", ours, f"{s_us:.0f}",
                             f"{got['awq kernel']:.0f}" if ours == "awq" else "", f"{got['nbits0']:.0f}",
                             words(s_us, got["nbits0"]), f"{got['nbits4']:.0f}", words(s_us, got["nbits4"]),
                             f"{got['fp32']:.0f}", words(s_us, got["fp32"])])
                print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(["threads", "clock", "K x N", "op", "session us", "kernel alone us", "NBits lvl0 us", "vs lvl0",
                 "NBits lvl4 us", "vs lvl4", "fp32 MatMul us", "vs fp32"], rows, numeric=[0, 4, 5, 6, 8, 10])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["mlp", "m1"], action="append")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=30, help="calls per round and case")
    p.add_argument("--seqs", default="1,16", help="the MLP's x [1, seq, 128]")
    p.add_argument("--shapes", default="2048x2048,2048x5632,5632x2048", help="m1's K x N")
    args = p.parse_args(argv)
    import onnx_lowbit.custom_ops  # noqa: F401  (sets OMP_WAIT_POLICY before Numba's pool starts)
    threads = [int(v) for v in args.threads.split(",")]
    only = args.only or ["mlp", "m1"]
    if "mlp" in only:
        mlp_section(threads, [int(v) for v in args.seqs.split(",")], args.rounds, args.batch)
    if "m1" in only:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        m1_section(threads, shapes, args.rounds, args.batch)


if __name__ == "__main__":
    main()

"""CPU kernels against the onnxruntime ops they replace, in one process (issue 34).

    python benchmarks/cpu_kernels.py                       # everything, 1 and 2 threads
    python benchmarks/cpu_kernels.py --only fplut --threads 1 --rounds 9
    python benchmarks/cpu_kernels.py --only 4bit --shapes 2048x2048 --ms 1,4,24
    python benchmarks/cpu_kernels.py --only idle           # CPU time burnt while idle after a call

Sections:
  fplut  FPLUT (kernel alone, and as a node in an onnx_lowbit session with IOBinding) on fp32 / fp16 tensors of
         1e4..1e7 elements, against onnxruntime's Sigmoid, Sigmoid+Mul (SiLU), Gelu (opset 20) and Tanh one-node
         models of the same tensor (each with its shipped table: fplut_tables).
  4bit   MatMulNF4 (accuracy_level 0 and 4) and MatMulAWQ (kernel alone: the CPU face's ``product``, and as a
         session node) against onnxruntime's MatMulNBits (accuracy_level 0 and 4, the AWQ weights in its layout:
         passes.weights4_quant) and the fp32 MatMul of the dequantised weight, at M = 1..64.
  idle   process CPU seconds burnt during 0.5 s of sleep right after each of our products (a spinning thread
         pool shows up here), and the time of a plain onnxruntime MatMul model run right after.
Threads: Numba's pool gets numba.set_num_threads(t) (our kernels split over that many threads); onnxruntime sessions
intra_op_num_threads = t, allow_spinning as --ort-spin says (with 2 threads its spinning pool competes with ours).
Timing: every contender runs ``--rounds`` rounds, alternating, each round a 50 ms pause (the previous contender's
onnxruntime threads stop spinning), one untimed call, then the median of a batch of calls (batch sized to ~20 ms); the table shows the median of the round medians in us and the ratio in words (ours
against the anchor: "1.8x faster" means the anchor takes 1.8x our time). The machine's other load shows up as
noise: compare ratios from one run. ``--clock``: wall (time.perf_counter, default), thread (time.thread_time: the
calling thread's CPU time, steadier on a shared machine; only meaningful with --threads 1, where every contender
runs on the calling thread) or process (time.process_time: all threads' CPU time, counts spinning pools too).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import print_table  # noqa: E402

from onnx_lowbit.rounds import SETTLE_S  # noqa: E402  (the pause before each contender's batch, as in rounds)


# ------------------------------------------------------------------------------------------------ timing helpers
CLOCK = {"now": time.perf_counter}   # --clock
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}


def _batch(fn):
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    return max(1, min(200, int(0.02 / max(one, 1e-7))))


def compare(fns: dict, rounds: int, clock=None) -> dict:
    """name -> median over ``rounds`` alternating rounds of the per-call median of a batch (us; before each batch a
    pause of SETTLE_S and one untimed call), timed by ``clock``
    (the 4bit section: time.thread_time for one thread, where other jobs on a shared machine do not count), else by
    --clock."""
    for f in fns.values():
        f()
    batches = {k: _batch(f) for k, f in fns.items()}
    got = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            time.sleep(SETTLE_S)   # the previous contender's onnxruntime threads stop spinning (onnx_lowbit/rounds.py)
            f()
            ts = []
            now = clock or CLOCK["now"]
            for _ in range(batches[k]):
                t = now()
                f()
                ts.append(now() - t)
            got[k].append(statistics.median(ts) * 1e6)
    return {k: statistics.median(v) for k, v in got.items()}


def words(ours, anchor):
    """'1.8x faster' when the anchor takes 1.8x our time, '1.3x slower' when we take 1.3x its time."""
    if ours <= anchor:
        return f"{anchor / ours:.2f}x faster"
    return f"{ours / anchor:.2f}x slower"


SPIN = {"value": "1"}     # onnxruntime's session.intra_op.allow_spinning for every session (--ort-spin)


def session(model, threads, ours=False):
    import onnxruntime as ort

    import onnx_lowbit
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", SPIN["value"])
    data = model.SerializeToString()
    if ours:
        return onnx_lowbit.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def bound_run(sess, feeds, out_shape, out_dtype):
    """A no-argument function running ``sess`` with IOBinding on preallocated CPU buffers; (function, output)."""
    import onnxruntime as ort
    io = sess.io_binding()
    for k, v in feeds.items():
        io.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
    out = np.empty(out_shape, out_dtype)
    io.bind_ortvalue_output(sess.get_outputs()[0].name, ort.OrtValue.ortvalue_from_numpy(out))
    return (lambda: sess.run_with_iobinding(io)), out


# ------------------------------------------------------------------------------------------------------- FPLUT
ORT_OPS = {"sigmoid": ["Sigmoid"], "silu": ["Sigmoid", "Mul"], "gelu": ["Gelu"], "tanh": ["Tanh"],
           "hardswish": ["HardSwish"],
           "hardswish_spelled": ["Add", "Clip", "Mul", "Div"]}    # x * Clip(x + 3, 0, 6) / 6, as paddle2onnx writes it
TABLE_OF = {"hardswish_spelled": "hardswish"}                   # --functions name -> FPLUT table, where they differ


def _elementwise_model(ops, et, n):
    from onnx import helper, numpy_helper
    inits = []
    if ops == ["Sigmoid", "Mul"]:
        nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    elif ops == ["Add", "Clip", "Mul", "Div"]:
        dt = np.float16 if et == 10 else np.float32
        inits = [numpy_helper.from_array(np.array(v, dt), k) for k, v in (("three", 3), ("zero", 0), ("six", 6))]
        nodes = [helper.make_node("Add", ["x", "three"], ["a"]), helper.make_node("Clip", ["a", "zero", "six"], ["c"]),
                 helper.make_node("Mul", ["x", "c"], ["m"]), helper.make_node("Div", ["m", "six"], ["y"])]
    else:
        nodes = [helper.make_node(ops[0], ["x"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", et, [n])],
                          [helper.make_tensor_value_info("y", et, [n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _fplut_model(function, et, n):
    from onnx import helper

    from onnx_lowbit import domain, fplut, fplut_tables
    node = helper.make_node("FPLUT", ["x"], ["y"], domain=domain.DOMAIN,
                            **fplut.node_attributes(fplut_tables.get_table(function)))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", et, [n])],
                          [helper.make_tensor_value_info("y", et, [n])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), domain.opset_import()], ir_version=10)


def fplut_section(threads, sizes, functions, rounds):
    import numba
    from onnx import TensorProto

    from onnx_lowbit import fplut, fplut_tables
    from onnx_lowbit.custom_ops.fplut import fplut_cpu
    rows = []
    for t in threads:
        numba.set_num_threads(t)
        for dt, et in ((np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT16)):
            for n in sizes:
                x = (np.random.default_rng(n).standard_normal(n) * 3).astype(dt)
                for fn in functions:
                    tab = fplut_tables.get_table(TABLE_OF.get(fn, fn))
                    lut = fplut_cpu.kernel_table(fplut.expand_table(tab.cut_points, tab.values), np.dtype(dt))
                    serial, parallel, bits = fplut_cpu.KERNELS[np.dtype(dt)]
                    kern = parallel if n >= fplut_cpu.PARALLEL_MIN else serial
                    stream = fplut_cpu.streams(np.dtype(dt), x.nbytes)      # as FPLUTKernel.compute decides
                    yk = np.empty_like(x)
                    run_ours, ys = bound_run(session(_fplut_model(TABLE_OF.get(fn, fn), et, n), t, ours=True),
                                             {"x": x}, (n,), dt)
                    run_ort, yo = bound_run(session(_elementwise_model(ORT_OPS[fn], et, n), t), {"x": x}, (n,), dt)
                    got = compare({"kernel": lambda: kern(x.view(bits), lut, yk.view(bits), stream),  # noqa: B023
                                   "session": run_ours, "ort": run_ort}, rounds)
                    ref = tab(x)
                    rb = ref.view(bits)
                    if not (np.array_equal(yk.view(bits), rb) and np.array_equal(ys.view(bits), rb)):
                        raise SystemExit(f"FPLUT {fn} {np.dtype(dt).name} n={n}: not bit-exact with the reference")
                    err = float(np.nanmax(np.abs(ys.astype(np.float64) - yo.astype(np.float64))))
                    rows.append([t, np.dtype(dt).name, f"{n:.0e}", "+".join(ORT_OPS[fn]), f"{got['ort']:.1f}",
                                 f"{got['kernel']:.1f}", words(got["kernel"], got["ort"]), f"{got['session']:.1f}",
                                 words(got["session"], got["ort"]), f"{err:.1e}"])
                    print(" ".join(str(v) for v in rows[-1]), file=sys.stderr, flush=True)
    print_table(["threads", "dtype", "elements", "onnxruntime op", "ort us", "FPLUT kernel us", "kernel vs ort",
                 "FPLUT session us", "session vs ort", "max |FPLUT - ort|"], rows, numeric=[4, 5, 7, 9])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["fplut", "4bit", "idle"], action="append",
                   help="sections to run (repeatable; default all)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", default="1e4,1e5,1e6,1e7", help="FPLUT element counts")
    p.add_argument("--functions", default="sigmoid,silu,gelu,tanh")
    p.add_argument("--shapes", default="2048x2048,2048x5632,5632x2048", help="4-bit K x N")
    p.add_argument("--ms", default="1,2,4,8,16,24,64", help="4-bit rows M")
    p.add_argument("--ort-spin", default="1", choices=["0", "1"],
                   help="onnxruntime sessions' session.intra_op.allow_spinning (default 1, onnxruntime's own default: "
                        "its idle intra-op threads spin after a run, next to our kernels' threads)")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="timer: wall (perf_counter), thread (thread_time: steady on a shared machine, 1 thread "
                        "only) or process (process_time)")
    a = p.parse_args(argv)
    SPIN["value"] = a.ort_spin
    CLOCK["now"] = CLOCKS[a.clock]
    only = a.only or ["fplut", "4bit", "idle"]
    threads = [int(v) for v in a.threads.split(",")]
    print(f"cores: {os.cpu_count()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS')}, onnxruntime allow_spinning={a.ort_spin}, "
          f"clock={a.clock}")
    import onnx_lowbit.custom_ops  # noqa: F401  (sets OMP_WAIT_POLICY before Numba's pool starts)
    if "fplut" in only:
        fplut_section(threads, [int(float(v)) for v in a.sizes.split(",")], a.functions.split(","), a.rounds)
    if "4bit" in only:
        from cpu_kernels_4bit import fourbit_section
        fourbit_section(threads, [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")],
                        [int(v) for v in a.ms.split(",")], a.rounds)
    if "idle" in only:
        from cpu_kernels_4bit import idle_section
        idle_section(threads)


if __name__ == "__main__":
    main()

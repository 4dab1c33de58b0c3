"""QuantGRU on the CPU (issue 34): our CPU kernel (Numba) against onnxruntime's float GRU, in the same process.

    python benchmarks/gru_cpu.py                      # H = 256, 400, 512, 600; T = 500; C = 257; int8 and int16
    python benchmarks/gru_cpu.py --hs 400 --cs 257 400 --runs 21 --stream-frames 300 [--json OUT.json]

Per (H, C): a random float GRU (torch's init, uniform +-1/sqrt(H); linear_before_reset=1, forward, batch 1),
X ~ N(0, 1) [T, 1, C]; QuantGRU parameters from gru_quant's calibration of that GRU (bits 8 and 16). Timed, all
in one process, the implementations in rounds (onnx_lowbit/rounds.py: per round and implementation a 50 ms pause,
one untimed call, then its timed calls in a row; medians). Alternating call by call, as before 2026-11-29 19:10 UTC,
each call ran next to the previous session's spinning intra-op threads: onnxruntime's two-thread float GRU measured
12.4 ms there against 6.5 run by itself, which inflated every ratio against it (int8 "3.1x" was 1.3x):

* `ort float GRU`: a one-node ONNX GRU model in a plain onnxruntime CPU session (default options: its intra-op
  pool on all cores); `ort float GRU 1 thread`: the same with intra_op_num_threads = 1;
* `session intN`: a one-node QuantGRU model in an onnxruntime CPU session with our library
  (onnx_lowbit.InferenceSession; W and R are initializers, so on VNNI hosts the kernel packs them once when the
  session is created; short calls are served by the native entry, long ones through the bridge's Python callback);
* `kernel intN`: quantgru_cpu.quant_gru_run on the host arrays (no session, no input checks, but Python's per-call
  work; W and R packed per call from PACK_MIN_STEPS steps, the direct path below).

`--narrow` adds `int16n`: the int16 parameters with W and R replaced by their top bytes (W >> 8, R >> 8: every
weight in [-128, 127], int16 storage: the "int8 weights, int16 arithmetic" form, which the kernel detects and
runs with int8 weights); timing inputs (the outputs are checked bit for bit, not for accuracy).
`--clock thread`: single-thread comparison by the calling thread's CPU time (time.thread_time; Numba's pool set
to 1 thread, onnxruntime sessions with intra_op_num_threads = 1 only), steadier than wall time on a shared
machine.

Offline: one call runs all T steps. Streaming: T = 1 per run, the state carried (Y_h fed back as initial_h), `--stream-frames`
frames each, in rounds of consecutive frames. Before timing, each QuantGRU
session's Y and Y_h are checked bit for bit against the integer reference (onnx_lowbit.gru_int.quant_gru).
Ratios: "1.8x faster" = the float GRU's (default options) time / ours, of the medians and of the minimums (on a
loaded machine the minimum is the steadier figure: preemption only adds time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import print_table, write_json  # noqa: E402


def float_gru_model(W, R, B, H, with_h0):  # noqa: N803
    import onnx
    from onnx import TensorProto, helper
    inits = [onnx.numpy_helper.from_array(np.asarray(a, np.float32), n) for n, a in (("W", W), ("R", R), ("B", B))]
    ins = ["X", "W", "R", "B", "", "h0"] if with_h0 else ["X", "W", "R", "B"]
    node = helper.make_node("GRU", ins, ["Y", "Y_h"], hidden_size=H, linear_before_reset=1)
    gin = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", W.shape[2]])]
    if with_h0:
        gin.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, "N", H]))
    outs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, None)]
    g = helper.make_graph([node], "g", gin, outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def quant_gru_model(p, H, bits, with_h0):  # noqa: N803
    import onnx
    from onnx import TensorProto, helper

    from onnx_lowbit import domain
    inits = [onnx.numpy_helper.from_array(np.asarray(p[k]), k) for k in ("W", "R", "B", "channel_exp", "luts")]
    ins = ["X", "W", "R", "B", "channel_exp", "luts", "", "h0"] if with_h0 else ["X", "W", "R", "B", "channel_exp",
                                                                                 "luts"]
    node = helper.make_node("QuantGRU", ins, ["Y", "Y_h"], domain=domain.DOMAIN, hidden_size=H, bits=bits,
                            exponents=list(p["exponents"]), zero_points=list(p["zero_points"]))
    gin = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", p["W"].shape[2]])]
    if with_h0:
        gin.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, [1, "N", H]))
    outs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, None)]
    g = helper.make_graph([node], "g", gin, outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), domain.opset_import()], ir_version=9)


def params(H, C, T, bits, seed):  # noqa: N803
    from onnx_lowbit import gru_quant
    rng = np.random.default_rng(seed)
    k = 1 / np.sqrt(H)
    W, R, B = (rng.uniform(-k, k, s) for s in [(1, 3 * H, C), (1, 3 * H, H), (1, 6 * H)])
    X = rng.standard_normal((T, 1, C)).astype(np.float32)
    ranges = gru_quant.calibrate(X[:64], W, R, B, hidden_size=H)
    qp = {b: gru_quant.quant_params(W, R, B, ranges, bits=b) for b in bits}
    return X, (W, R, B), qp


CLOCK = time.perf_counter   # wall time
HEAD = ["case", "implementation", "ms (median)", "ms (min)", "vs ort float (medians)", "vs ort float (mins)"]


def alternate(fns, runs):
    """(median, min) seconds per call of each of ``fns`` (name -> callable): in rounds (onnx_lowbit/rounds.py: per
    round and implementation a 50 ms pause, one untimed call, then its timed calls in a row; each implementation in
    each place of the order in turn), after one untimed call of each."""
    from onnx_lowbit import rounds
    names = list(fns)
    ts = rounds.timed_rounds([fns[n] for n in names], runs, clock=lambda: CLOCK(), warmup=1)
    return {n: (statistics.median(v) * 1e-3, min(v) * 1e-3) for n, v in zip(names, ts)}


def one_thread():
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return so


def ratio(base, ours):
    r = base / ours
    return f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hs", type=int, nargs="+", default=[256, 400, 512, 600])
    ap.add_argument("--cs", type=int, nargs="+", default=[257])
    ap.add_argument("--T", type=int, default=500)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--runs", type=int, default=15, help="timed offline runs of each implementation")
    ap.add_argument("--stream-frames", type=int, default=200, help="timed streamed frames of each (0: skip)")
    ap.add_argument("--json")
    ap.add_argument("--narrow", action="store_true", help="add int16 with weights in the int8 range (int16n)")
    ap.add_argument("--one-task", action="store_true",
                    help="add `session intN one task`: batch 1 on the single-task entry (quantgru_cpu.TASKS and FRAMES "
                         "off), as before the items on onnxruntime's pool (quantgru_tasks, quantgru_frames)")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: 1 thread everywhere, timed by time.thread_time")
    a = ap.parse_args()
    global CLOCK
    if a.clock == "thread":
        import numba
        numba.set_num_threads(1)
        CLOCK = time.thread_time
    import onnxruntime as ort

    import onnx_lowbit
    from onnx_lowbit import gru_int
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    cpu = ["CPUExecutionProvider"]
    print(f"cores: {os.cpu_count()}, onnxruntime {ort.__version__}, OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY')}", flush=True)
    rows, out = [], []
    for C in a.cs:  # noqa: N806
        for H in a.hs:  # noqa: N806
            X, (W, R, B), qp = params(H, C, a.T, a.bits, seed=H + C)
            fsess = ort.InferenceSession(float_gru_model(W, R, B, H, False).SerializeToString(), providers=cpu)
            fs1 = ort.InferenceSession(float_gru_model(W, R, B, H, False).SerializeToString(), one_thread(),
                                       providers=cpu)
            fns = {"ort float GRU": lambda: fsess.run(None, {"X": X}),  # noqa: B023
                   "ort float GRU 1 thread": lambda: fs1.run(None, {"X": X})}  # noqa: B023
            if a.clock == "thread":
                fns = {"ort float GRU": fns["ort float GRU 1 thread"]}
            for b in variants(a, qp):
                p = qp[b]
                attrs = dict(hidden_size=H, bits=nbits(b), exponents=p["exponents"], zero_points=p["zero_points"])
                qs = onnx_lowbit.InferenceSession(quant_gru_model(p, H, nbits(b), False), providers=cpu,
                                                  sess_options=one_thread() if a.clock == "thread" else None)
                y, yh = qs.run(None, {"X": X})
                want = gru_int.quant_gru(X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], **attrs)
                ok = np.array_equal(y, want[0]) and np.array_equal(yh, want[1])
                if not ok:
                    raise SystemExit(f"H={H} C={C} int{b}: session output differs from the integer reference")
                args = (X, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"])
                fns[f"session int{b}"] = lambda qs=qs: qs.run(None, {"X": X})  # noqa: B023
                if a.one_task:
                    q1 = one_task_session(quant_gru_model(p, H, nbits(b), False), a, {"X": X})
                    fns[f"session int{b} one task"] = lambda q1=q1: q1.run(None, {"X": X})  # noqa: B023
                fns[f"kernel int{b}"] = lambda args=args, attrs=attrs: quantgru_cpu.quant_gru_run(*args, **attrs)
            med = alternate(fns, a.runs)
            base, base_min = med["ort float GRU"]
            for n, (t, tmin) in med.items():
                rows.append((f"C={C} H={H} T={a.T}", n, f"{t * 1e3:.2f}", f"{tmin * 1e3:.2f}",
                             "" if n == "ort float GRU" else ratio(base, t),
                             "" if n == "ort float GRU" else ratio(base_min, tmin)))
                out.append({"C": C, "H": H, "T": a.T, "mode": "offline", "impl": n, "ms": t * 1e3,
                            "min_ms": tmin * 1e3})
            print_table(HEAD, rows[-len(med):])
            if a.stream_frames:
                stream(a, C, H, X, W, R, B, qp, rows, out)
    print("\nAll (streaming: ms per frame):")
    print_table(HEAD, rows)
    write_json(a.json, out)


def one_task_session(model, a, feeds):
    """A QuantGRU session whose first call (which records the native plan of that shape) ran with
    quantgru_cpu.TASKS and FRAMES off: batch 1 (whole calls and frames) then stays on the single-task entry."""
    import onnx_lowbit
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    sess = onnx_lowbit.InferenceSession(model, providers=["CPUExecutionProvider"],
                                        sess_options=one_thread() if a.clock == "thread" else None)
    quantgru_cpu.TASKS = quantgru_cpu.FRAMES = False
    try:
        sess.run(None, feeds)
    finally:
        quantgru_cpu.TASKS = quantgru_cpu.FRAMES = True
    return sess


def nbits(b):
    return 16 if b == "16n" else b


def variants(a, qp):
    """The QuantGRU variants to time: a.bits, plus "16n" (int16, weights in the int8 range) with --narrow."""
    if a.narrow and 16 in qp and "16n" not in qp:
        p = dict(qp[16])
        p["W"], p["R"] = p["W"] >> 8, p["R"] >> 8
        qp["16n"] = p
    return list(a.bits) + (["16n"] if a.narrow and 16 in qp else [])


def stream(a, C, H, X, W, R, B, qp, rows, out):  # noqa: N803
    """Frame by frame (T = 1 per run, the state carried): median time per frame, the implementations in rounds of
    consecutive frames (onnx_lowbit/rounds.py)."""
    import onnxruntime as ort

    import onnx_lowbit
    from onnx_lowbit.custom_ops.gru import quantgru_cpu
    cpu = ["CPUExecutionProvider"]
    fs = ort.InferenceSession(float_gru_model(W, R, B, H, True).SerializeToString(), providers=cpu)
    fs1 = ort.InferenceSession(float_gru_model(W, R, B, H, True).SerializeToString(), one_thread(), providers=cpu)
    impls = {"ort float GRU": (lambda x, h: fs.run(None, {"X": x, "h0": h})[1]),
             "ort float GRU 1 thread": (lambda x, h: fs1.run(None, {"X": x, "h0": h})[1])}
    if a.clock == "thread":
        impls = {"ort float GRU": impls["ort float GRU 1 thread"]}
    for b in variants(a, qp):
        p = qp[b]
        qs = onnx_lowbit.InferenceSession(quant_gru_model(p, H, nbits(b), True), providers=cpu,
                                          sess_options=one_thread() if a.clock == "thread" else None)
        attrs = dict(hidden_size=H, bits=nbits(b), exponents=p["exponents"], zero_points=p["zero_points"])
        impls[f"session int{b}"] = lambda x, h, qs=qs: qs.run(None, {"X": x, "h0": h})[1]
        if a.one_task:
            q1 = one_task_session(quant_gru_model(p, H, nbits(b), True), a,
                                  {"X": X[:1], "h0": np.zeros((1, 1, H), np.float32)})
            impls[f"session int{b} one task"] = lambda x, h, q1=q1: q1.run(None, {"X": x, "h0": h})[1]
        impls[f"kernel int{b}"] = (lambda x, h, p=p, attrs=attrs: quantgru_cpu.quant_gru_run(
            x, p["W"], p["R"], p["B"], p["channel_exp"], p["luts"], None, h, **attrs)[1])
    state = {n: np.zeros((1, 1, H), np.float32) for n in impls}
    pos = {n: 0 for n in impls}
    n_frames = min(a.stream_frames, X.shape[0])

    def frame(n):
        def f():   # the implementation's next frame of X (its own position), its state carried
            i = pos[n] % X.shape[0]
            state[n] = impls[n](X[i:i + 1], state[n])
            pos[n] += 1
        return f
    from onnx_lowbit import rounds
    names = list(impls)
    times = rounds.timed_rounds([frame(n) for n in names], n_frames, clock=lambda: CLOCK(), warmup=1)
    ts = {n: [v * 1e-3 for v in times[k]] for k, n in enumerate(names)}
    base, base_min = statistics.median(ts["ort float GRU"]), min(ts["ort float GRU"])
    for n, v in ts.items():
        t, tmin = statistics.median(v), min(v)
        rows.append((f"C={C} H={H} streaming", n, f"{t * 1e3:.3f}", f"{tmin * 1e3:.3f}",
                     "" if n == "ort float GRU" else ratio(base, t),
                     "" if n == "ort float GRU" else ratio(base_min, tmin)))
        out.append({"C": C, "H": H, "T": 1, "mode": "streaming", "impl": n, "ms": t * 1e3, "min_ms": tmin * 1e3})
    print_table(HEAD, rows[-len(impls):])

if __name__ == "__main__":
    main()

"""Side-by-side onnxruntime CUDA sessions: our 4-bit / fused ops against onnxruntime's own, in one run.

Decode shapes of LLaMA-7B's FFN (x[M, 4096], gate/up W[4096, 11008], fp16), every model run as a whole session
with IOBinding on fixed device buffers, median wall us per run() (after warm-up), with and without onnxruntime's
CUDA graphs. The 4-bit and fused models are made from the fp16 ones by our passes (weights4 with
--target lowbit|ort, ffn), so every row computes the same function:

  gate+up pair:  fp16 MatMul x2 | onnxruntime MatMulBnb4 x2 (nf4, block 64) | MatMulNBits x2 (int4, group 128)
                 | our MatMulNF4 x2 | our MatMulAWQ x2
  SwiGLU block:  fp16 unfused (MatMul x2, Sigmoid, Mul x2) | unfused with MatMulNBits | our FusedFFN (fp16; the
                 default layout, [K, N] for this dynamic-shape model, and [N, K])
                 | our FusedFFNNF4 | our FusedFFNAWQ
  prefill sweep: SwiGLU fp16 unfused vs FusedFFN for M in 1..1024, without and with CUDA graphs (the crossover);
                 FusedFFN on [N, K] weights as routed ("nk"; ffn_weights="nk") and on [K, N] weights as routed
                 ("kn"; what ffn_weights="auto", the default, gives this dynamic-shape fp16 model), and
                 alternatives timed in the same run: "cuBLAS" ([N, K] on cuBLAS where it takes its tensor-core
                 kernel), "kn cuBLAS" ([K, N] on cuBLAS where it takes
                 its tensor-core kernel), and with fp32 weights "strict" / "kn strict" (prefill GEMMs in strict
                 fp32, TF32 off). Each is checked against a float64 reference (first and
                 last rows) before
                 it is timed; "py/run" counts compute calls that reached Python per timed run (0: all native).

    python3 benchmarks/session_gpu.py [--runs 300] [--json out.json] [--skip-sweep | --sweep-only] [--ms 1,8,64]
                                      [--block-ms 1,4] [--shape 2048x8192]

Where FusedFFNNF4 takes the warp-column kernel (fusedffnnf4_cuda.WARPCOLS: K = 2048, M = 1, 2), a row "ours
FusedFFNNF4 (block kernel, WARPCOLS off)" times the same model with the block decode kernel.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from timing import time_wall, write_json  # noqa: E402 - benchmarks/ is on sys.path when run as a script

K, N = 4096, 11008


def _weights(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((K, N)) * 0.02).astype(np.float16 if MIXED else DTYPE)


def pair_model(w1, w3, m="M"):
    from onnx import helper, numpy_helper
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["g"], name="gate_proj"),
         helper.make_node("MatMul", ["x", "w3"], ["u"], name="up_proj")], "pair",
        [helper.make_tensor_value_info("x", _elem(), [m, K])],
        [helper.make_tensor_value_info("g", _elem(), [m, N]),
         helper.make_tensor_value_info("u", _elem(), [m, N])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w3, "w3")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def swiglu_model(w1, w3, m="M"):
    """The SwiGLU block; with --dtype mixed, fp32 x and fp16 weights read through Cast(to=float) (what the ffn pass
    turns into FusedFFN's mixed mode; onnxruntime folds the Casts into fp32 initializers)."""
    from onnx import TensorProto, helper, numpy_helper
    casts = [helper.make_node("Cast", [w], [w + "_f"], to=TensorProto.FLOAT, name=w + "_cast")
             for w in ("w1", "w3")] if MIXED else []
    wn = ("w1_f", "w3_f") if MIXED else ("w1", "w3")
    g = helper.make_graph(
        casts + [helper.make_node("MatMul", ["x", wn[0]], ["g"], name="gate_proj"),
         helper.make_node("MatMul", ["x", wn[1]], ["u"], name="up_proj"),
         helper.make_node("Sigmoid", ["g"], ["sg"], name="act_sigmoid"),
         helper.make_node("Mul", ["g", "sg"], ["a"], name="act_mul"),
         helper.make_node("Mul", ["a", "u"], ["s"], name="gate_mul")], "swiglu",
        [helper.make_tensor_value_info("x", _elem(), [m, K])],
        [helper.make_tensor_value_info("s", _elem(), [m, N])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w3, "w3")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def rewrite(model, passes, **opts):
    import onnx_lowbit
    out, _ = onnx_lowbit.rewrite(model, passes=passes, **opts)
    ops = sorted({f"{n.domain or 'ai.onnx'}.{n.op_type}" for n in out.graph.node})
    return out, ops


DEVICE = "cuda"
DTYPE = np.float16              # of x, the weights and the outputs (--dtype)
MIXED = False                   # --dtype mixed: DTYPE float32, weights fp16 (the SwiGLU block casts them)


def _elem():
    from onnx import TensorProto
    return TensorProto.FLOAT16 if DTYPE == np.float16 else TensorProto.FLOAT
BLOCK_KERNEL = "(block kernel, WARPCOLS off)"   # a row that times FusedFFNNF4 without the warp-column kernel


def time_model(model, m, runs, cuda_graph, check_replay=False):
    import onnxruntime as ort

    import onnx_lowbit
    if DEVICE == "cpu":
        if cuda_graph:
            raise RuntimeError("no CUDA graphs on the CPU")
        prov = ["CPUExecutionProvider"]
    else:
        prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if cuda_graph else {})]
    from onnx_lowbit.custom_ops.runtime import bridge
    sess = onnx_lowbit.InferenceSession(model, providers=prov)
    x = (np.random.default_rng(7 + m).standard_normal((m, K)) * 0.5).astype(DTYPE)
    xv = ort.OrtValue.ortvalue_from_numpy(x, DEVICE, 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xv)
    outs = []
    for o in sess.get_outputs():
        ov = ort.OrtValue.ortvalue_from_shape_and_type([m, N], DTYPE, DEVICE, 0)
        io.bind_ortvalue_output(o.name, ov)
        outs.append(ov)
    sess.run_with_iobinding(io)                  # the result checked is the first run's (recorded in Python)
    ys = [o.numpy() for o in outs]
    for _ in range(30):
        sess.run_with_iobinding(io)
    before = bridge.stats["python_computes"]
    med, p90 = time_wall(lambda: sess.run_with_iobinding(io), runs)
    py = (bridge.stats["python_computes"] - before) / runs
    if check_replay and not np.array_equal(outs[0].numpy(), ys[0]):
        raise RuntimeError(f"M={m}: the replayed result differs from the first run's")
    return med, p90, ys, x, py


class Reference:
    """float64 SwiGLU of a few rows of x (first and last), weights converted once."""

    def __init__(self, w1, w3):
        self.w1, self.w3 = w1.astype(np.float64), w3.astype(np.float64)

    def rel_err(self, y, x, rows=4):
        idx = sorted(set(list(range(min(rows, len(x)))) + [len(x) - 1]))
        xr = x[idx].astype(np.float64)
        g, u = xr @ self.w1, xr @ self.w3
        with np.errstate(over="ignore"):
            ref = g / (1.0 + np.exp(-g)) * u
        return float(np.abs(y[idx].astype(np.float64) - ref).max() / np.abs(ref).max())


SWEEP_MS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def prefill_sweep(sw, fused, ref, runs, ms, fused_kn=None, names=None):
    """Times, per M and CUDA-graph mode: the unfused graph and FusedFFN on [N, K] weights as routed ('nk'), on the
    cuBLAS path where nk takes the tensor-core kernel ('cuBLAS'), and FusedFFN on [K, N] weights ('kn', attribute
    weights_kn = 1: its decode and tensor-core kernels, cuBLAS NN GEMMs with fp16 outputs; 'kn cuBLAS' on cuBLAS
    where it takes its tensor-core kernel); with fp32 weights, 'strict'
    / 'kn strict': the prefill GEMMs in strict fp32 instead of TF32.
    ``names``: the variants to time."""
    from onnx_lowbit.custom_ops.ffn import fusedffn_cuda as fc
    variants = {"nk": {}, "cuBLAS": dict(TC_MAX_M=0), "kn": {}, "kn cuBLAS": dict(KN_TC_MAX_M=0),
                "strict": dict(TF32=False), "kn strict": dict(TF32=False)}
    names = [v for v in (names or variants) if v in variants and (not v.startswith("kn") or fused_kn is not None)]
    if "nk" not in names:
        names.insert(0, "nk")
    rows = []
    for graph in (False,) if DEVICE == "cpu" else (False, True):
        print(f"\n#### Prefill sweep, SwiGLU {'mixed' if MIXED else np.dtype(DTYPE).name} K={K} N={N}, CUDA graph: {'yes' if graph else 'no'} "
              "(median wall us per run; ratios = unfused / ours)\n")
        cols = names + [f"ratio {v}" for v in names if v in ("nk", "kn")]
        print("| M | unfused | " + " | ".join(cols) + " | best ours | " +
              " | ".join(f"err {v}" for v in names) + " | py/run |")
        print("| ---: | ---: | " + " | ".join("---:" for _ in cols) + " | --- | " + " | ".join("---:" for _ in names) +
              " | ---: |")
        for m in ms:
            r = dict(M=m, cuda_graph=graph)
            try:
                t, _, ys, x, _ = time_model(sw, m, runs, graph, True)
                r.update(unfused=t, err_unfused=ref.rel_err(ys[0], x))
                for name in names:
                    opts = variants[name]
                    if name == "kn cuBLAS" and not fc.KN_TC_MIN_M <= m <= fc.KN_TC_MAX_M:
                        continue
                    if name.endswith("strict") and DTYPE != np.float32:
                        continue
                    if name == "cuBLAS" and not (fc.DECODE_MAX_M < m and fc.TC_MIN_M <= m <= fc.TC_MAX_M):
                        continue
                    saved = {k: getattr(fc, k) for k in opts}
                    for k, v in opts.items():
                        setattr(fc, k, v)
                    try:
                        t, _, ys, x, py = time_model(fused_kn if name.startswith("kn") else fused, m, runs, graph,
                                                     True)
                    finally:
                        for k, v in saved.items():
                            setattr(fc, k, v)
                    r[name], r[f"err {name}"], r[f"py {name}"] = t, ref.rel_err(ys[0], x), py
            except Exception as e:  # noqa: BLE001
                print(f"| {m} | failed: {type(e).__name__}: {str(e)[:140]} |")
                rows.append(dict(r, error=str(e)[:300]))
                continue
            f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            e = lambda v: "-" if v is None else f"{v:.1e}" + (" FAIL" if v > 1e-3 else "")  # noqa: E731
            ours = {k: r[k] for k in names if k in r}
            best = min(ours, key=ours.get)
            ratios = [f"{r['unfused'] / r[v]:.2f}" if v in r else "-" for v in names if v in ("nk", "kn")]
            print(f"| {m} | {f(r['unfused'])} | " + " | ".join(f(r.get(v)) for v in names) + " | " +
                  " | ".join(ratios) + f" | {best} | " + " | ".join(e(r.get(f"err {v}")) for v in names) +
                  f" | {r['py nk']:.2f} |", flush=True)
            rows.append(r)
        ok = [r for r in rows if r["cuda_graph"] == graph and "nk" in r]
        for v in ("nk", "kn"):
            slower = [r["M"] for r in ok if v in r and r[v] > r["unfused"]]
            if v in names:
                print(f"\nours {v} slower than unfused at M = {slower or 'none'}")
    return rows


def main():
    global K, N, DEVICE, DTYPE, MIXED
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="only the prefill sweep (FusedFFN vs unfused)")
    ap.add_argument("--ms", help="comma-separated M values for the sweep (default 1..1024)")
    ap.add_argument("--sweep-variants", default="nk,cuBLAS,kn",
                    help="comma-separated FusedFFN variants the sweep times (nk, cuBLAS, kn, kn cuBLAS, strict, "
                         "kn strict)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32", "mixed"],
                    help="x, weights and outputs (float32: the sweep's strict / kn strict variants run the prefill "
                         "GEMMs in strict fp32 instead of TF32, onnxruntime's MatMul default and ours)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script, no figures)")
    ap.add_argument("--cpu", action="store_true", help="onnxruntime's CPU EP at --shape (the sweep; our CPU faces "
                    "against onnxruntime's MLAS)")
    ap.add_argument("--block-ms", default="1", help="comma-separated M values for the gate+up / SwiGLU blocks")
    ap.add_argument("--shape", default=f"{K}x{N}", help="K x N of the weights (default LLaMA-7B's gate/up)")
    ap.add_argument("--only", metavar="S1;S2", help="only the block models whose name holds one of these strings "
                    "(';'-separated; the fp16 baselines always run): fewer rewrites and runs")
    a = ap.parse_args()
    import onnxruntime as ort
    K, N = (int(v) for v in a.shape.lower().split("x"))
    MIXED = a.dtype == "mixed"
    DTYPE = np.float32 if MIXED else np.dtype(a.dtype).type
    if a.smoke:
        K, N, DEVICE = 256, 512, "cpu"
    elif a.cpu:
        DEVICE = "cpu"
        print("CPU:", os.cpu_count(), "cores | onnxruntime", ort.__version__)
    else:
        import torch
        print("GPU:", torch.cuda.get_device_name(0), "| onnxruntime", ort.__version__)
    t0 = time.perf_counter()
    w1, w3 = _weights(1), _weights(3)
    pair, sw = pair_model(w1, w3), swiglu_model(w1, w3)
    cases = [("gate+up", "fp16 MatMul x2 (onnxruntime)", pair, ["ai.onnx.MatMul"])]
    others = [] if a.sweep_only else [
            ("gate+up", "onnxruntime MatMulBnb4 x2 (nf4, block 64)", pair, "weights4",
             dict(weights="nf4", weights_target="ort")),
            ("gate+up", "onnxruntime MatMulNBits x2 (int4, group 128)", pair, "weights4",
             dict(weights="awq", weights_target="ort")),
            ("gate+up", "ours MatMulNF4 x2 (nf4, block 64)", pair, "weights4", dict(weights="nf4")),
            ("gate+up", "ours MatMulAWQ x2 (int4, group 128)", pair, "weights4", dict(weights="awq")),
            ("SwiGLU", "onnxruntime unfused with MatMulNBits", sw, "weights4",
             dict(weights="awq", weights_target="ort")),
            ("SwiGLU", "ours FusedFFNNF4", sw, "weights4,ffn", dict(weights="nf4")),
            ("SwiGLU", "ours FusedFFNAWQ", sw, "weights4,ffn", dict(weights="awq"))]
    others.insert(5, ("SwiGLU", "ours FusedFFN (fp16)", sw, "ffn", {}))
    others.insert(6, ("SwiGLU", "ours FusedFFN (fp16, [N, K])", sw, "ffn", dict(ffn_weights="nk")))
    from onnx_lowbit.custom_ops.ffn import fusedffnnf4_cuda as f4
    if not a.sweep_only and DEVICE == "cuda" and K % 1024 == 0 and any(c == K // 1024 for _, c in f4.WARPCOLS):
        others.insert(-1, ("SwiGLU", f"ours FusedFFNNF4 {BLOCK_KERNEL}", sw, "weights4,ffn", dict(weights="nf4")))
    if a.only:
        others = [o for o in others if any(t in o[1] for t in a.only.split(";"))]
    for label, name_, base, passes, opts in others:
        try:
            model, ops = rewrite(base, passes, **opts)
            cases.append((label, name_, model, ops))
        except Exception as e:  # noqa: BLE001
            print(f"rewrite for {name_!r} failed: {type(e).__name__}: {e}")
    first_sw = next((i for i, c in enumerate(cases) if c[0] == "SwiGLU"), len(cases))   # the block's fp16 baseline
    cases.insert(first_sw, ("SwiGLU", "fp16 unfused (onnxruntime)", sw, ["ai.onnx.MatMul", "Sigmoid", "Mul"]))
    print(f"models built in {time.perf_counter() - t0:.0f} s")
    rows, ref = [], {}
    for bm in [int(v) for v in a.block_ms.split(",")]:
        for label, name, model, ops in ([] if a.sweep_only else cases):
            for graph in (False, True):
                blk = f"{label} (M={bm})"
                saved = f4.WARPCOLS
                if BLOCK_KERNEL in name:        # the kernel objects read it when the session is made
                    f4.WARPCOLS = {}
                try:
                    med, p90, ys, x, _ = time_model(model, bm, a.runs, graph)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(block=blk, case=name, cuda_graph=graph,
                                     error=f"{type(e).__name__}: {str(e)[:160]}"))
                    continue
                finally:
                    f4.WARPCOLS = saved
                key = (blk, graph)
                if key not in ref:
                    ref[key] = ys
                err = max(float(np.abs(y.astype(np.float32) - r.astype(np.float32)).max() /
                                max(float(np.abs(r.astype(np.float32)).max()), 1e-30)) for y, r in zip(ys, ref[key]))
                rows.append(dict(block=blk, case=name, cuda_graph=graph, median_us=med, p90_us=p90,
                                 rel_err_vs_fp16=err, ops=ops))
                print(f"  {blk}, {name}, graph {'yes' if graph else 'no'}: {med:.1f} us (p90 {p90:.1f})",
                      flush=True)     # as it comes, so a run cut short still shows what it measured
    if rows:
        print("\n| block | model | CUDA graph | median us/run | p90 | speed-up vs fp16 | max rel. diff vs fp16 |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    base_t = {(r["block"], r["cuda_graph"]): r["median_us"] for r in rows if "median_us" in r and
              r["case"].startswith("fp16")}
    for r in rows:
        if "error" in r:
            print(f"| {r['block']} | {r['case']} | {'yes' if r['cuda_graph'] else 'no'} | failed: {r['error']} | | | |")
            continue
        b = base_t.get((r["block"], r["cuda_graph"]))
        print(f"| {r['block']} | {r['case']} | {'yes' if r['cuda_graph'] else 'no'} | {r['median_us']:.1f} | "
              f"{r['p90_us']:.1f} | {b / r['median_us']:.2f}x | {r['rel_err_vs_fp16']:.1e} |" if b else "")
    sweep = []
    if not a.skip_sweep:
        fused = next((c[2] for c in cases if c[1] == "ours FusedFFN (fp16, [N, K])"), None) or \
            rewrite(sw, ["ffn"], ffn_weights="nk")[0]
        ms = tuple(int(v) for v in a.ms.split(",")) if a.ms else SWEEP_MS
        fused_kn = rewrite(sw, ["ffn"], ffn_weights="kn")[0] if "kn" in a.sweep_variants else None
        sweep = prefill_sweep(sw, fused, Reference(w1, w3), max(50, a.runs // 3), ms, fused_kn,
                              a.sweep_variants.split(","))
        print(f"sweep done in {time.perf_counter() - t0:.0f} s")
    write_json(a.json, {"rows": rows, "sweep": sweep}, default=str)


if __name__ == "__main__":
    main()

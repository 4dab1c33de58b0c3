"""``onnx-lowbit demo``: rewrite the four embedded sample models in five ways, run original and rewritten side by
side in onnxruntime (CUDA when onnxruntime-gpu and a GPU are there, else CPU), and print what changed."""
from __future__ import annotations

import os
import tempfile

from .cpu_passes import ort_has_cuda
from .ratios import size, speed

SAMPLES = [("tiny_yolo.onnx", "YOLO-style CNN, SiLU activations"), ("gpt2_mlp.onnx", "GPT-2 MLP stack, GELU (tanh)")]
# also shown: llama_mlp.onnx (fused SwiGLU FFN, NF4 weights) and gru_small.onnx (integer GRU, calibrated)


def _providers():
    if ort_has_cuda():
        try:
            from numba import cuda
            if cuda.is_available():
                return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        except Exception:  # noqa: BLE001
            pass
    return ["CPUExecutionProvider"]


def _speed(timings) -> str:
    """The rewritten model against the original, in words: "1.23x faster" / "2.41x slower" (onnx_lowbit.ratios)."""
    return speed(timings["original"], timings["rewritten"])


def _tuned(model, feeds=None, **options) -> str:
    """The line a CPU deployment gets: ``rewrite(model, device="cpu", tune=True, **options)`` (each pass kept only
    where it measured faster here; 4-bit weights kept for their size) and the whole model's speed against the
    original."""
    from .api import rewrite
    _, report = rewrite(model, device="cpu", tune=True, feeds=feeds, **options)
    t = report.tune
    parts = []
    for d in t.decisions:
        if d.rewrites and d.after_ms is not None:
            parts.append(f"{d.pass_name} {'kept' if d.kept else 'dropped'} ({speed(d.before_ms, d.after_ms)})")
    kept = ", ".join(parts) if parts else "no pass rewrote anything"
    if t.final_ms is None:
        return f"   --device cpu --tune: {kept}; nothing kept: the output is the original graph"
    return (f"   --device cpu --tune: {kept}; latency {t.original_ms:.3f} -> {t.final_ms:.3f} ms: "
            f"{speed(t.original_ms, t.final_ms)}")


def _skipped(report) -> list:
    """One line per candidate a pass looked at and left (its reason), for the lines under a block's counts."""
    return [f"   skipped: {e.pass_name} {e.pattern} ({', '.join(e.nodes)}): {e.reason}" for e in report.skipped()]


def run(out_dir: str | None = None) -> int:
    from onnx_lowbit import passes, samples
    from . import model_io, verify
    providers = _providers()
    cpu = providers[0] == "CPUExecutionProvider"   # then each block also says what `--device cpu --tune` keeps
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="onnx-lowbit-demo-")
        out_dir = tmp.name
    os.makedirs(out_dir, exist_ok=True)
    print(f"onnx-lowbit demo on {providers[0]}: the four sample models of samples/, rewritten five ways\n")
    kept = tmp is None
    worst = 0
    for name, what in SAMPLES:
        src = samples.path(name)
        model = model_io.load(src)
        out, report = passes.run_passes(model)
        dst = os.path.join(out_dir, name.replace(".onnx", ".lowbit.onnx"))
        model_io.save(out, dst)
        before = {}
        for n in model.graph.node:
            before[n.op_type] = before.get(n.op_type, 0) + 1
        after = {}
        for n in out.graph.node:
            after[n.op_type] = after.get(n.op_type, 0) + 1
        errors, timings = verify.compare(model, out, providers=providers, timing_runs=50)
        print(f"== {name}: {what}")
        print(f"   nodes {len(model.graph.node)} -> {len(out.graph.node)}; rewritten {len(report.rewritten())}, "
              f"skipped {len(report.skipped())}; FPLUT ops: {after.get('FPLUT', 0)}")
        for line in _skipped(report):
            print(line)
        print("   " + verify.format_errors(errors, verify.DEFAULT_TOLERANCE).replace("\n", "\n   "))
        print(f"   latency (median of 50 runs): original {timings['original']:.3f} ms, "
              f"rewritten {timings['rewritten']:.3f} ms: {_speed(timings)}")
        if cpu:
            print(_tuned(model))
        print(f"   written: {dst}\n" if kept else "")
        worst = max(worst, 0 if all(e.ok for e in errors) else 1)
    # 4-bit weights: the size gain, and the same weights on stock onnxruntime (--target ort)
    src = samples.path("gpt2_mlp.onnx")
    model = model_io.load(src)
    print("== gpt2_mlp.onnx with 4-bit weights (NF4, block 64)")
    for target in ("lowbit", "ort"):
        out, _ = passes.run_passes(model, passes=["fplut", "weights4"] if target == "lowbit" else ["weights4"],
                                   weights="nf4", weights_target=target)
        dst = os.path.join(out_dir, f"gpt2_mlp.nf4-{target}.onnx")
        model_io.save(out, dst)
        errors, timings = verify.compare(model, out, providers=providers, timing_runs=50, tolerance=0.2)
        e = errors[0]
        print(f"   --target {target:6s}: file {os.path.getsize(src) / 1e3:.0f} kB -> {os.path.getsize(dst) / 1e3:.0f} kB "
              f"({size(os.path.getsize(src), os.path.getsize(dst))}); output rel err {e.rel:.3f} (4-bit weights); "
              f"latency {timings['original']:.3f} -> {timings['rewritten']:.3f} ms: {_speed(timings)}")
        if kept:
            print(f"   written: {dst}")
    if cpu:
        print(_tuned(model, weights="nf4"))
    print()
    # fused SwiGLU FFN with 4-bit weights, and the integer GRU (calibrated on the shipped sample data)
    import numpy as np

    from .cli_options import load_calibration
    from .api import InferenceSession
    for name, what, options, tol in [
            ("llama_mlp.onnx", "LLaMA-style SwiGLU MLP stack: FusedFFNNF4 + MatMulNF4 (4-bit weights)",
             dict(weights="nf4"), 0.2),
            ("gru_small.onnx", "GRU 64 -> 128: QuantGRU, int16 fixed point, calibrated on gru_small_calib.npz",
             None, 0.02)]:
        src = samples.path(name)
        model = model_io.load(src)
        feeds = None
        if options is None:
            cal = load_calibration(samples.path("gru_small_calib.npz"), model)
            options = dict(calibration=cal, calibration_session=InferenceSession)
            feeds = {"x": np.random.default_rng(1).standard_normal((4, 40, 64)).astype(np.float32)}
        out, report = passes.run_passes(model, **options)
        dst = os.path.join(out_dir, name.replace(".onnx", ".lowbit.onnx"))
        model_io.save(out, dst)
        ours = sorted({n.op_type for n in out.graph.node if n.domain == "onnx_lowbit"})
        errors, timings = verify.compare(model, out, providers=providers, timing_runs=50, tolerance=tol, feeds=feeds)
        print(f"== {name}: {what}")
        print(f"   nodes {len(model.graph.node)} -> {len(out.graph.node)}; our ops: {', '.join(ours)}; "
              f"file {os.path.getsize(src) / 1e3:.0f} kB -> {os.path.getsize(dst) / 1e3:.0f} kB "
              f"({size(os.path.getsize(src), os.path.getsize(dst))})")
        for line in _skipped(report):
            print(line)
        print("   " + verify.format_errors(errors, tol).replace("\n", "\n   ") +
              ("  (4-bit weights)" if "weights" in options else "  (fixed point vs float)"))
        print(f"   latency (median of 50 runs): original {timings['original']:.3f} ms, "
              f"rewritten {timings['rewritten']:.3f} ms: {_speed(timings)}")
        if cpu:
            print(_tuned(model, feeds, **options))
        print(f"   written: {dst}\n" if kept else "")
        worst = max(worst, 0 if all(e.ok for e in errors) else 1)
    print("FPLUT turns each activation (SiLU, GELU formulas, ...) into one table-lookup op: fewer nodes, one pass over "
          "memory (accuracy per function: `onnx-lowbit lut list`). 4-bit weights cut the file to about a quarter (fp16) "
          "or a seventh (fp32). On the CPU most of our ops now run natively after their first call (no Python on the "
          "path), but our CPU kernels are still slower than onnxruntime's own on most of these models: for CPU "
          "deployments `rewrite --device cpu --tune` keeps only what "
          "measured faster on your machine. The speed gains are on the GPU: BENCHMARKS.md.")
    if tmp is not None:
        tmp.cleanup()
        print("\nThe rewritten models went to a temporary folder, deleted now; `onnx-lowbit demo --out DIR` keeps "
              "them. Your own model: onnx-lowbit rewrite model.onnx model.lowbit.onnx --report --verify"
              + (" (for a GPU; for this CPU: onnx-lowbit rewrite model.onnx model.cpu.onnx --device cpu --tune "
                 "--report --verify)" if cpu else ""))
    return worst

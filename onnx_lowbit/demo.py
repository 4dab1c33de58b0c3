"""``onnx-lowbit demo``: rewrite the embedded sample models, run original and rewritten side by side in
onnxruntime (CUDA when onnxruntime-gpu and a GPU are there, else CPU), and print what changed."""
from __future__ import annotations

import os
import tempfile

SAMPLES = [("tiny_yolo.onnx", "YOLO-style CNN, SiLU activations"), ("gpt2_mlp.onnx", "GPT-2 MLP stack, GELU (tanh)")]


def _providers():
    import onnxruntime as ort
    if "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            from numba import cuda
            if cuda.is_available():
                return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        except Exception:  # noqa: BLE001
            pass
    return ["CPUExecutionProvider"]


def run(out_dir: str | None = None) -> int:
    from onnx_lowbit import passes, samples
    from . import model_io, verify
    providers = _providers()
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="onnx-lowbit-demo-")
        out_dir = tmp.name
    os.makedirs(out_dir, exist_ok=True)
    print(f"onnx-lowbit demo on {providers[0]}\n")
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
        print("   " + verify.format_errors(errors, verify.DEFAULT_TOLERANCE).replace("\n", "\n   "))
        print(f"   latency (median of 50 runs): original {timings['original']:.3f} ms, "
              f"rewritten {timings['rewritten']:.3f} ms  -> x{timings['original'] / timings['rewritten']:.2f}")
        print(f"   written: {dst}\n")
        worst = max(worst, 0 if all(e.ok for e in errors) else 1)
    print("FPLUT replaces each activation (Sigmoid+Mul SiLU, GELU formulas) by one table-lookup op: fewer nodes and "
          "one pass over memory. Its accuracy per function: `onnx-lowbit lut list`.")
    if tmp is not None:
        tmp.cleanup()
    return worst

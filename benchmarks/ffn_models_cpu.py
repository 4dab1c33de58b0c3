"""Accuracy of the ffn pass on the real architectures of tests/test_ffn_models.py (transformers LlamaMLP, Qwen2MLP,
a 2-layer LlamaForCausalLM; TorchScript and dynamo exports; fp32 and fp16), onnxruntime CPU with our ops.
Columns: max |got - ref| / max |ref| of the output over the test inputs, for ffn alone vs the original, and for all
passes with --weights nf4 / awq vs weights4 alone (same packed bytes) and vs the float original.

    PYTHONPATH=.:tests python benchmarks/ffn_models_cpu.py
"""
from __future__ import annotations

import test_ffn_models as T

from onnx_lowbit.passes import run_passes


def main():
    print("| model | exporter | dtype | ffn vs original | nf4 fused vs weights4 | nf4 vs float | awq fused vs weights4 "
          "| awq vs float |")
    for arch, exp, dt in T.CASES:
        m = T.export(arch, exp, dt)
        out, _ = run_passes(m, ["ffn"])
        feeds_list = T.feeds_list(arch, dt)
        refs = [T.run(m, f, ours=False)[0] for f in feeds_list]
        row = [max(T.rel(T.run(out, f)[0], r) for f, r in zip(feeds_list, refs))]
        for fmt in ("nf4", "awq"):
            fused, _ = run_passes(m, None, weights=fmt)
            q, _ = run_passes(m, ["weights4"], weights=fmt)
            got = [T.run(fused, f)[0] for f in feeds_list]
            row.append(max(T.rel(g, T.run(q, f)[0]) for g, f in zip(got, feeds_list)))
            row.append(max(T.rel(g, r) for g, r in zip(got, refs)))
        print(f"| {arch} | {exp} | {dt} | " + " | ".join(f"{v:.2e}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()

"""A BERT-style encoder on the CPU: its original graph against `rewrite --device cpu` (FPLUT for its Erf-spelled
GELU, CPU_FPLUT_FUNCTIONS) in onnxruntime CPU sessions, alternating, in one process (issue 34).

    python benchmarks/bert_cpu.py [--hidden 256] [--layers 4] [--inter 1024] [--tokens 128] [--rounds 15]

The model: transformers' BertModel with random weights (seed 0), exported by torch.onnx (TorchScript exporter,
opset 17). One thread timed by thread CPU time (the figure that survives a shared machine), two threads by the wall
clock. Prints the output's rel-L2 against the original and the medians of the per-round medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def export(path, a):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                                  intermediate_size=a.inter, vocab_size=1000)
    bert = transformers.BertModel(cfg).eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state
    ids = torch.randint(0, 1000, (1, a.tokens))
    torch.onnx.export(Encoder(), (ids,), path, input_names=["input_ids"], output_names=["y"], dynamo=False,
                      opset_version=17)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=20, help="runs per round (default 20)")
    a = ap.parse_args(argv)
    import onnxruntime as ort

    import onnx_lowbit
    from onnx_lowbit import model_io
    d = tempfile.mkdtemp(prefix="bert-cpu-")
    src, dst = os.path.join(d, "bert.onnx"), os.path.join(d, "bert.cpu.onnx")
    export(src, a)
    out, report = onnx_lowbit.rewrite(src, device="cpu")
    model_io.save(out, dst)
    print(f"rewrite --device cpu: {len(report.rewritten())} rewritten "
          f"({', '.join(sorted({e.pass_name for e in report.rewritten()})) or 'nothing'})")
    ids = np.random.default_rng(0).integers(0, 1000, (1, a.tokens)).astype(np.int64)
    for threads, clock in ((1, time.thread_time), (2, time.perf_counter)):
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.log_severity_level = threads, 3
        sa, sb = (onnx_lowbit.InferenceSession(p, so, providers=["CPUExecutionProvider"]) for p in (src, dst))
        ya, yb = sa.run(None, {"input_ids": ids})[0], sb.run(None, {"input_ids": ids})[0]
        rel = float(np.linalg.norm(ya - yb) / np.linalg.norm(ya))
        got = {"original": [], "rewritten": []}
        for _ in range(a.rounds):
            for name, s in (("original", sa), ("rewritten", sb)):
                ts = []
                for _ in range(a.batch):
                    t = clock()
                    s.run(None, {"input_ids": ids})
                    ts.append(clock() - t)
                got[name].append(statistics.median(ts) * 1e3)
        o, r = (statistics.median(got[k]) for k in ("original", "rewritten"))
        from onnx_lowbit.ratios import speed
        print(f"{threads} thread(s), {clock.__name__}: original {o:.3f} ms, rewritten {r:.3f} ms: {speed(o, r)}; "
              f"rel-L2 {rel:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KVAttention over a KV cache in onnxruntime CUDA sessions: onnxruntime's own kernels for the eager-attention spelling
of LLaMA exports (K / V repeats for grouped-query attention, MatMul with Transpose(K), Mul by the scale, Add of
the mask, Cast + Softmax + Cast, MatMul with V; tests/test_kvattention_kernels.unfused_model) against one KVAttention
node, in one run. fp16; IOBinding on fixed device buffers; median wall us per run() with and without CUDA graphs.
Each fused result is checked against the unfused session's first (within one fp16 rounding) before it is timed.

    PYTHONPATH=/tmp/ortgpu/site:/tmp/gs:.:benchmarks:tests python3 benchmarks/kvattention_gpu.py [--runs 500]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from test_kvattention_kernels import _close, _feeds, fused_model, unfused_model  # noqa: E402 - tests/ on sys.path
from timing import time_session  # noqa: E402 - benchmarks/ is on sys.path when run as a script

# (B, Hq, S, D, Hkv, T, mask shape, scale, divide): the LLaMA sample's decode step (16 heads, cache 128 + 1),
# grouped-query decode at longer caches, 4 and 16 queries (speculative decoding), a prefill chunk
SHAPES = [(1, 16, 1, 128, 16, 129, (1, 1, 1, 129), 0.0884, 0), (1, 32, 1, 128, 8, 1025, (1, 1, 1, 1025), 0.0884, 0),
          (1, 32, 1, 128, 8, 4096, (1, 1, 1, 4096), 0.0884, 0), (1, 16, 4, 128, 16, 132, (1, 1, 4, 132), 0.0884, 0),
          (1, 16, 16, 128, 16, 144, (1, 1, 16, 144), 0.0884, 0), (1, 32, 64, 128, 8, 576, (1, 1, 64, 576), 0.0884, 0)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    print(f"{'B,Hq,S,D,Hkv,T':>24} {'graph':>5} {'unfused us':>11} {'KVAttention us':>12} {'speed-up':>8}")
    for case in SHAPES:
        unf, fus = unfused_model(case, np.float16), fused_model(case, np.float16)
        feeds = _feeds(case, np.float16, seed=case[5])
        for graph in (False, True):
            tu, pu, yu = time_session(unf, feeds, a.runs, graph, feeds["Q"])
            tf, pf, yf = time_session(fus, feeds, a.runs, graph, feeds["Q"])
            _close(yf[0], yu[0], np.float16)
            rows.append({"case": [list(x) if isinstance(x, tuple) else x for x in case], "cuda_graph": graph,
                         "unfused_us": tu, "unfused_p90": pu, "attention_us": tf, "attention_p90": pf})
            print(f"{','.join(str(x) for x in case[:6]):>24} {'yes' if graph else 'no':>5} {tu:11.1f} {tf:12.1f} "
                  f"{tu / tf:7.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

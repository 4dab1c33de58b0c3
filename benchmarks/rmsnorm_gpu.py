"""Residual add + LLaMA RMSNorm in onnxruntime CUDA sessions: onnxruntime's own kernels for the exporters'
spelling (Add, Cast, Pow, ReduceMean, Add, Sqrt, Div, Mul, Cast, Mul; onnxruntime fuses the norm part into its
LayerNormalization kernel) against the same graph after our ``rmsnorm`` pass (one RMSNorm node writing Y and H),
in one run. fp16, rows of D = 2048 / 4096; IOBinding on fixed device buffers; median wall us per run() with and
without CUDA graphs. Each fused result is checked against the unfused session's (H bit for bit, Y within 2e-3)
before it is timed.

    PYTHONPATH=/tmp/ortgpu/site:/tmp/gs:.:benchmarks:tests python3 benchmarks/rmsnorm_gpu.py [--runs 500]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from timing import time_session  # noqa: E402 - benchmarks/ is on sys.path when run as a script

SHAPES = [(1, 1, 2048), (1, 1, 4096), (1, 128, 2048), (4, 512, 4096)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--json")
    a = ap.parse_args()
    import onnx_lowbit
    from test_rmsnorm_kernels import unfused_model
    rows = []
    print(f"{'shape':>16} {'graph':>5} {'unfused us':>11} {'RMSNorm us':>11} {'speed-up':>8}  ops")
    for shape in SHAPES:
        model = unfused_model(shape, np.float16, True)
        fused, _ = onnx_lowbit.rewrite(model, passes=["rmsnorm"])
        ops = sorted({n.op_type for n in fused.graph.node})
        rng = np.random.default_rng(sum(shape))
        feeds = {n: (rng.standard_normal(shape) * 2).astype(np.float16) for n in ("X", "skip")}
        for graph in (False, True):
            tu, pu, yu = time_session(model, feeds, a.runs, graph, feeds["X"])
            tf, pf, yf = time_session(fused, feeds, a.runs, graph, feeds["X"])
            if not (np.array_equal(yu[1], yf[1]) and np.allclose(yu[0].astype(np.float32), yf[0].astype(np.float32),
                                                                 rtol=2e-3, atol=2e-3)):
                raise RuntimeError(f"{shape}: RMSNorm differs from onnxruntime's unfused result")
            rows.append({"shape": list(shape), "cuda_graph": graph, "unfused_us": tu, "unfused_p90": pu,
                         "rmsnorm_us": tf, "rmsnorm_p90": pf, "ops": ops})
            print(f"{str(shape):>16} {'yes' if graph else 'no':>5} {tu:11.1f} {tf:11.1f} {tu / tf:7.2f}x  "
                  f"{','.join(ops)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

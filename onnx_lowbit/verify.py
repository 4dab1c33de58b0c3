"""--verify: run the original model (plain onnxruntime) and the rewritten one (with our ops) on the same random
inputs and compare every output. Part of the top (application) layer, with api.py and cli.py."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .errors import LowbitError

DEFAULT_TOLERANCE = 2e-2


@dataclass
class OutputError:
    name: str
    max_abs: float
    rel: float          # max |a - b| / max |ref|
    mismatched_nan: int
    ok: bool


def random_inputs(model: onnx.ModelProto, *, seed: int = 0, dim: int = 2, scale: float = 3.0) -> dict:
    """One random array per graph input (not initializer): symbolic dims become ``dim``; floats ~ N(0, scale)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else dim for d in tt.shape.dim]
        np_dt = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(np_dt, np.floating):
            feeds[vi.name] = (rng.standard_normal(shape) * scale).astype(np_dt)
        elif np.issubdtype(np_dt, np.integer):
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(np_dt)
        elif np_dt == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise LowbitError(f"--verify cannot make random data for input '{vi.name}' of type {np_dt}")
    return feeds


def _session(model, ours: bool, providers):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if ours:
        from .api import register
        register(opts)
    src = model if isinstance(model, str) else model.SerializeToString()  # a path: models with external data
    return ort.InferenceSession(src, opts, providers=providers)


def compare(original: onnx.ModelProto, rewritten: onnx.ModelProto, *, tolerance: float = DEFAULT_TOLERANCE,
            providers=("CPUExecutionProvider",), seed: int = 0, feeds=None, timing_runs: int = 0):
    """Returns (list of OutputError, timings dict) for the two models (ModelProtos, or paths of model files, e.g.
    with external data) on the same inputs."""
    if feeds is None:
        graph_of = original if not isinstance(original, str) else onnx.load(original, load_external_data=False)
        feeds = random_inputs(graph_of, seed=seed)
    try:
        s0 = _session(original, False, list(providers))
        s1 = _session(rewritten, True, list(providers))
        ref = s0.run(None, feeds)
        got = s1.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise LowbitError(f"--verify: onnxruntime could not run the models: {str(e).splitlines()[0][:300]}") from None
    errors = []
    for o, a, b in zip(s0.get_outputs(), ref, got):
        a64 = np.asarray(a, dtype=np.float64) if np.asarray(a).dtype.kind in "fiub" else None
        if a64 is None:
            errors.append(OutputError(o.name, 0.0, 0.0, 0, np.array_equal(a, b)))
            continue
        b64 = np.asarray(b, dtype=np.float64)
        nan_a, nan_b = np.isnan(a64), np.isnan(b64)
        both = ~(nan_a | nan_b)
        diff = np.abs(a64 - b64)[both]
        max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(a64[both]).max()) if both.any() else 0.0
        rel = max_abs / max(scale, 1e-12)
        mism = int(np.sum(nan_a != nan_b))
        errors.append(OutputError(o.name, max_abs, rel, mism, rel <= tolerance and mism == 0))
    timings = {}
    if timing_runs:
        for key, s in (("original", s0), ("rewritten", s1)):
            for _ in range(3):
                s.run(None, feeds)
            ts = []
            for _ in range(timing_runs):
                t = time.perf_counter()
                s.run(None, feeds)
                ts.append(time.perf_counter() - t)
            timings[key] = float(np.median(ts) * 1e3)
    return errors, timings


def format_errors(errors, tolerance) -> str:
    lines = [f"{'output':30s} {'max abs err':>12s} {'rel err':>10s}  result (tolerance {tolerance:g} relative)"]
    for e in errors:
        extra = f", {e.mismatched_nan} NaN mismatches" if e.mismatched_nan else ""
        lines.append(f"{e.name[:30]:30s} {e.max_abs:12.4g} {e.rel:10.3g}  {'ok' if e.ok else 'FAIL'}{extra}")
    return "\n".join(lines)

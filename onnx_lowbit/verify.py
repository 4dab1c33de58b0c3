"""--verify: run the original model (plain onnxruntime) and the rewritten one (with our ops) on the same inputs (the
user's data, or random inputs made consistent with the graph: onnx_lowbit.feeds) and compare every output. Part of
the top (application) layer, with api.py and cli.py.

Figures per output (a: the original's, b: the rewritten model's):
  rel-L2   ||a - b|| / ||a|| over the elements finite in both: the checked figure (``ok`` when <= the tolerance)
  max abs  max |a - b|;  max rel: max |a - b| / max |a| (the figure --verify checked before)
  top-1    for logit / classifier-like outputs (a name with logit, prob, score, class, label, cls or pred in it, or
           the only output of its model, of rank >= 2 with a last axis of 2 or more; or whatever its name, a
           Softmax over its last axis, e.g. a text recogniser's per-step character probabilities): the fraction of
           rows whose arg-max along the last axis agrees
NaN in one output but not the other, or a shape that differs, fails the output whatever the tolerance.

Outputs near zero: rel-L2 divides by ||a||, which means nothing when the output is near zero everywhere (a text
detector's probability map on random N(0, 1) images: values ~1e-5, where fp16 rounding upstream moves them by
2.7e-5 and rel-L2 reads 0.029). So the checked figure is ||a - b|| / max(||a||, floor x sqrt(n)), the floor being
FLOOR_SHARE (1 %) of the output's range per element: 1 for outputs of Sigmoid, Softmax, HardSigmoid, Tanh (through
shape-only ops: their values lie in [0, 1] / [-1, 1]), else max |a|. An output whose RMS is below the floor is
judged by its absolute error against the floor (an error RMS over tolerance x floor still fails: a 0.01 shift of a
probability map fails at the default 0.02); any other output exactly as before. The table shows the floor where
it applied. When the
model has logit-like outputs, the tolerance is checked on those only: the other outputs (an LLM's KV cache, which
4-bit weights move by 30-45 % rel-L2 in SmolLM2-135M's deeper layers while its logits move by 18 %) are shown but
not checked; a KV computation gone wrong shows in the logits too."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx

from . import feeds as feeds_mod, rounds
from .errors import LowbitError

DEFAULT_TOLERANCE = 2e-2
WEIGHTS4_TOLERANCE = 0.25   # default when 4-bit weights were written: they move an LLM's logits by ~10-20 % rel-L2
LOGIT_NAMES = re.compile(r"logit|prob|score|class|label|cls|pred", re.IGNORECASE)
FLOOR_SHARE = 1e-2      # near-zero floor: this share of an output's range, per element (module docstring)
BOUNDED = {"Sigmoid": 1.0, "Softmax": 1.0, "HardSigmoid": 1.0, "Tanh": 1.0}   # op -> the bound of |its output|
SHAPE_ONLY = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice", "Gather", "Concat",
              "Split", "Cast", "Resize", "MaxPool"}


@dataclass
class OutputError:
    name: str
    max_abs: float
    rel: float             # rel-L2: ||a - b|| / ||a|| (the checked figure)
    mismatched_nan: int
    ok: bool
    max_rel: float = 0.0   # max |a - b| / max |a|
    top1: float | None = None   # arg-max agreement along the last axis (logit / classifier-like outputs)
    rows: int = 0          # rows behind top1
    shape: tuple = ()
    note: str = ""         # e.g. a shape mismatch
    checked: bool = True   # False: shown, not held to the tolerance (a state output beside logit-like ones)
    floor: float | None = None   # the near-zero floor (per element), when it applied: rel-L2 was judged against it
    judged: float | None = None  # the figure held to the tolerance when the floor applied


def default_tolerance(weights_totals) -> float:
    """The rel-L2 limit when the user gives none: WEIGHTS4_TOLERANCE when 4-bit weights were written (their
    rounding alone moves outputs by several %), else DEFAULT_TOLERANCE."""
    return WEIGHTS4_TOLERANCE if weights_totals else DEFAULT_TOLERANCE


def random_inputs(model: onnx.ModelProto, *, seed: int = 0, dims: dict | None = None) -> dict:
    """Random inputs for every graph input, consistent with the graph (onnx_lowbit.feeds)."""
    return feeds_mod.make_feeds(model, dims=dims, seed=seed)[0]


def _session(model, ours: bool, providers):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if ours:
        from .api import register
        register(opts)
    src = model if isinstance(model, str) else model.SerializeToString()  # a path: models with external data
    return ort.InferenceSession(src, opts, providers=providers)


def _logit_like(name: str, shape: tuple, single: bool) -> bool:
    """A logit-like name of rank >= 2, or a model's only output of shape [batch, classes] (a detector's or a
    denoiser's single 4-D output is not: the arg-max of its last axis means nothing)."""
    return len(shape) >= 2 and shape[-1] >= 2 and (bool(LOGIT_NAMES.search(name)) or (single and len(shape) == 2))


def output_ranges(model) -> dict:
    """output name -> the bound of its values where the graph fixes one (the output of a Sigmoid, Softmax,
    HardSigmoid or Tanh, through shape-only ops); other outputs are absent (their range is max |a|)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for vi in model.graph.output:
        t, seen = vi.name, 0
        while t in producer and seen < 64:
            n = producer[t]
            if n.op_type in BOUNDED and not n.domain:
                out[vi.name] = BOUNDED[n.op_type]
                break
            if n.op_type not in SHAPE_ONLY or n.domain or not n.input:
                break
            t, seen = n.input[0], seen + 1
    return out


def softmax_outputs(model) -> set:
    """Names of the outputs that are a Softmax over their last axis (directly or through Identity / Cast): class
    probabilities per row, for which top-1 means something whatever the output's name."""
    producer = {o: n for n in model.graph.node for o in n.output}
    out = set()
    for vi in model.graph.output:
        n = producer.get(vi.name)
        while n is not None and n.op_type in ("Identity", "Cast") and not n.domain and n.input:
            n = producer.get(n.input[0])
        rank = len(vi.type.tensor_type.shape.dim)
        if n is None or n.op_type != "Softmax" or n.domain or rank < 2:
            continue
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1 if opset >= 13 else 1)
        if axis % rank == rank - 1:
            out.add(vi.name)
    return out


def compare_arrays(name: str, a, b, tolerance: float, single_output: bool = False,
                   value_range: float | None = None, softmax: bool = False) -> OutputError:
    """The figures of one output (module docstring); ``value_range``: the bound of its values when the graph fixes
    one (output_ranges), else max |a| is taken; ``softmax``: the output is a Softmax over its last axis
    (softmax_outputs): top-1 is given whatever its name."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return OutputError(name, float("inf"), float("inf"), 0, False, float("inf"), shape=a.shape,
                           note=f"shape {list(b.shape)}, the original's {list(a.shape)}")
    if a.dtype.kind not in "fiub":
        same = bool(np.array_equal(a, b))
        return OutputError(name, 0.0 if same else float("inf"), 0.0 if same else float("inf"), 0, same,
                           shape=a.shape)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    nan_a, nan_b = np.isnan(a64), np.isnan(b64)
    both = np.isfinite(a64) & np.isfinite(b64)
    inf_mismatch = int(np.sum((np.isinf(a64) | np.isinf(b64)) & ~(a64 == b64) & ~nan_a & ~nan_b))
    d = (a64 - b64)[both]
    max_abs = float(np.abs(d).max()) if d.size else 0.0
    ref = a64[both]
    norm = float(np.linalg.norm(ref))
    rel = float(np.linalg.norm(d)) / norm if norm > 0 else (0.0 if max_abs == 0 else float("inf"))
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    mism = int(np.sum(nan_a != nan_b)) + inf_mismatch
    top1 = None
    rows = 0
    if a.dtype.kind == "f" and a.size and (_logit_like(name, a.shape, single_output) or
                                           (softmax and a.ndim >= 2 and a.shape[-1] >= 2)):
        ia = np.argmax(np.where(np.isnan(a64), -np.inf, a64), axis=-1)
        ib = np.argmax(np.where(np.isnan(b64), -np.inf, b64), axis=-1)
        rows = int(ia.size)
        top1 = float(np.mean(ia == ib))
    floor = FLOOR_SHARE * (value_range if value_range else scale)
    floor_norm = floor * np.sqrt(ref.size)
    judged = rel
    if floor_norm > norm and floor_norm > 0:       # near zero: the error against the floor instead
        judged = float(np.linalg.norm(d)) / floor_norm
    e = OutputError(name, max_abs, rel, mism, judged <= tolerance and mism == 0, max_rel, top1, rows, a.shape)
    if judged != rel:
        e.floor, e.judged = floor, judged
    return e


def run_pair(original, rewritten, feeds: dict, providers=("CPUExecutionProvider",)):
    """(output names, original's outputs, rewritten's outputs, the two sessions); LowbitError naming the model
    that onnxruntime could not run."""
    for which, model, ours in (("original", original, False), ("rewritten", rewritten, True)):
        try:
            s = _session(model, ours, list(providers))
            out = s.run(None, feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise LowbitError(f"onnxruntime could not run the {which} model on these inputs: {msg[:300]}") from None
        if which == "original":
            s0, ref = s, out
        else:
            s1, got = s, out
    return [o.name for o in s0.get_outputs()], ref, got, (s0, s1)


def compare(original, rewritten, *, tolerance: float = DEFAULT_TOLERANCE, providers=("CPUExecutionProvider",),
            seed: int = 0, feeds=None, timing_runs: int = 0, dims: dict | None = None):
    """Returns (list of OutputError, timings dict) for the two models (ModelProtos, or paths of model files, e.g.
    with external data) on ``feeds`` (default: random inputs consistent with the original's graph)."""
    if feeds is None:
        graph_of = original if not isinstance(original, str) else onnx.load(original, load_external_data=False)
        feeds = random_inputs(graph_of, seed=seed, dims=dims)
    try:
        names, ref, got, (s0, s1) = run_pair(original, rewritten, feeds, providers)
    except LowbitError as e:
        raise LowbitError(f"--verify: {e}") from None
    graph = original if not isinstance(original, str) else onnx.load(original, load_external_data=False)
    ranges, probs = output_ranges(graph), softmax_outputs(graph)
    errors = [compare_arrays(n, a, b, tolerance, len(names) == 1, ranges.get(n), n in probs)
              for n, a, b in zip(names, ref, got)]
    # logit-like by name (an LLM's logits beside its KV cache): the tolerance applies to those only; a Softmax
    # output that has top-1 for its axis alone leaves the other outputs checked (a detector's boxes)
    if any(e.top1 is not None and _logit_like(e.name, e.shape, len(names) == 1) for e in errors):
        for e in errors:
            if e.top1 is None and not e.note and e.mismatched_nan == 0:
                e.checked, e.ok = False, True
    timings = {}
    if timing_runs:     # both sessions warmed, then timed in rounds (onnx_lowbit/rounds.py): a drift hits both
        runners = [lambda s=s: s.run(None, feeds) for s in (s0, s1)]
        for key, ts in zip(("original", "rewritten"), rounds.timed_rounds(runners, timing_runs, warmup=3)):
            timings[key] = float(np.median(ts))
    return errors, timings


def format_errors(errors, tolerance) -> str:
    width = max([30] + [len(e.name) for e in errors])
    lines = [f"{'output':{width}s} {'rel-L2':>10s} {'max abs':>11s} {'max rel':>10s} {'top-1':>8s}  "
             f"result (tolerance {tolerance:g} rel-L2)"]
    for e in errors:
        extra = f", {e.mismatched_nan} NaN/Inf mismatches" if e.mismatched_nan else ""
        extra += f", {e.note}" if e.note else ""
        top1 = f"{100 * e.top1:7.2f}%" if e.top1 is not None else f"{'-':>8s}"
        result = "not checked" if not e.checked else "ok" if e.ok else "FAIL"
        if e.floor is not None and e.checked:
            result += f" (near zero: {e.judged:.3g} against the floor {e.floor:.3g})"
        lines.append(f"{e.name:{width}s} {e.rel:10.3g} {e.max_abs:11.4g} {e.max_rel:10.3g} {top1}  {result}{extra}")
    tops = [e for e in errors if e.top1 is not None]
    if tops:
        lines.append("top-1: arg-max agreement along the last axis over " +
                     ", ".join(f"{e.rows} rows of {e.name}" for e in tops))
    if any(e.floor is not None for e in errors):
        lines.append(f"floor: an output whose RMS is under {FLOOR_SHARE:g} of its range (1 for Sigmoid / Softmax / "
                     "Tanh outputs, else max |original|) is judged by ||a - b|| against that floor, not against "
                     "its own near-zero values")
    if any(not e.checked for e in errors):
        lines.append("not checked: outputs beside the logit-like ones (e.g. a KV cache) are shown, the tolerance "
                     "applies to the logits")
    return "\n".join(lines)


def describe_inputs(feeds: dict, made_up, values: dict) -> str:
    """One line: what was fed (shapes, inputs numbered alike grouped: past_key_values.#.key x30; which inputs were
    made up when some were not; the symbolic dims' values)."""
    some = 0 < len(made_up) < len(feeds)
    groups = {}
    for n, v in feeds.items():
        key = (re.sub(r"\d+", "#", n), tuple(np.shape(v)), some and n in made_up)
        groups.setdefault(key, []).append(n)
    parts = [f"{names[0] if len(names) == 1 else f'{k} x{len(names)}'} {list(shape)}{' (made up)' if up else ''}"
             for (k, shape, up), names in groups.items()]
    dims = ", ".join(f"{k}={v}" for k, v in values.items())
    return "inputs: " + ", ".join(parts) + (f"; dims: {dims}" if dims else "")

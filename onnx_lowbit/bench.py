"""``onnx-lowbit bench ORIGINAL REWRITTEN [REWRITTEN ...]``: the models side by side in one process, on the same
inputs (several rewritten models, e.g. NF4 against AWQ against onnxruntime's own MatMulNBits, each compared with the
original).

Reports per model: latency median / p90 (ms, wall clock around each ``run``, which returns once the outputs
are complete), peak memory, weight bytes (every initializer and Constant tensor, external data included,
counted from dims x element size), and how far each rewritten model's outputs are from the original's.
A markdown table goes to stdout; ``bench-<mode>.png`` (matplotlib, Agg) and ``bench-<mode>.json`` to --out.

Sessions: the caller passes ``session_factory`` (``onnx_lowbit.api.InferenceSession`` from the CLI: our ops
registered) for the rewritten model, and for the original only when it uses our domain too; the original runs
in plain ``onnxruntime.InferenceSession`` otherwise. On CUDA every input and output lives on the device (io
binding, buffers allocated once), so the timings hold no host<->device copies; ``cuda_graph`` adds
onnxruntime's ``enable_cuda_graph`` provider option (the first runs capture, the timed ones replay).

Memory (the method is printed with the figures). Before any figure, every model that uses our ops gets one
untimed session and run (``_warm_library``): the library's one-time load (numba, our kernels' compilation, the
shim) is then charged to no model, where it used to land on the first one listed.
  cpu   peak RSS of the process while the model's session is created and run (timed in rounds: its creation and
        warm-up runs), minus RSS before: the kernel's
        high-water mark is reset first (``/proc/self/clear_refs`` 5) where Linux allows it, else RSS is
        sampled every millisecond.
  cuda  device memory in use (NVML through pynvml, else cupy's cudaMemGetInfo, else ``nvidia-smi
        --query-gpu=memory.used``) after the timed runs minus before the session was made. It is device-wide
        (other processes count), and onnxruntime's CUDA arena keeps what it grew to until the session ends, so
        "after" is the session's peak (arena_extend_strategy kSameAsRequested: no power-of-two rounding). The CUDA context is created before the first baseline (a throwaway
        session), so neither model pays for it.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import helper

from . import model_io, rounds
from .bench_inputs import (BATCH_NAMES, IMAGE_DIM, OTHER_DIM, _signature, guess_dims, load_inputs,  # noqa: F401
                           parse_dims, random_inputs, resolve_dims)                               # re-exported
from .errors import LowbitError
from .memory import DeviceMemory, HostMemory, release_host_memory
from .ratios import size, speed

MIB = 1024.0 * 1024.0
GRAPH_TOLERANCE = 1e-3  # replayed vs plain outputs: more than last-bit differences (split-K order) is a bug
SUB_BYTE = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4} | (
    {onnx.TensorProto.FLOAT4E2M1} if hasattr(onnx.TensorProto, "FLOAT4E2M1") else set())


@dataclass
class ModelResult:
    label: str
    path: str
    weight_bytes: int
    latency_ms: list = field(default_factory=list)
    peak_memory_bytes: int | None = None
    providers: list = field(default_factory=list)
    graph_vs_plain_max_rel: float | None = None   # cuda_graph: replayed outputs vs one plain run

    @property
    def median_ms(self):
        return statistics.median(self.latency_ms)

    @property
    def p90_ms(self):
        return float(np.percentile(self.latency_ms, 90))


@dataclass
class Agreement:
    output: str
    max_abs: float
    max_rel: float      # max |a - b| / max |a| (a: the original's output)
    model: str = "rewritten"    # label of the rewritten model compared with the original


# ---------------------------------------------------------------------------------------------- model facts

def tensor_bytes(t: onnx.TensorProto) -> int:
    """Bytes of a tensor's data, from its dims and element type (external data is not read)."""
    if t.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    n = 1
    for d in t.dims:
        n *= d
    if t.data_type in SUB_BYTE:
        return (n + 1) // 2
    return n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def weight_bytes(model: onnx.ModelProto) -> int:
    """Sum over initializers and Constant node tensors (subgraphs included)."""
    total = 0

    def walk(g):
        nonlocal total
        total += sum(tensor_bytes(t) for t in g.initializer)
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR and node.op_type == "Constant":
                    total += tensor_bytes(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        walk(sg)
    walk(model.graph)
    return total


# ---------------------------------------------------------------------------------------------- sessions

def _cuda_check(cuda_graph):
    import onnxruntime as ort
    what = "--cuda-graph" if cuda_graph else "--provider cuda"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise LowbitError(f"{what} needs onnxruntime-gpu and a CUDA GPU: this onnxruntime {ort.__version__} has "
                          f"{', '.join(ort.get_available_providers())} only (onnx-lowbit's \".[gpu]\" install brings onnxruntime-gpu)")


def _providers(provider, cuda_graph, device_id=0):
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    # the arena grows by what is asked for (not by powers of two), so its size is what the model needs
    opts = {"device_id": str(device_id), "arena_extend_strategy": "kSameAsRequested"}
    if cuda_graph:
        opts["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]


def _make_session(path, ours, provider, cuda_graph, session_factory):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 4  # fatal only: its errors come back as one LowbitError line, not twice
    providers = _providers(provider, cuda_graph)
    factory = session_factory if ours else ort.InferenceSession
    try:
        sess = factory(path, so, providers=providers)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = ""
        if cuda_graph and "graph" in msg.lower():
            hint = " (CUDA graphs need every compute node on the CUDA EP and static shapes)"
        raise LowbitError(f"{path}: onnxruntime could not create the session: {msg[:400]}{hint}") from None
    if provider == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
        raise LowbitError(f"{path}: onnxruntime fell back to {sess.get_providers()[0]}; the CUDA execution "
                          "provider could not start (no GPU, or CUDA/cuDNN libraries missing)")
    return sess


def _warm_cuda_context():
    """Creates the CUDA context (and onnxruntime's CUDA libraries) before any memory baseline."""
    import onnxruntime as ort
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "warm", [x], [y],
                          [helper.make_tensor("w", onnx.TensorProto.FLOAT, [4, 4], [0.0] * 16)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(m.SerializeToString(), so, providers=_providers("cuda", False))
    s.run(None, {"x": np.ones((1, 4), np.float32)})
    del s


def _run_error(path, e):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return LowbitError(f"{path}: onnxruntime failed to run the model: {msg[:400]}")


def _time_cpu(sess, feeds, warmup, runs, path):
    out = None
    try:
        for _ in range(warmup):
            out = sess.run(None, feeds)
        ts = []
        for _ in range(runs):
            t = time.perf_counter()
            out = sess.run(None, feeds)
            ts.append((time.perf_counter() - t) * 1e3)
    except Exception as e:  # noqa: BLE001
        raise _run_error(path, e) from None
    return ts, out


class _Bound:
    """An io binding with every input and output in a device buffer allocated once (fixed addresses, as CUDA
    graph replay needs)."""

    def __init__(self, sess, feeds, out_shapes, device_id=0):
        import onnxruntime as ort
        self.sess, self.binding = sess, sess.io_binding()
        self.keep = []
        for name, v in feeds.items():
            ov = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", device_id)
            self.keep.append(ov)
            self.binding.bind_ortvalue_input(name, ov)
        self.outputs = []
        for o in sess.get_outputs():
            shape, dt = out_shapes[o.name]
            ov = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dt, "cuda", device_id)
            self.outputs.append(ov)
            self.binding.bind_ortvalue_output(o.name, ov)

    def run(self):
        self.sess.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()

    def results(self):
        return self.binding.copy_outputs_to_cpu()


def _output_shapes(sess, feeds):
    """name -> (shape, dtype) of each output, from one plain io-binding run with onnxruntime-allocated outputs."""
    b = sess.io_binding()
    import onnxruntime as ort
    keep = []
    for name, v in feeds.items():
        ov = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", 0)
        keep.append(ov)
        b.bind_ortvalue_input(name, ov)
    for o in sess.get_outputs():
        b.bind_output(o.name, "cuda")
    sess.run_with_iobinding(b)
    outs = b.get_outputs()
    res = {o.name: (tuple(v.shape()), _np_dtype(v.data_type())) for o, v in zip(sess.get_outputs(), outs)}
    return res, b.copy_outputs_to_cpu()


def _np_dtype(ort_type: str):
    names = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
             "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_, "tensor(int16)": np.int16,
             "tensor(uint16)": np.uint16, "tensor(bfloat16)": np.uint16}
    if ort_type not in names:
        raise LowbitError(f"bench cannot bind an output of type {ort_type} on the device")
    return names[ort_type]


def _time_cuda(path, ours, feeds, warmup, runs, cuda_graph, session_factory, result, mem):
    plain = None
    if cuda_graph:  # output shapes (and a reference for the replayed outputs) from a plain session first
        s = _make_session(path, ours, "cuda", False, session_factory)
        try:
            shapes, plain = _output_shapes(s, feeds)
        except Exception as e:  # noqa: BLE001
            raise _run_error(path, e) from None
        del s
        release_host_memory()
    with mem.measure() as m:
        sess = _make_session(path, ours, "cuda", cuda_graph, session_factory)
        result.providers = sess.get_providers()
        try:
            if not cuda_graph:
                shapes, _ = _output_shapes(sess, feeds)
            bound = _Bound(sess, feeds, shapes)
            for _ in range(max(warmup, 2 if cuda_graph else 0)):   # onnxruntime captures on an early run
                bound.run()
            ts = []
            for _ in range(runs):
                t = time.perf_counter()
                bound.run()
                ts.append((time.perf_counter() - t) * 1e3)
            out = bound.results()
        except LowbitError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _run_error(path, e) from None
    result.peak_memory_bytes = int(m.peak)
    if plain is not None:
        result.graph_vs_plain_max_rel = max((_agree("", a, b).max_rel for a, b in zip(plain, out)), default=0.0)
    del bound, sess
    return ts, out


def _agree(name, a, b) -> Agreement:
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        return Agreement(name, float("inf"), float("inf"))
    if a.dtype.kind not in "fiub":
        same = np.array_equal(a, b)
        return Agreement(name, 0.0 if same else float("inf"), 0.0 if same else float("inf"))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(a64) & np.isfinite(b64)
    nan_mismatch = np.any(np.isnan(a64) != np.isnan(b64))
    diff = np.abs(a64 - b64)[finite]
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(a64[finite]).max()) if finite.any() else 0.0
    if nan_mismatch:
        max_abs = float("inf")
    return Agreement(name, max_abs, max_abs / max(scale, 1e-30) if max_abs else 0.0)


# ---------------------------------------------------------------------------------------------- the run

@dataclass
class BenchResult:
    provider: str
    cuda_graph: bool
    warmup: int
    runs: int
    memory_method: str
    inputs: dict            # name -> [shape, dtype]
    models: list            # [ModelResult original, ModelResult rewritten, ...]
    agreement: list         # [Agreement] per rewritten model and output
    written: list = field(default_factory=list)   # files written into out_dir
    timing_method: str = ""                        # how the timed runs were ordered (printed with the figures)

    def to_dict(self):
        d = asdict(self)
        for m, r in zip(d["models"], self.models):
            m["median_ms"], m["p90_ms"] = r.median_ms, r.p90_ms
        return d


def labels_for(count: int) -> list:
    """Labels of the models: 'original', then 'rewritten' (one) or 'rewritten 1' .. 'rewritten N'."""
    return ["original"] + (["rewritten"] if count == 1 else [f"rewritten {i}" for i in range(1, count + 1)])


def run(original, rewritten, *, session_factory, provider="cpu", cuda_graph=False, warmup=10, runs=100,
        inputs=None, dims=None, out_dir=".", seed=0) -> BenchResult:
    """Times the original and the rewritten model(s) (``rewritten``: a path or a list of paths) in this process
    (CPU: their runs alternating, ``_time_all``); returns a BenchResult and writes ``bench-<mode>.png`` /
    ``.json`` into ``out_dir`` (None: nothing written). ``session_factory(path, sess_options, providers=...)``
    makes sessions with our ops registered. LowbitError for every bad input."""
    rewritten = [rewritten] if isinstance(rewritten, (str, os.PathLike)) else list(rewritten)
    if not rewritten:
        raise LowbitError("no rewritten model to compare with the original")
    if provider not in ("cpu", "cuda"):
        raise LowbitError(f"unknown provider {provider!r}: cpu or cuda")
    if cuda_graph and provider != "cuda":
        raise LowbitError("--cuda-graph needs --provider cuda")
    if runs < 1 or warmup < 0:
        raise LowbitError(f"--runs must be >= 1 and --warmup >= 0 (got {runs}, {warmup})")
    if out_dir is not None and os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise LowbitError(f"--out {out_dir}: exists and is not a directory")
    if provider == "cuda":
        _cuda_check(cuda_graph)
    from .domain import DOMAIN
    paths = [original] + rewritten
    labels = labels_for(len(rewritten))
    models, sigs, ours = [], [], []
    for path in paths:
        m = model_io.load(path, load_external_data=False)
        model_io.check_opset(m, path)
        models.append(m)
        sigs.append(_signature(m))
        ours.append(any(n.domain == DOMAIN for n in m.graph.node))
    ours[1:] = [True] * len(rewritten)
    sig, first = dict(sigs[0]), {k: 0 for k in sigs[0]}     # every input, as the first model that has it wants it
    for i in range(1, len(sigs)):
        for name, (d1, s1) in sigs[i].items():
            if name not in sig:
                sig[name], first[name] = (d1, s1), i
                continue
            d0, s0 = sig[name]
            if d0 != d1 or len(s0) != len(s1):
                raise LowbitError(f"input {name!r} differs between the models: {d0}{s0} "
                                  f"({os.fspath(paths[first[name]])}) vs {d1}{s1} ({os.fspath(paths[i])})")
    chosen = {}
    if inputs:
        feeds = load_inputs(inputs, sig)
    else:
        chosen = guess_dims(sigs, dims or {}, models)
        if any(how != "given" for _, how in chosen.values()):
            print("onnx-lowbit: note: symbolic input dims guessed: "
                  + ", ".join(f"{n}={v} ({how})" for n, (v, how) in chosen.items() if how != "given")
                  + "; set them with --dim NAME=VALUE" + (" (INPUT:AXIS=VALUE for unnamed ones)" if any(
                      how.startswith("unnamed") for _, how in chosen.values()) else ""), file=sys.stderr)
        feeds = random_inputs(sig, {n: v for n, (v, _) in chosen.items()}, seed)
    if out_dir is not None:     # made once the models and inputs are good: bad input leaves no directory behind
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise LowbitError(f"--out {out_dir}: cannot create ({e.strerror or e})") from None
    mem = DeviceMemory() if provider == "cuda" else HostMemory()
    if provider == "cuda":
        _warm_cuda_context()
    try:
        warmed = _warm_library(paths, sigs, ours, feeds, provider, session_factory)
        if warmed:
            mem.method += (f"; measured after the library (numba, our kernels, the shim) was loaded and the "
                           f"kernels of {warmed} compiled by one untimed run each, so no model is charged "
                           "for that one-time load")
        results, outs, timing = _time_all(labels, paths, models, sigs, ours, feeds, provider, cuda_graph, warmup,
                                          runs, session_factory, mem)
    except LowbitError as e:
        if not chosen:
            raise
        used = ", ".join(f"{n}={v} ({'given' if how == 'given' else 'guessed'})" for n, (v, how) in chosen.items())
        raise LowbitError(f"{e} (the inputs were random with symbolic dims {used}: give the sizes the model "
                          "takes with --dim NAME=VALUE, or real inputs with --inputs DATA.npz)") from None
    names = [o.name for o in models[0].graph.output]
    agreement = []
    for label, out in zip(labels[1:], outs[1:]):
        for n, a, b in zip(names, outs[0], out):
            ag = _agree(n, a, b)
            ag.model = label
            agreement.append(ag)
    res = BenchResult(provider, cuda_graph, warmup, runs, mem.method,
                      {k: [list(v.shape), str(v.dtype)] for k, v in feeds.items()}, results, agreement,
                      timing_method=timing)
    if out_dir is not None:
        stem = os.path.join(out_dir, f"bench-{mode_name(res)}")
        try:
            plot(res, stem + ".png")
            res.written.append(stem + ".png")
        except ImportError:
            print("onnx-lowbit: note: no chart, matplotlib is not installed (pip install matplotlib, or "
                  "\".[cpu,plot]\" from the onnx-lowbit checkout)",
                  file=sys.stderr)
        res.written.append(stem + ".json")
        with open(stem + ".json", "w") as fh:
            json.dump(res.to_dict(), fh, indent=1)
    return res


def _warm_library(paths, sigs, ours, feeds, provider, session_factory) -> str:
    """One untimed session and run of every model that uses our ops, before any memory is measured: the library's
    one-time load (numba, our kernels' compilation, the shim) is then paid by none of the measured models (else
    the first one listed would carry it). Returns what was warmed, for the method line ("" for none)."""
    names = []
    for path, s, o in zip(paths, sigs, ours):
        if not o:
            continue
        sess = _make_session(path, True, provider, False, session_factory)
        try:
            sess.run(None, {k: feeds[k] for k in s})
        except Exception as e:  # noqa: BLE001
            raise _run_error(path, e) from None
        del sess
        names.append(os.path.basename(os.fspath(path)))
    release_host_memory()
    return ", ".join(names)


ALTERNATE_MAX_BYTES = 4 << 30  # CPU: models whose weights sum to this at most are timed alternately (sessions held
                               # together); larger ones one after another, each session freed before the next


def _time_all(labels, paths, models, sigs, ours, feeds, provider, cuda_graph, warmup, runs, session_factory, mem):
    """(ModelResults, outputs of each model, the timing method line); LowbitError when onnxruntime fails. CPU:
    the models' runs alternate (``_time_cpu_alternating``) where their sessions fit together, else each model is
    timed in turn, as on CUDA."""
    if provider == "cpu" and sum(weight_bytes(m) for m in models) <= ALTERNATE_MAX_BYTES:
        return _time_cpu_alternating(labels, paths, models, sigs, ours, feeds, warmup, runs, session_factory, mem)
    results, outs = [], []
    for label, path, m, s, o in zip(labels, paths, models, sigs, ours):
        r = ModelResult(label, os.fspath(path), weight_bytes(m))
        f = {k: feeds[k] for k in s}
        if provider == "cpu":
            with mem.measure() as meas:
                sess = _make_session(path, o, "cpu", False, session_factory)
                r.providers = sess.get_providers()
                ts, out = _time_cpu(sess, f, warmup, runs, path)
                del sess
            r.peak_memory_bytes = int(meas.peak)
        else:
            ts, out = _time_cuda(path, o, f, warmup, runs, cuda_graph, session_factory, r, mem)
        r.latency_ms = ts
        results.append(r)
        outs.append(out)
        release_host_memory()
    how = ("each model timed in turn (the models' weights exceed " f"{ALTERNATE_MAX_BYTES >> 30} GiB together: "
           "one session at a time)") if provider == "cpu" else "each model timed in turn"
    return results, outs, how


def _time_cpu_alternating(labels, paths, models, sigs, ours, feeds, warmup, runs, session_factory, mem):
    """CPU: every model's session made (its peak memory measured over its creation and warm-up runs) and kept;
    then the timed runs in rounds (onnx_lowbit/rounds.py: per round and model one untimed run, then its share of
    the timed runs in a row, round r starting with model r mod n), so a slow drift of the machine reaches every
    model alike. The outputs compared are each model's last run's."""
    results, sessions, fs = [], [], []
    try:
        for label, path, m, s, o in zip(labels, paths, models, sigs, ours):
            r = ModelResult(label, os.fspath(path), weight_bytes(m))
            f = {k: feeds[k] for k in s}
            with mem.measure() as meas:
                sess = _make_session(path, o, "cpu", False, session_factory)
                r.providers = sess.get_providers()
                _time_cpu(sess, f, max(warmup, 1), 0, path)
            r.peak_memory_bytes = int(meas.peak)
            results.append(r)
            sessions.append(sess)
            fs.append(f)
        outs = [None] * len(sessions)

        def runner(j):
            def run():
                try:
                    outs[j] = sessions[j].run(None, fs[j])
                except Exception as e:  # noqa: BLE001
                    raise _run_error(results[j].path, e) from None
            return run
        for r, ts in zip(results, rounds.timed_rounds([runner(j) for j in range(len(sessions))], runs)):
            r.latency_ms = ts
    finally:
        sessions.clear()
        release_host_memory()
    return results, outs, (f"rounds alternating between the models ({len(rounds.rounds_of(runs))} rounds, round r "
                           "starting with model r mod n; per round and model one untimed run, then its timed runs "
                           "in a row), wall clock around each run")


def mode_name(res) -> str:
    return res.provider + ("-graph" if res.cuda_graph else "")


# ---------------------------------------------------------------------------------------------- output

def _fmt_bytes(n):
    if n is None:
        return "n/a"
    return f"{n / MIB:.2f} MiB" if abs(n) >= 0.1 * MIB else f"{n / 1024:.1f} KiB"


def _time_words(a, b):
    """The rewritten model's figure ``b`` against the original's ``a``, in words: "1.80x faster"."""
    return speed(a, b) if a and b else ""


def _size_words(a, b):
    """"3.57x smaller" / "1.20x larger" (memory, weight bytes)."""
    return size(a, b) if a and b else ""


def _inputs_summary(inputs: dict) -> str:
    """``name dtype[shape]`` per input; inputs of one dtype and shape grouped (``32 x float16[...] (a, ..., z)``)."""
    groups = {}
    for k, (shape, dt) in inputs.items():
        groups.setdefault(f"{dt}{shape}", []).append(k)
    return ", ".join(f"{names[0]} {sig}" if len(names) == 1 else f"{len(names)} x {sig} ({names[0]} .. {names[-1]})"
                     for sig, names in groups.items())


def table(res: BenchResult) -> str:
    o, rs = res.models[0], res.models[1:]
    mode = f"{res.provider}{' + CUDA graph' if res.cuda_graph else ''}"
    head = "| | original |" + "".join(f" {r.label} | {r.label} vs original |" for r in rs)

    def row(name, fmt, get, words):
        cells = "".join(f" {fmt(get(r))} | {words(get(o), get(r))} |" for r in rs)
        return f"| {name} | {fmt(get(o))} |" + cells

    lines = [f"onnx-lowbit bench ({mode}; {res.warmup} warm-up + {res.runs} timed runs; inputs "
             + _inputs_summary(res.inputs) + ")", "", head, "|---|---|" + "---|---|" * len(rs),
             f"| model | {os.path.basename(o.path)} |" + "".join(f" {os.path.basename(r.path)} | |" for r in rs),
             row("latency median (ms)", lambda v: f"{v:.3f}", lambda m: m.median_ms, _time_words),
             row("latency p90 (ms)", lambda v: f"{v:.3f}", lambda m: m.p90_ms, _time_words),
             row("peak memory", _fmt_bytes, lambda m: m.peak_memory_bytes, _size_words),
             row("weight bytes", lambda v: f"{v:,}", lambda m: m.weight_bytes, _size_words),
             "", f"memory: {res.memory_method}"]
    lines += ([f"timing: {res.timing_method}"] if res.timing_method else []) + [""]
    several = len(rs) > 1
    lines += (["| model | output | max abs diff | max rel diff |", "|---|---|---|---|"] if several else
              ["| output | max abs diff | max rel diff |", "|---|---|---|"])
    lines += [("| " + a.model + " " if several else "") + f"| {a.output} | {a.max_abs:.4g} | {a.max_rel:.4g} |"
              for a in res.agreement]
    lines += ["", "max rel diff = max |rewritten - original| / max |original| per output"]
    for m in res.models:
        if m.graph_vs_plain_max_rel is not None:
            lines.append(f"{'warning: ' if m.graph_vs_plain_max_rel > GRAPH_TOLERANCE else ''}{m.label}: CUDA graph "
                         f"replay vs a plain run of the same model: max rel diff {m.graph_vs_plain_max_rel:.3g}")
    return "\n".join(lines)


COLORS = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def plot(res: BenchResult, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ms = res.models
    several = len(ms) > 2
    labels = [m.label.replace("rewritten ", "rw ") if several else m.label for m in ms]
    colors = [COLORS[i % len(COLORS)] for i in range(len(ms))]
    fig, axes = plt.subplots(1, 3, figsize=(11 + 1.2 * max(0, len(ms) - 2), 3.6))
    med = [m.median_ms for m in ms]
    p90 = [m.p90_ms - m.median_ms for m in ms]
    axes[0].bar(labels, med, color=colors, yerr=[[0] * len(ms), p90], capsize=6)
    axes[0].set_title("latency (ms): median, bar to p90")
    wmib = [m.weight_bytes / MIB for m in ms]
    axes[1].bar(labels, wmib, color=colors)
    axes[1].set_title("weight MiB")
    mem = [(m.peak_memory_bytes or 0) / MIB for m in ms]
    axes[2].bar(labels, mem, color=colors)
    axes[2].set_title("peak " + ("device" if res.provider == "cuda" else "RSS") + " memory MiB")
    for ax, vals in zip(axes, (med, wmib, mem)):
        for i, v in enumerate(vals):
            ax.annotate(f"{v:,.0f}" if v >= 100 else f"{v:.3g}", (i, v), xytext=(0 if several else 14, 2),
                        textcoords="offset points", ha="center" if several else "left", va="bottom", fontsize=9)
        ax.margins(y=0.15)
    worst = max((a.max_rel for a in res.agreement), default=0.0)
    names = " vs ".join(os.path.basename(m.path) for m in ms)
    if several:
        names = "; ".join(f"{lb} = {os.path.basename(m.path)}" for lb, m in zip(labels, ms))
    fig.suptitle(f"{names} on {res.provider}{' + CUDA graph' if res.cuda_graph else ''} "
                 f"(max rel output diff {worst:.3g})", fontsize=10 if not several else 8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(a, session_factory) -> int:
    """The CLI subcommand (``a``: argparse namespace)."""
    provider = a.provider or ("cuda" if a.cuda_graph else "cpu")
    res = run(a.original, a.rewritten, session_factory=session_factory, provider=provider,
              cuda_graph=a.cuda_graph, warmup=a.warmup, runs=a.runs, inputs=a.inputs,
              dims=parse_dims(a.dim), out_dir=a.out)
    print(table(res))
    print(f"\nwrote {', '.join(res.written)}")
    return 0

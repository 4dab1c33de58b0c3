"""Calibration runs shared by the passes that need activations: weights4 (AWQ's scale search) and gru (the
quantities' ranges). One run of a copy of the graph in onnxruntime, with the wanted tensors added as outputs.

    check_feeds(graph, calibration)                   the arrays checked against the graph inputs
    collect(graph, wanted, feeds, factory, ...)        {name: array} of the wanted tensors from one run
    runs(calibration)                                 a dict, a list of dicts, or NAME#K keys -> list of dicts
    stream(graph, wanted, frames, pairs, factory, ...) the wanted tensors of each frame of a streaming model
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnx_lowbit import domain

MS_DOMAIN = "com.microsoft"


def runs(calibration) -> list:
    """The calibration runs: a dict {input: array} is one run, unless its keys are NAME#K (K = 0, 1, ...: one run
    per K; plain keys are shared by every run); a list or tuple of such dicts is one run each."""
    if isinstance(calibration, (list, tuple)):
        if not calibration or not all(isinstance(c, dict) and c for c in calibration):
            raise ValueError("calibration: expected non-empty dicts {graph input name: numpy array}")
        return [r for c in calibration for r in runs(c)]
    if not isinstance(calibration, dict) or not calibration:
        raise ValueError("calibration: expected a non-empty dict {graph input name: numpy array}")
    keyed = {k: k.rpartition("#") for k in calibration if "#" in k}
    if not keyed:
        return [calibration]
    bad = [k for k, (_, _, n) in keyed.items() if not n.isdigit()]
    if bad:
        raise ValueError(f"calibration: {', '.join(map(repr, bad))}: a '#' in an array name must be followed by "
                         "the run number (NAME#0, NAME#1, ...)")
    shared = {k: v for k, v in calibration.items() if k not in keyed}
    out = {}
    for k, (name, _, n) in keyed.items():
        out.setdefault(int(n), dict(shared))[name] = calibration[k]
    return [out[n] for n in sorted(out)]


def stream(graph: gs.Graph, wanted, frames: dict, pairs: dict, factory, transform=None) -> list:
    """Runs a streaming model frame by frame: ``frames`` holds each non-state input with one extra leading axis
    (the frames), ``pairs`` maps each state input to the output that carries it to the next frame (the first
    frame's states are zeros). Returns one {name: array} of the ``wanted`` tensors per frame."""
    inputs = {t.name: t for t in graph.inputs}
    counts = {v.shape[0] if np.ndim(v) else -1 for v in frames.values()}
    if len(counts) != 1 or min(counts) < 1:
        raise ValueError(f"calibration: streaming model (state inputs {', '.join(map(repr, pairs))}): every other "
                         f"input needs [frames, ...] arrays with one frame count; got shapes "
                         f"{ {k: list(np.shape(v)) for k, v in frames.items()} }")
    states = {}
    for name in pairs:
        t = inputs[name]
        if t.shape is None or not all(isinstance(d, (int, np.integer)) and d > 0 for d in t.shape):
            raise ValueError(f"calibration: state input {name!r} needs a fixed shape to start from zeros, got "
                             f"{t.shape}; pass its arrays instead")
        states[name] = np.zeros(t.shape, np.dtype(t.dtype) if t.dtype is not None else np.float32)
    first = check_feeds(graph, {**{k: v[0] for k, v in frames.items()}, **states})
    run = None
    out = []
    for f in range(counts.pop()):
        feeds = dict(first) if f == 0 else {**{k: np.asarray(v[f]).astype(first[k].dtype, copy=False)
                                               for k, v in frames.items()}, **states}
        if run is None:
            run = _runner(graph, list(wanted) + [o for o in pairs.values() if o not in wanted], feeds, factory,
                          transform)
        try:
            got = run(feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime's errors, as one clear ValueError
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"calibration: running the model on frame {f} failed: {type(e).__name__}: "
                             f"{msg[:300]}") from None
        out.append({n: (feeds[n] if n in feeds else got[n]) for n in wanted if n in feeds or n in got})
        states = {i: got[o].reshape(states[i].shape).astype(states[i].dtype) for i, o in pairs.items()}
    return out


def _runner(graph, wanted, feeds, factory, transform):
    """A function feeds -> {name: array} running one session of the graph copy of ``collect``."""
    sess = _session(prepare(graph, wanted, feeds, factory, transform), factory)
    names = [o.name for o in sess.get_outputs()]
    return lambda f: dict(zip(names, sess.run(None, f)))


def _session(model, factory):
    import onnxruntime as ort  # noqa: PLC0415
    if factory is not None:
        return factory(model.SerializeToString())
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def collect(graph: gs.Graph, wanted, feeds: dict, factory, transform=None, hint: str = "") -> dict:
    """{output name: array} of one run of a copy of ``graph`` whose outputs include the ``wanted`` variables
    (``factory(model bytes or path)`` makes the session; default stock onnxruntime on the CPU). ``transform``
    may edit the copy's GraphProto first (gru: layout-1 GRUs as Transposes + layout 0). Every failure is one
    ValueError saying what went wrong."""
    model = prepare(graph, wanted, feeds, factory, transform, hint)
    try:
        return run_model(model, factory, feeds)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - onnxruntime's errors, as one clear ValueError
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"calibration: running the model failed: {type(e).__name__}: {msg[:300]}") from None


def prepare(graph: gs.Graph, wanted, feeds: dict, factory, transform=None, hint: str = "") -> onnx.ModelProto:
    """The graph copy of ``collect``: the wanted tensors as extra outputs."""
    copy = graph.copy()
    copy.cleanup(remove_unused_graph_inputs=False).toposort()
    have = {t.name for t in copy.outputs}
    tensors = copy.tensors()
    extra = [n for n in wanted if n not in have and n not in feeds and isinstance(tensors.get(n), gs.Variable)]
    model = gs.export_onnx(copy, do_type_check=False)
    del model.graph.value_info[:]
    for n in extra:
        model.graph.output.append(onnx.ValueInfoProto(name=n))
    if transform is not None:
        transform(model.graph)
    used = used_domains(model.graph)
    present = {o.domain for o in model.opset_import}
    if domain.DOMAIN in used and domain.DOMAIN not in present:
        model.opset_import.append(domain.opset_import())
    if MS_DOMAIN in used and MS_DOMAIN not in present:
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    model.ir_version = max(7, onnx.helper.find_min_ir_version_for(list(model.opset_import), True))
    if domain.DOMAIN in used and factory is None:
        raise ValueError("calibration: the graph already holds onnx_lowbit ops (e.g. FPLUT from the fplut pass), "
                         "which stock onnxruntime cannot run; pass calibration_session=onnx_lowbit.InferenceSession"
                         + hint)
    return model


def run_model(model: onnx.ModelProto, factory, feeds: dict) -> dict:
    """{output name: array} of one run of ``model`` (``factory(model bytes or path)``, default stock onnxruntime
    on the CPU). Models past protobuf's 2 GB limit go through a temporary file with external data."""
    import tempfile

    import onnxruntime as ort  # noqa: PLC0415

    def session(src):
        if factory is not None:
            return factory(src)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])

    if model.ByteSize() < 2 ** 31 - 1 - (1 << 20):
        sess = session(model.SerializeToString())
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    with tempfile.TemporaryDirectory(prefix="onnx-lowbit-calibration-") as d:
        path = f"{d}/model.onnx"
        onnx.save(model, path, save_as_external_data=True, location="model.onnx.data")
        sess = session(path)
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def used_domains(graph: onnx.GraphProto) -> set:
    out = set()
    for n in graph.node:
        out.add(n.domain or "")
        for a in n.attribute:
            for s in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                out |= used_domains(s)
    return out


def check_feeds(g: gs.Graph, calibration: dict) -> dict:
    """The calibration arrays checked against the graph inputs (names, ranks, fixed dims), cast to their types."""
    inputs = {t.name: t for t in g.inputs}
    unknown = sorted(set(calibration) - set(inputs))
    missing = [n for n in inputs if n not in calibration]
    if unknown:
        raise ValueError(f"calibration: no graph input named {', '.join(map(repr, unknown))}; inputs: "
                         f"{', '.join(map(repr, inputs))}")
    if missing:
        raise ValueError(f"calibration: no array for graph input {', '.join(map(repr, missing))}")
    feeds = {}
    for name, t in inputs.items():
        v = np.asarray(calibration[name])
        shape = t.shape
        if shape is not None:
            bad = len(shape) != v.ndim or any(isinstance(d, (int, np.integer)) and d > 0 and d != s
                                              for d, s in zip(shape, v.shape))
            if bad:
                raise ValueError(f"calibration: array {name!r} has shape {list(v.shape)}, the graph input "
                                 f"{[d if isinstance(d, (int, np.integer)) else str(d) for d in shape]}")
        if t.dtype is not None:
            try:
                v = v.astype(np.dtype(t.dtype), copy=False)
            except TypeError:
                pass
        feeds[name] = v
    return feeds

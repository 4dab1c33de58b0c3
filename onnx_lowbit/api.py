"""The public API layer: the only module of onnx_lowbit/ (besides cli.py) that reaches into passes/ and
custom_ops/. Everything else in onnx_lowbit/ is the core those depend on."""
from __future__ import annotations

import contextlib
import os
import re
import weakref

import onnxruntime as ort

from . import domain
from .errors import INSTALL


_registered = weakref.WeakSet()  # options already holding our ops: onnxruntime refuses a second registration
                                 # at session creation ("Domain already set in registry")


def register(sess_options: ort.SessionOptions) -> ort.SessionOptions:
    """Registers every onnx-lowbit op into ``sess_options`` (CPU and CUDA kernels) and returns it; registering
    the same options twice is harmless."""
    from onnx_lowbit.custom_ops.runtime import bridge
    domain.register_schemas()
    if sess_options in _registered:
        return sess_options
    bridge.register(sess_options)
    _registered.add(sess_options)
    return sess_options


def SessionOptions() -> ort.SessionOptions:  # noqa: N802 - mirrors onnxruntime.SessionOptions
    """An ``onnxruntime.SessionOptions`` with our ops registered."""
    return register(ort.SessionOptions())


def InferenceSession(model, sess_options=None, providers=None, **kwargs) -> ort.InferenceSession:  # noqa: N802
    """``onnxruntime.InferenceSession`` with our ops registered. ``model`` is a path, bytes or a ModelProto."""
    opts = register(sess_options or ort.SessionOptions())
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    return ort.InferenceSession(model, sess_options=opts, providers=providers, **kwargs)


def rewrite(model, passes=None, *, device=None, tune=False, feeds=None, dims=None, tune_runs=None, **options):
    """Rewrites ``model`` (ModelProto or path) with the named passes (default: the default passes; kvattention and
    rmsnorm only when named); returns (model, report).

    ``device="cpu"``: by default only the passes known not to be slower on the CPU (onnx_lowbit/cpu_passes.py; 4-bit
    weights when ``weights`` asks for them, with the target CPU_WEIGHTS names when ``weights_target`` is not given:
    onnxruntime's MatMulNBits at accuracy_level 4 for awq; QuantGRU when ``gru_bits`` or ``gru_weight_bits`` asks
    for it). ``tune=True`` (with device="cpu"): each pass is kept only where it measured faster on this machine
    (onnx_lowbit/tune.py) on ``feeds`` (default: made-up inputs, symbolic dims from ``dims``); the report's
    ``tune`` holds the decisions and figures."""
    import onnx

    from onnx_lowbit.passes import run_passes

    from .errors import LowbitError
    if device not in (None, "cpu", "cuda"):
        raise LowbitError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if tune and device != "cpu":
        raise LowbitError("tune=True measures in onnxruntime CPU sessions: give device='cpu' with it")

    from . import model_io
    if isinstance(model, (str, os.PathLike)):  # bad files: one-line LowbitErrors (as the CLI gives them)
        model = model_io.load(model)
        model_io.check_opset(model, os.fspath(model) if isinstance(model, str) else "model")
    elif isinstance(model, (bytes, bytearray)):
        model = model_io.load_bytes(model)
        model_io.check_opset(model)
    elif isinstance(model, onnx.ModelProto):
        model_io.check_opset(model)
    if device != "cpu":
        return run_passes(model, passes=passes, **options)
    from onnx_lowbit.passes import resolve

    from . import cpu_passes, tune as tune_mod
    size = tune_mod.asked_for_size(options, passes, cli=False)   # kept (by tune too) though slower
    options, _ = cpu_passes.cpu_weights_options(options)   # weights=... without weights_target: the CPU's faster
    selected = resolve(passes)
    if not tune:
        if passes is None:                                  # FPLUT for the activations it beats onnxruntime on
            options = cpu_passes.cpu_fplut_options(options)
        selected = cpu_passes.cpu_selection(selected, explicit=passes is not None, keep=size, quiet=True)
        from onnx_lowbit.passes import Report
        out, report = model, Report()
        for p in selected:
            out, r = run_passes(out, passes=[p.name], **options)
            report.extend(r)
        return out, report
    if feeds is None:
        feeds, where = tune_mod.tune_feeds(model, None, "", dims)
    else:
        where = "the given feeds"
    runs = tune_runs or tune_mod.DEFAULT_RUNS
    out, report, _ = tune_mod.tuned_rewrite(model, selected, options, tune_mod.SessionTimer(feeds, runs), size,
                                            where, runs)
    return out, report


# --------------------------------------------------------------------------------------------------------------
# A model using our ops, run without them registered. onnxruntime's own message ("Fatal error:
# onnx_lowbit:FPLUT(-1) is not a registered function/op") cannot be changed; these name the package and the fix.
class LibraryNotRegistered(RuntimeError):
    """A model uses onnx-lowbit ops but the session was made without them registered."""


_UNREGISTERED = re.compile(r"([\w.]+):(\w+)\((-?\d+)\) is not a registered function/op")

HOW_TO_REGISTER = (f"register the ops of the onnx-lowbit package ({INSTALL}) before creating the session: "
                   "`so = onnxruntime.SessionOptions(); "
                   "onnx_lowbit.register(so); onnxruntime.InferenceSession(model, so, providers=...)`, or use "
                   "`onnx_lowbit.InferenceSession(model, providers=...)`")


def explain_error(error, model=None):
    """A LibraryNotRegistered for onnxruntime's error ``error`` when it is about one of our ops not being
    registered (naming the op, the package and how to register it; with the model's onnx_lowbit.requires
    metadata when ``model``, a path or ModelProto, has it); None for any other error."""
    m = _UNREGISTERED.search(str(error))
    if not m or m.group(1) != domain.DOMAIN:
        return None
    note = ""
    try:
        import onnx
        proto = model if hasattr(model, "metadata_props") else (
            onnx.load(model, load_external_data=False) if isinstance(model, (str, os.PathLike)) else None)
        meta = {p.key: p.value for p in proto.metadata_props} if proto is not None else {}
        if "onnx_lowbit.ops" in meta:
            note = f" Its metadata lists the onnx-lowbit ops it uses: {meta['onnx_lowbit.ops']}."
    except Exception:  # noqa: BLE001 - the metadata only adds detail
        pass
    return LibraryNotRegistered(
        f"the model uses {domain.DOMAIN}.{m.group(2)}, an op of the onnx-lowbit package, and the onnxruntime "
        f"session was created without it: {HOW_TO_REGISTER}.{note} (onnxruntime said: "
        f"{str(error).strip().splitlines()[0][:200]})")


@contextlib.contextmanager
def explained_errors(model=None):
    """``with onnx_lowbit.api.explained_errors(path): sess = onnxruntime.InferenceSession(path)`` re-raises
    onnxruntime's unregistered-op error for our ops as LibraryNotRegistered (see explain_error)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        better = explain_error(e, model)
        if better is None:
            raise
        raise better from e


def plain_session(model, sess_options=None, providers=None, **kwargs) -> ort.InferenceSession:
    """A stock ``onnxruntime.InferenceSession`` (our ops not registered: e.g. for --target ort models); a model
    that needs our ops raises LibraryNotRegistered saying how to register them."""
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    with explained_errors(model if isinstance(model, (str, os.PathLike)) else None):
        return ort.InferenceSession(model, sess_options=sess_options, providers=providers, **kwargs)


def rewrite_file(src, dst, passes=None, **options):
    """Rewrites the model file ``src`` into ``dst`` and returns the Report. A model with external data (every model
    over 2 GB) is streamed as `onnx-lowbit rewrite` does it: weights are read one at a time and new ones written
    to ``dst``'s data file as they are made (docs/reliability.md). ``dst`` appears atomically, or not at all when
    anything fails; ``src`` is never modified."""
    from onnx_lowbit.passes import Report, resolve, run_passes

    from . import model_io
    from .errors import LowbitError
    selected = resolve(passes)
    if os.path.abspath(os.fspath(src)) == os.path.abspath(os.fspath(dst)):
        raise LowbitError(f"dst must differ from src ({dst}); the input is never overwritten")
    head = model_io.load(src, load_external_data=False)
    model_io.check_opset(head, os.fspath(src))
    model_io.check_output_spares_input(dst, src, head)
    report = Report()
    if not model_io.uses_external_data(head) or options.get("calibration") is not None:
        out = model_io.load(src)
        for p in selected:
            out, r = run_passes(out, passes=[p.name], **options)
            report.extend(r)
        model_io.save(out, dst)
        return report
    with model_io.StagedOutput(dst) as staged:
        options = dict(options, external_data_dir=os.path.dirname(os.path.abspath(os.fspath(src))), spill=staged.spill)
        out = head
        for p in selected:
            out, r = run_passes(out, passes=[p.name], **options)
            report.extend(r)
        staged.write(out, options["external_data_dir"])
        staged.commit()
    return report

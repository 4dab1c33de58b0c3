"""The public API layer: the only module of onnx_lowbit/ (besides cli.py) that reaches into passes/ and
custom_ops/. Everything else in onnx_lowbit/ is the core those depend on."""
from __future__ import annotations

import onnxruntime as ort

from . import domain


def register(sess_options: ort.SessionOptions) -> ort.SessionOptions:
    """Registers every onnx-lowbit op into ``sess_options`` (CPU and CUDA kernels) and returns it."""
    from onnx_lowbit.custom_ops import bridge
    domain.register_schemas()
    bridge.register(sess_options)
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


def rewrite(model, passes=None, **options):
    """Rewrites ``model`` (ModelProto or path) with the named passes (all by default); returns (model, report)."""
    from onnx_lowbit.passes import run_passes
    return run_passes(model, passes=passes, **options)

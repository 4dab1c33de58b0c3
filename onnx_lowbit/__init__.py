"""onnx-lowbit: rewrite ONNX graphs with low-bit and fused operators, and run them in onnxruntime.

Public API (imported lazily, so ``import onnx_lowbit`` stays light and the core never depends on the layers
above it):
    onnx_lowbit.rewrite(model, passes=...)            graph rewrites (onnx_lowbit.passes)
    onnx_lowbit.register(sess_options)                 our ops into an onnxruntime.SessionOptions
    onnx_lowbit.InferenceSession(model, providers=...) an onnxruntime session with our ops registered
    onnx_lowbit.DOMAIN                                 the custom op domain of every op we emit
"""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout the three code folders sit side by side (onnx_lowbit/, passes/, custom_ops/); an install
# maps them to onnx_lowbit.passes and onnx_lowbit.custom_ops. Let the checkout import the same way.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "passes")) and _os.path.isfile(
        _os.path.join(_root, "passes", "__init__.py")) and _os.path.isfile(_os.path.join(_root, "custom_ops", "__init__.py")):
    __path__.append(_root)  # noqa: F821 - onnx_lowbit.passes -> <root>/passes, onnx_lowbit.custom_ops -> <root>/custom_ops

from .domain import DOMAIN, DOMAIN_VERSION  # noqa: E402

_LAZY = {
    "rewrite": ("onnx_lowbit.api", "rewrite"),
    "rewrite_file": ("onnx_lowbit.api", "rewrite_file"),
    "register": ("onnx_lowbit.api", "register"),
    "InferenceSession": ("onnx_lowbit.api", "InferenceSession"),
    "SessionOptions": ("onnx_lowbit.api", "SessionOptions"),
    "explain_error": ("onnx_lowbit.api", "explain_error"),
    "explained_errors": ("onnx_lowbit.api", "explained_errors"),
    "LibraryNotRegistered": ("onnx_lowbit.api", "LibraryNotRegistered"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onnx_lowbit' has no attribute {name!r}")


__all__ = ["DOMAIN", "DOMAIN_VERSION", "rewrite", "register", "InferenceSession", "SessionOptions", "__version__"]

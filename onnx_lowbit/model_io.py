"""Model I/O: loading with clear errors, and atomic saving (temp file + rename, external data included).

A model whose serialized size would pass protobuf's 2 GB limit, or that came with external data, is written
with its weights in one external data file ``<OUT>.data`` beside it.
"""
from __future__ import annotations

import os
import tempfile

import onnx
from google.protobuf.message import DecodeError

from .errors import LowbitError

MIN_OPSET = 9
TWO_GB = 2 ** 31 - 1


def max_opset() -> int:
    return onnx.defs.onnx_opset_version()


def load(path, *, load_external_data: bool = True) -> onnx.ModelProto:
    """Loads an ONNX model, raising LowbitError with a one-line reason for every kind of bad file."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise LowbitError(f"{p}: no such file")
    if os.path.isdir(p):
        raise LowbitError(f"{p}: is a directory, not an ONNX file")
    if not os.access(p, os.R_OK):
        raise LowbitError(f"{p}: not readable (permission denied)")
    if os.path.getsize(p) == 0:
        raise LowbitError(f"{p}: empty file, not an ONNX model")
    try:
        model = onnx.load(p, load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise LowbitError(f"{p}: not an ONNX model or truncated ({type(e).__name__}: {str(e)[:120]})") from None
    except OSError as e:
        raise LowbitError(f"{p}: cannot read ({e.strerror or e})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise LowbitError(f"{p}: not an ONNX model (no graph); is the file truncated or of another format?")
    if load_external_data and uses_external_data(model):
        try:
            onnx.external_data_helper.load_external_data_for_model(model, os.path.dirname(os.path.abspath(p)))
        except (OSError, ValueError) as e:
            raise LowbitError(f"{p}: its external data could not be read ({e})") from None
    return model


def uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.external_data_helper._get_all_tensors(model))


def check_opset(model: onnx.ModelProto, what: str = "model") -> int:
    """The default-domain opset of the model; LowbitError if we do not support it."""
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    v = opsets.get("ai.onnx")
    if v is None:
        raise LowbitError(f"{what}: no default-domain opset import; not a standard ONNX model")
    if not MIN_OPSET <= v <= max_opset():
        raise LowbitError(f"{what}: opset {v} is not supported (supported: {MIN_OPSET}..{max_opset()})")
    return v


def save(model: onnx.ModelProto, path, *, external_data: bool | None = None) -> None:
    """Writes ``model`` to ``path`` atomically. With external data (default: when the input had it or the model
    is too large for one protobuf) the weights go to ``<name>.data`` beside it, also written atomically."""
    p = os.path.abspath(os.fspath(path))
    d = os.path.dirname(p)
    if not os.path.isdir(d):
        raise LowbitError(f"{path}: directory {d} does not exist")
    if not os.access(d, os.W_OK):
        raise LowbitError(f"{path}: directory {d} is not writable")
    if external_data is None:
        external_data = uses_external_data(model) or _too_big(model)
    tmpdir = tempfile.mkdtemp(prefix=".onnx-lowbit-", dir=d)
    try:
        base = os.path.basename(p)
        tmp_model = os.path.join(tmpdir, base)
        data_name = base + ".data"
        if external_data:
            m = onnx.ModelProto()
            m.CopyFrom(model)
            onnx.save_model(m, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024, convert_attribute=False)
            if os.path.exists(os.path.join(tmpdir, data_name)):
                os.replace(os.path.join(tmpdir, data_name), os.path.join(d, data_name))
        else:
            onnx.save_model(model, tmp_model)
        os.replace(tmp_model, p)
    except OSError as e:
        raise LowbitError(f"{path}: could not write ({e.strerror or e})") from None
    finally:
        for f in os.listdir(tmpdir):
            os.unlink(os.path.join(tmpdir, f))
        os.rmdir(tmpdir)


def _too_big(model: onnx.ModelProto) -> bool:
    try:
        return model.ByteSize() > TWO_GB - (64 << 20)
    except Exception:  # noqa: BLE001 - protobuf refuses to size > 2 GB messages on some builds
        return True

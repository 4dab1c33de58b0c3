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
    if uses_external_data(model):
        check_external_locations(model, os.path.dirname(os.path.abspath(p)), p)
    if load_external_data and uses_external_data(model):
        try:
            onnx.external_data_helper.load_external_data_for_model(model, os.path.dirname(os.path.abspath(p)))
        except (OSError, ValueError) as e:
            raise LowbitError(f"{p}: its external data could not be read ({e})") from None
    return model


_staging: set = set()  # data files of live StagedOutputs: the only absolute locations our own tensors refer to


def external_path(base_dir: str, location: str, name: str) -> str:
    """The file holding tensor ``name``'s external data: ``location`` must be relative and stay inside
    ``base_dir`` (checked lexically, as onnxruntime does: symlinks inside the folder are followed), or be the data
    file of one of our StagedOutputs. LowbitError otherwise: a model must not make us read other files."""
    if os.path.isabs(location):
        if location in _staging:
            return location
        raise LowbitError(f"tensor {name!r}: external data location {location!r} is an absolute path; it must be "
                          "relative to the model's folder")
    norm = os.path.normpath(location)
    if norm == ".." or norm.startswith(".." + os.sep) or not location:
        raise LowbitError(f"tensor {name!r}: external data location {location!r} points outside the model's folder")
    return os.path.join(base_dir, norm)


def open_external(base_dir: str, location: str, name: str):
    """``external_path`` opened for reading (LowbitError naming the tensor and file when it cannot be)."""
    path = external_path(base_dir, location, name)
    try:
        return open(path, "rb")
    except OSError as e:
        raise LowbitError(f"tensor {name!r}: external data file {path}: cannot read ({e.strerror or e})") from None


def check_external_locations(model: onnx.ModelProto, base_dir: str, what: str = "model") -> None:
    """Every external data reference of ``model`` is a relative location inside ``base_dir`` naming a file."""
    for t in onnx.external_data_helper._get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = onnx.external_data_helper.ExternalDataInfo(t)
            path = external_path(base_dir, info.location or "", t.name)
            if not os.path.isfile(path):
                raise LowbitError(f"{what}: tensor {t.name!r}: external data file {path} does not exist")


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


def external_files(model: onnx.ModelProto, base_dir: str) -> set:
    """Absolute paths of the external data files ``model``'s tensors read (relative to ``base_dir``)."""
    out = set()
    for t in onnx.external_data_helper._get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = onnx.external_data_helper.ExternalDataInfo(t).location
            out.add(os.path.abspath(loc if os.path.isabs(loc) else os.path.join(base_dir, loc)))
    return out


def data_path(path) -> str:
    """Where ``save`` / ``StagedOutput`` put the external data of the model written to ``path``."""
    return os.path.abspath(os.fspath(path)) + ".data"


def check_output_spares_input(out_path, in_path, model: onnx.ModelProto) -> None:
    """LowbitError when writing ``out_path`` (and its ``.data`` file) would replace the input model or one of the
    external data files it reads: the input is never modified."""
    in_dir = os.path.dirname(os.path.abspath(os.fspath(in_path)))
    inputs = {os.path.abspath(os.fspath(in_path))} | external_files(model, in_dir)
    for target in (os.path.abspath(os.fspath(out_path)), data_path(out_path)):
        for f in inputs:
            same = target == f
            if not same and os.path.exists(target) and os.path.exists(f):
                same = os.path.samefile(target, f)
            if same:
                raise LowbitError(f"{out_path}: writing it would replace {f}, which the input model reads; "
                                  "the input is never overwritten (choose another OUT)")


class StagedOutput:
    """An output model with external data written as it is made, committed atomically.

    ``spill(name, array)`` appends a tensor's bytes to a staging data file (in a temporary folder beside the
    output) and returns a TensorProto referring to them; ``write(model, src_dir)`` copies the external tensors the
    model still takes from the input (``src_dir``) into that file chunk by chunk, moves the other large tensors
    there too, and writes the model; ``commit()`` renames the data file and then the model into place;
    ``abort()`` (also on a failed ``write``) removes everything staged. Nothing appears at the output path
    before ``commit``. Use as a context manager: leaving it without ``commit`` aborts.
    """

    ALIGN = 64
    CHUNK = 64 << 20
    THRESHOLD = 1024  # tensors of this many bytes or more go to the data file

    def __init__(self, path):
        self.path = os.path.abspath(os.fspath(path))
        d = os.path.dirname(self.path)
        if not os.path.isdir(d):
            raise LowbitError(f"{path}: directory {d} does not exist")
        if not os.access(d, os.W_OK):
            raise LowbitError(f"{path}: directory {d} is not writable")
        self.base = os.path.basename(self.path)
        self.data_name = self.base + ".data"
        self.tmpdir = tempfile.mkdtemp(prefix=".onnx-lowbit-", dir=d)
        self.tmp_data = os.path.join(self.tmpdir, self.data_name)
        self.tmp_model = os.path.join(self.tmpdir, self.base)
        self._f = open(self.tmp_data, "wb")
        _staging.add(self.tmp_data)
        self.offset = 0
        self.written = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.abort()
        return False

    def _append(self, data) -> tuple:
        pad = (-self.offset) % self.ALIGN
        if pad:
            self._f.write(b"\0" * pad)
            self.offset += pad
        start = self.offset
        self._f.write(data)
        n = len(memoryview(data).cast("B"))
        self.offset += n
        return start, n

    def _refer(self, t: onnx.TensorProto, start: int, length: int, location: str) -> None:
        t.ClearField("raw_data")
        del t.external_data[:]
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(start)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v

    def spill(self, name: str, array) -> onnx.TensorProto:
        """Writes ``array`` now; the TensorProto refers to the staging file by its absolute path until ``write``."""
        import numpy as np
        a = np.ascontiguousarray(array)
        t = onnx.TensorProto()
        t.name = name
        t.data_type = onnx.helper.np_dtype_to_tensor_dtype(a.dtype)
        t.dims.extend(a.shape)
        try:
            start, n = self._append(a.reshape(-1).view(np.uint8))
            self._f.flush()  # a later pass may read it back (passes.external.ExternalValues opens the file anew)
        except OSError as e:
            raise LowbitError(f"{self.path}: could not write its data file ({e.strerror or e})") from None
        self._refer(t, start, n, self.tmp_data)
        return t

    def _copy_from(self, src_dir: str, location: str, offset: int, length: int | None, name: str) -> tuple:
        pad = (-self.offset) % self.ALIGN
        if pad:
            self._f.write(b"\0" * pad)
            self.offset += pad
        start, done = self.offset, 0
        src = external_path(src_dir, location, name)
        try:
            with open_external(src_dir, location, name) as f:
                f.seek(offset)
                while length is None or done < length:
                    block = f.read(self.CHUNK if length is None else min(self.CHUNK, length - done))
                    if not block:
                        break
                    self._f.write(block)
                    done += len(block)
        except OSError as e:
            raise LowbitError(f"external data of {name!r} ({src}): cannot read ({e.strerror or e})") from None
        if length is not None and done != length:
            raise LowbitError(f"external data of {name!r} ({src}): file too short ({done} of {length} bytes at "
                              f"offset {offset})")
        self.offset += done
        return start, done

    def write(self, model: onnx.ModelProto, src_dir: str | None) -> str:
        """Puts every tensor of ``model`` of THRESHOLD bytes or more into the data file and writes the model into
        the staging folder (``model``'s tensors are changed to refer to the output's data file). Returns the
        staged model's path (loadable, e.g. for --verify, until commit / abort)."""
        import numpy as np
        # tensors already external (ours or the input's) are all rewritten to the output's file; inline tensors
        # move out only from initializers, as onnx.save does (attribute tensors of Constant nodes stay inline)
        ext = onnx.TensorProto.EXTERNAL
        try:
            for t in onnx.external_data_helper._get_all_tensors(model):
                if t.data_location != ext:
                    continue
                info = onnx.external_data_helper.ExternalDataInfo(t)
                if info.location == self.tmp_data:
                    self._refer(t, int(info.offset or 0), int(info.length), self.data_name)
                    continue
                if src_dir is None:
                    raise LowbitError(f"tensor {t.name!r} refers to external data but no folder to read it from")
                start, n = self._copy_from(src_dir, info.location, int(info.offset or 0), info.length, t.name)
                self._refer(t, start, n, self.data_name)
            for t in onnx.external_data_helper._get_initializer_tensors(model):
                if t.data_location == ext:
                    continue
                if t.HasField("raw_data"):
                    if len(t.raw_data) >= self.THRESHOLD:
                        start, n = self._append(t.raw_data)
                        self._refer(t, start, n, self.data_name)
                elif t.data_type != onnx.TensorProto.STRING:
                    a = onnx.numpy_helper.to_array(t)
                    if a.nbytes >= self.THRESHOLD:
                        start, n = self._append(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
                        for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                            t.ClearField(f)
                        self._refer(t, start, n, self.data_name)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            with open(self.tmp_model, "wb") as f:
                f.write(model.SerializeToString())
        except OSError as e:
            self.abort()
            raise LowbitError(f"{self.path}: could not write ({e.strerror or e})") from None
        except BaseException:
            self.abort()
            raise
        self.written = True
        return self.tmp_model

    def commit(self, path=None) -> None:
        """Moves the staged model into place: at the output path, or at ``path`` (in the same folder; e.g. a
        rewrite that failed --verify, kept under another name: its data file is named after it)."""
        if not self.written:
            raise LowbitError(f"{self.path}: nothing written to commit")
        target = os.path.abspath(os.fspath(path)) if path is not None else self.path
        data_name = os.path.basename(target) + ".data"
        try:
            if data_name != self.data_name:  # the model refers to its data file by name: rename the references
                m = onnx.load(self.tmp_model, load_external_data=False)
                for t in onnx.external_data_helper._get_all_tensors(m):
                    if t.data_location == onnx.TensorProto.EXTERNAL:
                        for e in t.external_data:
                            if e.key == "location" and e.value == self.data_name:
                                e.value = data_name
                with open(self.tmp_model, "wb") as f:
                    f.write(m.SerializeToString())
            os.replace(self.tmp_data, os.path.join(os.path.dirname(target), data_name))
            os.replace(self.tmp_model, target)
        except OSError as e:
            raise LowbitError(f"{self.path}: could not write ({e.strerror or e})") from None
        finally:
            self.abort()

    def abort(self) -> None:
        """Removes the staging folder and everything in it (safe to call more than once)."""
        _staging.discard(self.tmp_data)
        try:
            if not self._f.closed:
                self._f.close()
        except OSError:
            pass
        if os.path.isdir(self.tmpdir):
            for f in os.listdir(self.tmpdir):
                try:
                    os.unlink(os.path.join(self.tmpdir, f))
                except OSError:
                    pass
            try:
                os.rmdir(self.tmpdir)
            except OSError:
                pass


def load_bytes(data, what: str = "model") -> onnx.ModelProto:
    """A serialized model -> ModelProto, with the same one-line LowbitErrors as ``load``."""
    if not data:
        raise LowbitError(f"{what}: empty, not an ONNX model")
    try:
        model = onnx.load_from_string(bytes(data))
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise LowbitError(f"{what}: not an ONNX model or truncated ({type(e).__name__}: {str(e)[:120]})") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise LowbitError(f"{what}: not an ONNX model (no graph); is it truncated or of another format?")
    return model


def malformed(model: onnx.ModelProto) -> str | None:
    """Why onnx's checker rejects ``model`` (one line), or None when it passes: used to tell a broken model from a
    bug of ours when a pass fails on it. Tensors whose data is external (a model streamed without its data) are
    checked as empty tensors: the checker would look for their files relative to the working directory, not the
    model's folder, and the streaming reader checks those files itself."""
    from onnx.external_data_helper import _get_all_tensors
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in _get_all_tensors(model)):
        stripped = onnx.ModelProto()
        stripped.CopyFrom(model)     # without external data, so cheap
        for t in _get_all_tensors(stripped):
            if t.data_location == onnx.TensorProto.EXTERNAL:
                dt, name = t.data_type, t.name
                t.Clear()
                t.data_type, t.name = dt, name
                t.dims.append(0)
        model = stripped
    try:
        from . import domain
        domain.register_schemas()
        onnx.checker.check_model(model, full_check=False)
    except Exception as e:  # noqa: BLE001 - the checker raises several types (ValidationError, ValueError, ...)
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        return (lines[0] if lines else type(e).__name__)[:300]
    return None

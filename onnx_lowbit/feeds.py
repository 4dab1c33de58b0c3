"""Inputs for running a model: its graph inputs' signature, the values of its symbolic dims, data read from an
.npz, and random arrays made to be consistent with what the graph does with them (``rewrite --verify``).

Symbolic dims get one value per name (inputs that share a name share the value). A dim whose name is an arithmetic
expression of other names, as exporters write them (optimum: ``past_sequence_length + sequence_length``; dynamo:
``s0 + s1``), is computed from its parts, so an attention mask is as long as the past plus the current tokens.
Values come from, in order: ``--dim NAME=VALUE``, the shapes of arrays the user gave, then one default rule, the
same for ``rewrite --verify`` / ``--tune`` and ``bench`` (``guess_dims``): 1 for batch-like names and for the first
axis of an image input (rank 4, float, 1-4 channels in axis 1 or 3: NCHW / NHWC; PaddleOCR's
``p2o.DynamicDimension.0`` too), 8 for past / cache lengths, an image input's height / width from the model's
``imgsz`` metadata (ultralytics) or 224 (a multiple of 32, so strided CNNs line up), 16 for anything else.
Free dims with no name (shown as '?') are addressed as ``INPUT:AXIS`` (``--dim x:0=2``); unset, they are 1 on the
first axis, 224 in an image's spatial places, else 16.

Random values: integer inputs that index a constant table (a Gather's indices: token ids, positions into an
embedding) lie within that table; ``attention_mask``-like inputs are ones, ``position_ids`` count from the past
length up, ``token_type_ids`` are zeros, other integers and bools are 0 or 1; floats ~ N(0, 1).
"""
from __future__ import annotations

import ast
import os
import re
import zipfile

import numpy as np
import onnx
from onnx import helper

from .errors import LowbitError

BATCH = re.compile(r"^(n|b|bs|batch.*|.*_batch|.*batch_size.*)$", re.IGNORECASE)
PAST = re.compile(r"past|cache|memory", re.IGNORECASE)
SPATIAL = re.compile(r"height|width|^h$|^w$|^(in|img|image)_?[hw]", re.IGNORECASE)
DEFAULT_PAST = 8
DEFAULT_IMAGE = 224
DEFAULT_OTHER = 16
MASK = re.compile(r"(^|_)mask$|attention_mask", re.IGNORECASE)
POSITIONS = re.compile(r"position_ids|^positions?$", re.IGNORECASE)
ZEROS = re.compile(r"token_type_ids|segment_ids", re.IGNORECASE)
PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand"}


def signature(model: onnx.ModelProto) -> dict:
    """input name -> (numpy dtype, dims: int, a dim name, or None for a free dim with no name; a dim_value of 0
    counts as free, as exporters write it for unknown sizes, and so does a dim named '?': Paddle exports write that
    name for every unknown size, e.g. [-1, 3, '?', '?'], and two free dims are not one dim)."""
    inits = {i.name for i in model.graph.initializer}
    sig = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise LowbitError(f"input {vi.name!r} is not a tensor; only tensor inputs can be fed")
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else
                (d.dim_param if d.dim_param not in ("", "?") else None) for d in tt.shape.dim]
        sig[vi.name] = (np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims)
    return sig


def parse_dims(specs, minimum: int = 0) -> dict:
    """``["batch=1", "past=128", "x:0=2"]`` -> {"batch": 1, "past": 128, "x:0": 2} (NAME=VALUE for a symbolic dim,
    INPUT:AXIS=VALUE for an unnamed one; LowbitError on a bad spec or a value under ``minimum``: --verify allows
    0, an empty past; bench 1)."""
    out = {}
    for s in specs or []:
        name, sep, value = s.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < minimum:
            raise LowbitError(f"--dim {s!r}: expected NAME=VALUE (or INPUT:AXIS=VALUE for an unnamed dim) with VALUE "
                              f"an integer >= {minimum}")
        out[name.strip()] = int(value)
    return out


def read_npz(path: str, flag: str) -> dict:
    """The named arrays of an .npz file given with ``flag`` (--calibration, --verify-data, --inputs); a clear
    LowbitError for a missing file, a folder, a single .npy array or an unreadable file."""
    if not os.path.exists(path):
        raise LowbitError(f"{path}: no such file ({flag})")
    if os.path.isdir(path):
        raise LowbitError(f"{path}: is a directory, not an .npz file ({flag})")
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise LowbitError(f"{path}: a single .npy array, not an .npz archive of named arrays ({flag}; save "
                              "with numpy.savez(path, input_name=array))")
        with z:
            arrays = {k: z[k] for k in z.files}
    except LowbitError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise LowbitError(f"{path}: not a readable .npz file ({flag}): {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}"[:300]) from None
    if not arrays:
        raise LowbitError(f"{path}: the .npz holds no arrays ({flag})")
    return arrays


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a // b}


def _expression(name: str):
    """The parsed expression when ``name`` is arithmetic over other names (e.g. 'past + seq'), else None."""
    try:
        tree = ast.parse(name.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.BinOp):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.BinOp, ast.Name, ast.Constant, ast.Load)) and type(node) not in _OPS:
            return None
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            return None
    return tree


def _leaves(tree) -> list:
    return [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]


def _evaluate(tree, values: dict) -> int:
    if isinstance(tree, ast.Constant):
        return int(tree.value)
    if isinstance(tree, ast.Name):
        return int(values[tree.id])
    return int(_OPS[type(tree.op)](_evaluate(tree.left, values), _evaluate(tree.right, values)))


def _image_axes(ds: list) -> tuple:
    """The spatial axes of a 4-D input with a fixed channel count of 1-4 in axis 1 (NCHW: (2, 3)) or axis 3 (NHWC:
    (1, 2)); () otherwise."""
    if len(ds) != 4:
        return ()
    if isinstance(ds[1], int) and 1 <= ds[1] <= 4:
        return (2, 3)
    if isinstance(ds[3], int) and 1 <= ds[3] <= 4:
        return (1, 2)
    return ()


def _images(sig: dict) -> dict:
    """input name -> its spatial axes, for the image inputs of ``sig`` (float, NCHW / NHWC; a KV cache is none)."""
    return {name: axes for name, (dt, ds) in sig.items()
            if np.issubdtype(dt, np.floating) and not PAST.search(name) and (axes := _image_axes(ds))}


def image_size(models) -> tuple | None:
    """(height, width) a model says it was exported for: ultralytics' ``imgsz`` metadata ("[640, 640]")."""
    for m in models:
        for p in m.metadata_props:
            if p.key == "imgsz":
                v = [int(x) for x in re.findall(r"\d+", p.value)]
                if len(v) in (1, 2) and all(x > 0 for x in v):
                    return (v[0], v[-1])
    return None


def _roles(sig: dict) -> tuple:
    """({dim name: 0 / 1, height / width of an image input}, {dim names on an image input's first axis})."""
    spatial, batch = {}, set()
    for name, axes in _images(sig).items():
        ds = sig[name][1]
        for k, i in enumerate(axes):
            if isinstance(ds[i], str):
                spatial.setdefault(ds[i], k)
        if isinstance(ds[0], str):
            batch.add(ds[0])
    return spatial, batch


def _default(name: str, spatial: dict, batch: set, size) -> tuple:
    """(value, how it was chosen) of a symbolic dim nobody gave: THE one rule (verify and bench alike)."""
    if BATCH.match(name):
        return 1, "batch-like name"
    if name in batch and name not in spatial:
        return 1, "batch axis of an image input"
    if PAST.search(name):
        return DEFAULT_PAST, "past / cache length"
    if name in spatial:
        return (size[spatial[name]], "the model's imgsz metadata") if size else \
            (DEFAULT_IMAGE, "image input, a multiple of 32")
    if SPATIAL.search(name):
        return DEFAULT_IMAGE, "height / width name"
    return DEFAULT_OTHER, "default"


def axis_key(name: str, axis: int) -> str:
    """How --dim addresses an unnamed free dim: ``INPUT:AXIS`` (e.g. ``x:0``)."""
    return f"{name}:{axis}"


def _unnamed(sig: dict) -> dict:
    """``INPUT:AXIS`` -> (input, axis) of every free dim with no name (shown as '?')."""
    return {axis_key(n, i): (n, i) for n, (_, ds) in sig.items() for i, d in enumerate(ds) if d is None}


def _unnamed_default(sig: dict, name: str, axis: int) -> tuple:
    if axis == 0:
        return 1, "unnamed, first axis"
    if axis in _images(sig).get(name, ()):
        return DEFAULT_IMAGE, "unnamed, image height / width"
    return DEFAULT_OTHER, "unnamed"


def _check_addresses(sig: dict, given: dict, names: list, leaves: list) -> None:
    """LowbitError for a --dim that names nothing: no such symbolic dim, nor an INPUT:AXIS of an unnamed one."""
    unnamed = _unnamed(sig)
    bad = []
    for key in given:
        if key in names or key in leaves or key in unnamed:
            continue
        inp, sep, axis = key.rpartition(":")
        if sep and inp in sig and axis.isdigit():
            ds = sig[inp][1]
            i = int(axis)
            if i >= len(ds):
                raise LowbitError(f"--dim {key}: input {inp!r} has {len(ds)} axes (0 to {len(ds) - 1})")
            what = f"the symbolic dim {ds[i]!r}: set it with --dim {ds[i]}=VALUE" if isinstance(ds[i], str) \
                else f"fixed at {ds[i]}"
            raise LowbitError(f"--dim {key}: axis {i} of input {inp!r} is {what}")
        bad.append(key)
    if bad:
        raise LowbitError(f"--dim {', '.join(bad)}: no input has such a symbolic dimension; symbolic dims: "
                          f"{', '.join(names) or 'none'}" + (f"; unnamed ones ('?') by INPUT:AXIS: "
                                                             f"{', '.join(unnamed)}" if unnamed else ""))


def guess_dims(sig: dict, given: dict | None = None, known: dict | None = None, size=None) -> dict:
    """{symbolic dim: (value, how it was chosen)} for every symbolic dim of ``sig``, and ``INPUT:AXIS`` for every
    unnamed free one: ``given`` (--dim NAME=VALUE or INPUT:AXIS=VALUE; may name expression parts too), ``known``
    (learnt from arrays the user gave), expressions computed from their parts, else the one default rule:
    1 for batch-like names and an image input's first axis (NCHW / NHWC, 1-4 channels), 8 for past / cache
    lengths, an image input's height / width from ``size`` (the model's imgsz metadata) or 224, 16 otherwise;
    unnamed dims 1 on the first axis, 224 in an image's spatial places, else 16. LowbitError for a --dim that
    names nothing, or an expression whose computed value contradicts a given one."""
    given, known = dict(given or {}), dict(known or {})
    names = []
    for _, ds in sig.values():
        names += [d for d in ds if isinstance(d, str) and d not in names]
    exprs = {n: t for n in names if (t := _expression(n)) is not None}
    leaves = []
    for t in exprs.values():
        leaves += [x for x in _leaves(t) if x not in leaves and x not in exprs]
    plain = [n for n in names if n not in exprs] + [x for x in leaves if x not in names]
    _check_addresses(sig, given, names, leaves)
    spatial, batch = _roles(sig)
    out = {}
    for n in plain:
        out[n] = (given[n], "given") if n in given else (known[n], "the data") if n in known else \
            _default(n, spatial, batch, size)
    values = {n: v for n, (v, _) in out.items()}
    for n, t in exprs.items():
        v = _evaluate(t, values)
        fixed = given.get(n, known.get(n))
        if fixed is not None and fixed != v:
            src = "--dim" if n in given else "the data"
            parts = ", ".join(f"{x}={values[x]}" for x in _leaves(t))
            raise LowbitError(f"dim {n!r} is {fixed} ({src}) but its parts give {v} ({parts}); give the parts "
                              f"with --dim instead")
        if v < 0:
            raise LowbitError(f"dim {n!r} comes out negative ({v}); set its parts with --dim")
        out[n] = (v, "given" if n in given else "its parts")
    for key, (inp, axis) in _unnamed(sig).items():
        out[key] = (given[key], "given") if key in given else (known[key], "the data") if key in known else \
            _unnamed_default(sig, inp, axis)
    return out


def resolve_dims(sig: dict, given: dict | None = None, known: dict | None = None, size=None) -> dict:
    """The values of guess_dims: every symbolic dim of ``sig`` and every unnamed one (``INPUT:AXIS``)."""
    return {n: v for n, (v, _) in guess_dims(sig, given, known, size).items()}


def shapes(sig: dict, values: dict) -> dict:
    """input name -> concrete shape (unnamed free dims from ``values[INPUT:AXIS]``, else by guess_dims' rule)."""
    out = {}
    for name, (_, ds) in sig.items():
        out[name] = [d if isinstance(d, int) and d > 0 else values[d] if isinstance(d, str) else
                     values.get(axis_key(name, i), _unnamed_default(sig, name, i)[0]) for i, d in enumerate(ds)]
    return out


def index_ranges(model: onnx.ModelProto) -> dict:
    """input name -> the number of rows of the constant table it indexes (the smallest such, over every Gather
    reading it as indices, directly or through Cast / Reshape / Unsqueeze ...)."""
    consts = {t.name: list(t.dims) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    consts[n.output[0]] = list(a.t.dims)
    readers = {}
    for n in model.graph.node:
        for i, x in enumerate(n.input):
            readers.setdefault(x, []).append((n, i))
    out = {}
    for vi in model.graph.input:
        todo, seen = [vi.name], set()
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            for n, i in readers.get(t, []):
                if n.op_type in PASS_THROUGH and i == 0 and not n.domain:
                    todo += list(n.output)
                elif n.op_type == "Gather" and i == 1 and not n.domain and n.input[0] in consts:
                    dims = consts[n.input[0]]
                    axis = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "axis"), 0)
                    if dims and -len(dims) <= axis < len(dims):
                        out[vi.name] = min(out.get(vi.name, dims[axis]), dims[axis])
    return out


def _past_length(sig: dict, shp: dict) -> int:
    for name, (_, ds) in sig.items():
        if PAST.search(name) and len(ds) == 4:
            return int(shp[name][2])
    return 0


def random_inputs(model: onnx.ModelProto, sig: dict, shp: dict, seed: int = 0, given: dict | None = None) -> dict:
    """Random arrays of the shapes ``shp`` for the inputs of ``sig`` not in ``given`` (module docstring)."""
    rng = np.random.default_rng(seed)
    ranges = index_ranges(model)
    past = _past_length(sig, shp)
    total = next((shp[n][-1] for n in sig if MASK.search(n) and shp[n]), None)
    feeds = dict(given or {})
    for name, (dt, _) in sig.items():
        if name in feeds:
            continue
        shape = shp[name]
        if not (np.issubdtype(dt, np.number) or dt == np.bool_):
            raise LowbitError(f"cannot make random data for input {name!r} of type {dt}; give it in an .npz")
        if MASK.search(name):
            v = np.ones(shape, dt)
        elif POSITIONS.search(name) and np.issubdtype(dt, np.integer) and shape:
            start = (total - shape[-1]) if total is not None else past
            v = np.broadcast_to(np.arange(max(start, 0), max(start, 0) + shape[-1]), shape).astype(dt)
        elif ZEROS.search(name) and not np.issubdtype(dt, np.floating):
            v = np.zeros(shape, dt)
        elif name in ranges and np.issubdtype(dt, np.integer):
            v = rng.integers(0, max(ranges[name], 1), size=shape).astype(dt)
        elif np.issubdtype(dt, np.floating):
            v = rng.standard_normal(shape).astype(dt)
        else:
            v = rng.integers(0, 2, size=shape).astype(dt)
        feeds[name] = np.ascontiguousarray(v)
    return feeds


def first_run(arrays: dict) -> tuple:
    """(arrays, number of runs): a file of several runs (``NAME#K`` keys, the --calibration format of docs/gru.md:
    one run per number, plain keys shared) gives its first run under the inputs' own names, with the shared keys;
    any other file is returned as it is (1 run)."""
    def run_of(key):
        base, sep, k = key.rpartition("#")
        return (base, int(k)) if sep and base and k.isdigit() else (key, None)
    runs = sorted({run_of(k)[1] for k in arrays} - {None})
    if not runs:
        return arrays, 1
    out = {k: v for k, v in arrays.items() if run_of(k)[1] is None}
    out.update({run_of(k)[0]: v for k, v in arrays.items() if run_of(k)[1] == runs[0]})
    return out, len(runs)


def load_npz(path: str, sig: dict, flag: str) -> dict:
    """Arrays of an .npz named after inputs of ``sig`` (some may be missing: the caller fills them); checked:
    names, ranks, fixed dims, numeric dtypes; cast to the input's dtype."""
    return check_arrays(path, read_npz(path, flag), sig, flag)


def check_arrays(path: str, arrays: dict, sig: dict, flag: str) -> dict:
    """load_npz's checks and casts on arrays already read from ``path``."""
    unknown = sorted(set(arrays) - set(sig))
    if unknown:
        raise LowbitError(f"{path}: array{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                          f"name{'' if len(unknown) > 1 else 's'} no model input; inputs: "
                          f"{', '.join(map(repr, sig))} ({flag})")
    out = {}
    for name, v in arrays.items():
        dt, ds = sig[name]
        if v.ndim != len(ds) or any(isinstance(d, int) and d > 0 and d != n for d, n in zip(ds, v.shape)):
            raise LowbitError(f"{path}: array {name!r} has shape {list(v.shape)}, the model input "
                              f"{[d if d is not None else '?' for d in ds]} ({flag})")
        if v.dtype.kind not in "fiub":
            raise LowbitError(f"{path}: array {name!r} has dtype {v.dtype}, not numeric ({flag})")
        out[name] = np.ascontiguousarray(v.astype(dt, copy=False))
    return out


def dims_of(sig: dict, arrays: dict) -> dict:
    """Symbolic dim values the given arrays fix (LowbitError when two arrays disagree on one name)."""
    found, where = {}, {}
    for name, v in arrays.items():
        for i, (d, n) in enumerate(zip(sig[name][1], v.shape)):
            if d is None:
                d = axis_key(name, i)
            if isinstance(d, str):
                if d in found and found[d] != n:
                    raise LowbitError(f"dim {d!r} is {found[d]} in array {where[d]!r} but {n} in {name!r}")
                found[d], where[d] = int(n), name
    return found


def make_feeds(model: onnx.ModelProto, *, data: dict | None = None, dims: dict | None = None,
               seed: int = 0) -> tuple:
    """(feeds, dim values, names of the inputs made up): the user's arrays (``data``), the rest random with
    dims from ``dims`` (--dim), the arrays' shapes and defaults."""
    sig = signature(model)
    data = dict(data or {})
    values = resolve_dims(sig, dims, dims_of(sig, data), image_size([model]))
    shp = shapes(sig, values)
    shp.update({n: list(v.shape) for n, v in data.items()})
    missing = [n for n in sig if n not in data]
    feeds = random_inputs(model, sig, shp, seed, data) if missing else data
    return feeds, values, missing

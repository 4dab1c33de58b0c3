"""The inputs of ``onnx-lowbit bench``: the models' input signatures, the values of their symbolic dims (given with
--dim, or guessed from the names, the shapes and the model's metadata: ``guess_dims``), random inputs of those
shapes, or the arrays of an --inputs .npz checked against the signatures."""
from __future__ import annotations

import re

import numpy as np
import onnx

from .errors import LowbitError
from .feeds import parse_dims as _parse_dims, read_npz, signature as _feeds_signature

BATCH_NAMES = re.compile(r"^(n|b|bs|batch.*|.*_batch|.*batch_size.*)$", re.IGNORECASE)
OTHER_DIM = 16          # symbolic dims that do not look like a batch dimension
IMAGE_DIM = 224         # symbolic height / width of an image input (NCHW / NHWC, 1-4 channels): a multiple of 32,
                        # so strided CNNs (YOLO: /32, upsampled and concatenated with /16) line up; 16 does not


def _signature(model: onnx.ModelProto) -> dict:
    """input name -> (numpy dtype, dims: int, a dim name, or None): feeds.signature."""
    return _feeds_signature(model)


def parse_dims(specs) -> dict:
    """``["batch=1", "past=128"]`` -> {"batch": 1, "past": 128}: feeds.parse_dims with values >= 1."""
    return _parse_dims(specs, minimum=1)


def resolve_dims(signatures, dims: dict, models=()) -> dict:
    """The value of every symbolic dim of the inputs: --dim, else a guess (guess_dims)."""
    return {n: v for n, (v, _) in guess_dims(signatures, dims, models).items()}


def _image_size(models) -> tuple | None:
    """(height, width) a model says it was exported for: ultralytics' ``imgsz`` metadata ("[640, 640]")."""
    for m in models:
        for p in m.metadata_props:
            if p.key == "imgsz":
                v = [int(x) for x in re.findall(r"\d+", p.value)]
                if len(v) in (1, 2) and all(x > 0 for x in v):
                    return (v[0], v[-1])
    return None


def guess_dims(signatures, dims: dict, models=()) -> dict:
    """{symbolic dim: (value, how it was chosen)}: --dim NAME=VALUE ("given"); else 1 for batch-like names and
    for the first axis of an image input (rank 4, 1-4 channels in axis 1 or 3); that input's height / width from
    the model's ``imgsz`` metadata, else IMAGE_DIM; else OTHER_DIM. LowbitError for a --dim naming no symbolic
    dim."""
    names, spatial, images = [], {}, set()     # spatial: dim name -> 0 (height) or 1 (width)
    for sig in signatures:
        for _, ds in sig.values():
            names += [d for d in ds if isinstance(d, str) and d not in names]
            if len(ds) == 4:
                hw = ds[2:] if isinstance(ds[1], int) and 1 <= ds[1] <= 4 else \
                    ds[1:3] if isinstance(ds[3], int) and 1 <= ds[3] <= 4 else ()     # NCHW, NHWC
                spatial.update((d, i) for i, d in enumerate(hw) if isinstance(d, str) and d not in spatial)
                if hw and isinstance(ds[0], str):
                    images.add(ds[0])
    unknown = [n for n in dims if n not in names]
    if unknown:
        raise LowbitError(f"--dim {', '.join(unknown)}: no input has such a symbolic dimension; "
                          f"symbolic dims: {', '.join(names) or 'none'}")
    size = _image_size(models)
    out = {}
    for n in names:
        if n in dims:
            out[n] = (dims[n], "given")
        elif BATCH_NAMES.match(n):
            out[n] = (1, "batch-like name")
        elif n in images and n not in spatial:
            out[n] = (1, "batch axis of an image input")
        elif n in spatial:
            out[n] = (size[spatial[n]], "the model's imgsz metadata") if size else \
                (IMAGE_DIM, "image input, a multiple of 32")
        else:
            out[n] = (OTHER_DIM, "default")
    return out


def random_inputs(sig: dict, values: dict, seed: int = 0) -> dict:
    """Floats ~ N(0, 1); integers and bools in {0, 1} (safe as indices); unnamed free dims: 1 first, else 16."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, (dt, ds) in sig.items():
        shape = [d if isinstance(d, int) else values[d] if isinstance(d, str) else (1 if i == 0 else OTHER_DIM)
                 for i, d in enumerate(ds)]
        if np.issubdtype(dt, np.floating):
            feeds[name] = rng.standard_normal(shape).astype(dt)
        elif np.issubdtype(dt, np.integer) or dt == np.bool_:
            feeds[name] = rng.integers(0, 2, size=shape).astype(dt)
        else:
            raise LowbitError(f"cannot make random data for input {name!r} of type {dt}; give --inputs")
    return feeds


def load_inputs(path: str, sig: dict) -> dict:
    """Arrays of an .npz, one per input of ``sig`` (names, ranks, fixed dims checked; cast to the input dtype)."""
    arrays = read_npz(path, "--inputs")
    missing = [n for n in sig if n not in arrays]
    if missing:
        raise LowbitError(f"{path}: no array for input{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(map(repr, missing))} (--inputs; has {', '.join(map(repr, arrays)) or 'none'})")
    feeds = {}
    for name, (dt, ds) in sig.items():
        v = arrays[name]
        if v.ndim != len(ds) or any(isinstance(d, int) and d != n for d, n in zip(ds, v.shape)):
            raise LowbitError(f"{path}: array {name!r} has shape {list(v.shape)}, the input "
                              f"{[d if d is not None else '?' for d in ds]} (--inputs)")
        if v.dtype.kind not in "fiub":
            raise LowbitError(f"{path}: array {name!r} has dtype {v.dtype}, not numeric (--inputs)")
        feeds[name] = v.astype(dt, copy=False)
    return feeds

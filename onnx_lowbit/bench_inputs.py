"""The inputs of ``onnx-lowbit bench``: the models' input signatures, the values of their symbolic dims (given with
--dim, or guessed by onnx_lowbit.feeds' one rule, the one --verify uses: ``guess_dims``), random inputs of those
shapes, or the arrays of an --inputs .npz checked against the signatures."""
from __future__ import annotations


import numpy as np
import onnx

from . import feeds
from .errors import LowbitError
from .feeds import parse_dims as _parse_dims, read_npz, signature as _feeds_signature

BATCH_NAMES = feeds.BATCH
OTHER_DIM = feeds.DEFAULT_OTHER     # symbolic dims of no known role
IMAGE_DIM = feeds.DEFAULT_IMAGE     # height / width of an image input with no imgsz metadata


def _signature(model: onnx.ModelProto) -> dict:
    """input name -> (numpy dtype, dims: int, a dim name, or None): feeds.signature."""
    return _feeds_signature(model)


def parse_dims(specs) -> dict:
    """``["batch=1", "x:0=2"]`` -> {"batch": 1, "x:0": 2}: feeds.parse_dims with values >= 1."""
    return _parse_dims(specs, minimum=1)


def _merged(signatures) -> dict:
    """One signature for several models: every input as the first model that has it wants it."""
    sig = {}
    for s in signatures:
        for name, v in s.items():
            sig.setdefault(name, v)
    return sig


def resolve_dims(signatures, dims: dict, models=()) -> dict:
    """The value of every symbolic dim of the inputs: --dim, else feeds' guess (guess_dims)."""
    return {n: v for n, (v, _) in guess_dims(signatures, dims, models).items()}


def guess_dims(signatures, dims: dict, models=()) -> dict:
    """{symbolic dim or INPUT:AXIS: (value, how it was chosen)}: feeds.guess_dims, the one rule --verify uses too,
    over the inputs of all ``signatures``, with the image size of the models' ``imgsz`` metadata."""
    return feeds.guess_dims(_merged(signatures), dims, size=feeds.image_size(models))


def random_inputs(sig: dict, values: dict, seed: int = 0) -> dict:
    """Floats ~ N(0, 1); integers and bools in {0, 1} (safe as indices); shapes by feeds.shapes (unnamed free
    dims from ``values[INPUT:AXIS]``, else 1 first, 224 in an image's spatial places, else 16)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in feeds.shapes(sig, values).items():
        dt = sig[name][0]
        if np.issubdtype(dt, np.floating):
            out[name] = rng.standard_normal(shape).astype(dt)
        elif np.issubdtype(dt, np.integer) or dt == np.bool_:
            out[name] = rng.integers(0, 2, size=shape).astype(dt)
        else:
            raise LowbitError(f"cannot make random data for input {name!r} of type {dt}; give --inputs")
    return out


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

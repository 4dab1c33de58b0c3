"""Pre-quantised AutoAWQ checkpoints: reading them and finding the tensors that belong to a model's MatMul.

AutoAWQ saves each quantised nn.Linear ``<module>`` as ``<module>.qweight`` int32 [K, N/8], ``<module>.qzeros``
int32 [K/G, N/8], ``<module>.scales`` float16 [K/G, N] (GEMM layout, the same as onnx_lowbit.awq), plus
``<module>.bias`` when the layer has one, in one or more ``.safetensors`` files. The safetensors format is read
here directly (8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the raw data), memory-mapped, so nothing is copied until a tensor is used.

A model's MatMul is matched to a checkpoint module through names exporters keep: the weight initializer's name
(``model.layers.0.mlp.gate_proj.weight``, dynamo and many TorchScript exports) or the node's name
(``/model/layers.0/mlp/gate_proj/MatMul``, TorchScript). A candidate name matches a module when one is a
dot-separated suffix of the other (checkpoints and exports may differ by a leading ``model.``); a match must be
unique.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass

import numpy as np

from .errors import LowbitError

_DTYPES = {"I32": np.int32, "F16": np.float16, "F32": np.float32, "I64": np.int64, "U8": np.uint8, "I8": np.int8,
           "I16": np.int16, "F64": np.float64, "BF16": np.uint16, "BOOL": np.bool_, "U16": np.uint16,
           "U32": np.uint32}
_SUFFIXES = (".qweight", ".qzeros", ".scales")


class CheckpointError(LowbitError):
    pass


def read_safetensors(path: str) -> dict:
    """name -> read-only numpy array (memory-mapped) for every tensor of one .safetensors file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: not a safetensors file (header length {hlen} does not fit the "
                                      f"file of {size} bytes)")
            header = json.loads(f.read(hlen).decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot read AWQ checkpoint {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (bad JSON header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + hlen
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = np.dtype(_DTYPES[info["dtype"]])
            shape = [int(d) for d in info["shape"]]
            b, e = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has an unreadable header entry {info!r}") from None
        n = int(np.prod(shape, dtype=np.int64))
        if b < 0 or e < b or data_start + e > size or e - b != n * dt.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} ({info['dtype']} {shape}) has byte range [{b}, {e}) that "
                                  f"does not match its size or the file")
        out[name] = mm[data_start + b: data_start + e].view(dt).reshape(shape)
    return out


@dataclass
class Module:
    name: str
    qweight: np.ndarray
    qzeros: np.ndarray
    scales: np.ndarray
    bias: np.ndarray | None

    @property
    def K(self):  # noqa: N802
        return int(self.qweight.shape[0])

    @property
    def N(self):  # noqa: N802
        return int(self.qweight.shape[1]) * 8

    @property
    def group_size(self) -> int:
        return self.K // int(self.scales.shape[0])


class Checkpoint:
    """The AWQ modules of one or more safetensors files (a file, a directory of them, or a list)."""

    def __init__(self, paths):
        if isinstance(paths, (str, os.PathLike)):
            p = os.fspath(paths)
            if os.path.isdir(p):
                paths = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
                if not paths:
                    raise CheckpointError(f"AWQ checkpoint directory {p} holds no .safetensors file")
            else:
                paths = [p]
        tensors = {}
        for p in paths:
            tensors.update(read_safetensors(os.fspath(p)))
        self.paths = [os.fspath(p) for p in paths]
        self.modules = {}
        for name in tensors:
            if not name.endswith(".qweight"):
                continue
            base = name[: -len(".qweight")]
            parts = [tensors.get(base + s) for s in _SUFFIXES]
            if any(t is None for t in parts):
                missing = [base + s for s, t in zip(_SUFFIXES, parts) if t is None]
                raise CheckpointError(f"AWQ checkpoint: {name} has no {', '.join(missing)}")
            m = Module(base, *parts, bias=tensors.get(base + ".bias"))
            _check_module(m)
            self.modules[base] = m
        if not self.modules:
            raise CheckpointError(f"no AWQ-quantised module (<name>.qweight/.qzeros/.scales) in "
                                  f"{', '.join(self.paths)}")

    def find(self, *names) -> tuple:
        """(Module, matched name) for the first candidate name with a unique module match, else (None, why)."""
        tried = []
        for raw in names:
            key = _module_key(raw)
            if not key:
                continue
            tried.append(key)
            hits = [m for n, m in self.modules.items() if _suffix_match(n, key)]
            if len(hits) == 1:
                return hits[0], key
            if len(hits) > 1:
                return None, f"name {key!r} matches {len(hits)} checkpoint modules ({', '.join(h.name for h in hits[:3])})"
        return None, f"no checkpoint module matches {' or '.join(map(repr, tried)) or 'its (generic) names'}"


def _check_module(m: Module) -> None:
    qw, qz, sc = m.qweight, m.qzeros, m.scales
    if qw.dtype != np.int32 or qz.dtype != np.int32 or sc.dtype != np.float16:
        raise CheckpointError(f"AWQ checkpoint module {m.name}: qweight/qzeros must be int32 and scales float16, got "
                              f"{qw.dtype}/{qz.dtype}/{sc.dtype}")
    if qw.ndim != 2 or qz.ndim != 2 or sc.ndim != 2 or sc.shape[0] == 0 or qw.shape[0] % sc.shape[0]:
        raise CheckpointError(f"AWQ checkpoint module {m.name}: shapes qweight {list(qw.shape)}, qzeros "
                              f"{list(qz.shape)}, scales {list(sc.shape)} are not AutoAWQ's GEMM layout")
    k, n8 = qw.shape
    g = sc.shape[0]
    if list(qz.shape) != [g, n8] or list(sc.shape) != [g, 8 * n8]:
        raise CheckpointError(f"AWQ checkpoint module {m.name}: qweight {list(qw.shape)} needs qzeros {[g, n8]} and "
                              f"scales {[g, 8 * n8]}, got {list(qz.shape)} and {list(sc.shape)}")
    if m.bias is not None and m.bias.shape != (8 * n8,):
        raise CheckpointError(f"AWQ checkpoint module {m.name}: bias has shape {list(m.bias.shape)}, expected "
                              f"[{8 * n8}]")


def _module_key(name: str) -> str:
    """A weight or node name turned into a dotted module path ('' for generic names)."""
    if not name:
        return ""
    s = name.strip("/")
    for suffix in (".weight", "/MatMul", "/Gemm", "/Transpose", ".MatMul", ".Gemm"):
        if s.endswith(suffix):
            s = s[: -len(suffix)]
    s = s.replace("/", ".")
    s = re.sub(r"_(MatMul|Gemm)(_\d+)?$", "", s)
    if re.fullmatch(r"(node|val|onnx::|_v)_?\w*\d+", s) or s.startswith("onnx::"):
        return ""  # an exporter's generic name: no module path in it
    return s


def _suffix_match(module: str, key: str) -> bool:
    return module == key or module.endswith("." + key) or key.endswith("." + module)

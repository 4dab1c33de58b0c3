"""Streaming of weights kept in external data (models over 2 GB): constants are read from their file when a pass
asks for their value, never cached in the graph, and new large constants can be spilled to the output's data
file as soon as a pass makes them (``spill``), so a rewrite holds about one weight at a time in memory.

    attach(graph, base_dir)     external initializers of ``graph`` (and subgraphs) read lazily from ``base_dir``
    constant(name, array, spill) a gs.Constant for a new value: spilled to the output file when ``spill`` is given

``spill`` is a callable(name, array) -> onnx.TensorProto with external data (onnx_lowbit.model_io.StagedOutput.spill),
whose location is the absolute path of the staging file until the output is written.
"""
from __future__ import annotations


import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues
from onnx import external_data_helper

from onnx_lowbit import model_io

# spill only what is worth a file read later (the size threshold of model_io.StagedOutput for external data)
SPILL_MIN_BYTES = 1024


class ExternalValues(LazyValues):
    """LazyValues over a TensorProto whose bytes live in a file; ``load`` reads them each time (no caching in the
    TensorProto). ``passes.base.constant_value`` does not store the result in the gs.Constant either."""

    streamed = True

    def __init__(self, tensor: onnx.TensorProto, base_dir: str):
        super().__init__(tensor)
        info = external_data_helper.ExternalDataInfo(tensor)
        self.base_dir, self.location = base_dir, info.location or ""
        self.path = model_io.external_path(base_dir, self.location, tensor.name)  # LowbitError: outside the folder
        self.offset = int(info.offset or 0)
        self.length = info.length

    def load(self):
        np_type = onnx.helper.tensor_dtype_to_np_dtype(self.tensor.data_type)
        count = int(np.prod(self.shape, dtype=np.int64))
        want = count * np.dtype(np_type).itemsize
        if self.length is not None and int(self.length) != want:
            raise ValueError(f"external data of {self.tensor.name!r}: length {self.length}, expected {want} bytes")
        with model_io.open_external(self.base_dir, self.location, self.tensor.name) as f:
            f.seek(self.offset)
            a = np.fromfile(f, dtype=np_type, count=count)
        if a.size != count:
            raise ValueError(f"external data of {self.tensor.name!r} in {self.path}: file too short "
                             f"({a.size} of {count} values at offset {self.offset})")
        return a.reshape(self.shape)


def _is_external(t: onnx.TensorProto) -> bool:
    return t.HasField("data_location") and t.data_location == onnx.TensorProto.EXTERNAL


def attach(graph: gs.Graph, base_dir: str) -> int:
    """Makes every external-data constant of ``graph`` (and its subgraphs) stream from ``base_dir``; returns how
    many were attached."""
    n = 0
    for g in [graph, *graph.subgraphs(recursive=True)]:
        for t in g.tensors().values():
            lazy = getattr(t, "_values", None) if isinstance(t, gs.Constant) else None
            if type(lazy) is LazyValues and isinstance(lazy.tensor, onnx.TensorProto) and _is_external(lazy.tensor):
                t._values = ExternalValues(lazy.tensor, base_dir)
                n += 1
    return n


def constant(name: str, array: np.ndarray, spill=None) -> gs.Constant:
    """A new constant; with ``spill``, its bytes go to the output file now and the graph keeps only a reference."""
    array = np.ascontiguousarray(array)
    if spill is None or array.nbytes < SPILL_MIN_BYTES:
        return gs.Constant(name, array)
    return gs.Constant(name, ExternalValues(spill(name, array), ""))

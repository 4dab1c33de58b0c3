"""Kernel lookup: op name + execution provider -> kernel class.

Each op has one module per face here: ``<op>_cpu.py`` (Numba CPU) and ``<op>_cuda.py`` (Numba CUDA).
A kernel class is built at session creation with the node's attributes (validated there) and computes with
``compute(ctx, inputs)``.
"""
from __future__ import annotations

import importlib

from onnx_lowbit import domain

_FACES = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}


class Kernel:
    """Base class: keeps the node's identity for error messages.

    ``native_plans = True`` (CUDA kernels): compute may be recorded once per input signature and replayed by the
    C shim without Python; see plans.py for what a kernel promises by setting it."""

    native_plans = False

    def __init__(self, *, spec, attrs, node_name, in_types, out_types):
        self.spec, self.attrs, self.node_name = spec, attrs, node_name
        self.in_types, self.out_types = in_types, out_types

    def describe(self):
        return f"{domain.DOMAIN}.{self.spec.name} node '{self.node_name}'"

    def check_input(self, inputs, index, *, ranks=None, min_size=None):
        from .bridge import KernelError
        t = inputs[index] if index < len(inputs) else None
        pname = self.spec.inputs[index].name
        if t is None:
            raise KernelError(f"input {index} '{pname}' is missing")
        if ranks is not None and len(t.shape) not in ranks:
            raise KernelError(f"input {index} '{pname}' must have rank {' or '.join(map(str, ranks))}, "
                              f"got shape {list(t.shape)}")
        return t


def kernel_class(op_name: str, provider: str):
    face = _FACES[provider]
    module = importlib.import_module(f"{__package__}.{op_name.lower()}_{face}")
    return module.KERNEL

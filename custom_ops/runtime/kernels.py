"""Kernel lookup: op name + execution provider -> kernel class; the Kernel base class and KernelError.

Each op has one module per face in its family's folder of custom_ops: ``<family>/<op>_cpu.py`` (Numba CPU) and
``<family>/<op>_cuda.py`` (Numba CUDA); ``FAMILIES`` names the folder of every op. The module is imported by name
(importlib) when a session first creates a kernel of that op and face, so the runtime imports no family itself.
A kernel class is built at session creation with the node's attributes (validated there) and computes with
``compute(ctx, inputs)``.
"""
from __future__ import annotations

import importlib

from onnx_lowbit import domain

_FACES = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}


class KernelError(Exception):
    """Raised by kernels for bad inputs/attributes; its message reaches onnxruntime's error status."""


class Kernel:
    """Base class: keeps the node's identity for error messages.

    ``native_plans = True`` (CUDA kernels): compute may be recorded once per input signature and replayed by the
    C shim without Python; see plans.py for what a kernel promises by setting it.

    ``constants``: {input index: bridge Tensor} of the inputs fed by constant initializers (onnxruntime's
    KernelInfoGetConstantInput_tensor at kernel creation): every compute call gets these same tensors at those
    indices, so a kernel may derive state from them once (e.g. packed weights)."""

    native_plans = False

    def __init__(self, *, spec, attrs, node_name, in_types, out_types, constants=None):
        self.spec, self.attrs, self.node_name = spec, attrs, node_name
        self.in_types, self.out_types = in_types, out_types
        self.constants = constants or {}

    def describe(self):
        return f"{domain.DOMAIN}.{self.spec.name} node '{self.node_name}'"

    def check_input(self, inputs, index, *, ranks=None, min_size=None):
        t = inputs[index] if index < len(inputs) else None
        pname = self.spec.inputs[index].name
        if t is None:
            raise KernelError(f"input {index} '{pname}' is missing")
        if ranks is not None and len(t.shape) not in ranks:
            raise KernelError(f"input {index} '{pname}' must have rank {' or '.join(map(str, ranks))}, "
                              f"got shape {list(t.shape)}")
        return t


# op name -> "<family>.<op>": the module of a face is "<family>.<op>_<face>" under onnx_lowbit.custom_ops
FAMILIES = {
    "FPLUT": "fplut.fplut",
    "MatMulNF4": "nf4.matmulnf4",
    "DequantNF4": "nf4.dequantnf4",
    "MatMulAWQ": "awq.matmulawq",
    "DequantAWQ": "awq.dequantawq",
    "FusedFFN": "ffn.fusedffn",
    "FusedFFNNF4": "ffn.fusedffnnf4",
    "FusedFFNAWQ": "ffn.fusedffnawq",
    "QuantGRU": "gru.quantgru",
    "Rotary": "attention.rotary",
    "RMSNorm": "attention.rmsnorm",
    "RotaryKV": "attention.rotarykv",
    "KVAttention": "attention.kvattention",
    "CacheAttention": "attention.cacheattention",
}


def kernel_module(op_name: str, face: str) -> str:
    """The module path of an op's face ("cpu" or "cuda"), relative to onnx_lowbit.custom_ops."""
    return f"{FAMILIES[op_name]}_{face}"


def kernel_class(op_name: str, provider: str):
    face = _FACES[provider]
    module = importlib.import_module(f"..{kernel_module(op_name, face)}", __package__)
    return module.KERNEL

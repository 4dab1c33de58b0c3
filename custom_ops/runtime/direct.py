"""Calling an op's CUDA kernel object as an onnxruntime session node calls it, on device arrays the caller owns.

For benchmarks that must time what sessions run: the kernel object is built from the node's attributes and the
op variant's input / output types exactly as the bridge builds it, and its ``compute`` picks the launch per call
(per M, per alignment) as in a session. What differs from a session: the outputs are the caller's arrays, and
scratch comes from one buffer this context keeps (grown when a call asks for more; onnxruntime's allocator hands out
a fresh one per call). Arrays are anything with ``__cuda_array_interface__`` (torch, Numba, CuPy), or, under
Numba's CUDA simulator, the simulator's device arrays (their host buffers are the simulator's device memory; the
kernels' SimLauncher turns the pointers back into arrays), so tests run an op's CUDA face through ``call`` without
a GPU. ``typed(array, elem)`` passes an array as another ONNX element type of the same width (bfloat16 in uint16
storage).

Used by the benchmarks that time what sessions run (nf4tc_gpu.py, fplut_gpu.py, ...) and by the CUDA kernel tests
(tests/helpers.direct_run)."""
from __future__ import annotations

import math

import numpy as np

from onnx_lowbit import domain

from .bridge import Tensor
from .kernels import kernel_class

_ELEM = {np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3, np.dtype(np.int16): 5,
         np.dtype(np.int32): 6, np.dtype(np.int64): 7, np.dtype(np.float16): 10}


class typed:  # noqa: N801 - reads as a conversion, like a dtype
    """``array`` passed as ONNX element type ``elem`` (same item size): bfloat16 (16) in uint16 storage."""

    def __init__(self, array, elem):
        self.array, self.elem = array, int(elem)


def _interface(arr):
    cai = getattr(arr, "__cuda_array_interface__", None)
    if cai is not None:
        return cai
    if type(arr).__module__.startswith("numba.cuda.simulator"):    # the simulator's device array: host memory
        return arr.__array_interface__
    raise TypeError(f"{type(arr).__name__} is not a device array (no __cuda_array_interface__)")


def describe(arr):
    """(device pointer, ONNX element type, shape) of a device array (or of ``typed(array, elem)``)."""
    cai = _interface(arr.array if isinstance(arr, typed) else arr)
    dt = np.dtype(cai["typestr"])
    if isinstance(arr, typed):
        elem = arr.elem
    elif dt in _ELEM:
        elem = _ELEM[dt]
    else:
        raise TypeError(f"no ONNX element type for {dt}")
    return int(cai["data"][0]), elem, tuple(int(d) for d in cai["shape"])


class Context:
    """The part of the bridge's kernel context that CUDA kernels use."""
    has_scratch = True
    recorder = None

    def __init__(self, stream, outputs):
        self._stream, self._outputs, self._scratch = stream, list(outputs), None

    @property
    def stream(self):
        """The stream handle: ``stream`` itself, or its value now when it is a function (e.g. torch's current
        stream, which changes under graph capture)."""
        return int(self._stream() if callable(self._stream) else self._stream)

    def output_count(self):
        """How many outputs the node has (a method, as bridge.Context's: RMSNorm asks whether H is wanted)."""
        return len(self._outputs)

    def output(self, index, shape):
        ptr, _, have = describe(self._outputs[index])
        if math.prod(shape) != math.prod(have):
            raise ValueError(f"output {index}: the kernel asks for shape {list(shape)}, the array has {list(have)}")
        return ptr

    def scratch(self, nbytes):
        if nbytes <= 0:
            return 0
        if self._scratch is None or self._scratch.nbytes < nbytes:
            from numba import cuda  # numba.cuda only when a kernel asks for scratch (the runtime imports without it)
            self._scratch = cuda.device_array(int(nbytes), np.uint8)
        return describe(self._scratch)[0]


def kernel(op, attrs, inputs, outputs, name="direct", constants=()):
    """The CUDA kernel object a session builds for an ``op`` node with ``attrs`` whose inputs and outputs have the
    element types of these arrays (None: an optional input left out). ``constants``: indices of the inputs that
    play constant initializers (the caller does not write them while the kernel object lives), as a session tells
    the kernel of its initializers (e.g. the weights: then the 4-bit decode kernels launch as programmatic dependent
    launches, device/pdl.py)."""
    spec = domain.OPS[op]
    given_in = [None if a is None else describe(a)[1] for a in inputs]
    given_out = [describe(a)[1] for a in outputs]
    for in_types, out_types in spec.variants():
        if all(g is None or g == t for g, t in zip(given_in, in_types)) and \
                list(out_types[:len(given_out)]) == given_out and len(given_in) <= len(in_types):
            cls = kernel_class(op, "CUDAExecutionProvider")
            consts = {i: Tensor(*describe(inputs[i])) for i in constants if inputs[i] is not None}
            return cls(spec=spec, attrs=dict(attrs), node_name=name, in_types=tuple(in_types),
                       out_types=tuple(out_types), constants=consts)
    raise TypeError(f"{op} has no variant with input types {given_in} and output types {given_out}")


def call(op, attrs, inputs, outputs, stream, name="direct", constants=()):
    """A function of no arguments that runs ``op`` once on these device arrays on ``stream`` (a handle, or a
    function returning one), as a session node would: one kernel object, built now. ``.kernel`` is that object.
    ``constants``: as ``kernel``'s."""
    kern = kernel(op, attrs, inputs, outputs, name, constants)
    tensors = [None if a is None else Tensor(*describe(a)) for a in inputs]
    ctx = Context(stream, outputs)

    def run():
        kern.compute(ctx, tensors)
    run.kernel, run.arrays = kern, (list(inputs), list(outputs))    # the arrays stay alive as long as ``run``
    return run

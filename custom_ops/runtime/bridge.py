"""The Python half of the onnxruntime bridge.

Loads the C shim (ortshim.c) with ctypes, declares every op variant of the domain for the CPU and CUDA
execution providers, and serves the shim's callbacks: kernel creation (attributes read through the shim) and
compute (input pointers, shapes and onnxruntime's CUDA stream in; outputs and per-call scratch allocated through the
shim, from onnxruntime's allocator). Calls the shim replays from a native plan (plans.py: CUDA launches, CPU entry
points) never reach Python; ``set_native_plans`` / ``set_native_cpu`` switch replay off for comparisons.
Kernels are looked up by op name in ``onnx_lowbit.custom_ops.runtime.kernels``.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from onnx_lowbit import domain

from . import build, kernels, plans
from .abi import LbPlan, LbTensor, NP_DTYPES, TYPE_NAMES
from .abi import MAX_DIMS, MAX_IO, MAX_PARAMS, MAX_PATCH, MAX_PLAN_STEPS  # noqa: F401 - the shim's limits, as bridge.X
from .driver import libcuda
from .kernels import KernelError

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"

CREATE_CB = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
COMPUTE_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                              ctypes.POINTER(LbTensor), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
DESTROY_CB = ctypes.CFUNCTYPE(None, ctypes.c_int64)


class Tensor:
    """One kernel input: raw pointer, element type and shape (device memory in CUDA kernels)."""
    __slots__ = ("ptr", "elem_type", "shape")

    def __init__(self, ptr, elem_type, shape):
        self.ptr, self.elem_type, self.shape = ptr, elem_type, shape

    @property
    def size(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self):
        return TYPE_NAMES.get(self.elem_type, f"type {self.elem_type}")

    def numpy(self):
        """A numpy view of a host tensor (CPU kernels only)."""
        dt = np.dtype(NP_DTYPES[self.elem_type])
        n = self.size
        if n == 0:
            return np.empty(self.shape, dtype=dt)
        buf = (ctypes.c_char * (n * dt.itemsize)).from_address(self.ptr)
        return np.frombuffer(buf, dtype=dt).reshape(self.shape)


class Context:
    """What a kernel's compute sees besides its inputs: output allocation, scratch memory and the CUDA stream."""
    __slots__ = ("_call", "stream", "_err", "recorder")

    def __init__(self, call, stream, err, recorder=None):
        self._call, self.stream, self._err, self.recorder = call, stream, err, recorder

    def _msg(self):
        return ctypes.string_at(self._err).decode(errors="replace")

    def output(self, index, shape):
        """Allocates output ``index`` with ``shape``; returns its data pointer."""
        nd = len(shape)
        dims = (ctypes.c_int64 * max(nd, 1))(*shape)
        ptr = ctypes.c_void_p()
        if _lib.lb_output(self._call, index, dims, nd, ctypes.byref(ptr), self._err, 512):
            raise KernelError(f"could not allocate output {index}: {self._msg()}")
        if self.recorder is not None:
            self.recorder.output(index, tuple(shape), ptr.value or 0)
        return ptr.value or 0

    def scratch(self, nbytes):
        """This call's scratch buffer of ``nbytes`` device bytes (CUDA ops; at most once per call; 0 when nbytes is
        0): taken from onnxruntime's allocator on the call's stream and given back by the shim right after compute
        returns, so it holds only what the launches issued in this call read and write (nothing is kept for a later
        call). Native plans take one of the same size per replay."""
        ptr = ctypes.c_void_p()
        if _lib.lb_scratch(self._call, int(nbytes), ctypes.byref(ptr), self._err, 512):
            raise KernelError(f"could not get {nbytes} bytes of scratch: {self._msg()}")
        if self.recorder is not None:
            self.recorder.scratch(ptr.value or 0, int(nbytes))
        return ptr.value or 0

    @property
    def has_scratch(self):
        """Whether ``scratch`` can serve this kernel (onnxruntime >= 1.18, a CUDA op)."""
        return bool(_lib.lb_scratch_ok(self._call, self._err, 512))

    def output_count(self):
        """How many outputs the node has (an optional trailing output it leaves out is not counted)."""
        n = _lib.lb_output_count(self._call)
        if n < 0:
            raise KernelError("could not read the node's output count")
        return n

    def output_numpy(self, index, shape, dtype):
        return _view(self.output(index, shape), shape, dtype)

    @property
    def native(self):
        """Whether this call records a native plan (CPU kernels then run their compiled entry, ``run_native``);
        false when native CPU replay is off or the kernel's plan table is full: the Python path serves the call."""
        return self.recorder is not None

    def run_native(self, entry, items, grain, values, pointer_slots):
        """Runs a CPU entry point now (``entry``: its address, ``values``: its uint64 parameters, pointers into
        this call's inputs / outputs at ``pointer_slots``) over ``items`` work items in tasks of at least ``grain``
        (onnxruntime's intra-op pool), and records it for replay. True when it ran; False when there is no recorder
        or the entry declined the input values: the kernel then takes its Python path."""
        if self.recorder is None:
            return False
        self.recorder.cpu(entry, items, grain, values, pointer_slots)
        params = (ctypes.c_uint64 * max(len(values), 1))(*[v & 0xFFFFFFFFFFFFFFFF for v in values])
        return _lib.lb_cpu_run(self._call, entry, items, grain, params) == 0


def _view(ptr, shape, dtype):
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.empty(shape, dtype=dt)
    return np.frombuffer((ctypes.c_char * (n * dt.itemsize)).from_address(ptr), dtype=dt).reshape(shape)


# --------------------------------------------------------------------------------------------------------
_lock = threading.Lock()
_lib = None
_path = None
_variants = []          # op index -> (OpSpec, provider, input types, output types)
_kernels = {}           # kernel id -> kernel object
_next_id = [0]
_callbacks = None
stats = {"python_computes": 0}  # compute calls served by Python (native plan replays are not counted)
_native_cpu = [True, True]  # native CPU replay on, CPU steps on onnxruntime's pool (set_native_cpu)


def _write_err(buf, errlen, msg):
    data = msg.encode("utf-8", "replace")[: max(errlen - 1, 0)]
    ctypes.memmove(buf, data + b"\0", len(data) + 1)


class AttrReader:
    """Reads node attributes through the shim during kernel creation."""

    def __init__(self, info):
        self.info = info
        self._err = ctypes.create_string_buffer(512)

    def node_name(self):
        size = ctypes.c_size_t(0)
        if _lib.lb_node_name(self.info, None, ctypes.byref(size), self._err, 512):
            return ""
        buf = ctypes.create_string_buffer(size.value + 1)
        _lib.lb_node_name(self.info, buf, ctypes.byref(size), self._err, 512)
        return buf.value.decode("utf-8", "replace")

    def get(self, name, kind):
        """The attribute's value, or None if the node does not have it."""
        b = name.encode()
        if kind == "float":
            v = ctypes.c_float()
            return None if _lib.lb_attr_float(self.info, b, ctypes.byref(v), self._err, 512) else v.value
        if kind == "int":
            v = ctypes.c_int64()
            return None if _lib.lb_attr_int(self.info, b, ctypes.byref(v), self._err, 512) else v.value
        size = ctypes.c_size_t(0)
        fn, ctype = {"string": (_lib.lb_attr_string, ctypes.c_char), "floats": (_lib.lb_attr_floats, ctypes.c_float),
                     "ints": (_lib.lb_attr_ints, ctypes.c_int64)}[kind]
        if fn(self.info, b, None, ctypes.byref(size), self._err, 512):
            return None
        buf = (ctype * max(size.value, 1))()
        if fn(self.info, b, buf, ctypes.byref(size), self._err, 512):
            return None
        if kind == "string":
            return bytes(buf[: size.value]).split(b"\0", 1)[0].decode("utf-8", "replace")
        return list(buf[: size.value])

    def constants(self, n_in):
        """{input index: Tensor} of the node's inputs fed by constant initializers (their data lives as long as the
        session; compute calls get the same tensors)."""
        out = {}
        for i in range(n_in):
            t = LbTensor()
            if _lib.lb_const_input(self.info, i, ctypes.byref(t), self._err, 512) == 0 and t.data:
                out[i] = Tensor(t.data, t.elem_type, tuple(t.dims[: t.ndim]))
        return out


def _create(op_index, info, err, errlen):
    spec, provider, in_types, out_types = _variants[op_index]
    node = "?"
    try:
        reader = AttrReader(info)
        node = reader.node_name()
        attrs = {}
        for a in spec.attributes:
            v = reader.get(a.name, a.kind)
            if v is None and a.required:
                raise KernelError(f"attribute '{a.name}' ({a.kind}) is required")
            if v is not None:
                attrs[a.name] = v
        cls = kernels.kernel_class(spec.name, provider)
        kernel = cls(spec=spec, attrs=attrs, node_name=node, in_types=in_types, out_types=out_types,
                     constants=reader.constants(len(in_types)))
        kernel.on_cpu = provider == CPU
        with _lock:
            kid = _next_id[0]
            _next_id[0] += 1
            _kernels[kid] = kernel
        return kid
    except Exception as e:  # noqa: BLE001 - every failure must become an onnxruntime status, never a crash
        _write_err(err, errlen, f"{domain.DOMAIN}.{spec.name} node '{node}' ({provider}): {_describe(e)}")
        return -1


def _describe(e):
    return str(e) if isinstance(e, (KernelError, ValueError, TypeError, KeyError)) else f"{type(e).__name__}: {e}"


def _compute(kid, call, n_in, ins, stream, plan, err, errlen):
    kernel = _kernels.get(kid)
    stats["python_computes"] += 1
    try:
        inputs = []
        for i in range(n_in):
            t = ins[i]
            if t.elem_type == 0:
                inputs.append(None)
            else:
                inputs.append(Tensor(t.data or 0, t.elem_type, tuple(t.dims[: t.ndim])))
        # NaN/Inf propagate as docs/reliability.md defines: a caller's numpy error state (np.seterr(all="raise"),
        # warnings as errors) must not turn them into failed runs
        with np.errstate(all="ignore"):
            if not plan:
                kernel.compute(Context(call, stream or 0, err), inputs)
                return 0
            plans.compute_and_record(kernel, Context(call, stream or 0, err), inputs,
                                     LbPlan.from_address(plan))
        return 0
    except Exception as e:  # noqa: BLE001
        name = kernel.describe() if kernel is not None else f"kernel {kid}"
        _write_err(err, errlen, f"{name}: {_describe(e)}")
        return 1


def _destroy(kid):
    with _lock:
        k = _kernels.pop(kid, None)
    if k is not None and hasattr(k, "close"):
        try:
            k.close()
        except Exception:  # noqa: BLE001
            pass


def library_path(path: str | None = None) -> str:
    """Loads the shim (building it if needed), declares all ops, and returns its path. ``path``: load this copy of
    the shim instead (onnxruntime-genai only loads custom-op libraries from the model folder: the process's Python
    side must be the very file onnxruntime dlopens); ignored once a shim is loaded (the loaded path is returned)."""
    global _lib, _path, _callbacks
    with _lock:
        if _lib is not None:
            return _path
        path = os.path.abspath(path) if path else build.shim_path()
        lib = ctypes.PyDLL(path)  # PyDLL: calls keep the GIL, the callbacks run under it anyway
        lib.lb_add_op.restype = ctypes.c_int
        lib.lb_output.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_int]
        lib.lb_scratch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                   ctypes.c_int]
        lib.lb_scratch_ok.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        for name in ("lb_attr_float", "lb_attr_int", "lb_attr_string", "lb_attr_floats", "lb_attr_ints"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_char_p, ctypes.c_int]
        for name in ("lb_attr_float", "lb_attr_int"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_char_p,
                                           ctypes.c_int]
        lib.lb_node_name.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.lb_const_input.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.lb_ort_version.restype = ctypes.c_char_p
        lib.lb_output_count.restype, lib.lb_output_count.argtypes = ctypes.c_int64, [ctypes.c_void_p]
        lib.lb_set_launch.restype, lib.lb_set_launch.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        lib.lb_set_launch_coop.restype, lib.lb_set_launch_coop.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        lib.lb_set_launch_ex.restype, lib.lb_set_launch_ex.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        lib.lb_cpu_run.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.lb_set_domain(domain.DOMAIN.encode())
        if lib.lb_plan_size() != ctypes.sizeof(LbPlan):
            raise RuntimeError("onnx_lowbit: the C shim's plan layout does not match bridge.py (rebuild the shim)")
        lib.lb_set_plans(int(_plans_enabled_by_env()))
        _native_cpu[0] = _env_on("ONNX_LOWBIT_NATIVE_CPU")
        lib.lb_set_native_cpu(int(_native_cpu[0]), int(_native_cpu[1]))
        for spec in domain.OPS.values():
            for in_types, out_types in spec.variants():
                for provider in (CPU, CUDA):
                    arr = lambda xs: (ctypes.c_int * max(len(xs), 1))(*xs)  # noqa: E731
                    idx = lib.lb_add_op(spec.name.encode(), int(provider == CUDA), len(in_types), arr(in_types),
                                        arr([int(p.optional) for p in spec.inputs]), len(out_types), arr(out_types),
                                        arr([int(p.optional) for p in spec.outputs]))
                    if idx != len(_variants):
                        raise RuntimeError("onnx_lowbit: could not declare op variants in the shim")
                    _variants.append((spec, provider, tuple(in_types), tuple(out_types)))
        _callbacks = (CREATE_CB(_create), COMPUTE_CB(_compute), DESTROY_CB(_destroy))
        lib.lb_set_callbacks(*_callbacks)
        try:  # native plan replay needs the driver's cuLaunchKernel; without a driver CUDA kernels cannot run anyway
            lib.lb_set_launch(ctypes.cast(libcuda().cuLaunchKernel, ctypes.c_void_p))
            lib.lb_set_launch_coop(ctypes.cast(libcuda().cuLaunchCooperativeKernel, ctypes.c_void_p))
            if hasattr(libcuda(), "cuLaunchKernelEx"):  # CUDA 11.8+ drivers: PDL steps (device/pdl.py)
                lib.lb_set_launch_ex(ctypes.cast(libcuda().cuLaunchKernelEx, ctypes.c_void_p))
        except OSError:
            pass
        _lib, _path = lib, path
        return path


def _env_on(name) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def _plans_enabled_by_env() -> bool:
    return _env_on("ONNX_LOWBIT_NATIVE_PLANS")


def set_native_cpu(enabled: bool, pool: bool = True) -> None:
    """Turns native replay of CPU ops on (default) or off (every CPU compute through Python, the kernels' Python
    paths), for all sessions of this process; ``ONNX_LOWBIT_NATIVE_CPU=0`` sets the default off. ``pool=False``
    runs CPU entry points as one task on onnxruntime's calling thread instead of splitting them over its
    intra-op thread pool (comparisons). Plans recorded before stay, and are used again when switched back on."""
    library_path()
    _native_cpu[:] = [bool(enabled), bool(pool)]
    _lib.lb_set_native_cpu(int(bool(enabled)), int(bool(pool)))


def set_native_plans(enabled: bool) -> None:
    """Turns native replay of CUDA launch plans on (default) or off (every compute through Python), for all
    sessions of this process; ``ONNX_LOWBIT_NATIVE_PLANS=0`` sets the default off."""
    library_path()
    _lib.lb_set_plans(int(bool(enabled)))


def scratch_counts() -> dict:
    """Scratch buffers the shim took from onnxruntime's allocator and gave back, and the bytes taken, since the
    process started (all kernels; Python calls and native replays alike)."""
    library_path()
    out = (ctypes.c_int64 * 3)()
    _lib.lb_scratch_counts(out)
    return {"taken": out[0], "given_back": out[1], "bytes": out[2]}


def register(sess_options) -> None:
    """Registers the onnx-lowbit ops into an ``onnxruntime.SessionOptions``."""
    sess_options.register_custom_ops_library(library_path())

"""Launching compiled Numba CUDA kernels without the Numba dispatcher.

At kernel creation a Numba kernel is compiled once for a fixed signature and its CUDA handle kept; each call
then only writes raw device pointers and sizes into preallocated parameter slots and calls the driver's
cuLaunchKernel on onnxruntime's stream. No array wrapping, no dispatcher, no allocation on the hot path.

Parameter layout is Numba's: an array argument is flattened into
(meminfo, parent, nitems, itemsize, data, shape[0..nd), strides[0..nd)), a scalar into its C value.

A launcher made with ``pdl=True`` launches through cuLaunchKernelEx with programmatic stream serialization
(device/pdl.py: the kernel may start before the previous kernel of the stream ends and waits for it with
``pdl.wait()``) on GPUs of compute capability 9.0+, unless ONNX_LOWBIT_PDL=0 (read once per process).

Used by every CUDA op module (its kernel class launches through a ``Launcher`` per compiled kernel, under the
simulator a ``SimLauncher`` with the same arguments) and by host runners and tests (``arg``, ``device_ptr``); the
runtime's plans.py records what ``launch`` does. Also the device queries the kernels size their grids with
(``current_device``, ``sm_count``, ``shared_optin``).
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
from numba import from_dtype, types

from ..runtime import plans
from ..runtime.driver import libcuda

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_lock = threading.Lock()
_pdl_devices = {}     # device -> whether PDL launches are used there


class _LaunchAttr(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: an id, padding, a 64-byte value union (here its first int)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("shmem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]


def pdl_enabled(device: int) -> bool:
    """Whether ``pdl=True`` launchers use programmatic dependent launch on ``device``: compute capability 9.0+,
    a driver with cuLaunchKernelEx, and ONNX_LOWBIT_PDL not set to 0 (for comparisons)."""
    on = _pdl_devices.get(device)
    if on is None:
        env = os.environ.get("ONNX_LOWBIT_PDL", "1").strip().lower() not in ("0", "false", "no", "off")
        major = ctypes.c_int(0)
        check(libcuda().cuDeviceGetAttribute(ctypes.byref(major), 75, device), "cuDeviceGetAttribute")  # CC major
        on = _pdl_devices[device] = env and major.value >= 9 and hasattr(libcuda(), "cuLaunchKernelEx")
    return on


class CudaError(RuntimeError):
    pass


def check(rc, what):
    if rc != 0:
        s = ctypes.c_char_p()
        libcuda().cuGetErrorString(rc, ctypes.byref(s))
        raise CudaError(f"{what} failed: CUDA error {rc} ({(s.value or b'?').decode()})")


def current_device() -> int:
    """The device of the calling thread's current CUDA context (Numba makes the primary context of device 0
    current first if the thread has none)."""
    ctx = ctypes.c_void_p()
    rc = libcuda().cuCtxGetCurrent(ctypes.byref(ctx))
    if rc != 3:     # CUDA_ERROR_NOT_INITIALIZED: nothing in the process has called cuInit yet (Numba does, below)
        check(rc, "cuCtxGetCurrent")
    if rc == 3 or not ctx.value:  # asked without an error, so compute-sanitizer stays quiet
        from numba import cuda  # numba.cuda only where no context is current yet (this module imports without it)
        cuda.current_context()
    d = ctypes.c_int(-1)
    check(libcuda().cuCtxGetDevice(ctypes.byref(d)), "cuCtxGetDevice")
    return d.value


def sm_count(device: int) -> int:
    v = ctypes.c_int(0)
    check(libcuda().cuDeviceGetAttribute(ctypes.byref(v), 16, device), "cuDeviceGetAttribute")  # MULTIPROCESSOR_COUNT
    return v.value


def shared_optin(device: int) -> int:
    """The most dynamic shared memory a block may opt in to on ``device`` (bytes; 227 KiB on Hopper, 163 KiB on
    the A100, 99 KiB on sm_86 / sm_89)."""
    v = ctypes.c_int(0)
    check(libcuda().cuDeviceGetAttribute(ctypes.byref(v), 97, device),  # MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
          "cuDeviceGetAttribute")
    return v.value


def arg(v):
    """A ``Launcher.launch`` argument from a host runner's value: a Numba device array becomes (device pointer,
    (size,)) (1-D, as the launch signatures declare it); a scalar or a ready (pointer, shape) pair is returned
    unchanged."""
    if hasattr(v, "device_ctypes_pointer"):
        return v.device_ctypes_pointer.value, (v.size,)
    return v


def device_ptr(v) -> int:
    """The device address of a device array (``__cuda_array_interface__``), or under Numba's CUDA simulator of one
    of its device arrays: the address of its host buffer, which SimLauncher turns back into an array. 0 for an
    empty array."""
    cai = getattr(v, "__cuda_array_interface__", None)
    if cai is None:     # the simulator's device arrays have none; their host buffer is the simulator's device memory
        cai = v.__array_interface__
    return int(cai["data"][0] or 0)


class Array:
    """Signature entry: a C-contiguous array of ``dtype`` and ``ndim`` dimensions."""

    def __init__(self, dtype, ndim=1):
        self.dtype, self.ndim = np.dtype(dtype), ndim

    def numba_type(self):
        return types.Array(from_dtype(self.dtype), self.ndim, "C")


_SCALARS = {"int64": ctypes.c_int64, "uint64": ctypes.c_uint64, "int32": ctypes.c_int32,
            "uint32": ctypes.c_uint32, "float32": ctypes.c_float, "float64": ctypes.c_double}


class Launcher:
    """One compiled kernel with its parameter slots. Call ``launch(grid, block, shmem, stream, *args)`` where an
    array argument is given as ``(device_pointer, shape_tuple)`` and a scalar as a number."""

    def __init__(self, dispatcher, signature, *, dynamic_shared=0, pdl=False):
        """``dynamic_shared``: the dynamic shared memory bytes of every launch, or the most a launch may ask for
        through ``launch(..., shmem=)`` (above 48 KiB the kernel is opted in once per device). ``pdl``: the kernel
        keeps device/pdl.py's contract (reads what an earlier kernel wrote only after ``pdl.wait()``) and is launched
        as a programmatic dependent launch where the device allows it (``pdl_enabled``)."""
        self._sig = signature
        self._pdl = None      # the launch configuration, once the device allows PDL (filled per launch)
        if pdl and pdl_enabled(current_device()):
            self._attr = _LaunchAttr(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 0, 1)
            self._pdl = _LaunchConfig(0, 1, 1, 0, 1, 1, 0, None, ctypes.pointer(self._attr), 1)
        numba_sig = tuple(s.numba_type() if isinstance(s, Array) else getattr(types, s) for s in signature)
        kernel = dispatcher.compile(numba_sig)
        kernel.bind()
        cufunc = kernel._codelibrary.get_cufunc()
        self.handle = ctypes.c_void_p(int(cufunc.handle))
        self.dynamic_shared = dynamic_shared
        self._configured = set()
        self._slots = []  # per argument: list of ctypes values
        flat = []
        self._pointer_slots = []  # flat indices of the array data pointers (what a native plan may patch)
        for s in signature:
            if isinstance(s, Array):
                self._pointer_slots.append(len(flat) + 4)
                vals = [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int64(0), ctypes.c_int64(s.dtype.itemsize),
                        ctypes.c_void_p(0)] + [ctypes.c_int64(0) for _ in range(2 * s.ndim)]
            else:
                vals = [_SCALARS[s](0)]
            self._slots.append(vals)
            flat.extend(vals)
        self._flat = flat
        self._mu = threading.Lock()  # the slots are shared: one thread fills and launches at a time
        self._params = (ctypes.c_void_p * len(flat))(*[ctypes.addressof(v) for v in flat])
        self._launch = libcuda().cuLaunchKernel
        self._launch_ex = getattr(libcuda(), "cuLaunchKernelEx", None)     # PDL launches (pdl_enabled checks it)

    def _configure(self, device):
        if self.dynamic_shared > 48 * 1024:
            rc = libcuda().cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.dynamic_shared,
                                                self.handle, device)
            if rc != 0:
                rc = libcuda().cuFuncSetAttribute(self.handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                  self.dynamic_shared)
            check(rc, "setting the kernel's dynamic shared memory size")
        self._configured.add(device)

    def function(self):
        """The CUfunction of the kernel in the current context (Numba may hold a CUkernel, which not every driver
        call takes: cuKernelGetFunction; an error means the handle already is a CUfunction)."""
        f = ctypes.c_void_p()
        return f if libcuda().cuKernelGetFunction(ctypes.byref(f), self.handle) == 0 and f.value else self.handle

    def blocks_per_sm(self, block, shmem=None):
        """Resident blocks per SM at ``block`` threads and ``shmem`` bytes of dynamic shared memory (default: the
        launcher's). The kernel is opted in to its dynamic shared memory first, as a launch does: before that the
        driver answers 0 for more than 48 KiB."""
        dev = current_device()
        if dev not in self._configured:
            with _lock:
                self._configure(dev)
        n = ctypes.c_int(0)
        check(libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), self.function(), block, self.dynamic_shared if shmem is None else shmem),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return n.value

    def launch(self, grid, block, stream, *args, shmem=None, pdl=True):
        """``pdl=False``: this call launches in order (no PDL) although the launcher may (the call's weights are not
        constants, so reading them before ``pdl.wait()`` would race with the kernel that writes them)."""
        if len(self._configured) == 0 or self.dynamic_shared > 48 * 1024:
            dev = current_device()
            if dev not in self._configured:
                with _lock:
                    self._configure(dev)
        with self._mu:
            for s, vals, a in zip(self._sig, self._slots, args):
                if isinstance(s, Array):
                    ptr, shape = a
                    n = 1
                    for d in shape:
                        n *= d
                    vals[2].value = n
                    vals[4].value = ptr
                    stride = s.dtype.itemsize
                    for k in range(s.ndim - 1, -1, -1):
                        vals[5 + k].value = shape[k]
                        vals[5 + s.ndim + k].value = stride
                        stride *= shape[k]
                else:
                    vals[0].value = a
            shmem = self.dynamic_shared if shmem is None else shmem
            cfg = self._pdl if pdl else None
            if cfg is None:
                rc = self._launch(self.handle, grid, 1, 1, block, 1, 1, shmem, stream, self._params, None)
                if rc:
                    check(rc, "cuLaunchKernel")
            else:
                cfg.gx, cfg.bx, cfg.shmem, cfg.stream = grid, block, shmem, stream
                rc = self._launch_ex(ctypes.byref(cfg), self.handle, self._params, None)
                if rc:
                    check(rc, "cuLaunchKernelEx")
            rec = plans.active()
            if rec is not None:
                rec.launch(self.handle.value, int(grid), int(block), int(shmem),
                           [int.from_bytes(bytes(v), "little") for v in self._flat], self._pointer_slots)
                if cfg is not None:
                    rec.mark_pdl()


class SimLauncher:
    """Launcher's stand-in under Numba's CUDA simulator (QuantGRU there, and tests): the same ``launch`` arguments,
    1-D arrays as ``(pointer, (nitems,))``, turned back into arrays over the simulator's host memory (no copies:
    pointers into one buffer stay aliases). Records into a native plan being recorded as Launcher does (arrays
    flattened the same way, the kernel keyed by ``id(fn)``), so tests can check the plan; ``last_slots`` (on the
    instance and its class) holds the last launch's data pointer slots, one flat index per array argument. Numba's
    simulator is imported only at launch: this module stays importable without a GPU and without the simulator."""

    last_slots = []

    def __init__(self, fn, signature, *, empty=1):
        """``empty``: what a null pointer or an empty array becomes: ``max(nitems, empty)`` zeros, or with 0 an
        empty array (strict: a kernel that reads it fails)."""
        self.fn, self.sig, self.empty = fn, signature, empty

    def launch(self, grid, block, stream, *args, shmem=None, pdl=True):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # only at launch: see the docstring
        conv, flat, slots = [], [], []
        for s, v in zip(self.sig, args):
            if isinstance(s, Array):
                ptr, (n,) = v
                it = s.dtype.itemsize
                if ptr and n:
                    ary = np.frombuffer((ctypes.c_char * (n * it)).from_address(ptr), s.dtype)
                else:
                    ary = np.zeros(max(n, self.empty) if self.empty else 0, s.dtype)
                conv.append(FakeCUDAArray(ary))
                slots.append(len(flat) + 4)
                flat += [0, 0, n, it, int(ptr or 0), n, it]
            else:
                conv.append(v)
                flat.append(int.from_bytes(bytes(_SCALARS[s](v)), "little"))   # as Launcher records it
        self.fn[grid, block, 0, shmem or 0](*conv)
        self.last_slots = SimLauncher.last_slots = slots     # the class attribute also for subclasses
        rec = plans.active()
        if rec is not None:
            rec.launch(id(self.fn), int(grid), int(block), int(shmem or 0), flat, slots)

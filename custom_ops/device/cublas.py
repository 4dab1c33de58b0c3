"""cuBLAS through ctypes: just what the fused FFN's prefill path needs (a handle per stream, cublasGemmEx).

A handle is made once per (CUDA context, stream), bound to that stream and given a fixed workspace
(cublasSetStream_v2, then cublasSetWorkspace_v2: setting the stream resets the workspace), and kept for the
process. So a GEMM call never allocates and needs no per-call stream switch: the same call is valid inside a
CUDA-graph capture, and a native launch plan (plans.py) can record it and replay it from C.

The workspace is the one device buffer of an onnxruntime run that does not come from onnxruntime's allocator: it
belongs to the handle (cuBLAS keeps its address across calls, and setting it per call would change the handle's
state under other threads), is made with the handle on the first call on a stream (a recording call, before any
CUDA-graph capture), is only used by GEMMs issued on that stream (so in stream order) and lives for the process:
32 MiB per (context, stream) that ever ran a cuBLAS GEMM.

The library is found, in this order: a libcublas already mapped into the process (onnxruntime-gpu or torch
loaded it: use the same copy), the ``nvidia.cublas`` / ``nvidia.cu13`` Python packages, the loader's search
path (``ctypes.util.find_library``), the CUDA toolkit directory. ``load()`` returns None when none is found; the
callers then use their Numba fallback kernels.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import struct
import threading

from ..runtime import plans
from . import launch

R_32F, R_16F = 0, 2              # cudaDataType_t
COMPUTE_32F = 68                 # cublasComputeType_t: fp32 accumulation, no TF32
COMPUTE_32F_FAST_TF32 = 77       # fp32 accumulation, fp32 inputs rounded to TF32 on the tensor cores
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1
WORKSPACE = 32 << 20             # bytes per handle (cuBLAS's recommendation for Hopper)
GEMM_POINTER_SLOTS = (7, 10, 14)  # A, B, C among cublasGemmEx's arguments

_lib = None
_tried = False
_lock = threading.Lock()


class CublasError(RuntimeError):
    pass


def _mapped():
    """Paths of libcublas copies already mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "/libcublas.so" in ln})
    except OSError:
        return []


def _candidates():
    yield from _mapped()
    for p in sys.path:
        for sub in ("nvidia/cublas/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            yield from sorted(glob.glob(os.path.join(p, sub, "libcublas.so*")), reverse=True)
    name = ctypes.util.find_library("cublas")
    if name:
        yield name
    for v in ("13", "12", "11"):
        yield f"libcublas.so.{v}"
    for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if d:
            yield from sorted(glob.glob(os.path.join(d, "lib64", "libcublas.so*")), reverse=True)


def _bind(lib):
    p, i, c = ctypes.c_void_p, ctypes.c_int, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
    lib.cublasDestroy_v2.argtypes = [p]
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasGemmEx.argtypes = [p, c, c, i, i, i, p, p, c, i, p, c, i, p, p, c, i, c, c]
    if hasattr(lib, "cublasSetWorkspace_v2"):
        lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
    return lib


def load():
    """The cuBLAS library (ctypes), or None if none can be loaded."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        for path in _candidates():
            if "/" in path and "libcublas.so" in path:   # its libcublasLt sits beside it (wheels use $ORIGIN)
                lt = os.path.join(os.path.dirname(path), os.path.basename(path).replace("libcublas", "libcublasLt"))
                if os.path.exists(lt):
                    try:
                        ctypes.CDLL(lt, mode=ctypes.RTLD_GLOBAL)
                    except OSError:
                        pass
            try:
                _lib = _bind(ctypes.CDLL(path))
                return _lib
            except (OSError, AttributeError):
                continue
        return None


def check(rc, what):
    if rc != 0:
        raise CublasError(f"{what} failed: cuBLAS status {rc}")


def _f32(v):
    """A float's 4 bytes as an integer (how a plan stores the host scalar alpha/beta)."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


class Handle:
    """One cuBLAS handle bound to one stream, with its own workspace (created in the calling thread's current
    CUDA context). Use ``handle_for(stream)``."""

    def __init__(self, stream):
        self.lib = load()
        if self.lib is None:
            raise CublasError("cuBLAS library not found")
        h = ctypes.c_void_p()
        check(self.lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.h, self.stream = h, stream
        check(self.lib.cublasSetStream_v2(h, ctypes.c_void_p(stream)), "cublasSetStream")
        self.workspace = None
        if hasattr(self.lib, "cublasSetWorkspace_v2"):
            from numba import cuda  # numba.cuda only once a handle is made: load() works without numba-cuda
            self.workspace = cuda.device_array(WORKSPACE, "u1")
            check(self.lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(self.workspace.device_ctypes_pointer.value),
                                                 WORKSPACE), "cublasSetWorkspace")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._gemm_addr = ctypes.cast(self.lib.cublasGemmEx, ctypes.c_void_p).value

    def gemm_rows(self, x, x_type, w, w_type, c, m, n, k, ldc, c_type=R_32F, w_kn=False, compute=COMPUTE_32F):
        """C[m, n] (row-major, c_type, row stride ldc) = X[m, k] (row-major) . W[n, k]^T (row-major), all device
        pointers, on this handle's stream; fp32 accumulation. Column-major view: C^T[n, m] = op_T(W as k x n) .
        (X^T as k x m). ``w_kn``: W is [k, n] row-major instead (C = X . W, op N on W as n x k, onnxruntime's
        MatMul layout). ``compute``: COMPUTE_32F, or COMPUTE_32F_FAST_TF32 for fp32 inputs on the tensor cores (what
        onnxruntime's CUDA MatMul does by default, provider option use_tf32). Recorded into the active native plan,
        if any."""
        op, lda = (OP_N, n) if w_kn else (OP_T, k)
        check(self.lib.cublasGemmEx(self.h, op, OP_N, n, m, k, ctypes.byref(self._one), ctypes.c_void_p(w), w_type,
                                    lda, ctypes.c_void_p(x), x_type, k, ctypes.byref(self._zero), ctypes.c_void_p(c),
                                    c_type, ldc, compute, GEMM_DEFAULT), "cublasGemmEx")
        rec = plans.active()
        if rec is not None:
            rec.gemm(self._gemm_addr, [self.h.value, op, OP_N, n, m, k, _f32(1.0), w, w_type, lda, x, x_type, k,
                                       _f32(0.0), c, c_type, ldc, compute, GEMM_DEFAULT], GEMM_POINTER_SLOTS)


_handles = {}
_handles_lock = threading.Lock()


def handle_for(stream):
    """The process's handle for ``stream`` in the current CUDA context (made on first use, never destroyed:
    native plans keep its address)."""
    launch.current_device()     # makes a context current if the thread has none
    ctx = ctypes.c_void_p()
    launch.libcuda().cuCtxGetCurrent(ctypes.byref(ctx))
    key = (ctx.value, stream)
    h = _handles.get(key)
    if h is None:
        with _handles_lock:
            h = _handles.get(key)
            if h is None:
                h = _handles[key] = Handle(stream)
    return h

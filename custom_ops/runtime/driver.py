"""The CUDA driver library (libcuda.so.1) through ctypes, loaded on first use with the argument types the bridge and
the device helpers call it with (cuLaunchKernel / cuLaunchKernelEx, context and device queries, kernel attributes, occupancy). Loading
it needs a driver, not a GPU toolkit; without one it raises OSError."""
from __future__ import annotations

import ctypes

_libcuda = None


def libcuda():
    global _libcuda
    if _libcuda is None:
        lib = ctypes.PyDLL("libcuda.so.1")  # PyDLL: keep the GIL, launches are short and need no release
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuKernelSetAttribute.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cuKernelGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                    ctypes.c_int, ctypes.c_size_t]
        if hasattr(lib, "cuLaunchKernelEx"):   # CUDA 11.8+: device/launch.Launcher's programmatic dependent launch
            lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _libcuda = lib
    return _libcuda

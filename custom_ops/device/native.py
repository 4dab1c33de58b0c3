"""Native CPU entry points: what a CPU kernel needs to give the C shim a compiled function it can call without
Python (runtime/plans.py, "CPU kernels").

An entry is a Numba ``@cfunc`` with the C signature ``int32 entry(const uint64* params, int64 begin, int64 end)``
(``SIGNATURE``): ``params`` its arguments as 8-byte slots (data pointers, integers), ``[begin, end)`` the range of
work items of this task (the shim splits a call's items over onnxruntime's intra-op threads). It wraps a kernel's
existing njit functions: ``array(params[i], shape, dtype)`` views a pointer slot as an array, ``vector`` a flat one.
It returns 0, or ``DECLINED`` when the call's input values are not its to serve (the shim then calls Python, whose
checks name the problem). ``compile_entry(fn)`` compiles a module-level Python function as such an entry once per
process (cached on disk like the kernels), so importing a kernel module compiles nothing.
"""
from __future__ import annotations

import threading

from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

SIGNATURE = types.int32(types.CPointer(types.uint64), types.int64, types.int64)
DECLINED = 1


@intrinsic
def pointer(typingctx, addr):
    """uint64 address -> void* (for numba.carray)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(addr), codegen


_compiled = {}  # fn -> its cfunc: kept for the life of the process (the shim's plans hold the code's address)
_lock = threading.Lock()


def compile_entry(fn) -> int:
    """The address of the entry point compiled from ``fn`` (a module-level function with SIGNATURE's arguments).
    Numba compiles it on the first request in the process (from its disk cache when it can)."""
    with _lock:
        c = _compiled.get(fn)
        if c is None:
            c = _compiled[fn] = cfunc(SIGNATURE, nopython=True, cache=True)(fn)
    return c.address


@njit(inline="always")
def array(addr, shape, dtype):
    """A C-contiguous array of ``shape`` at the address ``addr`` (a uint64 parameter slot)."""
    return carray(pointer(addr), shape, dtype)


@njit(inline="always")
def vector(addr, n, dtype):
    """A 1-D array of ``n`` elements at ``addr``."""
    return carray(pointer(addr), (n,), dtype)

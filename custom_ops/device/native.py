"""Native CPU entry points: what a CPU kernel needs to give the C shim a compiled function it can call without
Python (runtime/plans.py, "CPU kernels").

An entry is a Numba ``@cfunc`` with the C signature ``int32 entry(const uint64* params, int64 begin, int64 end)``
(``SIGNATURE``): ``params`` its arguments as 8-byte slots (data pointers, integers), ``[begin, end)`` the range of
work items of this task (the shim splits a call's items over onnxruntime's intra-op threads). It wraps a kernel's
existing njit functions: ``array(params[i], shape, dtype)`` views a pointer slot as an array, ``vector`` a flat one.
It returns 0, or ``DECLINED`` when the call's input values are not its to serve (the shim then calls Python, whose
checks name the problem). Claimed work: an entry that costs a set-up per task (quantising A) may instead ignore
``[begin, end)`` and take chunks with ``claim(params, slot)`` from a counter slot, in as many tasks as the machine
has cores (``CLAIM_TASKS``): on a pool of fewer threads the tasks run one after another and the later ones find
nothing left (a set-up only where a task got work), on more threads they share the chunks. ``compile_entry(fn)`` compiles a module-level Python function as such an entry once per
process (cached on disk like the kernels), so importing a kernel module compiles nothing.
"""
from __future__ import annotations

import threading

import numpy as np

import numba
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from .half_cpu import f2h, h2f

SIGNATURE = types.int32(types.CPointer(types.uint64), types.int64, types.int64)
DECLINED = 1
CLAIM_TASKS = max(1, min(64, __import__("os").cpu_count() or 1))   # tasks of a claimed step (see the module doc)


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


def start_pool() -> None:
    """Starts Numba's thread pool (a no-op once started; numba.get_num_threads does it, public API). Compiled code
    that calls Numba's parallel kernels, loaded from the disk cache into a new process, finds no pool otherwise
    and crashes: an entry point, or a non-parallel function called from Python (QuantGRU's run_direction*)."""
    numba.get_num_threads()


def compile_entry(fn) -> int:
    """The address of the entry point compiled from ``fn`` (a module-level function with SIGNATURE's arguments).
    Numba compiles it on the first request in the process (from its disk cache when it can)."""
    with _lock:
        c = _compiled.get(fn)
        if c is None:
            # Numba starts its thread pool when a parallel function is compiled or called from Python; an entry
            # loaded from the disk cache that calls a parallel kernel (FusedFFN, QuantGRU) would find none
            start_pool()
            c = _compiled[fn] = cfunc(SIGNATURE, nopython=True, cache=True)(fn)
    return c.address


def parallel_ok() -> bool:
    """Whether an entry may call Numba's parallel kernels: replays run without the GIL, so concurrent session runs can
    start parallel regions at once, which the OpenMP and TBB layers allow and the workqueue layer does not (it aborts
    the process). With workqueue, such calls keep the Python path (the GIL serialises them)."""
    start_pool()   # so that the layer is known
    return numba.threading_layer() != "workqueue"


@intrinsic
def claim(typingctx, params, i):
    """params[i] += 1 atomically (sequentially consistent; ``params`` the entry's parameter pointer); returns the
    value before, as int64. Tasks of one call share their parameter block, so a counter slot (recorded as 0, reset
    with the block's per-call copy) hands out work items one at a time: ``claimed``'s scheme."""
    if not isinstance(params, types.CPointer) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        from llvmlite import ir
        ptr = builder.gep(args[0], [args[1]])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return types.int64(params, i), codegen


@intrinsic
def add_release(typingctx, params, i, v):
    """params[i] += v atomically with release order (what this task wrote before is seen by a task whose
    ``wait_at_least`` sees the new value); returns nothing. With ``claim`` and ``wait_at_least``: staged work on
    a counter of finished items (QuantGRU's recurrence steps on onnxruntime's pool)."""
    if not isinstance(params, types.CPointer) or not isinstance(i, types.Integer) or not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ptr = builder.gep(args[0], [args[1]])
        val = context.cast(builder, args[2], signature.args[2], types.uint64)
        builder.atomic_rmw("add", ptr, val, "release")
        return context.get_dummy_value()

    return types.void(params, i, v), codegen


@intrinsic
def wait_at_least(typingctx, params, i, v):
    """Spins (x86 ``pause`` between reads) until params[i] >= v, read with acquire order; returns the value read.
    Only for values that a running task will reach (one holding a claimed item): never blocks on an idle pool."""
    if not isinstance(params, types.CPointer) or not isinstance(i, types.Integer) or not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        from llvmlite import ir
        from numba.core import cgutils
        ptr = builder.gep(args[0], [args[1]])
        want = context.cast(builder, args[2], signature.args[2], types.int64)
        pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                               "llvm.x86.sse2.pause")
        loop = builder.append_basic_block("wait.loop")
        done = builder.append_basic_block("wait.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        cur = builder.load_atomic(ptr, "acquire", 8)
        ready = builder.icmp_signed(">=", cur, want)
        with builder.if_then(builder.not_(ready)):
            builder.call(pause, [])
        builder.cbranch(ready, done, loop)
        builder.position_at_end(done)
        return cur

    return types.int64(params, i, v), codegen


@njit(inline="always")
def array(addr, shape, dtype):
    """A C-contiguous array of ``shape`` at the address ``addr`` (a uint64 parameter slot)."""
    return carray(pointer(addr), shape, dtype)


@njit(inline="always")
def vector(addr, n, dtype):
    """A 1-D array of ``n`` elements at ``addr``."""
    return carray(pointer(addr), (n,), dtype)


@njit(inline="always")
def arg(params, i):
    """Integer parameter slot ``i`` as int64 (slots are uint64: mixing them with int64 would give float64)."""
    return np.int64(params[i])


# ---- helpers the entries share: fp16 / fp32 operands and results (fp16 through half_cpu's bit code)
@njit(cache=True, nogil=True)
def load_f32(addr, rows, cols, f16):
    """The [rows, cols] float32 (f16 = 0) or float16 (f16 = 1, widened exactly) array at ``addr`` as float32."""
    if f16:
        h = array(addr, (rows, cols), np.uint16)
        out = np.empty((rows, cols), np.float32)
        for i in range(rows):
            for j in range(cols):
                out[i, j] = h2f(h[i, j])
        return out
    return array(addr, (rows, cols), np.float32)


@njit(cache=True, nogil=True)
def slice_f32(addr, start, count, f16):
    """Elements [start, start + count) of the float32 / float16 vector at ``addr``, as float32 (a view for float32,
    a widened copy of just those elements for float16)."""
    at = addr + np.uint64(start * (2 if f16 else 4))
    return load_f32(at, 1, count, f16)[0]


@njit(cache=True, nogil=True)
def add_bias(res, addr, c0, f16):
    """res[i, j] += bias[c0 + j] (float32 or float16 bias at ``addr``, widened), in float32."""
    cols = res.shape[1]
    if f16:
        b16 = vector(addr, c0 + cols, np.uint16)
        for i in range(res.shape[0]):
            for j in range(cols):
                res[i, j] += h2f(b16[c0 + j])
    else:
        b32 = vector(addr, c0 + cols, np.float32)
        for i in range(res.shape[0]):
            for j in range(cols):
                res[i, j] += b32[c0 + j]


@njit(cache=True, nogil=True)
def store_cols(res, addr, ld, c0, f16):
    """dest[i, c0 + j] = res[i, j] for the [rows, ld] float32 or float16 (rounded to nearest even) array at
    ``addr``."""
    rows, cols = res.shape
    if f16:
        d16 = array(addr, (rows, ld), np.uint16)
        for i in range(rows):
            for j in range(cols):
                d16[i, c0 + j] = f2h(res[i, j])
    else:
        d32 = array(addr, (rows, ld), np.float32)
        for i in range(rows):
            for j in range(cols):
                d32[i, c0 + j] = res[i, j]


@njit(cache=True, nogil=True)
def fingerprint(addr, nbytes):
    """FNV-1a hash of ``nbytes`` bytes at ``addr``: an entry compares input values it cannot check cheaply with the
    values Python checked when the call was recorded (a mismatch: DECLINED, Python checks them again)."""
    data = vector(addr, nbytes, np.uint8)
    h = np.uint64(0xCBF29CE484222325)
    for i in range(nbytes):
        h = (h ^ np.uint64(data[i])) * np.uint64(0x100000001B3)
    return h

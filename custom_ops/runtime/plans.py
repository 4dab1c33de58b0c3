"""Native launch plans: a CUDA kernel's compute call recorded once per input signature, replayed by the C shim.

The shim keys each call by its inputs' element types, ranks, dims and pointer alignment plus the CUDA stream.
On a miss it calls Python with an empty plan; ``compute_and_record`` runs the kernel's ordinary ``compute`` and
records what it did — the outputs it allocated (shapes), the scratch it took (``Context.scratch``: bytes), every
``Launcher.launch`` (CUfunction, grid, block, shared memory, the flattened parameter values) and every
``cublas.Handle.gemm_rows`` (cublasGemmEx's address and its 19 arguments, the handle bound to this stream) in
order — and marks each parameter that holds a pointer into one of this call's inputs, outputs or its scratch
buffer as a patch (kind, input/output index, byte offset). The next call with the same key is served entirely in
C: outputs allocated with the recorded shapes, a scratch buffer of the recorded size taken from onnxruntime's
allocator, the recorded steps issued with this call's pointers patched in, the scratch given back. No Python, no
GIL, no host synchronisation, no host state changed; the only allocations are onnxruntime's own (outputs,
scratch: arena blocks, as its own kernels take), so it is also safe under CUDA-graph capture.

A kernel class opts in with ``native_plans = True``. That promises: for a given key, compute's steps, output
shapes and scratch size depend on nothing but the key (not on input values or per-call host state); every
device buffer it passes that is neither an input, an output nor the call's scratch is read-only state living as
long as the kernel (tables, weights' derived forms) or a cuBLAS handle with its workspace; and all its GPU work
goes through ``device.launch.Launcher`` or ``cublas.Handle.gemm_rows`` -- or the call says ``not_replayable()``
(then that key keeps going through Python). Kernels without the flag run through Python on every call.

CPU kernels use the same plans with one kind of step, a compiled entry point (``CPU``): the kernel's compute,
when a recorder is attached (``Context.native``), checks its inputs, allocates its outputs and, instead of its
Python path, calls ``Context.run_native(entry, items, grain, values, pointer_slots)``: ``entry`` the address of a
Numba ``@cfunc`` with the C signature ``int32 entry(const uint64* params, int64 begin, int64 end)`` (device/native.py)
that calls the existing njit kernels, ``values`` its parameters (pointers into inputs / outputs, patched on replay
like a launch's; kernel-owned tables; integers), ``items`` the work items the shim splits into tasks of at least
``grain`` items over onnxruntime's intra-op thread pool. The call runs the entry at once (so the first call is
native too) and records it; later calls with the key run it from C. A CPU kernel with ``native_plans = True``
promises what a CUDA one does (steps and output shapes depend only on the key; other buffers are read-only kernel
state) and that every key either records at least one entry or says ``not_replayable()``. An entry returns nonzero
when it declines the call's input values (e.g. a sequence length out of range): that call then goes through
Python, which raises the clear error.
"""
from __future__ import annotations

import threading

import numpy as np

from .abi import MAX_DIMS, MAX_PARAMS, MAX_PATCH, MAX_PLAN_STEPS, NP_DTYPES

_tls = threading.local()

INPUT, OUTPUT, SCRATCH = 0, 1, 2  # patch kinds (ortshim.c: LB_PATCH_*)
LAUNCH, GEMM, COOP, CPU, PDL = 0, 1, 2, 3, 4  # step kinds (ortshim.c: LB_STEP_LAUNCH, _GEMM, _COOP, _CPU, _PDL)
GEMM_ARGS = 19                 # cublasGemmEx's arguments


class Recorder:
    """Collects one compute call's outputs, scratch and launches."""

    def __init__(self, inputs, out_itemsizes):
        self.ranges = []  # (kind, index, start, nbytes)
        self.scratch_bytes = 0
        for i, t in enumerate(inputs):
            if t is not None and t.ptr:
                self.ranges.append((INPUT, i, t.ptr, t.size * _itemsize(t.elem_type)))
        self.out_itemsizes = out_itemsizes
        self.outputs = {}  # index -> shape
        self.steps = []    # (kind, func, grid, block, shmem, values, pointer slot indices)
        self.ok = True

    def output(self, index, shape, ptr):
        self.outputs[index] = shape
        if ptr:
            n = 1
            for d in shape:
                n *= d
            self.ranges.append((OUTPUT, index, ptr, n * self.out_itemsizes[index]))

    def scratch(self, ptr, nbytes):
        self.scratch_bytes = nbytes
        if ptr:
            self.ranges.append((SCRATCH, 0, ptr, nbytes))

    def launch(self, func, grid, block, shmem, values, pointer_slots):
        self.steps.append((LAUNCH, func, grid, block, shmem, values, pointer_slots))

    def mark_cooperative(self, func):
        """The launch just recorded was cooperative (cuLaunchCooperativeKernel: all blocks resident at once, which
        a kernel with a grid-wide barrier needs): it is replayed the same way, on ``func`` (its CUfunction)."""
        self._mark(COOP, "mark_cooperative", func)

    def mark_pdl(self):
        """The launch just recorded was a programmatic dependent launch (device/pdl.py): replayed the same way."""
        self._mark(PDL, "mark_pdl")

    def _mark(self, kind, what, func=None):
        """The last step, a plain launch, becomes a launch of ``kind`` (on ``func`` when given)."""
        if not self.steps or self.steps[-1][0] != LAUNCH:
            raise ValueError(f"{what} follows a kernel launch")
        _, f, grid, block, shmem, values, pointer_slots = self.steps[-1]
        self.steps[-1] = (kind, f if func is None else func, grid, block, shmem, values, pointer_slots)

    def gemm(self, func, values, pointer_slots):
        """A cublasGemmEx call: ``func`` its address, ``values`` its 19 arguments as integers (host scalars alpha
        and beta as their bytes, little-endian), ``pointer_slots`` the device-pointer arguments."""
        if len(values) != GEMM_ARGS:
            raise ValueError(f"cublasGemmEx takes {GEMM_ARGS} arguments, got {len(values)}")
        self.steps.append((GEMM, func, 0, 0, 0, values, pointer_slots))

    def cpu(self, entry, items, grain, values, pointer_slots):
        """A CPU entry point's call (``entry`` its address) over ``items`` work items, tasks of >= ``grain``."""
        self.steps.append((CPU, entry, items, grain, 0, values, pointer_slots))

    def patch_for(self, value):
        """(kind, index, offset) of the input/output/scratch ``value`` points into, or None (a kernel-owned
        buffer)."""
        for kind, index, start, nbytes in self.ranges:
            if start <= value < start + max(nbytes, 1):
                return kind, index, value - start
        return None


def _itemsize(elem_type):
    return np.dtype(NP_DTYPES[elem_type]).itemsize


def active():
    """The recorder of the compute call running on this thread, or None."""
    return getattr(_tls, "rec", None)


def not_replayable() -> None:
    """Called by a kernel (with ``native_plans = True``) whose current call does GPU work outside ``Launcher`` and
    ``Handle.gemm_rows`` or depends on more than the key: no plan is made for this call's key, so calls with it
    keep going through Python."""
    rec = active()
    if rec is not None:
        rec.ok = False


def compute_and_record(kernel, ctx, inputs, plan) -> None:
    """Runs ``kernel.compute`` and, if the kernel allows it, fills ``plan`` (an abi.LbPlan) from what it did."""
    if not getattr(kernel, "native_plans", False):
        plan.never = 1
        kernel.compute(ctx, inputs)
        return
    rec = Recorder(inputs, [_itemsize(t) for t in kernel.out_types])
    ctx.recorder = rec
    _tls.rec = rec
    try:
        kernel.compute(ctx, inputs)
    finally:
        _tls.rec = None
        ctx.recorder = None
    fill(plan, rec, len(kernel.out_types), cpu=getattr(kernel, "on_cpu", False))


def fill(plan, rec, n_out, cpu=False) -> bool:
    """Writes the recorded call into ``plan``; leaves plan.valid = 0 if it does not fit a plan (a CPU kernel's: also
    when it recorded no entry call, or anything but entry calls)."""
    plan.valid = 0
    if not rec.ok or len(rec.steps) > MAX_PLAN_STEPS or any(len(s) > MAX_DIMS for s in rec.outputs.values()):
        return False
    if cpu and (not rec.steps or any(s[0] != CPU for s in rec.steps)):
        return False
    plan.n_out = n_out
    plan.scratch = rec.scratch_bytes
    for o in range(n_out):
        shape = rec.outputs.get(o)
        plan.out_ndim[o] = -1 if shape is None else len(shape)
        for d, v in enumerate(shape or ()):
            plan.out_dims[o][d] = v
    for s, (kind, func, grid, block, shmem, values, pointer_slots) in enumerate(rec.steps):
        if len(values) > MAX_PARAMS:
            return False
        st = plan.steps[s]
        st.kind, st.func, st.grid, st.block, st.shmem, st.n_params = kind, func, grid, block, shmem, len(values)
        for i, v in enumerate(values):
            st.params[i] = v & 0xFFFFFFFFFFFFFFFF     # negative integer arguments as two's complement
        n_patch = 0
        for slot in pointer_slots:
            hit = rec.patch_for(values[slot]) if values[slot] else None
            if hit is None:
                continue
            if n_patch == MAX_PATCH:
                return False
            st.patch_slot[n_patch], st.patch_kind[n_patch] = slot, hit[0]
            st.patch_index[n_patch], st.patch_off[n_patch] = hit[1], hit[2]
            n_patch += 1
        st.n_patch = n_patch
    plan.n_steps = len(rec.steps)
    plan.valid = 1
    return True

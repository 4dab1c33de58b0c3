"""Programmatic dependent launch (PDL, compute capability 9.0+): a kernel launched with it may start while the
kernel before it in the stream is still running, and waits for that kernel's results only where it reads them.

Device side (this module): ``wait()`` (PTX ``griddepcontrol.wait``: returns once every grid this one depends on
has completed and its memory is visible; a no-op in a kernel launched without PDL) and ``trigger()``
(``griddepcontrol.launch_dependents``: the next PDL-launched kernel may be scheduled once every block of this one
has called it or exited). Both compile to nothing below compute capability 9.0 and are plain no-ops under the
simulator. Host side: ``Launcher(..., pdl=True)`` (device/launch.py) launches with cuLaunchKernelEx and the
programmatic-stream-serialization attribute, and native plans replay it the same way (runtime/plans.PDL).

The contract of a kernel that a PDL launcher launches: before ``wait()`` it reads only what no kernel of the stream
writes while the model runs (weights, tables, kernel parameters) and writes no global memory; after it, anything.
A kernel calls ``trigger()`` where letting the next kernel's blocks in does not starve its own (we call it right
after ``wait()``: by then all of this grid's blocks are resident or done). Measured: docs/lab-log.md ("Programmatic
dependent launch").
"""
from __future__ import annotations

from .target import SIM

if SIM:
    def wait():
        pass

    def trigger():
        pass
else:
    from llvmlite import ir
    from numba import cuda, types
    from numba.extending import intrinsic

    def _supported():
        """Whether the kernel being compiled may hold griddepcontrol (sm_90+): Numba compiles a kernel's LLVM IR
        for the current device. Without a GPU (benchmarks/ptx_snapshot.py compiles for cc 9.0) it may."""
        try:
            return tuple(cuda.get_current_device().compute_capability) >= (9, 0)
        except Exception:  # noqa: BLE001 - no driver / no device: compiled to PTX only
            return True

    def _asm(name, text):
        def op(typingctx):
            def codegen(context, builder, sig, args):
                if _supported():   # the kernel is compiled for the current device (launch.Launcher)
                    fn = ir.FunctionType(ir.VoidType(), [])
                    builder.call(ir.InlineAsm(fn, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return types.void(), codegen
        op.__name__ = name
        return intrinsic(op)

    wait = _asm("wait", "griddepcontrol.wait;")
    trigger = _asm("trigger", "griddepcontrol.launch_dependents;")

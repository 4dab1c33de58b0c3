"""Where the CUDA kernels run and what the device offers: ``SIM`` (Numba's CUDA simulator, NUMBA_ENABLE_CUDASIM=1),
the ``device`` decorator of the shared device helpers (an inlined ``cuda.jit`` device function on the GPU; under the
simulator the plain Python function, see fp16.py), compute-capability checks (``tc_device``) and ``launch_cuda``
(numba.cuda on the GPU; under the simulator the running launch's stand-in module, for splitk.arrive_last).

Used by every CUDA module: the families' op modules and the other device/ helpers.

Why ``launch_cuda`` (simulator only; reviewed for issue 31 and kept): a device helper that lives outside its
kernels' module and calls ``cuda.threadfence`` / ``cuda.atomic`` after its last barrier (splitk.arrive_last) sees
numba.cuda, not the launch's stand-in, in the threads still inside it when the first thread returns (the
simulator swaps a device function's module only per call). The alternatives are worse: a copy of arrive_last in
every kernel module (the duplication the split-K helpers were made to remove), or simulator versions of the
atomics and fences written here (a second implementation of what the simulator already does). The cost is one
private function of numba-cuda's simulator, ``_get_kernel_context``; numba-cuda is pinned (0.30), and the split-K
kernels' simulator tests (AWQ, FusedFFN [K, N], NF4 tensor-core) fail if it changes. GPU builds never see it.
"""
from __future__ import annotations

from numba import config, cuda

SIM = bool(config.ENABLE_CUDASIM)

if SIM:
    # The simulator runs kernels as Python, has no libdevice, and calling a cuda.jit device function there
    # costs a module swap per call: the helpers are plain Python functions on numpy scalars instead.
    def device(fn):
        return fn

    from numba.cuda.simulator.kernel import _get_kernel_context   # simulator only (numba-cuda is pinned to 0.30)

    class _LaunchCuda:
        """Under the simulator, ``cuda`` for a device helper that lives outside its kernels' module and uses
        ``cuda.*`` after its last barrier (splitk.arrive_last): the running launch's fake module (threadfence,
        atomics, ...), else numba.cuda. The simulator swaps a kernel module's ``cuda`` for the whole launch, but a
        device function's own module only per call, restored by the first thread that returns while the block's
        other threads are still inside, so those threads would call numba.cuda.threadfence, which does not exist
        there. GPU builds never see this object."""

        def __getattr__(self, name):
            ctx = _get_kernel_context()
            return getattr(cuda if ctx is None else ctx, name)

    launch_cuda = _LaunchCuda()
else:
    device = cuda.jit(device=True, inline=True)
    launch_cuda = cuda


def tc_device():
    """mma.sync m16n8k16 needs compute capability 8.0 or newer (kernel classes check it before compiling)."""
    return tuple(cuda.get_current_device().compute_capability) >= (8, 0)

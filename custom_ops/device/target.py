"""Where the CUDA kernels run and what the device offers: ``SIM`` (Numba's CUDA simulator, NUMBA_ENABLE_CUDASIM=1),
the ``device`` decorator of the shared device helpers (an inlined ``cuda.jit`` device function on the GPU; under the
simulator the plain Python function, see fp16.py), and compute-capability checks (``tc_device``)."""
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

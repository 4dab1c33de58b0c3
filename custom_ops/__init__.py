"""onnx-lowbit kernels (Numba CPU and Numba CUDA) and the onnxruntime bridge that runs them.

CPU threads: the Numba CPU kernels run their parallel loops on Numba's OpenMP pool, in processes where numpy's
BLAS and onnxruntime keep their own threads. With libgomp's default wait policy, OpenMP threads spin after every
parallel loop and starve the others: on 2 cores a BLAS product right after a parallel loop took 8 ms instead of
0.2 ms (FusedFFN fp16 at M > 16, MatMulNF4's prefill). So unless the user chose one, OMP_WAIT_POLICY is set to
PASSIVE here, before Numba starts its pool (it costs a parallel loop ~20 us of wake-up). docs/reliability.md.
"""
import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .runtime.bridge import KernelError, library_path, register  # noqa: E402

__all__ = ["KernelError", "library_path", "register"]

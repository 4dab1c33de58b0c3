"""onnx-lowbit kernels (Numba CPU and Numba CUDA) and the onnxruntime bridge that runs them."""
from .bridge import KernelError, library_path, register

__all__ = ["KernelError", "library_path", "register"]

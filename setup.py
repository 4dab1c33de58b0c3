"""Builds the onnxruntime bridge's C shim at install time (plain C, libc only, no onnxruntime headers).
Everything else is in pyproject.toml. A source checkout without an install builds the shim on first use
(onnx_lowbit/custom_ops/runtime/build.py)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("onnx_lowbit.custom_ops.runtime._ortshim", sources=["custom_ops/runtime/ortshim.c"],
                             depends=["custom_ops/runtime/ortplans.c"],  # included by ortshim.c
                             extra_compile_args=["-std=c99", "-O2", "-pthread"],
                             extra_link_args=["-pthread"])])

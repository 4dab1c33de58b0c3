"""Finds or builds the C shim (ortshim.c) as a shared library.

``pip install`` compiles it next to this file (setup.py); a source checkout compiles it on first use into a
per-user cache, keyed by the source's hash, with the system C compiler (cc/gcc). No onnxruntime headers and no
link dependency beyond libc are needed.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from .abi import SHIM_ABI

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "ortshim.c")
PARTS = [SOURCE, os.path.join(HERE, "ortplans.c")]   # ortshim.c includes ortplans.c: one translation unit


class ShimBuildError(RuntimeError):
    pass


def compile_shim(out_path: str) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise ShimBuildError("onnx_lowbit needs a C compiler (cc/gcc) once to build its onnxruntime shim; "
                             "install gcc or install onnx-lowbit from a built wheel")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out_path))
    os.close(fd)
    cmd = [cc, "-O2", "-shared", "-fPIC", "-std=c99", "-pthread", "-Wall", SOURCE, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise ShimBuildError(f"building the onnxruntime shim failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out_path)  # atomic: concurrent builders never see a half-written library
    return out_path


def _source_hash() -> str:
    h = hashlib.sha256()
    for part in PARTS:
        with open(part, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _current(path) -> bool:
    """Whether the library at ``path`` speaks this Python code's interface (abi.SHIM_ABI): a shim built in place
    from an older ortshim.c (an editable install before a pull) does not."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return False
    return hasattr(lib, "lb_abi") and lib.lb_abi() == SHIM_ABI


def shim_path() -> str:
    """Path of a built shim: the one the install compiled, else (none, or a stale one) one built into the user
    cache."""
    shipped = sorted(glob.glob(os.path.join(HERE, "_ortshim*.so")))
    if shipped and _current(shipped[0]):
        return shipped[0]
    cache = os.environ.get("ONNX_LOWBIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "onnx_lowbit")
    path = os.path.join(cache, f"ortshim-{_source_hash()}-py{sys.version_info[0]}{sys.version_info[1]}.so")
    if not os.path.exists(path):
        compile_shim(path)
    return path


if __name__ == "__main__":  # python -m onnx_lowbit.custom_ops.runtime.build: the shim sessions load (built if needed)
    print(shim_path())

"""Resource report and SASS instruction mix of a Numba CUDA kernel, without a GPU (development tool).

Needs libNVVM, ptxas and nvdisasm (pip: nvidia-cuda-nvcc-cu12, nvidia-cuda-nvdisasm), and runs outside the
simulator. A CUDA toolkit's ptxas serves too (CUDA_HOME, /usr/local/cuda*); this development machine's CUDA 13
toolkit lacks libnvrtc and nvdisasm, which pip's nvidia-cuda-nvrtc==13.* and nvidia-cuda-nvdisasm==13.* bring
(`pip install --target DIR ...`, then LD_LIBRARY_PATH=DIR/nvidia/cu13/lib and DIR/nvidia/cu13/bin on PATH).
Example:
    python benchmarks/sass.py onnx_lowbit.custom_ops.awq.gemv_cuda 'make_gemv(1, True, 2)' 'sig(True, 2, True)' 80
prints registers / spills / shared memory and a histogram of SASS opcodes (whole kernel), plus the opcodes of the
largest loop body (the hot loop of a GEMV).
"""
from __future__ import annotations

import collections
import glob
import importlib
import os
import re
import subprocess
import sys
import tempfile


def tool(name):
    """``name``'s path: pip's nvidia packages first, then CUDA_HOME / /usr/local/cuda*'s bin and PATH."""
    try:
        import nvidia
        for base in nvidia.__path__:
            hits = glob.glob(os.path.join(base, "*", "bin", name))
            if hits:
                return sorted(hits)[-1]
    except ImportError:
        pass
    homes = [os.environ.get("CUDA_HOME", "")] + sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for home in homes:
        if home and os.path.exists(os.path.join(home, "bin", name)):
            return os.path.join(home, "bin", name)
    import shutil
    if shutil.which(name):
        return shutil.which(name)
    raise SystemExit(f"{name} not found (pip install nvidia-cuda-nvcc-cu12 nvidia-cuda-nvdisasm, or a CUDA toolkit)")


def ptx_of(fn, sig, cc=(9, 0)):
    from numba import cuda
    py = getattr(fn, "py_func", fn)
    ptx, _ = cuda.compile_ptx(py, sig, cc=cc)
    return ptx


def sass_of(ptx, maxreg=None, arch="sm_90"):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        c = os.path.join(d, "k.cubin")
        open(p, "w").write(ptx)
        cmd = [tool("ptxas"), f"-arch={arch}", "-v", "-O3", p, "-o", c]
        if maxreg:
            cmd.insert(1, f"-maxrregcount={maxreg}")
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res = " ".join(ln.strip() for ln in r.stderr.splitlines() if "Used" in ln or "spill" in ln)
        s = subprocess.run([tool("nvdisasm"), "-c", c], capture_output=True, text=True, check=True).stdout
    return res, s


def mix(sass_text):
    ops = []
    for ln in sass_text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", ln)
        if m:
            ops.append(m.group(2))
    return ops


def loops(sass_text):
    """Instruction lists of backward-branch loops (label .. BRA back to it), largest first."""
    lines = sass_text.splitlines()
    labels = {}
    for i, ln in enumerate(lines):
        m = re.match(r"(\.L_x_\d+):", ln.strip())
        if m:
            labels[m.group(1)] = i
    out = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            out.append(mix("\n".join(lines[labels[m.group(1)]:i + 1])))
    return sorted(out, key=len, reverse=True)


def report(fn, sig, maxreg=None, show=12):
    res, s = sass_of(ptx_of(fn, sig), maxreg)
    ops = mix(s)
    print(res)
    print(f"{len(ops)} instructions; top:", collections.Counter(o.split(".")[0] for o in ops).most_common(show))
    for body in loops(s)[:4]:
        n = collections.Counter(o.split(".")[0] for o in body)
        per = f" ({len(body) / n['FFMA']:.2f} per FFMA)" if n["FFMA"] else ""
        print(f"loop of {len(body)}{per}:", n.most_common(show))
    return s


def numba_sig(signature):
    from numba import types
    return tuple(a.numba_type() if hasattr(a, "numba_type") else getattr(types, a) for a in signature)


def main():
    """python benchmarks/sass.py MODULE 'FACTORY_EXPR' 'SIGNATURE_EXPR' [MAXREG], both evaluated in MODULE."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return
    sys.path.insert(0, os.getcwd())
    mod, make, sig, *rest = sys.argv[1:]
    ns = vars(importlib.import_module(mod))
    report(eval(make, ns), numba_sig(eval(sig, ns)), int(rest[0]) if rest else None)


if __name__ == "__main__":
    main()

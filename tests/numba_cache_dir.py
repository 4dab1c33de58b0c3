"""Prints the Numba cache folder for this tree's compiled sources (tests/run.sh exports it as NUMBA_CACHE_DIR).

Numba's disk cache checks only the source file of the function it caches: a cached entry whose callees live in
another module (QuantGRU's native entries call quantgru_steps, which calls quantgru_vnni's intrinsics) is loaded
as it was after such a callee changed, and tests then run the old code (seen 2026-11-29: edited quantgru_steps, the
quantgru_tasks tests passed in 4 s on stale code). The folder is named after a hash of every source the kernels
compile from (custom_ops/ and the onnx_lowbit modules it imports), so any change to them starts from an empty
cache; folders of other hashes are removed (the last KEEP stay, for switching branches)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEP = 3


def sources(root=ROOT):
    """The .py files the kernels compile from: custom_ops/ and the onnx_lowbit modules custom_ops imports."""
    files, core = [], set()
    for d, _, names in os.walk(os.path.join(root, "custom_ops")):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(d, n)
                files.append(p)
                with open(p, encoding="utf-8") as f:
                    text = f.read()
                for m in re.finditer(r"^from onnx_lowbit(?:\.(\w+))? import ([\w, ]+)", text, re.M):
                    core.update([m.group(1)] if m.group(1) else [s.strip() for s in m.group(2).split(",")])
    for name in core:
        p = os.path.join(root, "onnx_lowbit", name + ".py")
        if os.path.exists(p):
            files.append(p)
    return sorted(files)


def digest(root=ROOT):
    h = hashlib.sha256()
    for p in sources(root):
        h.update(os.path.relpath(p, root).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def folder(base, root=ROOT):
    """base/<digest>, created; older sibling folders beyond the newest KEEP removed."""
    here = os.path.join(base, digest(root))
    os.makedirs(here, exist_ok=True)
    os.utime(here)
    others = sorted((os.path.join(base, n) for n in os.listdir(base) if os.path.join(base, n) != here),
                    key=os.path.getmtime, reverse=True)
    for p in others[KEEP - 1:]:
        shutil.rmtree(p, ignore_errors=True)
    return here


if __name__ == "__main__":
    try:
        print(folder(sys.argv[1]))
    except OSError as e:   # no writable cache folder: Numba's default (next to the sources)
        print(f"numba_cache_dir: {e}; Numba's default cache", file=sys.stderr)
        print("")

"""Peak memory of `onnx-lowbit rewrite --weights nf4` (and of `inspect --weights nf4`) on a model over 2 GB (weights
in external data).

Builds an fp16 MLP stack (LAYERS x [MatMul d->f, Relu, MatMul f->d]) whose weights are written straight to one
external data file (the builder never holds more than one weight), runs the CLI in a subprocess under
/usr/bin/time -v (falls back to resource.getrusage(RUSAGE_CHILDREN)) and reports its peak RSS against the
target 2 x (largest tensor) + 1 GiB, with the output's size. CPU only; needs about 1.3x the model size free on
the temp folder's disk.

    python benchmarks/big_model.py                      # ~3 GiB: 12 layers, d=4096, f=16384 (128 MiB tensors)
    python benchmarks/big_model.py --layers 2 --d 1024 --f 4096 --keep /tmp/x   # small, keep the files
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from onnx import TensorProto, helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30
MIB = 1 << 20


def build(folder: str, layers: int, d: int, f: int, seed: int = 0) -> tuple:
    """Writes model.onnx + model.onnx.data into ``folder``; returns (model path, total weight bytes, largest)."""
    rng = np.random.default_rng(seed)
    data_name = "model.onnx.data"
    inits, nodes, x, offset, largest = [], [], "x", 0, 0
    with open(os.path.join(folder, data_name), "wb") as out:
        for i in range(layers):
            for name, shape in ((f"w_up_{i}", (d, f)), (f"w_down_{i}", (f, d))):
                w = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
                out.write(w.tobytes())
                t = TensorProto(name=name, data_type=TensorProto.FLOAT16, dims=list(shape))
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(w.nbytes))):
                    e = t.external_data.add()
                    e.key, e.value = k, v
                offset += w.nbytes
                largest = max(largest, w.nbytes)
                inits.append(t)
                del w
            nodes += [helper.make_node("MatMul", [x, f"w_up_{i}"], [f"h{i}"], name=f"up{i}"),
                      helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"),
                      helper.make_node("MatMul", [f"r{i}", f"w_down_{i}"], [f"y{i}"], name=f"down{i}")]
            x = f"y{i}"
    g = helper.make_graph(nodes, "big_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", d])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT16, ["n", d])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = os.path.join(folder, "model.onnx")
    with open(path, "wb") as fh:
        fh.write(m.SerializeToString())
    return path, offset, largest


def run_cli(args: list) -> tuple:
    """(peak RSS bytes, wall seconds, stdout+stderr) of `onnx-lowbit ARGS` in a subprocess."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "onnx_lowbit.cli", *args]
    use_time = os.path.exists("/usr/bin/time")
    if use_time:
        cmd = ["/usr/bin/time", "-v", *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    log = p.stdout + p.stderr
    if p.returncode:
        raise SystemExit(f"{' '.join(args[:1])} failed (exit {p.returncode}):\n{log[-3000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log) if use_time else None
    peak = int(m.group(1)) * 1024 if m else resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return peak, wall, log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=16384)
    ap.add_argument("--tmp", default=None, help="folder for the temporary files (default: the system temp)")
    ap.add_argument("--keep", default=None, help="build into this folder and keep the files")
    a = ap.parse_args(argv)
    need = 2 * a.layers * a.d * a.f * 2 * 1.35
    folder = a.keep or tempfile.mkdtemp(prefix="onnx-lowbit-big-", dir=a.tmp)
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SystemExit(f"{folder}: {free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed; scale down "
                         "(--layers/--d/--f)")
    try:
        t0 = time.perf_counter()
        src, total, largest = build(folder, a.layers, a.d, a.f)
        print(f"model: {a.layers} layers, d={a.d}, f={a.f}: {total / GIB:.2f} GiB fp16 in external data, "
              f"largest tensor {largest / MIB:.0f} MiB (built in {time.perf_counter() - t0:.0f} s)")
        dst = os.path.join(folder, "model.nf4.onnx")
        peak, wall, log = run_cli(["rewrite", src, dst, "--weights", "nf4"])
        out_bytes = os.path.getsize(dst) + os.path.getsize(dst + ".data")
        target = 2 * largest + GIB
        print(log.strip().splitlines()[1] if len(log.strip().splitlines()) > 1 else "")
        print(f"rewrite --weights nf4: peak RSS {peak / GIB:.2f} GiB ({peak / MIB:.0f} MiB), target <= 2 x "
              f"{largest / MIB:.0f} MiB + 1 GiB = {target / GIB:.2f} GiB: {'OK' if peak <= target else 'OVER'}; "
              f"wall {wall:.0f} s")
        print(f"output: {out_bytes / GIB:.3f} GiB ({out_bytes / total:.3f}x of the input)")
        ipeak, iwall, _ = run_cli(["inspect", src, "--weights", "nf4"])
        print(f"inspect --weights nf4: peak RSS {ipeak / GIB:.2f} GiB ({ipeak / MIB:.0f} MiB): "
              f"{'OK' if ipeak <= target else 'OVER'}; wall {iwall:.0f} s")
        return 0 if max(peak, ipeak) <= target else 1
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

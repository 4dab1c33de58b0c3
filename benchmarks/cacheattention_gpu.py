"""CacheAttention's decode kernels at genai's decode shape, one after the other in one process, for ncu to time
(issue 32): the routed warp kernel (cacheattention.warps) and the first kernel (cacheattention.split), each launched
--launches times through the kernel object as a session node runs it (runtime/direct.call), past and present one
buffer as genai binds them. Python's launch cost hides the kernels' own time from host timers, hence ncu:

    PYTHONPATH=/tmp/site:. ncu --kernel-name regex:kernel --metrics gpu__time_duration.sum \\
        python3 benchmarks/cacheattention_gpu.py [--keys 201,1001] [--heads 16] [--dim 128] [--length 2048]

Prints which route each group of launches ran; ncu prints their durations in the same order. ``--prompt N``: a
first prompt of N tokens through the tensor-core route, then the rows route, instead (``--routes tc`` for one);
``--nsm N,...``: the tensor-core route once per round length of its block order (the device's SM count is the
default; 1 orders the tiles heaviest first without turning back). ``--decode warps`` times the warp kernel alone;
``--g G --nsplit N`` build it with G loads per lane in flight and N blocks per query row instead of the module's
(one setting per process).
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="201,1001", help="keys in the cache per call (comma-separated)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=2048, help="the cache buffer's positions (genai's max_length)")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=0,
                    help="time a first prompt of this many tokens instead (routes cacheattention.tc and .rows)")
    ap.add_argument("--routes", default="tc,rows", help="the prompt routes to time (comma-separated)")
    ap.add_argument("--nsm", default="", help="tc route: round lengths of its block order to time (comma-separated)")
    ap.add_argument("--decode", default="warps,split", help="the decode routes to time (comma-separated)")
    ap.add_argument("--g", type=int, default=0, help="decode kernel: G (loads per lane in flight), 0: the module's")
    ap.add_argument("--nsplit", type=int, default=0, help="decode kernel: blocks per query row, 0: the module's")
    a = ap.parse_args(argv)
    from onnx_lowbit.custom_ops.attention import cacheattention_cuda as kmod
    for name, v in (("G", a.g), ("NSPLIT", a.nsplit)):
        if v > 0:
            setattr(kmod, name, v)      # read when the kernel is built
    print(f"decode kernel: G = {kmod.G}, NSPLIT = {kmod.NSPLIT}", flush=True)
    if a.prompt and a.nsm:
        from onnx_lowbit.custom_ops.device import host
        for v in a.nsm.split(","):
            host.sm_count = lambda v=int(v): v      # what the kernel object reads when a call builds it
            run_group(a, ("cacheattention.tc",), a.prompt, a.prompt,
                      f" (2 launches each): a {a.prompt}-token prompt, block rounds of {v}")
        return
    if a.prompt:
        groups = [(("cacheattention." + r,), a.prompt, a.prompt,
                   f" (2 launches each): a {a.prompt}-token prompt") for r in a.routes.split(",")]
    else:
        groups = [((name, "cacheattention.rows"), 1, int(keys), f": {keys} keys in a {a.length}-position cache")
                  for keys in a.keys.split(",") for name in ("cacheattention." + r for r in a.decode.split(","))]
    for kernels, s, keys, what in groups:
        run_group(a, kernels, s, keys, what)


def run_group(a, kernels, s, keys, what):
    """``a.launches`` calls of s new tokens with ``keys`` keys in the cache after them, routed to ``kernels`` only
    (the first one named runs), through the kernel object as a session node runs it, past and present one buffer."""
    from numba import cuda

    from onnx_lowbit.custom_ops.attention import cacheattention_cuda as kmod
    from onnx_lowbit.custom_ops.runtime import direct
    rng = np.random.default_rng(0)
    h, d, length = a.heads, a.dim, a.length
    full = kmod.ROUTES
    kmod.ROUTES = tuple(r for r in full if r.kernel in kernels)
    try:
        dev = lambda *shape: cuda.to_device(rng.standard_normal(shape).astype(np.float16))  # noqa: E731
        qkv, pk, pv = dev(1, s, 3 * h * d), dev(1, h, length, d), dev(1, h, length, d)
        cs, sn = dev(length, d // 2), dev(length, d // 2)
        sl = cuda.to_device(np.array([keys - 1], np.int32))
        o = cuda.device_array((1, s, h * d), np.float16)
        run = direct.call("CacheAttention", dict(num_heads=h, kv_num_heads=h, share_buffer=1),
                          [qkv, pk, pv, sl, cs, sn], [o, pk, pv], 0)
        for _ in range(a.launches):
            run()
        cuda.synchronize()
    finally:
        kmod.ROUTES = full
    print(f"ran {kernels[0]} x{a.launches}{what}, {h} heads, D = {d}", flush=True)


if __name__ == "__main__":
    main()

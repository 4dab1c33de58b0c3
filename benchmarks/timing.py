"""The one timing and reporting module of the benchmarks (torch CUDA events; times in microseconds).

time_cuda     CUDA events around batches of back-to-back calls, after warm-up: median (and p90)
time_graph    the same calls captured into one CUDA graph and replayed: median (and p90)
copy_gbps     the device-to-device copy bandwidth the kernels are compared with; pct_of_copy
time_wall     wall time per call (onnxruntime run_with_iobinding): median, p90
time_session  one onnx_lowbit CUDA session with IOBinding; compare_sessions: an unfused and a fused model, with
              and without CUDA graphs, checked, then timed
print_table   a markdown table; write_json: the results for --json
"""
from __future__ import annotations

import statistics

BATCH = 20
COPY_BYTES = 2 * (256 << 20)   # bytes one 256 MiB device-to-device copy moves (read + write)


def _stats(ts, p90):
    return (statistics.median(ts), _p90(ts)) if p90 else statistics.median(ts)


def _p90(ts):
    import numpy as np
    return float(np.percentile(ts, 90))


def time_cuda(fn, iters=30, warmup=5, batch=BATCH, p90=False):
    """Median device time per call in us: CUDA events around ``batch`` back-to-back calls, so host-side launch
    cost overlaps the previous kernel as in a real pipeline (it would otherwise be counted as GPU time).
    ``p90``: (median, p90) over the ``iters`` batches."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / batch)
    return _stats(ts, p90)


def time_graph(fn, iters=30, batch=BATCH, p90=False):
    """Median time per call in us of ``batch`` calls captured into one CUDA graph and replayed (``p90``: (median,
    p90))."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):     # the warm-up's stream: per-stream buffers a kernel made there serve
        # the capture too (an allocation during capture would fail)
        for _ in range(batch):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / batch)
    return _stats(ts, p90)


def copy_gbps(graph=False, mib=256):
    """(GB/s, us per copy) of a ``mib`` MiB device-to-device copy (read + write counted; 256 MiB: COPY_BYTES): the
    bandwidth the benchmarks compare their kernels with. ``graph``: timed with time_graph (as dequant_gpu times its
    kernels), else with time_cuda (the figure the other benchmarks print)."""
    import torch
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = (time_graph if graph else time_cuda)(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3, us


def pct_of_copy(nbytes, us, gbps):
    """Percentage of the copy bandwidth ``gbps`` that moving ``nbytes`` in ``us`` microseconds reaches."""
    return 100.0 * nbytes / us / 1e3 / gbps


def time_wall(fn, runs, warmup=0):
    """(median, p90) wall time per call in us of ``fn()`` (e.g. one onnxruntime ``run_with_iobinding``), after
    ``warmup`` untimed calls."""
    import time

    import numpy as np
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts), float(np.percentile(ts, 90))


def print_table(headers, rows, numeric=None):
    """Print a markdown table; ``numeric``: the columns to right-align (default: all but the first)."""
    numeric = range(1, len(headers)) if numeric is None else numeric
    print("| " + " | ".join(str(h) for h in headers) + " |")
    print("| " + " | ".join("---:" if i in numeric else "---" for i in range(len(headers))) + " |")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |", flush=True)


def write_json(path, obj, **kw):
    """Write ``obj`` as indented JSON to ``path`` (nothing when ``path`` is empty: --json not given)."""
    if not path:
        return
    import json
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, **kw)


def bind_io(sess, feeds, out_like):
    """(IOBinding, output OrtValues) of an onnxruntime session: ``feeds`` (name -> array) copied to device buffers,
    every output bound to a device buffer shaped and typed like the array ``out_like``."""
    import onnxruntime as ort
    io = sess.io_binding()
    for n, a in feeds.items():
        io.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0))
    outs = []
    for o in sess.get_outputs():
        v = ort.OrtValue.ortvalue_from_shape_and_type(out_like.shape, out_like.dtype, "cuda", 0)
        io.bind_ortvalue_output(o.name, v)
        outs.append(v)
    return io, outs


def time_session(model, feeds, runs, cuda_graph, out_like):
    """(median us, p90 us, first run's outputs) of run_with_iobinding on an onnx_lowbit CUDA session of ``model``
    (ModelProto) with ``feeds`` bound as device buffers and every output bound to a device buffer shaped and typed
    like the array ``out_like``; 30 untimed runs first (with ``cuda_graph``: capture and replays)."""
    import onnx_lowbit
    prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if cuda_graph else {}), "CPUExecutionProvider"]
    sess = onnx_lowbit.InferenceSession(model.SerializeToString(), providers=prov)
    io, outs = bind_io(sess, feeds, out_like)
    sess.run_with_iobinding(io)
    ys = [o.numpy() for o in outs]
    for _ in range(30):
        sess.run_with_iobinding(io)
    med, p90 = time_wall(lambda: sess.run_with_iobinding(io), runs)
    return med, p90, ys


def compare_sessions(cases, runs, key, check, label="case"):
    """For each (name, unfused model, fused model, feeds, out_like) in ``cases``: both models as CUDA sessions
    (time_session), without and with CUDA graphs; ``check(unfused outputs, fused outputs)`` raises if they differ,
    before the times count. Prints one line per case and mode; returns the rows ({label, cuda_graph, unfused_us,
    unfused_p90, <key>_us, <key>_p90}) for write_json."""
    rows = []
    print(f"{label:>24} {'graph':>5} {'unfused us':>11} {key + ' us':>14} {'speed-up':>8}")
    for name, unfused, fused, feeds, out_like in cases:
        for graph in (False, True):
            tu, pu, yu = time_session(unfused, feeds, runs, graph, out_like)
            tf, pf, yf = time_session(fused, feeds, runs, graph, out_like)
            check(yu, yf)
            rows.append({label: name, "cuda_graph": graph, "unfused_us": tu, "unfused_p90": pu, f"{key}_us": tf,
                         f"{key}_p90": pf})
            print(f"{str(name):>24} {'yes' if graph else 'no':>5} {tu:11.1f} {tf:14.1f} {tu / tf:7.2f}x", flush=True)
    return rows

"""Timing helpers shared by the GPU benchmarks (torch CUDA events; medians in microseconds)."""
from __future__ import annotations

import statistics

BATCH = 20
COPY_BYTES = 2 * (256 << 20)   # bytes one 256 MiB device-to-device copy moves (read + write)


def time_cuda(fn, iters=30, warmup=5, batch=BATCH):
    """Median device time per call in us: CUDA events around ``batch`` back-to-back calls, so host-side launch
    cost overlaps the previous kernel as in a real pipeline (it would otherwise be counted as GPU time)."""
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
    return statistics.median(ts)


def time_graph(fn, iters=30, batch=BATCH):
    """Median time per call in us of ``batch`` calls captured into one CUDA graph and replayed."""
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
    return statistics.median(ts)


def copy_gbps(graph=False):
    """(GB/s, us per copy) of a 256 MiB device-to-device copy (COPY_BYTES moved): the bandwidth the benchmarks
    compare their kernels with. ``graph``: timed with time_graph (as dequant_gpu times its kernels), else with
    time_cuda (the figure the other benchmarks print)."""
    import torch
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = (time_graph if graph else time_cuda)(lambda: dst.copy_(src))
    return COPY_BYTES / us / 1e3, us


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


def time_session(model, feeds, runs, cuda_graph, out_like):
    """(median us, p90 us, first run's outputs) of run_with_iobinding on an onnx_lowbit CUDA session of ``model``
    (ModelProto) with ``feeds`` bound as device buffers and every output bound to a device buffer shaped and typed
    like the array ``out_like``; 30 untimed runs first (with ``cuda_graph``: capture and replays)."""
    import onnxruntime as ort

    import onnx_lowbit
    prov = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if cuda_graph else {}), "CPUExecutionProvider"]
    sess = onnx_lowbit.InferenceSession(model.SerializeToString(), providers=prov)
    io = sess.io_binding()
    for n, a in feeds.items():
        io.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0))
    outs = []
    for o in sess.get_outputs():
        v = ort.OrtValue.ortvalue_from_shape_and_type(out_like.shape, out_like.dtype, "cuda", 0)
        io.bind_ortvalue_output(o.name, v)
        outs.append(v)
    sess.run_with_iobinding(io)
    ys = [o.numpy() for o in outs]
    for _ in range(30):
        sess.run_with_iobinding(io)
    med, p90 = time_wall(lambda: sess.run_with_iobinding(io), runs)
    return med, p90, ys

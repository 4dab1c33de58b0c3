"""Split-K state and handshake shared by the decode kernels that split K over blocks (AWQ, FusedFFN [K, N], the NF4
tensor-core kernels): ``arrive_last`` (a block publishes its partials and learns whether it is the last of its tile),
``sum_splits`` (the last block's deterministic sum of the partials), ``partial_floats`` (their size) and
``ScratchPool`` (a kernel object's tile counters and fallback partials, per CUDA stream)."""
from __future__ import annotations

import threading

import numpy as np
from numba import cuda, uint32, uint64

from .target import SIM, device, launch_cuda

if SIM:
    cuda = launch_cuda  # noqa: F811 - arrive_last's cuda.* after its last barrier: see target.launch_cuda

U0, U1, U2, U3, U4, U5, U6, U7, U8 = (np.uint64(v) for v in (0, 1, 2, 3, 4, 5, 6, 7, 8))
F0 = np.float32(0.0)


@(cuda.jit(device=True) if SIM else device)    # the simulator's cuda.threadfence exists inside cuda.jit functions
def arrive_last(cnt, ci, total, flag, leader):
    """Split-K: publish this block's partials (threadfence) and count its arrival at counter ``ci`` (the ``leader``
    thread); True in every thread of the block whose arrival is the ``total``-th, i.e. the last, after a
    threadfence so that the other blocks' partials are visible. ``flag``: a 1-word uint32 shared array."""
    cuda.threadfence()
    cuda.syncthreads()
    if leader:
        old = cuda.atomic.add(cnt, ci, uint32(1))
        flag[0] = uint32(1) if uint64(old) == total - U1 else uint32(0)
    cuda.syncthreads()
    last = flag[0] != uint32(0)
    if last:
        cuda.threadfence()
    return last


@device
def sum_splits(acc, i0, stride, splits):
    """acc[i0] + acc[i0 + stride] + ... (``splits`` terms), added one by one in split order (deterministic, the
    same bits as a plain loop), with 8 loads in flight at a time instead of one: the last block of a
    column tile reads its tile's partials from L2, and one load per add made that read a chain of L2 round trips
    (32 at the small shapes' 32 splits)."""
    tot = F0
    n = uint64(splits)
    sp = U0
    while sp + U8 <= n:                 # 8 independent loads, then the adds in order
        b = i0 + sp * stride
        v0 = acc[b]
        v1 = acc[b + stride]
        v2 = acc[b + U2 * stride]
        v3 = acc[b + U3 * stride]
        v4 = acc[b + U4 * stride]
        v5 = acc[b + U5 * stride]
        v6 = acc[b + U6 * stride]
        v7 = acc[b + U7 * stride]
        tot += v0
        tot += v1
        tot += v2
        tot += v3
        tot += v4
        tot += v5
        tot += v6
        tot += v7
        sp += U8
    while sp < n:
        tot += acc[i0 + sp * stride]
        sp += U1
    return tot


def _dptr(a):
    """The device address of a Numba device array (under the simulator: its host buffer's)."""
    return int(a._ary.ctypes.data if SIM else a.device_ctypes_pointer.value)


def partial_floats(splits, nw, m, n):
    """fp32 split-K partials one launch of a decode kernel (fp32 or tensor-core, ``nw`` weights) writes at M = m:
    splits x nw x M x N; none with a single split (the blocks then write the output directly)."""
    return splits * nw * m * n if splits > 1 else 0


class ScratchPool:
    """What a MatMulAWQ / FusedFFNAWQ kernel object keeps of its decode kernels' split-K state, per CUDA stream.

    * The tile counters (uint32, ``tiles`` of them: a few KB): zero when a launch starts and left zero by every
      launch (the last block of a tile resets its counter), so they carry from one call to the next and cannot be
      per-call scratch. One set per stream (runs on different streams never share one; the launches of one stream
      are ordered); the first is made at kernel creation, the others on a stream's first call (synchronously,
      before that call's launch). A native plan keeps them as kernel-owned state (the plan key holds the stream).
    * The fp32 partials only for calls without onnxruntime's scratch (``Context.has_scratch`` false: onnxruntime
      older than 1.18): ``size`` floats (the largest M's need) per stream, made on its first such call and never
      replaced, so a native plan may keep it too. Sessions on onnxruntime >= 1.18 take the partials per call from
      onnxruntime's allocator (``partials``) and this buffer is never made."""

    def __init__(self, size, tiles):
        self.size, self.tiles = max(size, 1), max(tiles, 1)
        self._lock = threading.Lock()
        self._first = self._zeros()
        self._cnt = {}      # stream -> device array of counters
        self._acc = {}      # stream -> device array of partials (calls without onnxruntime's scratch only)

    def _zeros(self):
        return cuda.to_device(np.zeros(self.tiles, np.uint32))

    def counters(self, stream):
        """(device pointer, shape) of ``stream``'s tile counters."""
        c = self._cnt.get(stream)
        if c is None:
            with self._lock:
                c = self._cnt.get(stream)
                if c is None:
                    c = self._cnt[stream] = self._first if not self._cnt else self._zeros()
        return _dptr(c), (self.tiles,)

    def partials(self, ctx, floats):
        """(device pointer, shape) of this call's ``floats`` fp32 partials: onnxruntime's per-call scratch
        (``ctx.scratch``: a native plan records it as the call's scratch and takes a new one per replay) when
        ``ctx.has_scratch``, else the stream's own buffer; a null pointer when the launch needs none (one split)."""
        if floats == 0:
            return 0, (0,)
        if ctx.has_scratch:
            return ctx.scratch(4 * floats), (floats,)
        if floats > self.size:
            raise RuntimeError(f"split-K partials of {floats} floats exceed the kernel's {self.size}")
        a = self._acc.get(ctx.stream)
        if a is None:
            with self._lock:
                a = self._acc.get(ctx.stream)
                if a is None:
                    a = self._acc[ctx.stream] = cuda.device_array(self.size, np.float32)
        return _dptr(a), (floats,)

    def owned_partials(self):
        """Streams that have partials of this pool's own (tests: none in sessions with onnxruntime's scratch)."""
        return len(self._acc)

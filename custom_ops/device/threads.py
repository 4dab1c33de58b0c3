"""CPU kernels split over threads without Numba's parallel loops: ``run_ranges(fn, args_for, split(total))`` calls
``fn(*args_for(start, end))`` for PER_THREAD contiguous ranges per thread, claimed one at a time by the calling
thread and a small pool of Python threads (the kernels are ``nogil`` Numba functions, so the ranges run at once),
and returns when all are done. ``threads()`` is how many threads a call may use: Numba's thread count
(NUMBA_NUM_THREADS, numba.set_num_threads). Ranges are claimed rather than handed out so that on a loaded machine a
pool thread that is not scheduled does not hold the call up (static halves did: 2 threads ran 10-100x slower).

Why not ``prange``: on this project's 2-core CI machine Numba's parallel loops ran the FPLUT and 4-bit bodies
2.5-3x slower per element even with one thread (the body's arrays lose the contiguity LLVM needs to vectorise);
serial kernels over contiguous parts keep the vectorised code. The pool threads sleep on a queue between calls
(nothing spins after a call). Used by fplut/, nf4/, awq/ and ffn/'s 4-bit CPU faces.
"""
from __future__ import annotations

import threading

import numba

PER_THREAD = 4      # ranges per thread
_POOL = []
_LOCK = threading.Lock()


def threads() -> int:
    return max(1, int(numba.get_num_threads()))


def _pool():
    if not _POOL:
        with _LOCK:
            if not _POOL:
                from concurrent.futures import ThreadPoolExecutor
                _POOL.append(ThreadPoolExecutor(max_workers=max(1, numba.config.NUMBA_NUM_THREADS - 1),
                                                thread_name_prefix="onnx_lowbit_cpu"))
    return _POOL[0]


def run_ranges(fn, args_for, bounds):
    """fn(*args_for(start, end)) for every (start, end) in ``bounds``, the ranges claimed one at a time by this
    thread and by threads() - 1 pool threads; returns when every range is done. A pool thread the OS has not
    scheduled yet (a loaded machine) claims nothing and holds nothing up: this thread does the work instead."""
    n = len(bounds)
    helpers = min(threads(), n) - 1
    if helpers <= 0:
        for lo, hi in bounds:
            fn(*args_for(lo, hi))
        return
    lock = threading.Lock()
    finished = threading.Event()
    state = [0, 0]              # next range to claim, ranges done
    errors = []

    def work():
        while True:
            with lock:
                i = state[0]
                if i >= n:
                    return
                state[0] = i + 1
            try:
                fn(*args_for(*bounds[i]))
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(e)
            with lock:
                state[1] += 1
                if state[1] == n:
                    finished.set()

    pool = _pool()
    for _ in range(helpers):
        pool.submit(work)
    work()
    finished.wait()
    if errors:
        raise errors[0]


def split(total: int, align: int = 1, per_thread: int = PER_THREAD):
    """Ranges for run_ranges: threads() * per_thread contiguous ranges over [0, total) (starts multiples of
    ``align``), or one range when there is one thread."""
    parts = threads() * per_thread if threads() > 1 else 1
    parts = max(1, min(parts, -(-total // align)))
    return [r for r in ranges(total, parts, align) if r[1] > r[0]]


def ranges(total: int, parts: int, align: int = 1):
    """``parts`` contiguous [start, end) ranges covering [0, total), each start a multiple of ``align``."""
    per = -(-total // parts)
    per = -(-per // align) * align
    return [(min(total, i * per), min(total, (i + 1) * per)) for i in range(parts)]

"""CPU kernels split over threads without Numba's parallel loops: ``run_parts(fn, args_for, parts)`` calls
``fn(*args_for(i))`` for every part i, the first part on the calling thread and the others on a small pool of Python
threads (the kernels are ``nogil`` Numba functions, so the parts run at once), and returns when all are done.
``threads()`` is how many parts a call may use: Numba's thread count (NUMBA_NUM_THREADS, numba.set_num_threads).

Why not ``prange``: on this project's 2-core CI machine Numba's parallel loops ran the FPLUT and 4-bit bodies
2.5-3x slower per element even with one thread (the body's arrays lose the contiguity LLVM needs to vectorise);
serial kernels over contiguous parts keep the vectorised code. The pool threads sleep on a queue between calls
(nothing spins after a call). Used by fplut/, nf4/, awq/ and ffn/'s 4-bit CPU faces.
"""
from __future__ import annotations

import threading

import numba

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


def run_parts(fn, args_for, parts: int):
    """fn(*args_for(i)) for i in range(parts); part 0 on this thread."""
    if parts <= 1:
        fn(*args_for(0))
        return
    futs = [_pool().submit(fn, *args_for(i)) for i in range(1, parts)]
    try:
        fn(*args_for(0))
    finally:
        for f in futs:
            f.result()


def ranges(total: int, parts: int, align: int = 1):
    """``parts`` contiguous [start, end) ranges covering [0, total), each start a multiple of ``align``."""
    per = -(-total // parts)
    per = -(-per // align) * align
    return [(min(total, i * per), min(total, (i + 1) * per)) for i in range(parts)]

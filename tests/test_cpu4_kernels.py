"""The 4-bit CPU products (MatMulNF4 / FusedFFNNF4: nf4/matmulnf4_cpu.product; MatMulAWQ / FusedFFNAWQ:
awq/matmulawq_cpu.product) called directly on every path: NF4's vector-permute kernels (M = 1 fused dot, M > 1
chunked decode) and its scalar kernel (K not a multiple of the block), AWQ's M = 1 and M > 1 loops, tile and
row-block remainders, NaN / Inf rows of A, the column split over threads (bit-identical with one thread), and no
CPU burnt after a call (no spinning BLAS or thread pool). Tolerances as test_nf4_kernels / test_awq_kernels."""
import resource
import time

import numpy as np
import pytest

from onnx_lowbit import nf4
from onnx_lowbit.custom_ops.awq import matmulawq_cpu
from onnx_lowbit.custom_ops.awq.dequantawq_cpu import parse_attrs
from onnx_lowbit.custom_ops.nf4 import matmulnf4_cpu

from test_awq_kernels import exact_ref, weights


def _nf4(k, n, bs, seed=0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    q, am = nf4.quantize(w, "nf4", bs)
    return q, am, np.ascontiguousarray(nf4.code("nf4"), dtype=np.float32)


def _rel(y, ref):
    return np.abs(y.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12)


def _split(monkeypatch, parts):
    monkeypatch.setattr(matmulnf4_cpu.threads, "threads", lambda: parts)
    monkeypatch.setattr(matmulnf4_cpu, "PARALLEL_MIN_MACS", 0)
    monkeypatch.setattr(matmulawq_cpu, "PARALLEL_MIN_MACS", 0)


@pytest.mark.parametrize("k,n,bs", [(256, 36, 64), (2304, 20, 256), (64, 8, 32), (200, 12, 64), (80, 9, 32),
                                    (352, 13, 64), (1120, 10, 256)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_nf4_product_vs_reference(k, n, bs, m):
    """(256, 64), (2304, 256: chunks of 1024 + 256), (64, 32): the permute kernels where AVX-512 is there;
    K = 200 and 80 (blocks straddling rows of W^T): the scalar kernel; K = 352, 1120 (straddling, 32 | K): the
    permute kernels with one absmax per 32 elements (pieces_path)."""
    q, am, code = _nf4(k, n, bs)
    a = (np.random.default_rng(m).standard_normal((m, k)) + 0.3).astype(np.float32)
    y = matmulnf4_cpu.product(a, q, am, code, k, n, bs)
    ref = nf4.matmul(a, q, am, "nf4", bs, k, n).astype(np.float64)
    assert _rel(y, ref) <= 1e-5


@pytest.mark.skipif(not matmulnf4_cpu.FAST, reason="the permute kernels need AVX-512")
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("k,pieces", [(512, False), (352, True)])
def test_nf4_fast_and_scalar_paths_agree(m, k, pieces, monkeypatch):
    n, bs = 24, 64
    q, am, code = _nf4(k, n, bs, seed=2)
    a = np.random.default_rng(9).standard_normal((m, k)).astype(np.float32)
    assert matmulnf4_cpu.fast_path(k, bs) != pieces and matmulnf4_cpu.pieces_path(k, bs) == pieces
    fast = matmulnf4_cpu.product(a, q, am, code, k, n, bs)
    monkeypatch.setattr(matmulnf4_cpu, "FAST", False)
    scalar = matmulnf4_cpu.product(a, q, am, code, k, n, bs)
    assert _rel(fast, scalar.astype(np.float64)) <= 1e-5


@pytest.mark.parametrize("k,bs", [(256, 64), (200, 64)])
@pytest.mark.parametrize("m", [1, 4])
def test_nf4_nan_inf_rows(k, bs, m):
    n = 16
    q, am, code = _nf4(k, n, bs, seed=4)
    a = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    a[0, 3] = np.nan
    if m > 1:
        a[1, 5] = np.inf
    y = matmulnf4_cpu.product(a, q, am, code, k, n, bs)
    ref = nf4.matmul(a, q, am, "nf4", bs, k, n).astype(np.float64)
    assert np.array_equal(np.isnan(y), np.isnan(ref)) and np.array_equal(np.isinf(y), np.isinf(ref))
    fin = np.isfinite(ref)
    assert np.isnan(y[0]).all()
    if fin.any():
        assert np.abs(y[fin] - ref[fin]).max() <= 1e-5 * np.abs(ref[fin]).max()


@pytest.mark.parametrize("m", [1, 6])
def test_nf4_split_is_bit_identical(m, monkeypatch):
    k, n, bs = 256, 40, 64
    q, am, code = _nf4(k, n, bs, seed=5)
    a = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    one = matmulnf4_cpu.product(a, q, am, code, k, n, bs)
    _split(monkeypatch, 3)
    assert np.array_equal(matmulnf4_cpu.product(a, q, am, code, k, n, bs), one)


@pytest.mark.parametrize("K,N,G", [(256, 64, 64), (200, 2056, 64), (130, 16, 128)])  # noqa: N803
@pytest.mark.parametrize("m", [1, 2, 9, 24])
def test_awq_product_vs_reference(K, N, G, m):  # noqa: N803
    """K not a multiple of G (200, 130), N past one tile of 256 words (2056 = 257 words), rows past a block of 8
    (9, 24), one group narrower than 4 rows of W (130 = 128 + 2)."""
    qw, qz, sc = weights(K, N, G, seed=7)
    a = (np.random.default_rng(m).standard_normal((m, K)) + 0.3).astype(np.float32)
    y = matmulawq_cpu.product(a, qw, qz, sc, parse_attrs({"group_size": G, "K": K, "N": N}))
    ref, e = exact_ref(a, qw, qz, sc, G, K, N)
    assert np.all(np.abs(y.astype(np.float64) - ref) <= 2.0 ** -18 * e)


@pytest.mark.parametrize("m", [1, 3])
def test_awq_nan_inf_rows_and_split(m, monkeypatch):
    K, N, G = 256, 264, 64  # noqa: N806
    qw, qz, sc = weights(K, N, G, seed=8)
    sh = parse_attrs({"group_size": G, "K": K, "N": N})
    a = np.random.default_rng(3).standard_normal((m, K)).astype(np.float32)
    a[0, 7] = np.nan
    if m > 1:
        a[2, 1] = -np.inf
    y = matmulawq_cpu.product(a, qw, qz, sc, sh)
    ref, e = exact_ref(a, qw, qz, sc, G, K, N)
    # rows 0 and 2 hold NaN / -Inf: every output of theirs is non-finite (the zero correction s (sum x*q - z sum x)
    # turns Inf into NaN; test_ffn4_kernels' _check_nonfinite asks the same), the other rows within the bound
    assert not np.isfinite(y[0]).any()
    if m > 1:
        assert not np.isfinite(y[2]).any() and np.all(np.abs(y[1] - ref[1]) <= 2.0 ** -18 * e[1])
    _split(monkeypatch, 2)
    assert np.array_equal(matmulawq_cpu.product(a, qw, qz, sc, sh), y, equal_nan=True)


def _cpu_while_idle(seconds=0.3):
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


_IDLE_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import test_cpu4_kernels as t
from onnx_lowbit.custom_ops.awq import matmulawq_cpu
from onnx_lowbit.custom_ops.awq.dequantawq_cpu import parse_attrs
from onnx_lowbit.custom_ops.nf4 import matmulnf4_cpu
matmulnf4_cpu.threads.threads = lambda: 2
matmulnf4_cpu.PARALLEL_MIN_MACS = matmulawq_cpu.PARALLEL_MIN_MACS = 0
k, n = 512, 256
q, am, code = t._nf4(k, n, 64)
qw, qz, sc = t.weights(k, n, 64, seed=9)
a = np.random.default_rng(0).standard_normal((24, k)).astype(np.float32)
for _ in range(3):
    matmulnf4_cpu.product(a, q, am, code, k, n, 64)
    matmulawq_cpu.product(a, qw, qz, sc, parse_attrs({"group_size": 64, "K": k, "N": n}))
print(t._cpu_while_idle())
"""


def test_nothing_spins_after_the_products():
    """After M = 24 products (the former path used numpy's BLAS there; OpenBLAS's threads then spun ~0.1 CPU-s
    per 0.5 s) and the split over threads, the process burns (almost) no CPU while it sleeps. In a fresh process:
    in the suite's worker, thread pools that earlier tests left (onnxruntime sessions, BLAS) would be counted."""
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _IDLE_CHILD, tests], capture_output=True, text=True, timeout=600,
                       env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert float(p.stdout.split()[-1]) < 0.03


def test_run_ranges_does_not_wait_for_a_busy_pool(monkeypatch):
    """Every pool thread busy (as when the OS does not schedule them): the calling thread claims every range and
    returns without waiting for them."""
    import threading

    from onnx_lowbit.custom_ops.device import threads
    monkeypatch.setattr(threads, "threads", lambda: 2)
    pool, gate = threads._pool(), threading.Event()
    blockers = [pool.submit(gate.wait) for _ in range(pool._max_workers)]
    try:
        done = []
        bounds = threads.split(1000, 8)
        assert len(bounds) == 2 * threads.PER_THREAD
        threads.run_ranges(lambda lo, hi: done.append((lo, hi)), lambda lo, hi: (lo, hi), bounds)
        assert done == bounds and all(not b.done() for b in blockers)
    finally:
        gate.set()


@pytest.mark.parametrize("k,n,bs", [(100, 3, 64), (256, 8, 128), (64, 1, 32)])
@pytest.mark.parametrize("transposed", [False, True])
def test_nf4_dequantize_bit_exact(k, n, bs, transposed):
    """DequantNF4's host entry (the vector-permute flat decode on AVX-512 CPUs, the tail block by lookups):
    bit-exact with the reference, a last partial block included (100 x 3 = 4 blocks of 64 + 44)."""
    from onnx_lowbit.custom_ops.nf4 import dequantnf4_cpu
    q, am, code = _nf4(k, n, bs, seed=11)
    for adt in (np.float32, np.float16):
        w = dequantnf4_cpu.dequantize(q, am.astype(adt), code, k, n, bs, transposed)
        ref = nf4.dequantize(q, am.astype(adt).astype(np.float32), "nf4", bs, k, n, np.float32).astype(adt)
        assert w.dtype == adt and np.array_equal(w, ref.T if transposed else ref)

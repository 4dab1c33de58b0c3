"""FPLUT CPU kernels (custom_ops/fplut/fplut_cpu.py) called directly, serial and split over threads, bit-exact
with the numpy reference on every kind of input: random bit patterns (NaN payloads, +-Inf, subnormals, values
past the fp16 range), the rounding boundaries of fp32 -> fp16, odd sizes around the chunk length."""
import numpy as np
import pytest

from onnx_lowbit import fplut, halfbits
from onnx_lowbit.custom_ops.fplut import fplut_cpu

from helpers import SEED, seed_table

SIZES = [1, 7, fplut_cpu.CHUNK - 1, fplut_cpu.CHUNK, fplut_cpu.CHUNK + 1, 3 * fplut_cpu.CHUNK + 5, 20011]


def _map():
    return fplut.expand_table(SEED, seed_table().values)


def _run(key, which, x_bits, table):
    serial, parallel, bits = fplut_cpu.KERNELS[key]
    out = np.empty_like(x_bits)
    (serial if which == "serial" else parallel)(x_bits, table, out)
    return out


@pytest.mark.parametrize("which", ["serial", "split"])
@pytest.mark.parametrize("n", SIZES)
def test_fp32_random_bits(which, n):
    rng = np.random.default_rng(n)
    b = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    b[: min(n, 6)] = np.array([0x7FC00000, 0xFF800000, 0x7F800000, 0x00000001, 0x477FF000, 0xFFC12345],
                              np.uint32)[: min(n, 6)]
    ref = fplut.apply(b.view(np.float32), SEED, seed_table().values)
    assert np.array_equal(_run(np.dtype(np.float32), which, b, _map()), ref.view(np.uint32))


@pytest.mark.parametrize("which", ["serial", "split"])
def test_fp32_rounding_boundaries(which):
    """Every fp16 value and the fp32 values half an fp16 ulp around it (ties to even), both signs: the
    branch-free fp32 -> fp16 index against the reference's numpy cast."""
    h = halfbits.all_fp16()
    h = h[np.isfinite(h)].astype(np.float32).view(np.uint32)
    b = np.concatenate([h + d for d in (np.uint32(0), np.uint32(0xFFF), np.uint32(0x1000), np.uint32(0x1001))]
                       + [h - np.uint32(1)])
    b = np.concatenate([b, b ^ np.uint32(0x80000000)])
    ref = fplut.apply(b.view(np.float32), SEED, seed_table().values)
    assert np.array_equal(_run(np.dtype(np.float32), which, b, _map()), ref.view(np.uint32))


@pytest.mark.parametrize("which", ["serial", "split"])
@pytest.mark.parametrize("n", [1, fplut_cpu.CHUNK + 1, 1 << 16])
def test_fp16_and_bf16_all_patterns(which, n):
    x = np.resize(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16), n)
    np.random.default_rng(n).shuffle(x)
    ref16 = fplut.apply(x.view(np.float16), SEED, seed_table().values).view(np.uint16)
    assert np.array_equal(_run(np.dtype(np.float16), which, x, _map()), ref16)
    refb = fplut.apply(x, SEED, seed_table().values, bf16=True)
    assert np.array_equal(_run("bf16", which, x, _map()), refb)


def test_split_uses_the_threads_and_agrees(monkeypatch):
    """The split path with 1 thread is the serial kernel; with 2 it covers the tensor in 2 x PER_THREAD ranges
    whose starts are whole chunks."""
    x = (np.random.default_rng(3).standard_normal(50_000) * 8).astype(np.float32).view(np.uint32)
    want = _run(np.dtype(np.float32), "serial", x, _map())
    calls = []
    serial = fplut_cpu._SERIAL[np.dtype(np.float32)]
    run = fplut_cpu.split(lambda a, t, o: (calls.append(a.size), serial(a, t, o)))
    for threads in (1, 2):
        calls.clear()
        monkeypatch.setattr(fplut_cpu.threads, "threads", lambda t=threads: t)
        out = np.empty_like(x)
        run(x, _map(), out)
        assert np.array_equal(out, want)
        if threads == 1:
            assert calls == [x.size]
        else:
            assert len(calls) == 2 * fplut_cpu.threads.PER_THREAD and sum(calls) == x.size
            assert sorted(calls)[1:] == [6656] * 7                          # whole chunks but the last range

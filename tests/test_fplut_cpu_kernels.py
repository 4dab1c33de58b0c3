"""FPLUT CPU kernels (custom_ops/fplut/fplut_cpu.py) called directly, serial and split over threads, bit-exact
with the numpy reference on every kind of input: random bit patterns (NaN payloads, +-Inf, subnormals, values
past the fp16 range), the rounding boundaries of fp32 -> fp16, odd sizes around the chunk length; both paths (the
AVX-512 one where the CPU has it, the portable one everywhere), with and without non-temporal stores, into outputs
at every alignment."""
import numpy as np
import pytest

from onnx_lowbit import fplut, halfbits
from onnx_lowbit.custom_ops.fplut import fplut_cpu

from helpers import SEED, seed_table

SIZES = [1, 7, fplut_cpu.CHUNK - 1, fplut_cpu.CHUNK, fplut_cpu.CHUNK + 1, 3 * fplut_cpu.CHUNK + 5, 20011]


PATHS = ["portable"] + (["avx512"] if fplut_cpu.FAST else [])


def _map():
    return fplut.expand_table(SEED, seed_table().values)


def _run(key, which, x_bits, table=None):
    serial, parallel, bits = fplut_cpu.KERNELS[key]
    out = np.empty_like(x_bits)
    table = fplut_cpu.kernel_table(_map() if table is None else table, key)
    (serial if which == "serial" else parallel)(x_bits, table, out)
    return out


def _path(key, path, x_bits, stream=False, offset=0):
    """The serial kernel of ``path`` into an output starting ``offset`` elements into a fresh buffer."""
    serial = (fplut_cpu.AVX512 if path == "avx512" else fplut_cpu.PORTABLE)[key]
    buf = np.full(x_bits.size + 64, 0x5A5A, x_bits.dtype)
    out = buf[offset:offset + x_bits.size]
    serial(x_bits, fplut_cpu.kernel_table(_map(), key), out, stream)
    assert np.all(buf[:offset] == 0x5A5A) and np.all(buf[offset + x_bits.size:] == 0x5A5A)   # nothing else written
    return out


def _fp32_inputs(n, seed):
    """Random fp32 bits of every kind: normal values in and past the fp16 range, fp16 subnormal range, fp32
    subnormals, exact fp16 values and the ties half an fp16 ulp around them, NaN (payloads, both signs), +-Inf."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32),
             (rng.standard_normal(n) * 4).astype(np.float32).view(np.uint32),
             (rng.standard_normal(n) * 1e-6).astype(np.float32).view(np.uint32),              # fp16 subnormals
             rng.integers(1, 1 << 23, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)]
    h = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)].astype(np.float32).view(np.uint32)
    parts += [h, h + np.uint32(0x1000), h - np.uint32(0x1000), h + np.uint32(0x0FFF)]                # ties
    b = np.concatenate(parts)
    b = b[rng.permutation(b.size)][:n]
    b[: min(n, 8)] = np.array([0x7FC00000, 0xFF800000, 0x7F800000, 0x00000001, 0x477FF000, 0xFFC12345, 0x7F800001,
                               0x80000000], np.uint32)[: min(n, 8)]
    return b


def _ref(key, x_bits):
    if key == "bf16":
        return fplut.apply(x_bits, SEED, seed_table().values, bf16=True)
    return fplut.apply(x_bits.view(key), SEED, seed_table().values).view(x_bits.dtype)


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
    serial = fplut_cpu.KERNELS[np.dtype(np.float32)][0]
    run = fplut_cpu.split(lambda a, t, o, stream: (calls.append(a.size), serial(a, t, o, stream)))
    for threads in (1, 2):
        calls.clear()
        monkeypatch.setattr(fplut_cpu.threads, "threads", lambda t=threads: t)
        out = np.empty_like(x)
        run(x, fplut_cpu.kernel_table(_map(), np.dtype(np.float32)), out)
        assert np.array_equal(out, want)
        if threads == 1:
            assert calls == [x.size]
        else:
            assert len(calls) == 2 * fplut_cpu.threads.PER_THREAD and sum(calls) == x.size
            per = -(-x.size // 8 // fplut_cpu.CHUNK) * fplut_cpu.CHUNK                # whole chunks
            assert sorted(calls)[1:] == [per] * 7 and sorted(calls)[0] == x.size - 7 * per


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 31, 33, fplut_cpu.CHUNK + 7, 4 * fplut_cpu.CHUNK + 13, 10007])
def test_paths_fp32_fresh_inputs(path, n):
    """Both paths, every output alignment (the kernels go one by one up to a 64-byte boundary), with and without
    the non-temporal stores: bit-exact, and nothing written outside the output."""
    x = _fp32_inputs(n, 1000 + n)
    ref = _ref(np.dtype(np.float32), x)
    for offset in (0, 1, 2, 7, 15):
        for stream in (False, True):
            assert np.array_equal(_path(np.dtype(np.float32), path, x, stream, offset), ref), (offset, stream)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [0, 1, 3, 5, 31, 33, fplut_cpu.CHUNK + 3, 10007])
def test_paths_fp16_bf16_fresh_inputs(path, n):
    x = np.random.default_rng(2000 + n).integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    for key in (np.dtype(np.float16), "bf16"):
        ref = _ref(key, x)
        for offset in (0, 1, 3, 31):
            for stream in (False, True):
                assert np.array_equal(_path(key, path, x, stream, offset), ref), (key, offset, stream)


@pytest.mark.parametrize("path", PATHS)
def test_paths_every_fp16_value_and_neighbours(path):
    """Every finite fp16 value as fp32, and the fp32 values half an ulp (ties to even) and one fp32 ulp around
    it, both signs; every bf16 pattern."""
    h = halfbits.all_fp16()
    h = h[np.isfinite(h)].astype(np.float32).view(np.uint32)
    b = np.concatenate([h + d for d in (np.uint32(0), np.uint32(0xFFF), np.uint32(0x1000), np.uint32(0x1001))]
                       + [h - np.uint32(0x1000), h - np.uint32(1)])
    b = np.concatenate([b, b ^ np.uint32(0x80000000)])
    assert np.array_equal(_path(np.dtype(np.float32), path, b, True), _ref(np.dtype(np.float32), b))
    assert np.array_equal(_path(np.dtype(np.float32), path, b), _ref(np.dtype(np.float32), b))
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(_path("bf16", path, x), _ref("bf16", x))


def test_kernel_tables():
    """The tables are the reference's conversions of the map (the lookup is the whole of pass 2)."""
    m = _map()
    assert np.array_equal(fplut_cpu.kernel_table(m, np.dtype(np.float16)), m)
    y = m.view(np.float16).astype(np.float32)
    assert np.array_equal(fplut_cpu.kernel_table(m, np.dtype(np.float32)), y.view(np.uint32))
    assert np.array_equal(fplut_cpu.kernel_table(m, "bf16"), halfbits.f32_to_bf16_bits(y))


def test_wrong_table_raises():
    x = np.zeros(4, np.uint32)
    with pytest.raises(ValueError, match="kernel_table"):
        fplut_cpu.KERNELS[np.dtype(np.float32)][0](x, _map(), np.empty_like(x))   # the fp16 map, not the fp32 table


def test_streams_fp32_outputs_from_the_threshold():
    f32, big = np.dtype(np.float32), fplut_cpu.STREAM_MIN_BYTES
    assert fplut_cpu.streams(f32, big) and not fplut_cpu.streams(f32, big - 1)
    assert not fplut_cpu.streams(np.dtype(np.float16), big) and not fplut_cpu.streams("bf16", big)

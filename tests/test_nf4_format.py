"""NF4 / FP4 blockwise format (onnx_lowbit.nf4): numpy properties, and bit-for-bit agreement with bitsandbytes.

The bitsandbytes comparisons skip (with a reason) when bitsandbytes / torch are not installed; the rest needs numpy
only. Verified with bitsandbytes 0.50.2 on torch 2.13.0 (CPU).
"""
import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_lowbit import halfbits, nf4

BNB_TYPES = ("nf4", "fp4")   # bitsandbytes' own codes (nf4.QUANT_TYPES also has int4, which it does not know)

SHAPES = [(688, 24), (33, 7), (64, 64), (1, 1), (3, 5), (100, 130), (4096, 3), (5, 4099)]


def _weight(K, N, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    specials = np.array([0.0, 1e-6, -1e-6], dtype=np.float32)  # zero and tiny values (FP4's +-0 region)
    w.reshape(-1)[:min(3, w.size)] = specials[:min(3, w.size)]
    return w


def _bits32(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def _bits32_signless_zero(x):
    """_bits32 with -0.0 read as +0.0: bitsandbytes 0.50.2's CPU dequantisation gives FP4 index 8 (sign bit, zero
    magnitude) as -0.0 on some machines and +0.0 on others (seen 2026-11-25: the same wheel, inputs and bytes), so
    the sign of a zero is not bitsandbytes' format; every other value is compared bit for bit."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return np.where(x == 0, np.float32(0), x).view(np.uint32)


# ---------------------------------------------------------------------------------------------------------------
# numpy-only properties


def test_codes():
    assert nf4.NF4_CODE.dtype == np.float32 and nf4.NF4_CODE.shape == (16,)
    assert np.all(np.diff(nf4.NF4_CODE) > 0) and nf4.NF4_CODE[0] == -1 and nf4.NF4_CODE[15] == 1
    assert nf4.NF4_CODE[7] == 0
    mags = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3], dtype=np.float32)
    np.testing.assert_array_equal(nf4.FP4_CODE[:8], mags / np.float32(12))
    np.testing.assert_array_equal(nf4.FP4_CODE[8:], -(mags / np.float32(12)))
    assert not np.signbit(nf4.FP4_CODE[8]) and not np.signbit(nf4.FP4_CODE[0])  # bit 3 is the sign; both zeros +0
    assert nf4.FP4_CODE[3] == 1.0 and nf4.FP4_CODE[11] == -1.0
    with pytest.raises(ValueError, match="quant_type"):
        nf4.code("int3")
    # int4 (not a bitsandbytes type): symmetric integers, code[q] = (q - 8) / 8, index 8 is 0
    np.testing.assert_array_equal(nf4.code("int4"), (np.arange(16) - 8) / 8)


def test_dynamic_code_shape():
    c = nf4.dynamic_code()
    assert c.shape == (256,) and c.dtype == np.float32
    assert np.all(np.diff(c) >= 0) and c[-1] == 1.0 and 0.0 in c and abs(c[0] + 0.99296875) < 1e-6


def test_layout_first_element_in_high_nibble():
    # W^T flat = [1, 0, -1] (K=3, N=1): NF4 indices 15, 7, 0 -> bytes 0xF7, 0x07 (an odd count is padded with the
    # code of 0.0: NF4 index 7, FP4 index 0)
    w = np.array([[1.0], [0.0], [-1.0]], dtype=np.float32)
    packed, absmax = nf4.quantize(w, "nf4", 32)
    assert packed.tolist() == [0xF7, 0x07] and absmax.tolist() == [1.0]
    # the transpose: W[K=2, N=2] = [[a, b], [c, d]] is stored as a, c, b, d
    w = np.array([[1.0, -1.0], [0.0, 1.0]], dtype=np.float32)
    packed, _ = nf4.quantize(w, "nf4", 32)
    assert packed.tolist() == [0xF7, 0x0F]
    packed, _ = nf4.quantize(np.array([0.5, -1.0], np.float32), "fp4", 32)  # flat input; FP4 0.5 = 5, -1 = 11
    assert packed.tolist() == [0x5B]


def test_ties_and_fp4_zero_quirk():
    bounds, order = nf4._BOUNDS["fp4"]
    # exact midpoints go to the lower code value; small positives map to FP4's "-0" (index 8), like bitsandbytes
    x = np.concatenate([[1.0], bounds, [0.0, 1e-4, -1e-4]]).astype(np.float32)
    packed, _ = nf4.quantize(x, "fp4", 32)
    q = nf4.unpack_indices(packed, x.size)
    sorted_codes = nf4.FP4_CODE[order]
    np.testing.assert_array_equal(nf4.FP4_CODE[q[1:16]], sorted_codes[:15])
    assert q[16] == 0 and q[17] == 8 and q[18] == 0
    nb, _ = nf4._BOUNDS["nf4"]
    q = nf4.unpack_indices(nf4.quantize(np.concatenate([[1.0], nb]).astype(np.float32), "nf4", 32)[0], 16)
    assert q[1:].tolist() == list(range(15))


@settings(max_examples=40, deadline=None)
@given(K=st.integers(1, 200), N=st.integers(1, 40), p=st.integers(5, 12), qt=st.sampled_from(nf4.QUANT_TYPES),
       seed=st.integers(0, 2**31))
def test_round_trip_is_nearest_code(K, N, p, qt, seed):
    bs = 1 << p
    w = (np.random.default_rng(seed).standard_normal((K, N)) * 3).astype(np.float32)
    packed, absmax = nf4.quantize(w, qt, bs)
    n = K * N
    assert packed.shape == (nf4.packed_size(n),) and packed.dtype == np.uint8
    assert absmax.shape == (nf4.num_blocks(n, bs),) and absmax.dtype == np.float32
    flat = w.T.reshape(-1)
    np.testing.assert_array_equal(absmax, [np.abs(flat[i:i + bs]).max() for i in range(0, n, bs)])
    deq = nf4.dequantize(packed, absmax, qt, bs, K, N)
    assert deq.shape == (K, N) and deq.flags.c_contiguous
    # every element is the nearest representable value code * absmax of its block
    c = nf4.code(qt).astype(np.float64)
    am = np.repeat(absmax, bs)[:n].astype(np.float64)
    best = np.min(np.abs(flat[:, None] - c[None, :] * am[:, None]), axis=1)
    err = np.abs(flat - deq.T.reshape(-1).astype(np.float64))
    np.testing.assert_allclose(err, best, rtol=0, atol=1e-6 * am.max())
    if n % 2:
        assert packed[-1] & 0x0F == {"nf4": 7, "fp4": 0, "int4": 8}[qt]


def test_dequantize_dtypes():
    w = _weight(40, 9)
    packed, absmax = nf4.quantize(w, "nf4", 64)
    w32 = nf4.dequantize(packed, absmax, "nf4", 64, 40, 9)
    np.testing.assert_array_equal(nf4.dequantize(packed, absmax, "nf4", 64, 40, 9, np.float16), w32.astype(np.float16))
    np.testing.assert_array_equal(nf4.dequantize(packed, absmax, "nf4", 64, 40, 9, "bfloat16"),
                                  halfbits.f32_to_bf16_bits(w32))
    am16 = absmax.astype(np.float16)
    np.testing.assert_array_equal(nf4.dequantize(packed, am16, "nf4", 64, 40, 9),
                                  nf4.dequantize(packed, am16.astype(np.float32), "nf4", 64, 40, 9))
    with pytest.raises(ValueError, match="dtype"):
        nf4.dequantize(packed, absmax, "nf4", 64, 40, 9, np.int8)


def test_validation_messages():
    w = _weight(16, 8)
    packed, absmax = nf4.quantize(w, "nf4", 32)  # 128 elements -> 64 bytes, 4 blocks
    for bad in (48, 16, 8192, 0, -64, 64.0, True):
        with pytest.raises(ValueError, match="block_size"):
            nf4.quantize(w, "nf4", bad)
        with pytest.raises(ValueError, match="block_size"):
            nf4.dequantize(packed, absmax, "nf4", bad, 16, 8)
    with pytest.raises(ValueError, match=r"absmax has 3 values.*ceil\(N\*K/block_size\) = 4"):
        nf4.dequantize(packed, absmax[:3], "nf4", 32, 16, 8)
    with pytest.raises(ValueError, match=r"packed weight has 63 bytes.*ceil\(N\*K/2\) = 64"):
        nf4.dequantize(packed[:63], absmax, "nf4", 32, 16, 8)
    with pytest.raises(ValueError, match="uint8"):
        nf4.dequantize(packed.astype(np.int8), absmax, "nf4", 32, 16, 8)
    with pytest.raises(ValueError, match="unknown quant_type 'af4'"):
        nf4.quantize(w, "af4")
    with pytest.raises(ValueError, match="unknown quant_type"):
        nf4.dequantize(packed, absmax, "NF4", 32, 16, 8)
    with pytest.raises(ValueError, match="K must be a positive integer"):
        nf4.dequantize(packed, absmax, "nf4", 32, 0, 8)
    with pytest.raises(ValueError, match="2-D"):
        nf4.quantize(np.zeros((2, 2, 2), np.float32), "nf4")
    with pytest.raises(ValueError, match="empty"):
        nf4.quantize(np.zeros((0,), np.float32), "nf4")


def test_matmul_reference():
    K, N = 96, 20
    w = _weight(K, N, 3)
    packed, absmax = nf4.quantize(w, "fp4", 64)
    wd = nf4.dequantize(packed, absmax, "fp4", 64, K, N).astype(np.float64)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    y = nf4.matmul(a, packed, absmax, "fp4", 64, K, N, bias)
    assert y.dtype == np.float32 and y.shape == (2, 3, N)
    np.testing.assert_array_equal(y, (a.astype(np.float64) @ wd + bias).astype(np.float32))
    y16 = nf4.matmul(a.astype(np.float16), packed, absmax, "fp4", 64, K, N)
    assert y16.dtype == np.float16
    np.testing.assert_allclose(y16.astype(np.float32), a.astype(np.float16).astype(np.float64) @ wd,
                               rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="last dimension"):
        nf4.matmul(a[..., :-1], packed, absmax, "fp4", 64, K, N)
    with pytest.raises(ValueError, match="bias"):
        nf4.matmul(a, packed, absmax, "fp4", 64, K, N, bias[:-1])


def test_double_quant_round_trip():
    absmax = np.abs(np.random.default_rng(2).standard_normal(1000)).astype(np.float32) * 0.1
    q, absmax2, offset, code8 = nf4.double_quantize(absmax)
    assert q.dtype == np.uint8 and q.shape == (1000,) and absmax2.shape == (4,) and code8.shape == (256,)
    assert offset == np.float32(np.mean(absmax, dtype=np.float64))
    back = nf4.double_dequantize(q, absmax2, offset)
    assert back.dtype == np.float32
    assert np.max(np.abs(back - absmax)) < 0.02 * np.max(np.abs(absmax - offset))
    with pytest.raises(ValueError, match="absmax2"):
        nf4.double_dequantize(q, absmax2[:3], offset)


# ---------------------------------------------------------------------------------------------------------------
# bitsandbytes, bit for bit


@pytest.fixture(scope="module")
def bnb():
    torch = pytest.importorskip("torch", reason="the bitsandbytes comparisons need torch")
    F = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed "
                            "(pip install bitsandbytes==0.50.2 --no-deps)")
    dynamo_config = importlib.import_module("torch._dynamo").config
    saved = dynamo_config.disable
    dynamo_config.disable = True  # bnb torch.compile()s its portable dequantiser per shape: seconds each
    yield torch, F
    dynamo_config.disable = saved


_TORCH_DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("qt", BNB_TYPES)
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
def test_quantize_matches_bitsandbytes(bnb, qt, dtype):
    torch, F = bnb
    tdt = getattr(torch, dtype)
    for i, (K, N) in enumerate(SHAPES):
        w = _weight(K, N, i)
        wt = torch.from_numpy(np.ascontiguousarray(w.T)).to(tdt)
        w_in = wt.float().numpy().T  # the weight bitsandbytes sees, widened exactly to float32
        for bs in nf4.BLOCK_SIZES:
            ref_q, state = F.quantize_4bit(wt, blocksize=bs, quant_type=qt)
            packed, absmax = nf4.quantize(w_in, qt, bs)
            assert ref_q.shape == (nf4.packed_size(K * N), 1)
            np.testing.assert_array_equal(packed, ref_q.numpy().reshape(-1), err_msg=f"{K}x{N} bs={bs}")
            np.testing.assert_array_equal(absmax.view(np.uint32), state.absmax.numpy().view(np.uint32))


@pytest.mark.parametrize("qt", BNB_TYPES)
def test_quantize_special_values_match_bitsandbytes(bnb, qt):
    torch, F = bnb
    bounds, _ = nf4._BOUNDS[qt]
    parts = [np.concatenate([[1.0], bounds, -bounds, [0.0, -0.0, 1e-4, -1e-4, 3e-3, -3e-3]]),  # exact ties
             np.zeros(64), np.array([np.nan] + [0.5] * 63), np.array([np.inf, 1.0] + [0.25] * 62),
             np.full(64, -7.0), np.array([2.0] + list(bounds * 2) + list(-bounds * 2) + [0.0] * 34)]
    x = np.concatenate([np.resize(p, 64) for p in parts] + [bounds[:7] * 3]).astype(np.float32)  # partial block
    for bs in (32, 64):
        ref_q, state = F.quantize_4bit(torch.from_numpy(x.copy()), blocksize=bs, quant_type=qt)
        packed, absmax = nf4.quantize(x, qt, bs)
        np.testing.assert_array_equal(packed, ref_q.numpy().reshape(-1))
        np.testing.assert_array_equal(absmax.view(np.uint32), state.absmax.numpy().view(np.uint32))


@pytest.mark.parametrize("qt", BNB_TYPES)
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
def test_dequantize_matches_bitsandbytes(bnb, qt, dtype):
    """bitsandbytes.functional.dequantize_4bit, where its CPU backend follows its own flat-block layout."""
    torch, F = bnb
    tdt = getattr(torch, dtype)
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16"}[dtype]
    checked = 0
    for i, (K, N) in enumerate(SHAPES):
        w = _weight(K, N, i)
        wt = torch.from_numpy(np.ascontiguousarray(w.T)).to(tdt)
        for bs in nf4.BLOCK_SIZES:
            # bitsandbytes 0.50.2's CPU C kernel (used when K is even) indexes absmax as row * (K // bs) + col // bs,
            # which is the flat block only when bs divides K; odd K takes its portable torch path (always flat)
            if K % 2 == 0 and K % bs:
                continue
            ref_q, state = F.quantize_4bit(wt, blocksize=bs, quant_type=qt)
            ref = F.dequantize_4bit(ref_q, state)
            assert ref.dtype == tdt and tuple(ref.shape) == (N, K)
            packed, absmax = nf4.quantize(wt.float().numpy().T, qt, bs)
            mine = nf4.dequantize(packed, absmax, qt, bs, K, N, np_dtype)
            if dtype == "bfloat16":
                pos0 = lambda b: np.where(b == 0x8000, np.uint16(0), b)  # noqa: E731 - -0.0 as +0.0, as above
                np.testing.assert_array_equal(pos0(mine), pos0(ref.view(torch.int16).numpy().view(np.uint16).T))
            else:
                np.testing.assert_array_equal(_bits32_signless_zero(mine.astype(np.float32)),
                                              _bits32_signless_zero(ref.float().numpy().T))
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("qt", BNB_TYPES)
def test_dequantize_matches_bitsandbytes_portable_backend(bnb, qt):
    """All shapes against bitsandbytes' portable (default) dequantiser, the flat-block reference."""
    torch, _ = bnb
    try:
        from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
        from bitsandbytes.backends.utils import _get_4bit_code
    except ImportError as e:  # private helpers: only in the bitsandbytes versions that have them
        pytest.skip(f"bitsandbytes has no portable 4-bit dequantiser here: {e}")
    for i, (K, N) in enumerate(SHAPES):
        w = _weight(K, N, i)
        for bs in nf4.BLOCK_SIZES:
            packed, absmax = nf4.quantize(w, qt, bs)
            ref = _dequantize_4bit_compute(torch.from_numpy(packed), torch.from_numpy(absmax),
                                           _get_4bit_code(qt, torch.device("cpu")), bs, (N, K), torch.float32)
            mine = nf4.dequantize(packed, absmax, qt, bs, K, N)
            np.testing.assert_array_equal(mine.view(np.uint32), ref.numpy().T.view(np.uint32))


def test_dynamic_code_matches_bitsandbytes(bnb):
    _, F = bnb
    np.testing.assert_array_equal(nf4.dynamic_code().view(np.uint32), F.create_dynamic_map().numpy().view(np.uint32))


def test_8bit_blockwise_matches_bitsandbytes(bnb):
    torch, F = bnb
    rng = np.random.default_rng(5)
    for n in (1, 255, 256, 257, 1000, 5000):
        x = (rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(np.float32)
        if n > 600:
            x[256:512] = 0.0  # an all-zero block
        ref_q, state = F.quantize_blockwise(torch.from_numpy(x.copy()), blocksize=256)
        q, absmax = nf4.quantize_blockwise_8bit(x)
        np.testing.assert_array_equal(q, ref_q.numpy())
        np.testing.assert_array_equal(absmax.view(np.uint32), state.absmax.numpy().view(np.uint32))
        ref_back = F.dequantize_blockwise(ref_q, state).numpy()
        back = nf4.dequantize_blockwise_8bit(q, absmax)
        np.testing.assert_array_equal(back.view(np.uint32), ref_back.view(np.uint32))


@pytest.mark.parametrize("qt", BNB_TYPES)
def test_double_quant_matches_bitsandbytes(bnb, qt):
    torch, F = bnb
    for i, (K, N, bs) in enumerate([(688, 24, 64), (512, 512, 32), (100, 33, 64), (2048, 1100, 64), (7, 5, 32)]):
        w = _weight(K, N, i)
        ref_q, state = F.quantize_4bit(torch.from_numpy(np.ascontiguousarray(w.T)), blocksize=bs, quant_type=qt,
                                       compress_statistics=True)
        packed, absmax = nf4.quantize(w, qt, bs)
        np.testing.assert_array_equal(packed, ref_q.numpy().reshape(-1))
        ref_offset = state.offset.item()
        q, absmax2, offset, code8 = nf4.double_quantize(absmax, offset=ref_offset)
        np.testing.assert_array_equal(q, state.absmax.numpy())
        np.testing.assert_array_equal(absmax2.view(np.uint32), state.state2.absmax.numpy().view(np.uint32))
        np.testing.assert_array_equal(code8.view(np.uint32), state.state2.code.numpy().view(np.uint32))
        assert state.state2.blocksize == nf4.DOUBLE_QUANT_BLOCK and offset == ref_offset
        # our own offset (float64 mean) is bitsandbytes' float32 mean to within an ulp or two
        own = nf4.double_quantize(absmax)[2]
        assert abs(own - ref_offset) <= 2 * np.spacing(np.float32(ref_offset))
        # the rebuilt absmax, and the weight dequantised through it, are bitsandbytes' own
        rebuilt = nf4.double_dequantize(q, absmax2, offset)
        ref_rebuilt = (F.dequantize_blockwise(state.absmax, state.state2) + state.offset).numpy()
        np.testing.assert_array_equal(rebuilt.view(np.uint32), ref_rebuilt.view(np.uint32))
        if K % 2 or K % bs == 0:
            ref_w = F.dequantize_4bit(ref_q, state).numpy().T
            np.testing.assert_array_equal(_bits32_signless_zero(nf4.dequantize(packed, rebuilt, qt, bs, K, N)),
                                          _bits32_signless_zero(ref_w))

"""NF4 / FP4 blockwise 4-bit weights in bitsandbytes' format: numpy reference semantics of MatMulNF4 / DequantNF4.
(A third 16-value code, ``int4`` (``INT4_CODE``), holds symmetric 4-bit integers in the same storage: onnxruntime
MatMulNBits weights converted without loss; see INT4_CODE.)

Storage (what the ops take; identical bytes to ``bitsandbytes.functional.quantize_4bit(W^T)``):
  * the ONNX MatMul weight W[K, N] is stored as its transpose W^T[N, K], row-major and flattened
    (flat index i = n * K + k), exactly like the ``nn.Linear`` weight that bitsandbytes quantises;
  * the flat sequence is cut into blocks of ``block_size`` consecutive elements (a power of two in 32..4096);
    the last block may be partial; each block has one float32 ``absmax``;
  * every element is a 4-bit index into a 16-value code (``NF4_CODE`` or ``FP4_CODE``); two indices share a byte,
    the FIRST element of a pair in the HIGH nibble; for an odd element count the low nibble of the last byte holds
    the index of 0.0 (NF4: 7, FP4: 0, int4: 8), as bitsandbytes pads the scaled values with 0.
  * value = code[index] * absmax[block] (float32 product).

Quantisation, as bitsandbytes does it on the CPU (its portable ``default`` backend; verified bit-for-bit against
bitsandbytes 0.50.2 by tests/test_nf4_format.py):
  * the input is widened to float32 first (fp16 and bf16 widen exactly);
  * full blocks: absmax = max |x|; x is scaled by the float32 reciprocal ``1 / max(absmax, 1e-38)`` (a multiply),
    clamped to [-1, 1]; the stored absmax is the unclamped max (0 for an all-zero block);
  * the partial last block: am = max(max |x|, 1e-38) is both the stored absmax and the divisor (a true division);
  * index = the code entry nearest to the scaled value; the decision boundaries are the float32 midpoints of
    neighbouring code values (sorted), and a value exactly on a midpoint goes to the LOWER code value.
    NaN anywhere in a block makes that block's absmax NaN and every index of the block the largest code value.
  * FP4 quirk kept for bit-identity: FP4 indices 0 and 8 (sign bit set) both decode to +0.0 in bitsandbytes' code
    table. Its stable sort puts index 0 first, so a scaled value in (-0.0026, 0] gets index 0 and one in
    (0, 0.0026] gets index 8. (bitsandbytes' CUDA/Triton kernels decide FP4 by sign bit + thresholds instead, so
    their bytes can differ from these only for such tiny values and exact ties, never in the decoded value by
    more than the tie.)

Double quantisation (bitsandbytes' ``compress_statistics=True``): offset = mean(absmax); absmax - offset is
quantised with bitsandbytes' 8-bit blockwise "dynamic" code (256 values, blocks of 256, float32 absmax2);
absmax = code8[q] * absmax2[block] + offset.

``matmul`` (the MatMulNF4 reference): W is dequantised to float32, Y = A @ W (+ bias) is accumulated in float64 and
rounded once to A's dtype. Kernels accumulate in float32 and are compared to this with a tolerance. With the op's
attribute accuracy_level = 4, A is quantised to int8 first: onnx_lowbit.nf4_int8 defines that product.
"""
from __future__ import annotations

import numpy as np

from . import matmul_ref

QUANT_TYPES = ("nf4", "fp4", "int4")
BLOCK_SIZES = tuple(1 << p for p in range(5, 13))  # 32 .. 4096
DOUBLE_QUANT_BLOCK = 256

# NF4 (QLoRA "NormalFloat"): 16 quantiles of N(0, 1) normalised to [-1, 1], index = position, ascending;
# index 7 is exactly 0. Same float32 values as bitsandbytes' get_4bit_type("nf4").
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)

# FP4 (bitsandbytes' own e2m1 variant): bit 3 is the sign, bits 2..0 select a magnitude; the magnitudes, in units
# of 1/12, are 000 -> 0, 001 -> 0.0625 (the only subnormal), 010 -> 8, 011 -> 12, 100 -> 4, 101 -> 6, 110 -> 2,
# 111 -> 3, i.e. the largest exponent is 01, not 11. Divided by 12 (float32) so the code spans [-1, 1].
# Index 8 ("negative zero") is +0.0, exactly as in bitsandbytes' table (and what its CPU kernel writes).
_FP4_MAGNITUDES = [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0]
FP4_CODE = (np.array(_FP4_MAGNITUDES + [0.0] + [-m for m in _FP4_MAGNITUDES[1:]], dtype=np.float32)
            / np.float32(12.0))


# int4 (not a bitsandbytes type): symmetric 4-bit integers with zero point 8, onnxruntime's MatMulNBits grid
# without zero points (what onnxruntime-genai's builder writes): code[q] = (q - 8) / 8, so that a block stored as
# MatMulNBits' scale s has absmax = 8 s and value = code[q] * absmax = (q - 8) * s, the same fp32 product (q - 8
# and 8 s are exact). onnx_lowbit/matmulnbits.to_int4 converts MatMulNBits weights to it without loss. Quantising
# floats to it (``quantize``) scales by the block's absmax like NF4 / FP4: the largest positive value lands on 7/8.
INT4_CODE = ((np.arange(16, dtype=np.float32) - np.float32(8.0)) / np.float32(8.0)).astype(np.float32)

_CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE, "int4": INT4_CODE}


def code(quant_type: str) -> np.ndarray:
    """The 16 float32 code values of ``quant_type`` (a copy), indexed by the 4-bit value."""
    _check_quant_type(quant_type)
    return _CODES[quant_type].copy()


def _check_quant_type(quant_type) -> None:
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"unknown quant_type {quant_type!r}: expected 'nf4', 'fp4' or 'int4'")


def check_block_size(block_size) -> int:
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"block_size must be an integer, got {block_size!r}")  # noqa: TRY004 (the API raises ValueError)
    b = int(block_size)
    if b < 32 or b > 4096 or b & (b - 1):
        raise ValueError(f"block_size must be a power of two in 32..4096, got {b}")
    return b


def num_blocks(n: int, block_size: int) -> int:
    """Number of absmax values for n elements: ceil(n / block_size)."""
    return -(-int(n) // int(block_size))


def packed_size(n: int) -> int:
    """Number of packed bytes for n elements: ceil(n / 2)."""
    return -(-int(n) // 2)


def _check_dims(K, N) -> int:
    for name, v in (("K", K), ("N", N)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(K) * int(N)


def _sorted_bounds(quant_type: str):
    """Decision midpoints between neighbouring code values in ascending order, and the code index of each
    sorted position (stable sort: +0 of FP4 before -0, as bitsandbytes' argsort)."""
    c = code(quant_type)
    order = np.argsort(c, kind="stable")
    s = c[order]
    return ((s[:-1] + s[1:]) / np.float32(2.0)).astype(np.float32), order.astype(np.uint8)


_BOUNDS = {qt: _sorted_bounds(qt) for qt in QUANT_TYPES}
_TINY = np.float32(1e-38)


# ---------------------------------------------------------------------------------------------------------------
# 4-bit quantise / dequantise


def flatten_weight(w: np.ndarray) -> np.ndarray:
    """The flat float32 sequence that is quantised: W^T row-major for a 2-D W[K, N]; a 1-D array as it is."""
    w = np.asarray(w)
    if w.ndim == 2:
        w = w.T
    elif w.ndim != 1:
        raise ValueError(f"weight must be 2-D [K, N] (or already flat, 1-D), got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"weight must be a float array, got dtype {w.dtype}")
    return np.ascontiguousarray(w, dtype=np.float32).reshape(-1)


def quantize_flat(flat: np.ndarray, quant_type: str, block_size: int = 64):
    """Quantise a flat sequence. Returns (packed uint8[ceil(n/2)], absmax float32[ceil(n/block_size)])."""
    _check_quant_type(quant_type)
    bs = check_block_size(block_size)
    x = np.ascontiguousarray(flat, dtype=np.float32).reshape(-1)
    n = x.size
    if n == 0:
        raise ValueError("cannot quantise an empty weight")
    full = n - n % bs
    nb_full = full // bs
    scaled = np.empty(n + (n & 1), dtype=np.float32)
    scaled[n:] = 0.0  # the pad element of an odd count (bitsandbytes pads the scaled values with 0)
    absmax = np.empty(num_blocks(n, bs), dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if nb_full:
            blocks = x[:full].reshape(nb_full, bs)
            am = np.max(np.abs(blocks), axis=1)
            absmax[:nb_full] = am
            recip = np.float32(1.0) / np.maximum(am, _TINY)
            np.clip(blocks * recip[:, None], -1.0, 1.0, out=scaled[:full].reshape(nb_full, bs))
        if full < n:
            am = np.maximum(np.max(np.abs(x[full:])), _TINY)
            absmax[nb_full] = am
            scaled[full:n] = np.clip(x[full:] / am, -1.0, 1.0)
    q = nearest_indices(scaled, quant_type)
    packed = ((q[0::2] << 4) | q[1::2]).astype(np.uint8)
    return packed, absmax


def nearest_indices(scaled: np.ndarray, quant_type: str) -> np.ndarray:
    """The 4-bit index (uint8) of the code value nearest to each scaled float32 value in [-1, 1], as
    ``quantize_flat`` picks it: ties go to the lower code value, NaN to the largest."""
    bounds, order = _BOUNDS[quant_type]
    return order[np.searchsorted(bounds, np.asarray(scaled, np.float32), side="left")]


def pack_indices(indices: np.ndarray, quant_type: str) -> np.ndarray:
    """A flat sequence of 4-bit indices -> packed uint8[ceil(n/2)], the first of a pair in the high nibble; an odd
    count is padded with the index of 0.0 (as bitsandbytes pads the scaled values with 0)."""
    q = np.asarray(indices, np.uint8).reshape(-1)
    if q.size & 1:
        q = np.concatenate([q, nearest_indices(np.zeros(1, np.float32), quant_type)])
    return ((q[0::2] << 4) | q[1::2]).astype(np.uint8)


def quantize(w: np.ndarray, quant_type: str, block_size: int = 64):
    """Quantise the MatMul weight W[K, N] (or an already-flat 1-D sequence) like bitsandbytes'
    ``quantize_4bit(torch.tensor(W^T), blocksize=block_size, quant_type=quant_type)``.

    Returns (packed uint8[ceil(N*K/2)], absmax float32[ceil(N*K/block_size)]); bitsandbytes' packed tensor is the
    same bytes with shape [ceil(N*K/2), 1]. float16 / bfloat16 weights: pass them as float32 (exact widening, which
    is what bitsandbytes does internally); float64 is rounded to float32 first.
    """
    return quantize_flat(flatten_weight(w), quant_type, block_size)


def validate(packed: np.ndarray, absmax: np.ndarray, quant_type: str, block_size: int, K: int, N: int):
    """Check the tensors of one NF4/FP4 weight; returns (packed uint8 1-D, absmax float32 1-D, n)."""
    _check_quant_type(quant_type)
    bs = check_block_size(block_size)
    n = _check_dims(K, N)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise ValueError(f"packed weight must be uint8, got {packed.dtype}")
    if packed.size != packed_size(n):
        raise ValueError(f"packed weight has {packed.size} bytes; K={K}, N={N} needs ceil(N*K/2) = {packed_size(n)}")
    absmax = np.asarray(absmax)
    if not np.issubdtype(absmax.dtype, np.floating):
        raise ValueError(f"absmax must be float32 (or float16), got {absmax.dtype}")
    if absmax.size != num_blocks(n, bs):
        raise ValueError(f"absmax has {absmax.size} values; K={K}, N={N}, block_size={bs} needs "
                         f"ceil(N*K/block_size) = {num_blocks(n, bs)}")
    return packed.reshape(-1), absmax.reshape(-1).astype(np.float32), n


def unpack_indices(packed: np.ndarray, n: int) -> np.ndarray:
    """The n 4-bit indices (uint8) of a packed sequence: high nibble first."""
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    q = np.empty(p.size * 2, dtype=np.uint8)
    q[0::2] = p >> 4
    q[1::2] = p & 0x0F
    return q[:n]


def _cast(values32: np.ndarray, dtype):
    """float32 -> dtype: float32, float64, float16 (round to nearest even) or 'bfloat16' (uint16 bit patterns,
    round to nearest even, the project's convention for bf16 in numpy)."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        from .halfbits import f32_to_bf16_bits
        return f32_to_bf16_bits(values32)
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32, float16, float64 or 'bfloat16', got {dtype!r}")
    with np.errstate(over="ignore"):
        return values32.astype(dt)


def dequantize_flat(packed, absmax, quant_type: str, block_size: int, n: int, dtype=np.float32) -> np.ndarray:
    """The flat sequence: code[index] * absmax[i // block_size] in float32, then cast to dtype."""
    c = code(quant_type)
    q = unpack_indices(packed, n)
    bs = check_block_size(block_size)
    am = np.asarray(absmax, dtype=np.float32).reshape(-1)
    vals = c[q] * np.repeat(am, bs)[:n]
    return _cast(vals, dtype)


def dequantize(packed, absmax, quant_type: str, block_size: int, K: int, N: int, dtype=np.float32) -> np.ndarray:
    """W[K, N] (C-contiguous) from its stored form; equals bitsandbytes' ``dequantize_4bit`` (shape [N, K],
    the same dtype) transposed. dtype: float32 (default), float16, float64 or 'bfloat16' (uint16 bit patterns)."""
    packed, absmax, n = validate(packed, absmax, quant_type, block_size, K, N)
    flat = dequantize_flat(packed, absmax, quant_type, block_size, n, dtype)
    return np.ascontiguousarray(flat.reshape(int(N), int(K)).T)


def matmul(a: np.ndarray, packed, absmax, quant_type: str, block_size: int, K: int, N: int, bias=None,
           accuracy_level: int = 0) -> np.ndarray:
    """MatMulNF4 reference: Y[..., N] = A[..., K] @ W (+ bias), W dequantised to float32, products and sums in
    float64, one rounding to A's dtype (float32 or float16). ``accuracy_level`` 4: int8 activations, as
    onnx_lowbit.nf4_int8 defines them (0..3: this float product)."""
    if accuracy_level:
        from . import nf4_int8  # noqa: PLC0415 (nf4_int8 imports this module)
        if nf4_int8.check_level(accuracy_level) == nf4_int8.INT8:
            return nf4_int8.matmul(a, packed, absmax, quant_type, block_size, K, N, bias)
    return matmul_ref.matmul(a, K, N, bias, lambda: dequantize(packed, absmax, quant_type, block_size, K, N, np.float32))


# ---------------------------------------------------------------------------------------------------------------
# Double quantisation of absmax (bitsandbytes' compress_statistics)


def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps, dtype=float32) on the CPU: step = (end - start) / (steps - 1) in float32;
    the first half is start + step * i, the second half end - step * (steps - 1 - i), each rounded once
    (a fused multiply-add; exact in float64 here, then rounded to float32)."""
    s, e = np.float32(start), np.float32(end)
    if steps == 1:
        return np.array([s], dtype=np.float32)
    step = np.float32((e - s) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    lo = np.float64(s) + np.float64(step) * i
    hi = np.float64(e) - np.float64(step) * (steps - 1 - i)
    return np.where(i < steps // 2, lo, hi).astype(np.float32)


def dynamic_code(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' 8-bit "dynamic" code (256 ascending float32 values in [-0.99297, 1]): for each exponent
    e = 0..6, the midpoints of an even split of [0.1, 1] into 2**e parts, scaled by 10**(e - 6), with both signs,
    plus 0 and 1. Only the signed 8-bit variant (the one double quantisation uses) is provided."""
    if (signed, max_exponent_bits, total_bits) != (True, 7, 8):
        raise ValueError("only the signed 8-bit dynamic code with 7 exponent bits is provided")
    values = []
    for e in range(max_exponent_bits):
        b = _linspace_f32(0.1, 1.0, 2 ** e + 1)
        means = (b[:-1] + b[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (e - (max_exponent_bits - 1)))
        values.extend((scale * means).tolist())
        values.extend((-scale * means).tolist())
    values += [0.0, 1.0]
    values.sort()
    return np.array(values, dtype=np.float32)


_DYNAMIC = dynamic_code()


def _lut_8bit(code8: np.ndarray) -> np.ndarray:
    """bitsandbytes' CPU 8-bit quantiser maps [-1, 1] onto 65,536 grid points, each to the code entry nearest to
    it (float32 midpoints, ties to the lower entry)."""
    mid = (np.float32(0.5) * (code8[:-1] + code8[1:])).astype(np.float32)
    grid = (np.float32(-1.0) + (np.float32(2.0) * np.arange(65536, dtype=np.float32)) / np.float32(65535.0))
    return np.searchsorted(mid, grid.astype(np.float32), side="left").astype(np.uint8)


def quantize_blockwise_8bit(x: np.ndarray, code8: np.ndarray | None = None, block_size: int = DOUBLE_QUANT_BLOCK):
    """bitsandbytes' CPU ``quantize_blockwise`` (8-bit, float32 input): per block absmax = max |x| (0 -> all
    indices 0); v = clamp(x * (1 / absmax), -1, 1); index = lut[uint16((v + 1) * 0.5 * 65535 + 0.5)] where lut
    holds the nearest code entry of each grid point. Returns (q uint8[n], absmax float32[ceil(n/block_size)])."""
    code8 = _DYNAMIC if code8 is None else np.asarray(code8, dtype=np.float32)
    if code8.shape != (256,):
        raise ValueError(f"the 8-bit code must hold 256 values, got shape {code8.shape}")
    if int(block_size) <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    bs = int(block_size)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(x)):
        raise ValueError("8-bit blockwise quantisation needs finite values")
    n = x.size
    nb = num_blocks(n, bs)
    padded = np.zeros(nb * bs, dtype=np.float32)
    padded[:n] = x
    blocks = padded.reshape(nb, bs)
    absmax = np.max(np.abs(blocks), axis=1).astype(np.float32)
    safe = np.where(absmax == 0, np.float32(1.0), absmax)
    v = np.clip(blocks * (np.float32(1.0) / safe)[:, None], -1.0, 1.0).astype(np.float32)
    idx = ((v + np.float32(1.0)) * np.float32(0.5) * np.float32(65535.0) + np.float32(0.5)).astype(np.uint16)
    q = _lut_8bit(code8)[idx]
    q[absmax == 0] = 0
    return q.reshape(-1)[:n].copy(), absmax


def dequantize_blockwise_8bit(q, absmax, code8=None, block_size: int = DOUBLE_QUANT_BLOCK) -> np.ndarray:
    """code8[q] * absmax[i // block_size], float32."""
    code8 = _DYNAMIC if code8 is None else np.asarray(code8, dtype=np.float32)
    q = np.asarray(q, dtype=np.uint8).reshape(-1)
    am = np.asarray(absmax, dtype=np.float32).reshape(-1)
    if am.size != num_blocks(q.size, block_size):
        raise ValueError(f"absmax2 has {am.size} values; {q.size} codes in blocks of {block_size} need "
                         f"{num_blocks(q.size, block_size)}")
    return code8[q] * np.repeat(am, int(block_size))[:q.size]


def double_quantize(absmax: np.ndarray, offset: float | None = None, block_size: int = DOUBLE_QUANT_BLOCK):
    """Quantise absmax like bitsandbytes' ``compress_statistics``. Returns (q uint8[n], absmax2 float32[ceil(n/256)],
    offset (a float holding a float32 value), code float32[256]).

    offset defaults to the mean of absmax (float64 sum, rounded to float32). bitsandbytes sums in float32 with
    torch's blocked/vectorised order, so its offset can differ from this one in the last bit (about 40% of the
    time); pass bitsandbytes' ``QuantState.offset`` to reproduce its q and absmax2 bit for bit."""
    a = np.asarray(absmax, dtype=np.float32).reshape(-1)
    if a.size == 0:
        raise ValueError("absmax is empty")
    off = np.float32(np.mean(a, dtype=np.float64)) if offset is None else np.float32(offset)
    q, absmax2 = quantize_blockwise_8bit(a - off, _DYNAMIC, block_size)
    return q, absmax2, float(off), _DYNAMIC.copy()


def double_dequantize(q, absmax2, offset: float, code8=None, block_size: int = DOUBLE_QUANT_BLOCK) -> np.ndarray:
    """absmax (float32) = code8[q] * absmax2[block] + offset, as bitsandbytes rebuilds it in dequantize_4bit."""
    return (dequantize_blockwise_8bit(q, absmax2, code8, block_size) + np.float32(offset)).astype(np.float32)

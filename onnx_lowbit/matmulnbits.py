"""onnxruntime's com.microsoft.MatMulNBits 4-bit weights (what onnxruntime-genai's model builder writes) read as
numpy arrays, and converted to our AWQ format (onnx_lowbit/awq.py) where the two grids agree.

MatMulNBits (bits=4, block_size=B, K, N; the weight W is [K, N], nb = ceil(K / B) blocks per column):
  * B uint8 [N, nb, B/2]: element k of block j of column n sits in byte (n, j, k // 2), even k in the low nibble;
  * scales [N * nb] (or [N, nb]) in A's dtype (float32 or float16);
  * zero_points (optional) uint8 [N * ceil(nb / 2)] (or [N, ceil(nb / 2)]): block j of column n in byte
    n * ceil(nb / 2) + j // 2, even j in the low nibble; absent: every zero point is 8 (the symmetric form);
    zero points in A's float dtype (another form) are not read here;
  * W[k, n] = (q[k, n] - z[k // B, n]) * s[k // B, n]; rows past K are ignored.

Our AWQ format (awq.py) holds the same integers: codes q and zero points z in 0..15 per group of G = B rows and
one fp16 scale per group and column, W = (q - z) * s computed exactly and rounded once to fp16. So a MatMulNBits
weight with fp16 scales (fp16 models) converts without loss: the fp16 weights AWQ dequantises to are the fp16
values of (q - z) * s, what MatMulNBits computes in T = float16 (``dequantize(..., np.float16)``). With float32
scales (fp32 models) the scales must be rounded to fp16 and the conversion is not lossless
(``to_awq(..., lossy=True)`` does it anyway and says by how much the weight moved).

The int4 code of MatMulNF4 (onnx_lowbit/nf4.py, INT4_CODE: code[q] = (q - 8) / 8) holds the symmetric form (every
zero point 8) without loss, whatever the scales' dtype: ``to_int4`` repacks the codes into bitsandbytes' order (the
flat W^T, the first element of a pair in the high nibble) and stores absmax = 8 s in float32 (exact), so the
float32 weight code[q] * absmax equals (q - 8) * s rounded once, as MatMulNBits dequantises it. It needs K to be a
multiple of the block (MatMulNF4's blocks run over the flat W^T: a padded last block would straddle two columns)
and a block size MatMulNF4 takes (a power of two in 32..4096).
"""
from __future__ import annotations

import numpy as np

from . import awq

ORT_BLOCK_SIZES = (16, 32, 64, 128, 256)  # what onnxruntime's MatMulBnb4 / MatMulNBits kernels accept (1.31)


def _nb(K: int, block_size: int) -> int:
    return -(-int(K) // int(block_size))


def unpack(b, scales, zero_points, K: int, N: int, block_size: int):
    """(q uint8 [Kp, N], z uint8 [nb, N], s [nb, N] in the scales' dtype); Kp = nb * block_size. Raises
    ValueError for tensors of other shapes or types."""
    K, N, bs = int(K), int(N), int(block_size)
    if bs < 2 or bs % 2:
        raise ValueError(f"block_size must be an even number >= 2, got {bs}")
    nb = _nb(K, bs)
    b = np.asarray(b)
    if b.dtype != np.uint8 or b.size != N * nb * (bs // 2):
        raise ValueError(f"B must be uint8 [N={N}, {nb}, {bs // 2}], got {b.dtype} {list(b.shape)}")
    b = b.reshape(N, nb, bs // 2)
    q = np.empty((N, nb, bs), np.uint8)
    q[:, :, 0::2] = b & 0x0F
    q[:, :, 1::2] = b >> 4
    q = np.ascontiguousarray(q.reshape(N, nb * bs).T)                     # [Kp, N]
    s = np.asarray(scales)
    if s.dtype not in (np.float16, np.float32) or s.size != N * nb:
        raise ValueError(f"scales must be float16/float32 with N * nb = {N * nb} values, got {s.dtype} "
                         f"{list(s.shape)}")
    s = np.ascontiguousarray(s.reshape(N, nb).T)                          # [nb, N]
    if zero_points is None:
        z = np.full((nb, N), 8, np.uint8)
    else:
        zp = np.asarray(zero_points)
        zb = (nb + 1) // 2
        if zp.dtype != np.uint8 or zp.size != N * zb:
            raise ValueError(f"zero_points must be packed uint8 [N={N}, {zb}], got {zp.dtype} {list(zp.shape)}")
        zp = zp.reshape(N, zb)
        z2 = np.empty((N, 2 * zb), np.uint8)
        z2[:, 0::2] = zp & 0x0F
        z2[:, 1::2] = zp >> 4
        z = np.ascontiguousarray(z2[:, :nb].T)                            # [nb, N]
    return q, z, s


def dequantize(b, scales, zero_points, K: int, N: int, block_size: int, dtype=np.float32) -> np.ndarray:
    """W [K, N] = (q - z) * s, the product computed exactly (float64) and rounded once to ``dtype``."""
    q, z, s = unpack(b, scales, zero_points, K, N, block_size)
    diff = q.astype(np.int16) - np.repeat(z, int(block_size), axis=0).astype(np.int16)
    w = diff.astype(np.float64) * np.repeat(s.astype(np.float64), int(block_size), axis=0)
    return np.ascontiguousarray(w[:int(K)].astype(dtype))


def to_awq(b, scales, zero_points, K: int, N: int, block_size: int, lossy: bool = False):
    """The MatMulNBits weight as AWQ tensors (qweight int32 [Kp, N/8], qzeros int32 [nb, N/8], scales fp16 [nb, N],
    group_size = block_size) and the relative Frobenius change of the dequantised weight (0.0 when lossless).
    N must be a multiple of 8. Float32 scales: ValueError unless ``lossy`` (then rounded to fp16). Rows past K
    (a K that is not a multiple of the block) get their group's zero point, so they dequantise to 0 as AWQ's
    padded rows do."""
    K, N, bs = int(K), int(N), int(block_size)
    if N % awq.PACK:
        raise ValueError(f"N={N} is not a multiple of {awq.PACK} (AWQ packs 8 columns per int32)")
    q, z, s = unpack(b, scales, zero_points, K, N, bs)
    if s.dtype != np.float16 and not lossy:
        raise ValueError(f"scales are {s.dtype}: rounding them to fp16 (AWQ's scales) is not lossless")
    with np.errstate(over="ignore"):                                     # reported just below
        s16 = s.astype(np.float16)
    if not np.all(np.isfinite(s16)):
        raise ValueError("a scale overflows fp16")
    if q.shape[0] > K:
        q = q.copy()
        q[K:] = z[-1]
    qweight, qzeros, scales16 = awq.pack(q, z, s16)
    rel = 0.0
    if s.dtype != np.float16:
        ref = dequantize(b, scales, zero_points, K, N, bs, np.float64)
        got = awq.dequantize(qweight, qzeros, scales16, bs, K, N).astype(np.float64)
        den = float(np.linalg.norm(ref))
        rel = float(np.linalg.norm(ref - got) / den) if den else 0.0
    return qweight, qzeros, scales16, rel


def to_int4(b, scales, zero_points, K: int, N: int, block_size: int):
    """The MatMulNBits weight as MatMulNF4 tensors of quant_type "int4" (packed uint8 [N K / 2], absmax float32
    [N K / block_size]; block_size unchanged), exact (see the module doc). ValueError where it does not convert:
    a zero point other than 8, K not a multiple of the block, a block size MatMulNF4 does not take, a non-finite
    scale or one whose 8 s overflows float32."""
    from . import nf4  # noqa: PLC0415
    K, N, bs = int(K), int(N), int(block_size)
    if bs not in nf4.BLOCK_SIZES:
        raise ValueError(f"block_size={bs}: MatMulNF4 takes powers of two in 32..4096")
    if K % bs:
        raise ValueError(f"K={K} is not a multiple of block_size={bs} (MatMulNF4's blocks run over the flat W^T)")
    q, z, s = unpack(b, scales, zero_points, K, N, bs)
    if np.any(z != 8):
        raise ValueError("zero points other than 8 (asymmetric blocks; the int4 code is symmetric)")
    s32 = s.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        absmax = s32 * np.float32(8.0)
    if not np.all(np.isfinite(absmax)):
        raise ValueError("a scale is not finite or 8 x scale overflows float32")
    flat = np.ascontiguousarray(q.T).reshape(-1)                          # W^T [N, K], K % bs == 0: no padding rows
    packed = ((flat[0::2] << 4) | flat[1::2]).astype(np.uint8)
    return packed, np.ascontiguousarray(absmax.T).reshape(-1)             # absmax per (n, block), n-major

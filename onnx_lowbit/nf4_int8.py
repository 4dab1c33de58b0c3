"""MatMulNF4 with ``accuracy_level`` 4: int8 activations (numpy reference), like onnxruntime's MatMulNBits at
accuracy_level 4. Level 0 (the default; also 1..3, which ask for no less than fp32) is onnx_lowbit.nf4.matmul.

Definition, for A [..., K] (float32, or float16 widened exactly) flattened to rows m, and the weight of
onnx_lowbit.nf4 (block size bs, W^T [N, K] flat, element n * K + k in block (n * K + k) // bs):

* groups: A's rows are cut into groups of g = ``int8_group(K, bs)`` consecutive elements: g = bs when K % bs == 0,
  else 32 when K % 32 == 0 (then each 32-element piece of a W^T row lies in one weight block, as bs is a power of
  two >= 32); any other K has no level 4: the op computes level 0 (``matmul`` below does so too).
* activations, per row m and group j, in float32: amax = max |a| over the group; s_a[m, j] = amax / 127 (one fp32
  division); inv = 127 / amax (fp32; 0 when amax == 0); a_q = rint(a * inv) (fp32 product, round half to even),
  clipped to [-127, 127] (never reached: |a * inv| <= 127 (1 + 2^-24)^2 < 127.5) -> int8.
  A group holding a NaN or an infinity has s_a = NaN (and a_q = 0): every output of that row is NaN.
* weights: the 16 code values as int8 levels c8 = rint(code * L) and w_scale = absmax[block] / L, with L = 127 for
  NF4 and FP4 (codes in [-1, 1]; float64 product, half to even: FP4's 0.5 * 127 = 63.5 -> 64) and L = 128 for
  int4 (codes (q - 8) / 8: c8 = 16 (q - 8), exact, so c8 w_scale = (q - 8) absmax / 8, the weight itself;
  ``level_divisor``).
* y[m, n] = sum_j (absmax[b(n, j)] / L) * s_a[m, j] * sum_{k in group j} a_q[m, k] * c8[nib(n, k)] (+ bias), the
  inner sums exact integers, the rest evaluated in float64 here and rounded once to A's dtype; b(n, j) the weight
  block of the group's first element n * K + j g.

Kernels (custom_ops/nf4/nf4vnni_cpu.py) quantise A bit-identically (the same fp32 operations), so their integer
sums are this reference's; they apply the scales in fp32 (absmax * fp32(s_a / 127) per group, times fp32(127 / L)
for int4, fp32 sums), so they differ from it by a few fp32 rounding steps of the sum of |terms|.

With int4 weights converted from onnxruntime's MatMulNBits (symmetric, blocks of 32 = the activation groups), this
is the arithmetic of MatMulNBits at its accuracy_level 4 (A quantised per block to int8 with amax / 127, integer
block sums with q - 8, fp32 scales): the integer sums agree, the fp32 accumulation order differs."""
from __future__ import annotations

import numpy as np

from . import matmul_ref, nf4

LEVELS = (0, 1, 2, 3, 4)    # accepted accuracy_level values (onnxruntime's MatMulNBits': 0 unset, 1 fp32, 2 fp16,
INT8 = 4                    # 3 bf16, 4 int8); only 4 changes MatMulNF4's arithmetic, 1..3 compute in fp32 like 0


def check_level(level) -> int:
    """``level`` as an int, or ValueError naming the accepted values."""
    if isinstance(level, (bool, np.bool_)) or not isinstance(level, (int, np.integer)) or int(level) not in LEVELS:
        raise ValueError(f"accuracy_level must be one of {', '.join(map(str, LEVELS))} (4: int8 activations), "
                         f"got {level!r}")
    return int(level)


def int8_group(K: int, block_size: int) -> int | None:
    """The activation group of level 4 (see the module doc): block_size when it divides K, else 32 when 32 divides
    K, else None (level 4 computes as level 0)."""
    if K % block_size == 0:
        return int(block_size)
    return 32 if K % 32 == 0 else None


def level_divisor(quant_type: str) -> int:
    """L of the module doc: 128 for int4 (its levels 16 (q - 8) exact), 127 for NF4 and FP4."""
    return 128 if quant_type == "int4" else 127


def code_levels(quant_type: str) -> np.ndarray:
    """int8[16]: rint(code * L) of the 16 code values of ``quant_type`` (L: ``level_divisor``)."""
    return np.rint(nf4.code(quant_type).astype(np.float64) * level_divisor(quant_type)).astype(np.int8)


def quantize_activations(a2: np.ndarray, group: int):
    """a2 float32 [M, K] (K a multiple of ``group``) -> (a_q int8 [M, K], s_a float32 [M, K // group])."""
    a2 = np.ascontiguousarray(a2, dtype=np.float32)
    m, k = a2.shape
    blocks = a2.reshape(m, k // group, group)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(blocks), axis=2) if k else np.zeros((m, 0), np.float32)
        finite = np.isfinite(amax)
        s_a = np.where(finite, amax / np.float32(127.0), np.float32(np.nan)).astype(np.float32)
        inv = np.where(finite & (amax > 0), np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        q = np.rint(blocks * inv[:, :, None])
    q = np.where(finite[:, :, None], np.clip(q, -127, 127), 0)
    return q.astype(np.int8).reshape(m, k), s_a


def product64(a: np.ndarray, packed, absmax, quant_type: str, block_size: int,
              K: int, N: int) -> np.ndarray:  # noqa: N803
    """A @ W at level 4 in float64, not rounded (shape A.shape[:-1] + (N,)); K must be a multiple of 32."""
    g = int8_group(int(K), nf4.check_block_size(block_size))
    if g is None:
        raise ValueError(f"level 4 needs K % 32 == 0 (K={K}): the op computes level 0 there")
    packed, am, n_el = nf4.validate(packed, absmax, quant_type, block_size, K, N)
    a = matmul_ref.check_a(a, K)
    aq, s_a = quantize_activations(a.astype(np.float32).reshape(-1, K), g)
    w8 = code_levels(quant_type)[nf4.unpack_indices(packed, n_el)].reshape(N, K).astype(np.int64)
    groups = K // g
    first = np.arange(N)[:, None] * K + np.arange(groups)[None, :] * g             # [N, G] first elements
    w_scale = am[first // block_size].astype(np.float64) / level_divisor(quant_type)   # [N, G]
    isum = np.einsum("mjk,njk->mnj", aq.reshape(-1, groups, g).astype(np.int64), w8.reshape(N, groups, g))
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.einsum("mnj,nj,mj->mn", isum.astype(np.float64), w_scale, s_a.astype(np.float64))
    return y.reshape(*a.shape[:-1], N)


def matmul(a: np.ndarray, packed, absmax, quant_type: str, block_size: int, K: int, N: int, bias=None,  # noqa: N803
           accuracy_level: int = INT8) -> np.ndarray:
    """The MatMulNF4 reference at ``accuracy_level`` (0..4; 4 where K % 32 == 0: the definition above, rounded once
    to A's dtype; else nf4.matmul)."""
    if check_level(accuracy_level) != INT8 or int8_group(int(K), nf4.check_block_size(block_size)) is None:
        return nf4.matmul(a, packed, absmax, quant_type, block_size, K, N, bias)
    a = matmul_ref.check_a(a, K)
    y = matmul_ref.add_bias(product64(a, packed, absmax, quant_type, block_size, K, N), N, bias)
    with np.errstate(over="ignore"):
        return y.astype(a.dtype)

"""Shared pieces of the NF4/FP4 kernels (MatMulNF4, DequantNF4, FusedFFNNF4): attribute and input validation,
the block size with the encodings the kernels take (``BlockSize``), the 16-value code table, and the readers of
the NF4 routing tables' Case fields. Layout (onnx_lowbit.nf4): W^T [N, K] row-major flat, element i = n*K + k lives
in byte i>>1 (high nibble for even i), block i // block_size, one fp32 absmax per block."""
from __future__ import annotations

import dataclasses

import numpy as np

from onnx_lowbit import nf4, nf4_int8

from ..runtime.kernels import KernelError


@dataclasses.dataclass(frozen=True)
class BlockSize:
    """The absmax block size (elements of W^T per fp32 absmax), checked once (a power of two in 32..4096), with the
    shifts the kernels take, each named by the index it turns into a block index:

    * ``log2``: element index >> log2 (nf4tc, nf4mma, DequantNF4's vector kernel);
    * ``log2_words``: index of an 8-byte word (16 elements) >> log2_words, i.e. log2(size) - 4 (MatMulNF4's
      gemv16, M = 1 and two-row kernels, FusedFFNNF4's decode kernels and nf4warp; the wide decode and nf4warp
      read 16-byte units and shift by one less inside)."""
    size: int

    def __post_init__(self):
        bs = self.size
        if not isinstance(bs, int) or bs < 32 or bs > 4096 or bs & (bs - 1):
            raise KernelError(f"attribute 'block_size' must be a power of two in 32..4096, got {bs}")

    @property
    def log2(self):
        return self.size.bit_length() - 1

    @property
    def log2_words(self):
        return self.size.bit_length() - 5


def parse_attrs(attrs: dict):
    """(quant_type, BlockSize, K, N, the 16 fp32 code values) of a node's attributes."""
    qt = attrs.get("quant_type", "")
    if qt not in nf4.QUANT_TYPES:
        raise KernelError(f"attribute 'quant_type' must be one of {', '.join(map(repr, nf4.QUANT_TYPES))}, "
                          f"got {qt!r}")
    bs, k, n = BlockSize(int(attrs["block_size"])), int(attrs["K"]), int(attrs["N"])
    if k <= 0 or n <= 0:
        raise KernelError(f"attributes 'K' and 'N' must be positive, got K={k}, N={n}")
    return qt, bs, k, n, np.ascontiguousarray(nf4.code(qt), dtype=np.float32)


def parse_level(attrs: dict) -> int:
    """MatMulNF4's / FusedFFNNF4's optional 'accuracy_level' (onnx_lowbit.nf4_int8): 0 (default) .. 4; 4 quantises
    the activations to int8 (the CPU faces; the CUDA faces compute in float at every level)."""
    try:
        return nf4_int8.check_level(attrs.get("accuracy_level", 0))
    except ValueError as e:
        raise KernelError(f"attribute {e}") from None


def parse_transposed(attrs: dict) -> bool:
    """DequantNF4's optional 'transposed' attribute: 0 (default, W [K, N]) or 1 (W^T [N, K])."""
    t = int(attrs.get("transposed", 0))
    if t not in (0, 1):
        raise KernelError(f"attribute 'transposed' must be 0 (W [K, N]) or 1 (W^T [N, K]), got {t}")
    return bool(t)


def check_q_absmax(q, absmax, k, n, bs, q_index=1, absmax_index=2, q_name="Q", absmax_name="absmax"):
    """The packed weight and its absmax (``bs``: a BlockSize) hold K * N elements."""
    bs = bs.size
    total = k * n
    if q is None or absmax is None:
        raise KernelError(f"inputs '{q_name}' and '{absmax_name}' are required")
    if q.size != (total + 1) // 2:
        raise KernelError(f"input {q_index} '{q_name}' must hold ceil(K*N/2) = {(total + 1) // 2} bytes for K={k}, "
                          f"N={n}, got shape {list(q.shape)}")
    nb = (total + bs - 1) // bs
    if absmax.size != nb:
        raise KernelError(f"input {absmax_index} '{absmax_name}' must hold ceil(K*N/block_size) = {nb} values "
                          f"(K={k}, N={n}, block_size={bs}), got shape {list(absmax.shape)}")


def check_a(a, k, bias, n, bias_index=3):
    if a is None or len(a.shape) < 1 or a.shape[-1] != k:
        raise KernelError(f"input 0 'A' must have last dimension K={k}, got shape {None if a is None else list(a.shape)}")
    if bias is not None and (len(bias.shape) != 1 or bias.shape[0] != n):
        raise KernelError(f"input {bias_index} 'bias' must have shape [{n}], got {list(bias.shape)}")
    m = 1
    for d in a.shape[:-1]:
        m *= d
    return m


def even_parts(steps, cap):
    """Column slices for ``steps`` steps on at most ``cap`` resident blocks (one wave), every slice the same number
    of steps (the last one possibly fewer): a wave where some blocks walk one step more than others takes as long
    as if all did."""
    per = -(-max(1, steps) // max(1, cap))
    return max(1, -(-max(1, steps) // per))


def check_weights(q1, am1, q3, am3, k, n, bs):
    """FusedFFNNF4's two weights (inputs 1, 2: Q1, absmax1; 3, 4: Q3, absmax3), as MatMulNF4 checks its one."""
    check_q_absmax(q1, am1, k, n, bs, 1, 2, "Q1", "absmax1")
    check_q_absmax(q3, am3, k, n, bs, 3, 4, "Q3", "absmax3")


# ------------------------------------------------------------------------------------------------- Case readers
def case_f16(c):
    """The routing Case's activations are fp16."""
    return c.dtype == "float16"


def case_align(c, buf):
    """The alignment (bytes, up to 16) of the call's buffer ``buf`` in the routing Case: 16 when ``c.aligned``, else
    its opts entry '<buf>_align'."""
    return 16 if c.aligned else c.opt(buf + "_align", 1)


def case_fp32_decode(c):
    """ONNX_LOWBIT_FP32_DECODE=1 for this call (the kernel object read it when it was made)."""
    return bool(c.opt("fp32_decode"))

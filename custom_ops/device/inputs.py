"""Host-side input checks shared by families: the X / bias checks of the fused two-weight 4-bit SwiGLU kernels
(FusedFFNNF4, FusedFFNAWQ: KernelError naming the input), used by their faces in ffn/ and by the host runners of
the nf4/ and awq/ kernels in their two-weight modes (nf4warp_cuda, matmulawq1_cuda). Moved out of ffn/common4.py
so that nf4/ and awq/ import no other family."""
from __future__ import annotations

import numpy as np

from ..runtime.kernels import KernelError


def type_name(t) -> str:
    if hasattr(t, "type_name"):
        return t.type_name
    return {"float32": "float", "float16": "float16"}.get(np.dtype(t.dtype).name, np.dtype(t.dtype).name)


def check_x_biases(x, b1, b3, k, n, b1_index, b3_index) -> int:
    """X [..., K] float/float16; B1, B3 [N] of X's type. Returns M (product of X's leading dims)."""
    if x is None:
        raise KernelError("input 0 'X' is missing")
    xt = type_name(x)
    if xt not in ("float", "float16"):
        raise KernelError(f"input 0 'X' must be float or float16, got {xt}")
    if len(x.shape) < 1 or x.shape[-1] != k:
        raise KernelError(f"input 0 'X' must have last dimension K={k}, got shape {list(x.shape)}")
    for b, idx, name in ((b1, b1_index, "B1"), (b3, b3_index, "B3")):
        if b is None:
            continue
        if type_name(b) != xt:
            raise KernelError(f"input {idx} '{name}' must have X's type {xt}, got {type_name(b)}")
        if tuple(b.shape) != (n,):
            raise KernelError(f"input {idx} '{name}' must have shape [{n}] (N), got {list(b.shape)}")
    m = 1
    for d in x.shape[:-1]:
        m *= int(d)
    return m

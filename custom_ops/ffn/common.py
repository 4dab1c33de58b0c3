"""Host-side input checks of FusedFFN's CUDA face: ``check_shapes`` (M, K, N from the input shapes)."""
from __future__ import annotations

from ..runtime.kernels import KernelError


def check_shapes(x_shape, w1_shape, w3_shape, b1_shape=None, b3_shape=None, kn=False):
    """(M, K, N) for the given input shapes (``kn``: W1, W3 [K, N], else [N, K]), or a KernelError naming the
    input."""
    lay = "[K, N]" if kn else "[N, K]"
    if len(w1_shape) != 2:
        raise KernelError(f"input 1 'W1' must be 2-D {lay}, got shape {list(w1_shape)}")
    if tuple(w3_shape) != tuple(w1_shape):
        raise KernelError(f"input 2 'W3' must have W1's shape {lay} = {list(w1_shape)}, got {list(w3_shape)}")
    k, n = w1_shape if kn else w1_shape[::-1]
    if len(x_shape) < 1 or x_shape[-1] != k:
        raise KernelError(f"input 0 'X' must have last dimension K={k} (W1 is {lay} = {list(w1_shape)}), "
                          f"got shape {list(x_shape)}")
    for i, name, s in ((3, "B1", b1_shape), (4, "B3", b3_shape)):
        if s is not None and tuple(s) != (n,):
            raise KernelError(f"input {i} '{name}' must have shape [N] = [{n}], got {list(s)}")
    m = 1
    for d in x_shape[:-1]:
        m *= d
    return m, k, n

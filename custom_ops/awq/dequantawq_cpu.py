"""DequantAWQ, CPU face: W[K, N] float16 from AutoAWQ GEMM-layout 4-bit weights (Numba, parallel over rows).

Format (onnx_lowbit.awq): qweight int32 [Kp, N/8], nibble j (bits 4j..4j+3) of qweight[k, c] holds column
8c + ORDER[j], ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros int32 [Kp/G, N/8] packed the same way; scales float16
[Kp/G, N]; W[k, n] = (q - z) * s, rounded once to float16 (the product is exact in fp32). Kp = K rounded up to
a multiple of G = group_size; rows K..Kp-1 are padding and are never read.

This module also holds what both AWQ ops and both faces share: attribute parsing (``parse_attrs``) and the
per-run input checks (``check_weights``, ``check_a_bias``), which raise KernelError naming the input and the
expected value before any kernel touches memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..device import native
from ..device.jit import variant
from ..device.half_cpu import f32_to_f16 as _f32_to_f16
from ..runtime.kernels import Kernel, KernelError

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble j -> column offset within the group of 8
ORDER_NP = np.array(ORDER, dtype=np.int64)


@dataclass(frozen=True)
class AWQShape:
    """Validated attributes and the shapes they imply."""
    group_size: int
    K: int
    N: int

    @property
    def Kp(self):  # noqa: N802 - the format's name
        return -(-self.K // self.group_size) * self.group_size

    @property
    def groups(self):
        return self.Kp // self.group_size

    @property
    def NG(self):  # noqa: N802 - column groups of 8 (int32 words per row)
        return self.N // 8

    def describe(self):
        return f"K={self.K}, N={self.N}, group_size={self.group_size}"


def parse_attrs(attrs: dict) -> AWQShape:
    """Checks group_size, K and N at kernel creation.

    AutoAWQ itself accepts any group_size dividing in_features (or -1 = one group over all of K) and needs
    out_features % 8 == 0; its CUDA kernels use 32, 64 or 128. Like the reference (onnx_lowbit.awq.validate) we
    accept any positive group_size (K is zero-padded up to a multiple of it) and N a positive multiple of 8.
    group_size = -1 is not accepted: an exporter writes the real group size (= K) instead, so that the shapes
    stay explicit. (The kernels are fastest for group sizes with a power-of-two factor >= 32.)"""
    try:
        g, k, n = int(attrs["group_size"]), int(attrs["K"]), int(attrs["N"])
    except KeyError as e:
        raise KernelError(f"attribute {e.args[0]!r} is required") from None
    if g < 1:
        raise KernelError(f"attribute 'group_size' must be a positive integer (AutoAWQ uses 32, 64 or 128; "
                          f"per-channel quantisation is group_size=K), got {g}")
    if k < 1:
        raise KernelError(f"attribute 'K' must be positive, got {k}")
    if n < 8 or n % 8:
        raise KernelError(f"attribute 'N' must be a positive multiple of 8 (8 columns per int32), got {n}")
    return AWQShape(g, k, n)


_NP_NAMES = {"float32": "float", "float64": "double"}


def type_name(x) -> str:
    """ONNX-style element type name of a bridge Tensor or a numpy array."""
    if hasattr(x, "type_name"):
        return x.type_name
    name = np.dtype(x.dtype).name
    return _NP_NAMES.get(name, name)


def _check(t, index, name, tname, shape, why):
    if t is None:
        raise KernelError(f"input {index} '{name}' is missing")
    got = type_name(t)
    if got != tname:
        raise KernelError(f"input {index} '{name}' must be {tname}, got {got}")
    if tuple(t.shape) != tuple(shape):
        raise KernelError(f"input {index} '{name}' must have shape {list(shape)} ({why}), got {list(t.shape)}")


def check_weights(qweight, qzeros, scales, sh: AWQShape, first: int = 0):
    """qweight int32 [Kp, N/8], qzeros int32 [Kp/G, N/8], scales float16 [Kp/G, N] (inputs first..first+2)."""
    d = sh.describe()
    _check(qweight, first, "qweight", "int32", (sh.Kp, sh.NG), f"[Kp, N/8] with Kp = K rounded up to a multiple "
                                                               f"of group_size; {d}")
    _check(qzeros, first + 1, "qzeros", "int32", (sh.groups, sh.NG), f"[Kp/group_size, N/8]; {d}")
    _check(scales, first + 2, "scales", "float16", (sh.groups, sh.N), f"[Kp/group_size, N]; {d}")


def check_a_bias(a, bias, sh: AWQShape, a_types=("float", "float16"), bias_index=4) -> int:
    """A [..., K] of float/float16, bias [N] of A's type; returns M = product of A's leading dimensions."""
    if a is None:
        raise KernelError("input 0 'A' is missing")
    at = type_name(a)
    if at not in a_types:
        raise KernelError(f"input 0 'A' must be {' or '.join(a_types)}, got {at}")
    if len(a.shape) < 1 or a.shape[-1] != sh.K:
        raise KernelError(f"input 0 'A' must have last dimension K={sh.K}, got shape {list(a.shape)}")
    if bias is not None:
        bt = type_name(bias)
        if bt != at:
            raise KernelError(f"input {bias_index} 'bias' must have A's type {at}, got {bt}")
        if tuple(bias.shape) != (sh.N,):
            raise KernelError(f"input {bias_index} 'bias' must have shape [{sh.N}] (N), got {list(bias.shape)}")
    m = 1
    for dim in a.shape[:-1]:
        m *= int(dim)
    return m


# ------------------------------------------------------------------------------------------------ kernels
@njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def dequant_rows_f32(qw, qz, sc, order, g_size, k0, k1, out):
    """out[k - k0, n] = W[k, n] as float32 for k in [k0, k1); sc: scales as float32 [Kp/G, N]. The exact
    product (q - z) * s (no rounding)."""
    ng = qw.shape[1]
    for k in prange(k0, k1):
        g = k // g_size
        for j in range(8):
            sh = 4 * j
            oj = order[j]
            for c in range(ng):
                q = (qw[k, c] >> sh) & 15
                z = (qz[g, c] >> sh) & 15
                out[k - k0, 8 * c + oj] = np.float32(q - z) * sc[g, 8 * c + oj]


def dequantize(qweight, qzeros, scales, group_size, K, N):  # noqa: N803 - the format's names
    """Host-array entry (tests): W float16 [K, N]."""
    sh = parse_attrs({"group_size": group_size, "K": K, "N": N})
    check_weights(qweight, qzeros, scales, sh)
    out = np.empty((K, N), np.float16)
    _run(np.ascontiguousarray(qweight), np.ascontiguousarray(qzeros), np.ascontiguousarray(scales), sh, out)
    return out


@njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def dequant_rows_f16bits(qw, qz, sc, order, g_size, k_dim, out):
    """out[k, n] = float16 bits of W[k, n] for k < K: the exact fp32 product rounded once (RNE, the integer
    conversion shared with the GPU face's simulator path and tested against numpy)."""
    n = out.shape[1]
    ng = qw.shape[1]
    for k in prange(k_dim):
        g = k // g_size
        row = np.empty(n, np.float32)
        for j in range(8):
            sh = 4 * j
            oj = order[j]
            for c in range(ng):
                row[8 * c + oj] = np.float32(((qw[k, c] >> sh) & 15) - ((qz[g, c] >> sh) & 15)) * sc[g, 8 * c + oj]
        bits = row.view(np.uint32)
        for i in range(n):
            out[k, i] = _f32_to_f16(bits[i])


def _run(qw, qz, sc16, sh, out):
    if out.size:
        dequant_rows_f16bits(qw, qz, sc16.astype(np.float32), ORDER_NP, sh.group_size, sh.K, out.view(np.uint16))


class DequantAWQKernel(Kernel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.sh = parse_attrs(self.attrs)

    native_plans = True  # the native entry (below)

    def compute(self, ctx, inputs):
        qw, qz, sc = (inputs[i] if i < len(inputs) else None for i in range(3))
        check_weights(qw, qz, sc, self.sh)
        sh = self.sh
        if ctx.native:
            values = [qw.ptr, qz.ptr, sc.ptr, ctx.output(0, (sh.K, sh.N)), sh.K, sh.N, sh.group_size]
            grain = max(1, TASK_ELEMENTS // (sh.group_size * sh.N))
            if ctx.run_native(native.compile_entry(_native_dequant), -(-sh.K // sh.group_size), grain, values,
                              (0, 1, 2, 3)):
                return
        out = ctx.output_numpy(0, (self.sh.K, self.sh.N), np.float16)
        _run(qw.numpy(), qz.numpy(), sc.numpy(), self.sh, out)


KERNEL = DequantAWQKernel


# ---- native entry (runtime/plans.py, "CPU kernels"): items are groups of rows; a task runs
# dequant_rows_f16bits' body (compiled once more single-threaded) on its groups' rows.
# params: qweight, qzeros, scales, W, K, N, group size
TASK_ELEMENTS = 1 << 16
rows_serial = njit(cache=True, nogil=True, boundscheck=False)(   # own caches: device/jit
    variant(dequant_rows_f16bits.py_func, "serial"))


def _native_dequant(p, begin, end):
    k, n, g = native.arg(p, 4), native.arg(p, 5), native.arg(p, 6)
    k0, k1 = begin * g, min(end * g, k)
    if k1 <= k0:
        return 0
    groups, ng = (k + g - 1) // g, n // 8
    qw = native.array(p[0], (groups * g, ng), np.int32)
    qz = native.array(p[1], (groups, ng), np.int32)
    sc = native.load_f32(p[2] + np.uint64(begin * n * 2), end - begin, n, 1)
    out = native.array(p[3], (k, n), np.uint16)
    rows_serial(qw[k0:], qz[begin:], sc, ORDER_NP, g, k1 - k0, out[k0:k1])
    return 0


def check_both(w1, w3, sh):
    """(qweight, qzeros, scales) of W1 = inputs 1..3 and of W3 = inputs 4..6, names suffixed 1 / 3."""
    for ws, first, sfx in ((w1, 1, "1"), (w3, 4, "3")):
        try:
            check_weights(*ws, sh, first=first)
        except KernelError as e:  # name the op's input (qweight1, ...), not MatMulAWQ's
            msg = str(e)
            for name in ("qweight", "qzeros", "scales"):
                msg = msg.replace(f"'{name}'", f"'{name}{sfx}'")
            raise KernelError(msg) from None

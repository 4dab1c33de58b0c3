"""DequantNF4, CUDA face.

transposed=1 (W^T [N, K], the storage order): a streaming kernel, one 8-byte word (16 nibbles) per thread step,
grid-stride, the word's block scale loaded once; the tail (fewer than 16 elements) element by element.
transposed=0 (W [K, N]): one thread per output element, reading its nibble (correct; the transposition makes
the reads strided, so prefer transposed=1 with Gemm transB=1 where speed matters)."""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint64

from . import nf4_common
from .kernels import Kernel

BLOCK = 256
U0, U1, U3, U4, U15 = (np.uint64(v) for v in (0, 1, 3, 4, 15))


@cuda.jit
def dequant_rows(q64, q8, absmax, code, out, total, bs_shift, bs):
    """out[i] = code[nib(i)] * absmax[i // bs] for i < total (flat W^T). One byte (two outputs) per thread step,
    so a warp reads 32 consecutive bytes and writes 64 consecutive outputs (coalesced); grid-stride."""
    sm_code = cuda.shared.array(16, dtype=float32)
    if cuda.threadIdx.x < 16:
        sm_code[cuda.threadIdx.x] = code[cuda.threadIdx.x]
    cuda.syncthreads()
    t = uint64(cuda.grid(1))
    stride = uint64(cuda.gridsize(1))
    npairs = uint64(total) >> U1
    b = t
    while b < npairs:
        byte = uint64(q8[b])
        i = b << U1
        s = float32(absmax[i // uint64(bs)])   # both elements of a byte share a block (block sizes are even)
        out[i] = sm_code[byte >> U4] * s
        out[i + U1] = sm_code[byte & U15] * s
        b += stride
    if t == U0 and (uint64(total) & U1) == U1:
        i = uint64(total) - U1
        out[i] = sm_code[uint64(q8[i >> U1]) >> U4] * float32(absmax[i // uint64(bs)])


@cuda.jit
def dequant_kn(q8, absmax, code, out, k_dim, n_dim, bs):
    """out[k * N + n] = W[k, n]."""
    t = uint64(cuda.grid(1))
    total = uint64(k_dim) * uint64(n_dim)
    if t >= total:
        return
    k = t // uint64(n_dim)
    n = t - k * uint64(n_dim)
    i = n * uint64(k_dim) + k
    byte = uint64(q8[i >> U1])
    nib = (byte >> U4) if (i & U1) == U0 else (byte & U15)
    out[t] = code[nib] * float32(absmax[i // uint64(bs)])


def _grid_rows(total):
    return max(1, min(132 * 16, (total // 2 + BLOCK - 1) // BLOCK))


def run_arrays(q, absmax, code, k, n, bs, transposed=False):
    from numba import config
    total = k * n
    out = cuda.device_array(total, absmax.dtype)
    dq = cuda.to_device(q.reshape(-1))
    dam, dcode = cuda.to_device(absmax.reshape(-1)), cuda.to_device(code)
    nw = total // 16
    if transposed:
        dq64 = dq[: nw * 8].view(np.uint64) if nw else cuda.to_device(np.zeros(1, np.uint64))
        args = [dq64, dq, dam, dcode, out, total, bs.bit_length() - 5, bs]
        kern, grid = dequant_rows, _grid_rows(total)
    else:
        args = [dq, dam, dcode, out, k, n, bs]
        kern, grid = dequant_kn, (total + BLOCK - 1) // BLOCK
    if config.ENABLE_CUDASIM:
        kern[grid, BLOCK](*args)
    else:
        launcher = _launcher(transposed, absmax.dtype)
        ptr = lambda d: d.device_ctypes_pointer.value  # noqa: E731
        launcher.launch(grid, BLOCK, 0, *[(ptr(x), x.shape) if hasattr(x, "device_ctypes_pointer") else x for x in args])
        cuda.synchronize()
    return out.copy_to_host().reshape((n, k) if transposed else (k, n))


_launchers = {}


def _launcher(transposed, dtype):
    from .cuda_launch import Array, Launcher
    key = (transposed, np.dtype(dtype).str)
    if key not in _launchers:
        if transposed:
            sig = [Array(np.uint64), Array(np.uint8), Array(dtype), Array(np.float32), Array(dtype), "int64", "int64",
                   "int64"]
            _launchers[key] = Launcher(dequant_rows, sig)
        else:
            sig = [Array(np.uint8), Array(dtype), Array(np.float32), Array(dtype), "int64", "int64", "int64"]
            _launchers[key] = Launcher(dequant_kn, sig)
    return _launchers[key]


class DequantNF4CudaKernel(Kernel):
    native_plans = True  # launches depend only on shapes; see plans.py

    def __init__(self, **kw):
        super().__init__(**kw)
        self.qt, self.bs, self.k, self.n, code = nf4_common.parse_attrs(self.attrs)
        self.transposed = nf4_common.parse_transposed(self.attrs)
        self.dtype = np.float32 if self.in_types[1] == 1 else np.float16
        self.code = cuda.to_device(code)
        self.code_ptr = self.code.device_ctypes_pointer.value
        self.launcher = _launcher(self.transposed, self.dtype)

    def compute(self, ctx, inputs):
        q, absmax = inputs[0], inputs[1]
        nf4_common.check_q_absmax(q, absmax, self.k, self.n, self.bs, 0, 1)
        total = self.k * self.n
        out = ctx.output(0, (self.n, self.k) if self.transposed else (self.k, self.n))
        if self.transposed:
            nw = total // 16
            args = [(q.ptr, (max(nw, 1),)), (q.ptr, (q.size,)), (absmax.ptr, (absmax.size,)), (self.code_ptr, (16,)),
                    (out, (total,)), total, self.bs.bit_length() - 5, self.bs]
            self.launcher.launch(_grid_rows(total), BLOCK, ctx.stream, *args)
        else:
            args = [(q.ptr, (q.size,)), (absmax.ptr, (absmax.size,)), (self.code_ptr, (16,)), (out, (total,)),
                    self.k, self.n, self.bs]
            self.launcher.launch((total + BLOCK - 1) // BLOCK, BLOCK, ctx.stream, *args)


KERNEL = DequantNF4CudaKernel

"""Read-bandwidth ceilings of the 4-bit decode kernels' access patterns (H100; no decoding, the words are only
XOR-ed so that the loads cannot be dropped). Two LLaMA-7B gate+up NF4 weights: 2 x 4096 x 11008 nibbles
(2 x 22.5 MB). Patterns:
  words64  FusedFFNNF4's: a block covers all of K (thread t = 8-byte word t of each row), walks a contiguous slice
           of columns COLS at a time, both weights (2 * COLS loads of 8 bytes in flight per thread); optional
           block barrier per step (the kernel has one); grid = SMs x blocks per SM
  v4       16-byte non-coherent loads (ld.global.nc.L1::no_allocate.v4.u32), each thread U of them in flight,
           consecutive threads on consecutive 16 bytes (fully coalesced), one pass over each weight
    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/stream4_gpu.py
"""
from __future__ import annotations

import numpy as np
from numba import cuda, uint32, uint64
from timing import copy_gbps, time_graph

K, N = 4096, 11008
WPR = K // 16
BYTES = 2 * K * N // 2


def make_words64(cols, sync):
    @cuda.jit
    def words64(q1, q3, out, n_dim, parts):
        t = cuda.threadIdx.x
        part = cuda.blockIdx.x
        n_lo = part * n_dim // parts
        n_hi = (part + 1) * n_dim // parts
        acc = uint64(0)
        n0 = n_lo
        while n0 < n_hi:
            for c in range(cols):
                n = min(n0 + c, n_hi - 1)
                acc ^= q1[n * WPR + t] ^ q3[n * WPR + t]
            if sync:
                cuda.syncthreads()
            n0 += cols
        if acc == uint64(0x123456789):
            out[0] = acc
    return words64


def make_v4(unroll):
    from onnx_lowbit.custom_ops.fusedffn_cuda import LOAD, _make_ld4
    ld4 = _make_ld4(LOAD)

    @cuda.jit
    def v4(q, out, n16):
        t = uint32(cuda.threadIdx.x)
        bd = uint32(cuda.blockDim.x)
        base = uint32(cuda.blockIdx.x) * bd * uint32(unroll) + t
        step = uint32(cuda.gridDim.x) * bd * uint32(unroll)
        acc = uint32(0)
        while base < n16:
            for u in range(unroll):
                i = base + uint32(u) * bd
                if i < n16:
                    a, b, c, d = ld4(q, i)
                    acc ^= a ^ b ^ c ^ d
            base += step
        if acc == uint32(0x12345):
            out[0] = acc
    return v4


def main():
    import torch

    from onnx_lowbit.custom_ops.cuda_launch import Array, Launcher, current_device, sm_count
    torch.zeros(1, device="cuda")     # the primary context, current (as the other benchmarks)
    sms = sm_count(current_device())
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    print(f"GPU {torch.cuda.get_device_name(0)}, copy 256 MiB: {copy_gbps()[0]:.0f} GB/s")
    q1 = torch.randint(0, 2 ** 62, (N * WPR,), dtype=torch.int64, device="cuda")
    q3 = torch.randint(0, 2 ** 62, (N * WPR,), dtype=torch.int64, device="cuda")
    qq = torch.cat([q1, q3])
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    p = lambda t, n=None: (t.data_ptr(), (t.numel() if n is None else n,))  # noqa: E731
    a64 = Array(np.uint64)
    for cols in (4, 8):
        for sync in (True, False):
            lau = Launcher(make_words64(cols, sync), [a64, a64, a64, "int64", "int64"])
            occ = lau.blocks_per_sm(WPR)
            for bps in sorted({3, occ, 8}):
                parts = sms * bps
                fn = lambda: lau.launch(parts, WPR, stream(), p(q1), p(q3), p(out), N, parts)  # noqa: E731
                tg = time_graph(fn)
                print(f"words64 cols={cols} sync={int(sync)} {parts} blocks ({bps}/SM, occ {occ}): {tg:6.1f} us "
                      f"{BYTES / tg / 1e3:5.0f} GB/s", flush=True)
    a32 = Array(np.uint32)
    n16 = BYTES // 16
    for unroll in (2, 4, 8):
        lau = Launcher(make_v4(unroll), [a32, a32, "int64"])
        for block in (256, 512):
            occ = lau.blocks_per_sm(block)
            for waves in (1, 2):
                grid = min(sms * occ * waves, -(-n16 // (block * unroll)))
                fn = lambda: lau.launch(grid, block, stream(), p(qq.view(torch.int32)), p(out.view(torch.int32)), n16)  # noqa: E731
                tg = time_graph(fn)
                print(f"v4 unroll={unroll} block={block} grid={grid} ({occ}/SM, {waves} waves): {tg:6.1f} us "
                      f"{BYTES / tg / 1e3:5.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()

"""How fast can a kernel merely *read* AutoAWQ's K-major qweight [K, N/8] (int32) with a given block geometry?
No decode, no math: each thread XORs the words it loads. The times bound what a MatMulAWQ M=1 kernel of that
geometry can reach, and show whether the access pattern (bytes per row segment, rows per warp, words in flight)
or the kernel's arithmetic is what holds it back. Weights cycled past L2 (a pool of >= 128 MB), CUDA-graph medians.

    PYTHONPATH=/tmp/site:.:benchmarks python3 benchmarks/awq_read_probe.py [K N]

Geometries (per variant): ``w`` bytes per lane per row (4 or 16), ``warps`` per block, ``rows`` per warp,
``unroll`` rows in flight per thread, ``inter`` (the block's warps take interleaved rows, so at each step the
block reads ``warps`` consecutive rows, instead of each warp a band of its own).
"""
from __future__ import annotations

import sys

import numpy as np
from timing import copy_gbps, time_graph

SRC = r"""
template <typename T> __device__ __forceinline__ unsigned fold(T v);
template <> __device__ __forceinline__ unsigned fold<unsigned>(unsigned v) { return v; }
template <> __device__ __forceinline__ unsigned fold<uint2>(uint2 v) { return v.x ^ v.y; }
template <> __device__ __forceinline__ unsigned fold<uint4>(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// lanes: threads across the row (lanes * sizeof(T) bytes per row segment); block = lanes * warps threads.
template <typename T, int UNR>
__device__ void rd(const T* __restrict__ w, unsigned* out, int nq, int rows, int lanes, int warps, int tiles,
                   int inter) {
    int lane = threadIdx.x % lanes, warp = threadIdx.x / lanes;
    int tile = blockIdx.x % tiles, split = blockIdx.x / tiles;
    int c = tile * lanes + lane;
    unsigned acc = 0;
    if (c < nq) {
        long kb = (long)split * warps * rows;
        long k0 = inter ? kb + warp : kb + (long)warp * rows;
        long step = inter ? warps : 1;
        const T* p = w + k0 * nq + c;
        long st = step * nq;
        for (int r = 0; r < rows; r += UNR) {
            T v[UNR];
#pragma unroll
            for (int u = 0; u < UNR; u++) v[u] = __ldg(p + (long)u * st);
#pragma unroll
            for (int u = 0; u < UNR; u++) acc ^= fold(v[u]);
            p += UNR * st;
        }
    }
    if (acc == 0x9E3779B9u) out[0] = acc;
}

extern "C" {
__global__ void rd4_8(const unsigned* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<unsigned, 8>(w, o, nq, r, l, wa, t, i); }
__global__ void rd4_16(const unsigned* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<unsigned, 16>(w, o, nq, r, l, wa, t, i); }
__global__ void rd4_4(const unsigned* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<unsigned, 4>(w, o, nq, r, l, wa, t, i); }
__global__ void rd8_4(const uint2* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<uint2, 4>(w, o, nq, r, l, wa, t, i); }
__global__ void rd8_8(const uint2* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<uint2, 8>(w, o, nq, r, l, wa, t, i); }
__global__ void rd16_4(const uint4* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<uint4, 4>(w, o, nq, r, l, wa, t, i); }
__global__ void rd16_8(const uint4* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<uint4, 8>(w, o, nq, r, l, wa, t, i); }
__global__ void rd16_16(const uint4* w, unsigned* o, int nq, int r, int l, int wa, int t, int i) {
    rd<uint4, 16>(w, o, nq, r, l, wa, t, i); }
// the roof: every thread reads a contiguous run of the buffer, grid-stride, 16 B per load, 8 in flight
__global__ void flat(const uint4* __restrict__ w, unsigned* out, long n) {
    unsigned acc = 0;
    long stride = (long)gridDim.x * blockDim.x;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = __ldg(w + i + u * stride);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= fold(v[u]);
    }
    for (; i < n; i += stride) acc ^= fold(__ldg(w + i));
    if (acc == 0x9E3779B9u) out[0] = acc;
}
}
"""

# (label, bytes per lane, lanes, warps (K slices per block), rows per slice, unroll, inter)
VARIANTS = [
    ("current: 4 B x 32 lanes, 8 slices x 64 rows, 16 in flight", 4, 32, 8, 64, 16, 0),
    ("4 B x 32, 8 x 64, 8 in flight", 4, 32, 8, 64, 8, 0),
    ("4 B x 32, 8 x 64 interleaved", 4, 32, 8, 64, 16, 1),
    ("8 B x 32, 8 x 32", 8, 32, 8, 32, 8, 0),
    ("16 B x 32, 4 x 32 (a group per block)", 16, 32, 4, 32, 8, 0),
    ("16 B x 32, 4 x 32 interleaved", 16, 32, 4, 32, 8, 1),
    ("16 B x 32, 4 x 32, 16 in flight", 16, 32, 4, 32, 16, 0),
    ("16 B x 32, 4 x 32, 4 in flight", 16, 32, 4, 32, 4, 0),
    ("16 B x 32, 8 x 16", 16, 32, 8, 16, 8, 0),
    ("16 B x 32, 8 x 32", 16, 32, 8, 32, 8, 0),
    ("16 B x 32, 8 x 32 interleaved", 16, 32, 8, 32, 8, 1),
    ("16 B x 32, 2 x 64", 16, 32, 2, 64, 8, 0),
    ("16 B x 32, 4 x 64", 16, 32, 4, 64, 8, 0),
    ("16 B x 32, 4 x 64, 16 in flight", 16, 32, 4, 64, 16, 0),
    ("16 B x 16 lanes, 8 x 32", 16, 16, 8, 32, 8, 0),
    ("16 B x 8 lanes, 16 x 32", 16, 8, 16, 32, 8, 0),
    # the tensor-core kernel's pattern: 32 B of a row per 8 lanes (4 rows per warp instruction)
    ("4 B x 8 lanes, 16 x 32 (32 B segments)", 4, 8, 16, 32, 8, 0),
    ("4 B x 8 lanes, 16 x 32 interleaved", 4, 8, 16, 32, 8, 1),
    ("4 B x 8 lanes, 16 x 64, 4 in flight", 4, 8, 16, 64, 4, 0),
    ("8 B x 8 lanes, 16 x 32 (64 B segments)", 8, 8, 16, 32, 8, 0),
    ("8 B x 8 lanes, 16 x 32, 4 in flight", 8, 8, 16, 32, 4, 0),
]


def main():
    import cupy as cp
    import torch
    k, n = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (4096, 11008)
    torch.zeros(1, device="cuda")
    print("GPU:", torch.cuda.get_device_name(0), f"K={k} N={n}")
    bw, _ = copy_gbps()
    print(f"device copy 256 MiB: {bw:.0f} GB/s")
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=None)
    nbytes = k * n // 2
    cnt = max(4, -(-(128 << 20) // nbytes))
    pool = [torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32, device="cuda") for _ in range(cnt)]
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    stream = lambda: cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # noqa: E731

    def timed(launch):
        it = iter(range(1 << 30))
        return time_graph(lambda: launch(pool[next(it) % cnt]), batch=2 * cnt)

    def gbs(t):
        return f"{t:7.2f} us  {nbytes / t / 1e3:6.0f} GB/s  {100 * nbytes / t / 1e3 / bw:5.1f}% of copy"

    fl = mod.get_function("flat")
    t = timed(lambda w: fl((132 * 8,), (256,), (w.data_ptr(), out.data_ptr(), np.int64(nbytes // 16)),
                           stream=stream()))
    print(f"{'flat read (roof), 16 B, grid-stride':58s} {gbs(t)}")
    for label, wb, lanes, warps, rows, unr, inter in VARIANTS:
        nq = (n // 8) * 4 // wb
        if (n // 8) * 4 % wb or k % (warps * rows) or rows % unr:
            continue
        f = mod.get_function(f"rd{wb}_{unr}")
        tiles = -(-nq // lanes)
        grid = tiles * (k // (warps * rows))
        args = lambda w: (w.data_ptr(), out.data_ptr(), np.int32(nq), np.int32(rows), np.int32(lanes),  # noqa
                          np.int32(warps), np.int32(tiles), np.int32(inter))
        t = timed(lambda w: f((grid,), (lanes * warps,), args(w), stream=stream()))
        print(f"{label:58s} {gbs(t)}  grid {grid} x {lanes * warps}")
    x = (torch.randn(1, k, device="cuda") * 0.5).half()
    wp = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02 for _ in range(max(4, -(-(128 << 20)
                                                                                         // (k * n * 2))))]
    it = iter(range(1 << 30))
    t = time_graph(lambda: torch.matmul(x, wp[next(it) % len(wp)]), batch=2 * len(wp))
    print(f"torch fp16 GEMV (2 bytes per weight, for reference): {t:.2f} us, "
          f"{k * n * 2 / t / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
